"""Dequantization of every supported GGUF type vs gguf-py's `gguf.quants.dequantize`: bit-exact."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from dflash_jax import quants
from dflash_jax.gguf_io import read_gguf
from conftest import QWEN

BLOCK_F16_FIELDS = {  # byte offsets of the f16 scale fields in each block
    "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
    "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
}


def _random_blocks(rng, fmt, n_rows, n_blocks):
  """Random bytes with finite random f16 scales: every bit pattern of the quants is exercised."""
  blk, size = quants.BLOCK_FORMATS[fmt]
  b = rng.integers(0, 256, size=(n_rows, n_blocks, size), dtype=np.uint8)
  for off in BLOCK_F16_FIELDS[fmt]:
    h = (rng.standard_normal((n_rows, n_blocks)) * 0.05).astype(np.float16)
    b[..., off:off + 2] = h.view(np.uint8).reshape(n_rows, n_blocks, 2)
  return b.reshape(n_rows, n_blocks * size)


def _assert_bit_equal(ours, ref):
  ours = np.asarray(ours, np.float32)
  ref = np.asarray(ref, np.float32)
  assert ours.shape == ref.shape
  assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), \
      f"max abs diff {np.abs(ours - ref).max()}"


@pytest.mark.parametrize("fmt", sorted(quants.BLOCK_FORMATS))
def test_block_formats_random_bytes_bit_exact(fmt):
  rng = np.random.default_rng()  # fresh inputs every run
  blk, _ = quants.BLOCK_FORMATS[fmt]
  n_rows, n_blocks = 7, 3
  raw = _random_blocks(rng, fmt, n_rows, n_blocks)
  w = quants.from_numpy(raw, fmt, (n_rows, n_blocks * blk))
  ref = gq.dequantize(raw, QT[fmt.upper()])
  _assert_bit_equal(quants.dequantize(jax_tree(w)), ref)
  rows = np.array([5, 0, 5, 2], np.int32)
  _assert_bit_equal(quants.take_rows(jax_tree(w), jnp.asarray(rows)), ref[rows])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "f16", "bf16"])
def test_gguf_quantized_values_bit_exact(fmt):
  rng = np.random.default_rng()
  x = rng.standard_normal((5, 96)).astype(np.float32) * 3.0
  qt = QT[fmt.upper()]
  raw = gq.quantize(x, qt)
  w = quants.from_numpy(raw, fmt, (5, 96))
  _assert_bit_equal(quants.dequantize(jax_tree(w)), gq.dequantize(raw, qt))


@pytest.mark.parametrize("gguf_name", ["model-q4_k_m.gguf", "model-q8_0.gguf"])
def test_real_llama_cpp_tensors_bit_exact(gguf_name):
  """Every quantized tensor llama.cpp wrote into the tiny Qwen3.5 files (Q4_K, Q6_K, Q8_0)."""
  f = read_gguf(os.path.join(QWEN, gguf_name))
  seen = set()
  for t in f.tensors.values():
    if t.fmt == "f32":
      continue
    seen.add(t.fmt)
    w = quants.from_numpy(t.data, t.fmt, t.shape, name=t.name)
    # through the loader's compiled dequantize, one program per (format, shape) (eager dispatch
    # compiles a program per op and shape: ~1 min here)
    _assert_bit_equal(quants.to_dtype(w, "f32").data, gq.dequantize(t.data, QT[t.fmt.upper()]))
  assert seen == ({"q4_k", "q6_k"} if "q4_k_m" in gguf_name else {"q8_0"})


def test_smollm2_q4_1_and_q8_0_bit_exact(smol_path):
  f = read_gguf(smol_path)
  for name in ("token_embd.weight", "blk.0.ffn_down.weight", "blk.29.attn_q.weight"):
    t = f.tensors[name]
    w = quants.from_numpy(t.data, t.fmt, t.shape, name=name)
    _assert_bit_equal(quants.dequantize(jax_tree(w)), gq.dequantize(t.data, QT[t.fmt.upper()]))


def test_unknown_format_names_tensor():
  with pytest.raises(ValueError, match=r"blk\.3\.ffn_up\.weight.*Q2_K"):
    quants.from_numpy(np.zeros((2, 84), np.uint8), "q2_k", (2, 256), name="blk.3.ffn_up.weight")


def jax_tree(w):
  import jax
  return jax.tree.map(jnp.asarray, w)


def test_q8_0_recipe_rebuilds_llama_cpps_file(tmp_path):
  """tests/gguf_recipe.py: the Q8_0 file rebuilt from the F32 one hashes to the recorded sha256 of
  the file llama.cpp's converter wrote; a recipe whose header was altered is refused by name."""
  import gguf_recipe
  from conftest import unxz
  recipe = os.path.join(QWEN, "model-q8_0.recipe.npz")
  f32 = unxz(os.path.join(QWEN, "model-f32.gguf.xz"), tmp_path / "f32.gguf")
  gguf_recipe.rebuild(recipe, f32, str(tmp_path / "q8.gguf"))
  assert gguf_recipe.matches(recipe, str(tmp_path / "q8.gguf"))
  r = dict(np.load(recipe))
  r["header"] = r["header"].copy()
  r["header"][100] ^= 1
  np.savez(tmp_path / "bad.npz", **r)
  with pytest.raises(ValueError, match=r"bad\.npz: rebuilt file has sha256"):
    gguf_recipe.rebuild(str(tmp_path / "bad.npz"), f32, str(tmp_path / "q8b.gguf"))
