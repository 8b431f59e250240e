"""llama.cpp's Q8_0 / Q4_0 block formats in JAX (kv_quant.py) against gguf-py's quantize and
dequantize (the reference implementation of ggml-quants.c): stored blocks bit-exact, values
exact."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import kv_quant

QT = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def _values(seed: int) -> np.ndarray:
  """K/V-like rows: Gaussian with per-row scales, exact zeros, ties at .5 steps, a zero block, a
  block of one value, large and tiny magnitudes."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((6, 4, 128)).astype(np.float32) * rng.uniform(0.01, 30, (6, 4, 1))
  x[0, 0, :32] = 0.0
  x[0, 1, :32] = 2.5
  x[0, 2, :32] = np.arange(32) * 0.5 - 8
  x[1, 0, 32:64] = 1e-30
  x[1, 1, 64:96] = -7.0
  x[2, 3, :5] = 0.0
  x[2, 0, :32] = np.arange(32) - 15.5         # + one 127: d = 1, so x / d has exact .5 ties
  x[2, 0, 0] = 127.0
  x[3, 0, :32] = -np.arange(32) * 0.5         # q4_0: ties at its own steps
  return x


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_bit_exact_with_gguf(fmt, seed):
  x = _values(seed)
  qs, d = kv_quant.quantize(fmt, jnp.asarray(x))
  ours = kv_quant.to_gguf_blocks(qs, d)
  ref = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), QT[fmt]).reshape(ours.shape)
  np.testing.assert_array_equal(ours, ref)
  back = np.asarray(kv_quant.dequantize(fmt, qs, d))
  want = gguf.quants.dequantize(ref.reshape(-1), QT[fmt]).reshape(x.shape)
  np.testing.assert_array_equal(back, want)
  # the error bound of the format: |x - deq| <= d/2 (q8_0) or d (q4_0) per block
  err = np.abs(back - x).reshape(-1, 32).max(axis=1)
  dd = np.abs(np.asarray(d, np.float32)).reshape(-1)
  slack = 1e-3 * np.abs(x).reshape(-1, 32).max(axis=1) + 1e-30
  assert (err <= dd * (0.5 if fmt == "q8_0" else 1.0) + slack).all()


def test_sizes_and_errors():
  qs, d = kv_quant.quantize("q4_0", jnp.ones((3, 64)))
  assert qs.shape == (3, 32) and qs.dtype == jnp.uint8 and d.shape == (3, 2) and d.dtype == jnp.float16
  qs, d = kv_quant.quantize("q8_0", jnp.ones((3, 64)))
  assert qs.shape == (3, 64) and qs.dtype == jnp.int8
  assert kv_quant.bytes_per_value("q4_0") == 18 / 32
  with pytest.raises(ValueError, match="multiple of 32"):
    kv_quant.quantize("q8_0", jnp.ones((2, 40)))
  with pytest.raises(ValueError, match="unknown format 'q5_0'"):
    kv_quant.quantize("q5_0", jnp.ones((2, 32)))
