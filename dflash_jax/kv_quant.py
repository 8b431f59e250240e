"""llama.cpp's Q8_0 and Q4_0 block formats in JAX, for quantized KV-cache rows (the long-context
issue: a q8_0 cache is ~3.8x smaller than f32, q4_0 ~7.1x).

A block is 32 consecutive values of the last axis with one float16 scale d (ggml-quants.c
`quantize_row_q8_0_ref` / `quantize_row_q4_0_ref`, gguf-py `gguf.quants.Q8_0` / `Q4_0`):
  * Q8_0: amax = max |x|, d = amax / 127, q = round-half-away(x / d) in int8 (x * (1/d) in
    float32, as the reference), value = q * f16(d).
  * Q4_0: m = the x of largest |x| (signed), d = m / -8, q = min(15, trunc(x * (1/d) + 8.5)) in
    0..15, value = (q - 8) * f16(d).
Stored here as separate planes (not interleaved bytes) so a cache row is two dense arrays:
  q8_0: qs [..., D] int8, d [..., D/32] float16;
  q4_0: qs [..., D/2] uint8 (within each 32-block, byte j holds element j in its low nibble and
        element j+16 in its high nibble: gguf's order), d [..., D/32] float16.
`to_gguf_blocks` interleaves them into gguf's [n_blocks, 2 + bytes] layout, which the tests
compare bit for bit with `gguf.quants.quantize`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

BLOCK = 32
FORMATS = ("q8_0", "q4_0")


def _blocks(x: jnp.ndarray) -> jnp.ndarray:
  if x.shape[-1] % BLOCK:
    raise ValueError(f"kv_quant: the last axis ({x.shape[-1]}) must be a multiple of {BLOCK}")
  return x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // BLOCK, BLOCK))


def _inv(d: jnp.ndarray) -> jnp.ndarray:
  return jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def quantize_q8_0(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """x: [..., D] float (D a multiple of 32) -> (qs [..., D] int8, d [..., D/32] float16)."""
  b = _blocks(x)
  d = jnp.max(jnp.abs(b), axis=-1, keepdims=True) / 127
  v = b * _inv(d)
  a = jnp.abs(v)
  fl = jnp.floor(a)
  q = jnp.sign(v) * (fl + jnp.floor(2 * (a - fl)))            # gguf's np_roundf
  return q.astype(jnp.int8).reshape(x.shape), d[..., 0].astype(jnp.float16)


def dequantize_q8_0(qs: jnp.ndarray, d: jnp.ndarray) -> jnp.ndarray:
  """(qs [..., D] int8, d [..., D/32] float16) -> [..., D] float32."""
  b = qs.astype(jnp.float32).reshape(qs.shape[:-1] + (-1, BLOCK))
  return (b * d.astype(jnp.float32)[..., None]).reshape(qs.shape)


def quantize_q4_0(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """x: [..., D] float -> (qs [..., D/2] uint8, d [..., D/32] float16)."""
  b = _blocks(x)
  i = jnp.argmax(jnp.abs(b), axis=-1)[..., None]
  m = jnp.take_along_axis(b, i, axis=-1)
  d = m / -8
  q = jnp.clip(jnp.trunc(b * _inv(d) + jnp.float32(8.5)), 0, 15).astype(jnp.uint8)
  packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
  return packed.reshape(x.shape[:-1] + (x.shape[-1] // 2,)), d[..., 0].astype(jnp.float16)


def dequantize_q4_0(qs: jnp.ndarray, d: jnp.ndarray) -> jnp.ndarray:
  """(qs [..., D/2] uint8, d [..., D/32] float16) -> [..., D] float32."""
  b = qs.reshape(qs.shape[:-1] + (-1, BLOCK // 2))
  q = jnp.concatenate([b & 0x0F, b >> 4], axis=-1).astype(jnp.float32) - 8.0
  out = q * d.astype(jnp.float32)[..., None]
  return out.reshape(qs.shape[:-1] + (qs.shape[-1] * 2,))


def quantize(fmt: str, x: jnp.ndarray):
  """(qs, d) of x in `fmt` ("q8_0" | "q4_0"); ValueError naming an unknown format."""
  if fmt == "q8_0":
    return quantize_q8_0(x)
  if fmt == "q4_0":
    return quantize_q4_0(x)
  raise ValueError(f"kv_quant: unknown format {fmt!r}; supported: {', '.join(FORMATS)}")


def dequantize(fmt: str, qs: jnp.ndarray, d: jnp.ndarray) -> jnp.ndarray:
  """[..., D] float32 values of (qs, d) in `fmt`."""
  if fmt == "q8_0":
    return dequantize_q8_0(qs, d)
  if fmt == "q4_0":
    return dequantize_q4_0(qs, d)
  raise ValueError(f"kv_quant: unknown format {fmt!r}; supported: {', '.join(FORMATS)}")


def bytes_per_value(fmt: str) -> float:
  """Stored bytes per cached value (scale included): q8_0 34/32, q4_0 18/32."""
  return {"q8_0": 34 / 32, "q4_0": 18 / 32}[fmt]


def to_gguf_blocks(qs, d) -> np.ndarray:
  """Host: gguf's interleaved blocks [n_blocks, 2 + bytes per block] uint8 of (qs, d) (q8_0:
  34 bytes, q4_0: 18), in row-major block order."""
  d = np.asarray(d, np.float16).reshape(-1, 1).view(np.uint8)
  q = np.asarray(qs).view(np.uint8).reshape(d.shape[0], -1)
  return np.concatenate([d, q], axis=1)
