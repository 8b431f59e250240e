"""GGUF block formats and their pure-JAX dequantization: the reference the kernels in this
package are tested against, and what `dequant_matmul_reference` runs.

A packed weight is any object with `data`, `fmt` and `shape` (e.g. dflash_jax's QuantWeight):
for block formats `data` is `[N, K // block_size * type_size] uint8` (the raw GGUF bytes of each
row), for float formats `[N, K]` float32 / float16 / bfloat16 values; `fmt` is the GGML type
name in lower case; `shape` the logical (N, K). `dequantize` turns it into `[N, K]` float32
with the same arithmetic, in the same order, as gguf-py's `gguf.quants.dequantize` (which is
bit-identical to ggml's `dequantize_row_*`), so the result is bit-identical on CPU.

Block layouts: ggml/src/ggml-common.h (block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0,
block_q4_K, block_q5_K, block_q6_K); the unpacking mirrors gguf-py/gguf/quants.py.
This module stands alone (jax only), like the rest of pallas_kernels.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

QK_K = 256

# name -> (elements per block, bytes per block); names are the GGML type names in lower case.
BLOCK_FORMATS: dict[str, tuple[int, int]] = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q8_0": (32, 34),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}
FLOAT_FORMATS = ("f32", "f16", "bf16")
SUPPORTED_FORMATS = FLOAT_FORMATS + tuple(BLOCK_FORMATS)



def _f16(lo: jax.Array, hi: jax.Array) -> jax.Array:
  """Two uint8 byte planes (little endian) -> float32 via IEEE half."""
  u = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
  return jax.lax.bitcast_convert_type(u, jnp.float16).astype(jnp.float32)


def _u32(b: jax.Array) -> jax.Array:
  """[..., 4] uint8 little endian -> [...] uint32."""
  b = b.astype(jnp.uint32)
  return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _nibbles(qs: jax.Array) -> jax.Array:
  """[..., n] uint8 -> [..., 2n] uint8: low nibbles of all bytes, then high nibbles."""
  return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def unpack_scale_min_k4(s, xp=jnp):
  """Q4_K/Q5_K 12-byte packed 6-bit scales [..., 12] uint8 -> (sc, m) [..., 8] uint8.
  xp: the array module (jax.numpy in the forward, numpy when repacking at load)."""
  d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
  sc = xp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
  mn = xp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return sc, mn


def _scale_min_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Q4_K/Q5_K 12-byte packed 6-bit scales [..., 12] uint8 -> (sc, m) [..., 8] float32."""
  sc, mn = unpack_scale_min_k4(s)
  return sc.astype(jnp.float32), mn.astype(jnp.float32)


def k_quant_values(d: jax.Array, dmin: jax.Array, sc: jax.Array, mn: jax.Array,
                   q: jax.Array) -> jax.Array:
  """Q4_K/Q5_K weights from their fields: d, dmin [...] float32; sc, mn [..., 8] float32
  sub-block scales and mins; q [..., 8, 32] integer codes. Returns [..., 256] float32,
  (d * sc) * q - dmin * mn in gguf-py's order."""
  dsc = (d[..., None] * sc)[..., None]  # [..., 8, 1]
  dm = (dmin[..., None] * mn)[..., None]
  return (dsc * q.astype(jnp.float32) - dm).reshape(*q.shape[:-2], QK_K)


def q4_k_codes(qs: jax.Array) -> jax.Array:
  """Q4_K codes [..., 128] uint8 (four 32-byte groups: low nibbles = weights 64j..64j+31,
  high nibbles = 64j+32..64j+63) -> [..., 8, 32] uint8 in weight order."""
  lead = qs.shape[:-1]
  qs = qs.reshape(*lead, 4, 1, 32)
  return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, 8, 32)


def q5_k_codes(qs: jax.Array, qh: jax.Array) -> jax.Array:
  """Q5_K codes: qs [..., 128] uint8 low nibbles (Q4_K's order), qh [..., 32] uint8 fifth bits
  (bit g of byte i: weight 32g + i) -> [..., 8, 32] uint8 in weight order."""
  hb = (qh[..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1   # [..., 8, 32]
  return q4_k_codes(qs) | (hb << 4)


def q6_k_values(d: jax.Array, scales: jax.Array, ql: jax.Array, qh: jax.Array) -> jax.Array:
  """Q6_K weights from their fields: d [...] float32; scales [..., 16] float32; ql [..., 128]
  uint8 low nibbles; qh [..., 64] uint8 2-bit high parts. Returns [..., 256] float32,
  (d * scale) * (q - 32) in gguf-py's order."""
  lead = ql.shape[:-1]
  ql = ql.reshape(*lead, 2, 1, 64)
  qh = qh.reshape(*lead, 2, 1, 32)
  dsc = (d[..., None] * scales).reshape(*lead, 16, 1)
  ql = jnp.concatenate([ql & 0x0F, ql >> 4], axis=-2).reshape(*lead, 2, 4, 32)  # [.., half, quarter, 32]
  qh = ((qh >> jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]) & 3).reshape(*lead, 2, 4, 32)
  q = (ql | (qh << 4)).astype(jnp.int8) - jnp.int8(32)
  q = q.reshape(*lead, 16, 16).astype(jnp.float32)
  return (dsc * q).reshape(*lead, QK_K)


def dequantize_blocks(b: jax.Array, fmt: str) -> jax.Array:
  """Dequantize raw blocks.

  b: [..., type_size] uint8, one GGUF block per row of the last axis.
  Returns [..., block_size] float32, bit-identical to gguf.quants.dequantize on CPU.
  Raises ValueError for an unknown fmt.
  """
  if fmt == "q8_0":
    return b[..., 2:].view(jnp.int8).astype(jnp.float32) * _f16(b[..., 0], b[..., 1])[..., None]
  if fmt == "q4_0":
    d = _f16(b[..., 0], b[..., 1])[..., None]
    q = _nibbles(b[..., 2:18]).astype(jnp.int8) - jnp.int8(8)
    return d * q.astype(jnp.float32)
  if fmt == "q4_1":
    d = _f16(b[..., 0], b[..., 1])[..., None]
    m = _f16(b[..., 2], b[..., 3])[..., None]
    return d * _nibbles(b[..., 4:20]).astype(jnp.float32) + m
  if fmt in ("q5_0", "q5_1"):
    off = 2 if fmt == "q5_0" else 4
    d = _f16(b[..., 0], b[..., 1])[..., None]
    qh = _u32(b[..., off:off + 4])[..., None] >> jnp.arange(32, dtype=jnp.uint32)
    qh = (qh & 1).astype(jnp.uint8)
    q = _nibbles(b[..., off + 4:off + 20]) | (qh << 4)
    if fmt == "q5_0":
      return d * (q.astype(jnp.int8) - jnp.int8(16)).astype(jnp.float32)
    return d * q.astype(jnp.float32) + _f16(b[..., 2], b[..., 3])[..., None]
  if fmt in ("q4_k", "q5_k"):
    sc, mn = _scale_min_k4(b[..., 4:16])
    if fmt == "q4_k":
      q = q4_k_codes(b[..., 16:144])
    else:
      q = q5_k_codes(b[..., 48:176], b[..., 16:48])
    return k_quant_values(_f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3]), sc, mn, q)
  if fmt == "q6_k":
    return q6_k_values(_f16(b[..., 208], b[..., 209]),
                       b[..., 192:208].view(jnp.int8).astype(jnp.float32),
                       b[..., 0:128], b[..., 128:192])
  raise ValueError(f"unsupported block format {fmt=}; supported: {SUPPORTED_FORMATS}")


def dequantize(w: Any, dtype=jnp.float32) -> jax.Array:
  """Packed weight (`data`, `fmt`, logical `shape` [N, K]; leading batch axes of `data` are
  kept) -> [..., N, K] array of `dtype` (float32 default, exact). Raises ValueError for an
  unknown fmt."""
  if w.fmt in FLOAT_FORMATS:
    return w.data.astype(dtype)
  blk, size = BLOCK_FORMATS[w.fmt]
  n, k = w.shape
  lead = w.data.shape[:-1]
  b = w.data.reshape(*lead, k // blk, size)
  return dequantize_blocks(b, w.fmt).reshape(*lead, k).astype(dtype)
