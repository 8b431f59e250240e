"""Kernel-friendly planes of Q4_K / Q5_K / Q6_K weights (pallas_kernels.repack) vs gguf-py: the
planes rebuild the file's bytes exactly, and their dequantization is bit-identical to
`gguf.quants.dequantize`; device bytes within 12 % of the GGUF bytes (the bound the Mosaic GPU kernel is planned for)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from dflash_jax.gguf_io import read_gguf
from pallas_kernels import repack
from conftest import QWEN
from test_quants import _assert_bit_equal, _random_blocks


@pytest.mark.parametrize("fmt", repack.REPACK_FORMATS)
def test_random_blocks_round_trip_and_bit_exact(fmt):
  rng = np.random.default_rng()          # fresh bytes every run: every code / scale pattern
  n, nb = 5, 3
  raw = _random_blocks(rng, fmt, n, nb)
  p = repack.repack(raw, fmt, (n, nb * 256))
  assert np.array_equal(repack.to_gguf(p), raw)
  assert raw.nbytes <= p.nbytes <= 1.12 * raw.nbytes
  got = jax.jit(repack.dequantize_planes)(jax.tree.map(jnp.asarray, p))
  _assert_bit_equal(got, gq.dequantize(raw, QT[fmt.upper()]))


def test_planes_layout_is_contiguous_per_tile():
  """A K tile of 64 Q4_K weights is 32 consecutive code bytes: weight 64g+i sits in the low
  nibble of byte 32g+i, weight 64g+32+i in its high nibble (across block boundaries too)."""
  rng = np.random.default_rng(0)
  raw = _random_blocks(rng, "q4_k", 2, 2)
  p = repack.repack(raw, "q4_k", (2, 512))
  codes = np.asarray(p.codes)
  blocks = raw.reshape(2, 2, 144)
  for g in range(8):
    blk, j = divmod(g, 4)
    qs = blocks[:, blk, 16 + 32 * j:16 + 32 * (j + 1)]
    assert np.array_equal(codes[:, 32 * g:32 * (g + 1)], qs)
  assert p.scales.shape == (2, 16) and p.d.shape == (2, 2)


@pytest.mark.parametrize("gguf_name", ["model-q4_k_m.gguf"])
def test_llama_cpp_q4_k_m_tensors(gguf_name):
  """Every Q4_K / Q6_K tensor llama.cpp wrote: bytes round-trip, dequantization bit-exact,
  plane bytes <= 1.12 x GGUF bytes (Q4_K: 148 / 144; Q6_K: equal)."""
  f = read_gguf(os.path.join(QWEN, gguf_name))
  seen = set()
  gguf_bytes = plane_bytes = 0
  for t in f.tensors.values():
    if t.fmt not in repack.REPACK_FORMATS:
      continue
    seen.add(t.fmt)
    p = repack.repack(t.data, t.fmt, t.shape, name=t.name)
    assert np.array_equal(repack.to_gguf(p), np.asarray(t.data).reshape(t.shape[0], -1)), t.name
    _assert_bit_equal(repack.dequantize_planes(jax.tree.map(jnp.asarray, p)),
                      gq.dequantize(t.data, QT[t.fmt.upper()]))
    gguf_bytes += np.asarray(t.data).nbytes
    plane_bytes += p.nbytes
  assert seen == {"q4_k", "q6_k"}
  assert gguf_bytes < plane_bytes <= 1.12 * gguf_bytes


def test_planes_matmul_reference_against_float64():
  rng = np.random.default_rng(1)
  raw = _random_blocks(rng, "q6_k", 6, 2)
  p = repack.repack(raw, "q6_k", (6, 512))
  x = rng.standard_normal((3, 512)).astype(np.float32)
  want = x.astype(np.float64) @ gq.dequantize(raw, QT.Q6_K).astype(np.float64).T
  got = np.asarray(repack.planes_matmul_reference(jnp.asarray(x), jax.tree.map(jnp.asarray, p)))
  assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()      # max-abs, relative to max


def test_bad_input_names_the_tensor():
  with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*q4_0"):
    repack.repack(np.zeros((2, 18), np.uint8), "q4_0", (2, 32), name="blk.0.ffn_up.weight")
  with pytest.raises(ValueError, match=r"attn_q.*multiple of 256"):
    repack.repack(np.zeros((2, 72), np.uint8), "q4_k", (2, 128), name="attn_q")
  with pytest.raises(ValueError, match=r"w: q6_k data must be uint8 \(2, 210\)"):
    repack.repack(np.zeros((2, 200), np.uint8), "q6_k", (2, 256), name="w")
