"""Kernel-friendly planes for the K-quant weights of a Q4_K_M file (Q4_K, Q5_K, Q6_K), made at load.

A GGUF row interleaves, every 256 weights, a header (f16 scales, packed 6-bit sub-block scales)
with the codes (144-byte Q4_K, 176-byte Q5_K, 210-byte Q6_K blocks: Q6_K's not even word-aligned). A GPU
kernel that streams the codes with wide (TMA) loads wants each field as its own plane, one
row of the weight per plane row, so that a K tile of the weight is one contiguous byte range
of every plane:

  Q4_K -> codes [N, K/2] uint8  (4-bit codes; byte 32g+i holds weights 64g+i (low nibble) and
                                 64g+32+i (high nibble): GGUF's in-block order, continued across
                                 blocks, so a K tile of 64t weights is 32t bytes)
          scales, mins [N, K/32] uint8 (the 6-bit sub-block scale and min, unpacked)
          d, dmin [N, K/256] float16
          bytes: 148 per 256 weights (GGUF: 144, +2.8 %)
  Q5_K -> as Q4_K (codes = the low 4 bits), plus
          high [N, K/8] uint8 (the fifth bits: byte 32b+i, bit g holds weight 256b+32g+i: GGUF's
                                qh, block after block)
          bytes: 180 per 256 weights (GGUF: 176, +2.3 %)
  Q6_K -> codes [N, K/2] uint8  (low 4 bits; byte 64h+i holds weights 128h+i and 128h+64+i)
          high [N, K/4] uint8   (high 2 bits; byte 32h+i, bits 2s..2s+1 hold weight 128h+32s+i)
          scales [N, K/16] int8, d [N, K/256] float16
          bytes: 210 per 256 weights (as GGUF)

Nothing is rounded: `to_gguf` rebuilds the file's bytes exactly, and `dequantize_planes`
computes the same float32 operations, in the same order, as gguf-py's
`gguf.quants.dequantize` (`Q4_K.dequantize_blocks`, `Q5_K...`, `Q6_K...`), so it is
bit-identical to it (tests/test_repack.py). Block layouts: ggml/src/ggml-common.h (block_q4_K,
block_q5_K, block_q6_K).

The arithmetic is gguf_blocks' (`k_quant_values`, `q6_k_values`), shared with the GGUF-block
reference; this package imports nothing from dflash_jax.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gguf_blocks import (BLOCK_FORMATS, QK_K, k_quant_values, q4_k_codes,
                                        q5_k_codes, q6_k_values, unpack_scale_min_k4)

REPACK_FORMATS = ("q4_k", "q5_k", "q6_k")
_TYPE_SIZE = {f: BLOCK_FORMATS[f][1] for f in REPACK_FORMATS}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Planes:
  """One K-quant weight as planes (see the module docstring for each plane's layout).

  fmt: "q4_k" | "q5_k" | "q6_k" (static); shape: logical (N, K) (static); codes: [N, K/2] uint8;
  scales: [N, K/32] uint8 (Q4_K, Q5_K) or [N, K/16] int8 (Q6_K); d: [N, K/256] float16;
  mins: [N, K/32] uint8 and dmin: [N, K/256] float16 (Q4_K, Q5_K, else None);
  high: [N, K/8] uint8 (Q5_K), [N, K/4] uint8 (Q6_K), else None.
  """

  codes: jax.Array
  scales: jax.Array
  d: jax.Array
  mins: Optional[jax.Array] = None
  dmin: Optional[jax.Array] = None
  high: Optional[jax.Array] = None
  fmt: str = dataclasses.field(default="q4_k", metadata=dict(static=True))
  shape: tuple = dataclasses.field(default=(0, 0), metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes of all planes (what the device holds)."""
    return arrays_nbytes(self.codes, self.scales, self.d, self.mins, self.dmin, self.high)


def arrays_nbytes(*arrays) -> int:
  """Bytes of the given arrays (numpy, jax or ShapeDtypeStruct; None entries skipped)."""
  return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays if a is not None)


def _blocks(raw: np.ndarray, fmt: str, shape, name: str) -> np.ndarray:
  """raw GGUF rows [N, K/256 * type_size] uint8 -> [N, K/256, type_size]; ValueError naming
  the tensor for an unsupported format or a size that does not match."""
  if fmt not in REPACK_FORMATS:
    raise ValueError(f"{name}: cannot repack format {fmt!r}; repackable: {REPACK_FORMATS}")
  n, k = (int(s) for s in shape)
  if k % QK_K:
    raise ValueError(f"{name}: {fmt} row length K={k} is not a multiple of {QK_K}")
  raw = np.asarray(raw)
  want = (n, k // QK_K * _TYPE_SIZE[fmt])
  if raw.dtype != np.uint8 or raw.shape != want:
    raise ValueError(f"{name}: {fmt} data must be uint8 {want} for logical shape {(n, k)}, got "
                     f"{raw.dtype} {raw.shape}")
  return raw.reshape(n, k // QK_K, _TYPE_SIZE[fmt])


def repack(raw: np.ndarray, fmt: str, shape, name: str = "weight") -> Planes:
  """GGUF rows -> Planes (numpy arrays; host work at load time, no float arithmetic).

  raw: [N, K/256 * type_size] uint8, the tensor's bytes as in the file; fmt: REPACK_FORMATS;
  shape: logical (N, K). Raises ValueError naming `name` for another format, K not a multiple
  of 256, or data of the wrong size.
  """
  b = _blocks(raw, fmt, shape, name)
  n, nb, _ = b.shape
  if fmt in ("q4_k", "q5_k"):
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0]
    sc, mn = unpack_scale_min_k4(b[..., 4:16], xp=np)
    codes, high = (b[..., 16:144], None) if fmt == "q4_k" else (b[..., 48:176], b[..., 16:48])
    return Planes(codes=codes.reshape(n, nb * 128), scales=sc.reshape(n, nb * 8), d=d,
                  mins=mn.reshape(n, nb * 8), dmin=dmin,
                  high=None if high is None else high.reshape(n, nb * 32), fmt=fmt,
                  shape=(n, nb * QK_K))
  d = b[..., 208:210].copy().view(np.float16)[..., 0]
  return Planes(codes=b[..., 0:128].reshape(n, nb * 128), high=b[..., 128:192].reshape(n, nb * 64),
                scales=b[..., 192:208].copy().view(np.int8).reshape(n, nb * 16), d=d, fmt=fmt,
                shape=(n, nb * QK_K))


def to_gguf(p: Planes) -> np.ndarray:
  """Planes -> the GGUF rows they were made from, [N, K/256 * type_size] uint8 (exact inverse
  of `repack`: the 6-bit scales are packed back into their 12 bytes)."""
  n, k = p.shape
  nb = k // QK_K
  if p.fmt in ("q4_k", "q5_k"):
    sc = np.asarray(p.scales).reshape(n, nb, 8)
    mn = np.asarray(p.mins).reshape(n, nb, 8)
    lo = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    hi = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    md = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    parts = [np.asarray(p.d, np.float16)[..., None].view(np.uint8),
             np.asarray(p.dmin, np.float16)[..., None].view(np.uint8), lo, hi, md]
    if p.fmt == "q5_k":
      parts.append(np.asarray(p.high).reshape(n, nb, 32))
    parts.append(np.asarray(p.codes).reshape(n, nb, 128))
  elif p.fmt == "q6_k":
    parts = [np.asarray(p.codes).reshape(n, nb, 128), np.asarray(p.high).reshape(n, nb, 64),
             np.asarray(p.scales).reshape(n, nb, 16).view(np.uint8),
             np.asarray(p.d, np.float16)[..., None].view(np.uint8)]
  else:
    raise ValueError(f"to_gguf: unknown planes format {p.fmt!r}")
  return np.concatenate([x.astype(np.uint8).reshape(n, nb, -1) for x in parts],
                        axis=-1).reshape(n, -1)


def dequantize_planes(p: Planes, dtype=jnp.float32) -> jax.Array:
  """Planes -> [N, K] array of `dtype`; in float32 bit-identical to gguf.quants.dequantize of
  the GGUF bytes (same operations in the same order: (d * sc) * q - dmin * m for Q4_K / Q5_K,
  (d * scale) * (q - 32) for Q6_K, all float32). Raises ValueError for an unknown format."""
  n, k = p.shape
  nb = k // QK_K
  d = p.d.astype(jnp.float32)
  if p.fmt in ("q4_k", "q5_k"):
    codes = p.codes.reshape(n, nb, 128)
    q = q4_k_codes(codes) if p.fmt == "q4_k" else q5_k_codes(codes, p.high.reshape(n, nb, 32))
    w = k_quant_values(d, p.dmin.astype(jnp.float32),
                       p.scales.reshape(n, nb, 8).astype(jnp.float32),
                       p.mins.reshape(n, nb, 8).astype(jnp.float32), q)
  elif p.fmt == "q6_k":
    w = q6_k_values(d, p.scales.reshape(n, nb, 16).astype(jnp.float32),
                    p.codes.reshape(n, nb, 128), p.high.reshape(n, nb, 64))
  else:
    raise ValueError(f"dequantize_planes: unknown planes format {p.fmt!r}")
  return w.reshape(n, k).astype(dtype)


def planes_matmul_reference(x: jax.Array, p: Planes) -> jax.Array:
  """Pure-JAX reference of the planes matmul: x [M, K] float -> [M, N] float32, x @
  dequantize_planes(p)^T at HIGHEST precision (what a planes kernel is tested against)."""
  w = dequantize_planes(p)
  return jnp.dot(w, x.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32).T
