"""GGUF weights kept packed on device: `QuantWeight`, loading from GGUFReader data, embedding
rows, dequantization at load.

A `QuantWeight` holds one GGUF matrix exactly as the file stores it: for block formats, the raw
bytes of each row (`[N, K // block_size * type_size] uint8`, row r = output channel r); for float
formats, the values (`[N, K]` float32 / float16 / bfloat16). `dequantize` turns it into `[N, K]`
float32 with the same arithmetic, in the same order, as gguf-py's `gguf.quants.dequantize`
(which is bit-identical to ggml's `dequantize_row_*`), so the result is bit-identical on CPU.

The block tables and the pure-JAX dequantization live in pallas_kernels.gguf_blocks (the
kernels' reference; that package imports nothing from dflash_jax). Pallas kernels (pallas_kernels/dequant_matmul.py) read the same `[N, row_bytes] uint8` rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gguf_blocks, mgpu_matmul, repack
from pallas_kernels.gguf_blocks import (BLOCK_FORMATS, FLOAT_FORMATS, QK_K, SUPPORTED_FORMATS,  # noqa: F401
                                         dequantize_blocks)


def _static(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantWeight:
  """One weight matrix, logical shape [N, K] (numpy order: N output rows, K inputs).

  Attributes:
    data: block formats: [N, K // block * type_size] uint8 raw GGUF rows;
      float formats: [N, K] float32 / float16 / bfloat16 values.
    fmt: GGML type name in lower case, one of SUPPORTED_FORMATS.
    shape: logical (N, K).
  """

  data: jax.Array
  fmt: str = _static()
  shape: tuple[int, int] = _static()

  @property
  def nbytes(self) -> int:
    return int(self.data.size * self.data.dtype.itemsize)


def dequantize(w, dtype=jnp.float32) -> jax.Array:
  """A weight -> its [N, K] values in `dtype`, bit-identical (in float32) to
  `gguf.quants.dequantize` of its GGUF bytes. w: a QuantWeight, or a K-quant weight in the Mosaic
  GPU kernel's tile layout (`pallas_kernels.mgpu_matmul.TILES`, what `--kernels mosaic` loads
  Q4_K / Q5_K / Q6_K matrices as). Raises ValueError for an unknown format."""
  if isinstance(w, mgpu_matmul.TILES):
    return repack.dequantize_planes(mgpu_matmul.to_planes(w), dtype)
  return gguf_blocks.dequantize(w, dtype)


def take_rows(w: QuantWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Embedding lookup: rows `ids` ([T] int32) of w, dequantized -> [T, K] `dtype`.

  Only the selected packed rows are read and dequantized (GGUF blocks never cross rows).
  """
  rows = QuantWeight(jnp.take(w.data, ids, axis=0), w.fmt, (int(ids.shape[0]), w.shape[1]))
  return dequantize(rows, dtype)


def from_numpy(raw: np.ndarray, fmt: str, shape: tuple[int, int], *, name: str = "?") -> QuantWeight:
  """Wrap GGUFReader tensor data into a QuantWeight (host arrays; device_put later).

  raw: block formats: [N, row_bytes] uint8 (as GGUFReader returns it); float formats: [N, K].
  Raises ValueError naming the tensor if fmt is unsupported or the byte count does not match.
  """
  if fmt not in SUPPORTED_FORMATS:
    raise ValueError(f"tensor {name!r}: quant type {fmt.upper()} is not supported; "
                     f"supported: {', '.join(f.upper() for f in SUPPORTED_FORMATS)}")
  n, k = shape
  if fmt in BLOCK_FORMATS:
    blk, size = BLOCK_FORMATS[fmt]
    if k % blk:
      raise ValueError(f"tensor {name!r}: row length {k} is not a multiple of the {fmt} block {blk}")
    raw = np.asarray(raw, np.uint8).reshape(n, k // blk * size)
  else:
    if fmt == "bf16":
      raw = np.asarray(raw).view(np.uint16).reshape(n, k)
      import ml_dtypes  # ships with jax
      raw = raw.view(ml_dtypes.bfloat16)
    else:
      raw = np.asarray(raw).reshape(n, k)
  return QuantWeight(raw, fmt, (int(n), int(k)))


_dequantize_jit = jax.jit(dequantize, static_argnums=1)


def to_dtype(w: QuantWeight, fmt: str) -> QuantWeight:
  """Dequantize at load (host side) into a float QuantWeight of fmt 'f32' | 'bf16' | 'f16'.
  One compiled program per (format, shape, dtype), so the layers of a model share a handful
  (eager ops cost ~1 s of dispatch for SmolLM2's 211 tensors)."""
  if fmt == w.fmt:
    return w
  dt = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[fmt]
  return QuantWeight(np.asarray(_dequantize_jit(jax.tree.map(jnp.asarray, w), dt)), fmt, w.shape)
