"""KV cache storage formats: `KVBuffer`, a cache of attention keys or values in float32,
bfloat16, float16, or llama.cpp's q8_0 / q4_0 blocks (`kv_quant`), with one interface for the
target's and the draft's caches.

A buffer is a tuple of planes that share every axis but the last: a float format has one plane
[..., S, Dh] in its dtype; a block format has its codes [..., S, Dh | Dh/2] and its float16
scales [..., S, Dh/32] (kv_quant's layout). Every row operation (write rows at a position,
read a chunk of rows, copy rows in or out of a slot) is therefore the same dynamic slice on each
plane, so the in-place writes of the decode loop and the chunked reads of
`layers.attention_live` stay what they are for float caches, and the values are quantized on
write and dequantized per chunk on read (never the whole cache).

Relative to the same format: a forward attends to its own new rows through `roundtrip` (the
exact values the cache will return once they are written), so a chain or tree verify reads what
autoregressive decoding with the same cache format reads, up to the last bits in which a
many-token forward's K/V differ from a one-token forward's; a rounding format can turn those into
a whole rounding step, so greedy outputs agree up to near ties (README, Limitations).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax import kv_quant

FLOAT_FORMATS = ("float32", "bfloat16", "float16")
FORMATS = FLOAT_FORMATS + kv_quant.FORMATS


def check_format(fmt: str, dim: int, what: str = "kv_dtype") -> None:
  """ValueError naming `what` for an unknown format, or a block format whose 32-value blocks do
  not tile the head dimension `dim`."""
  if fmt not in FORMATS:
    raise ValueError(f"{what}={fmt!r}: expected one of {FORMATS}")
  if fmt in kv_quant.FORMATS and dim % kv_quant.BLOCK:
    raise ValueError(f"{what}={fmt!r} stores blocks of {kv_quant.BLOCK} values along the head "
                     f"dimension, which is {dim} here (not a multiple of {kv_quant.BLOCK}); use "
                     f"float32, bfloat16 or float16")


def bytes_per_value(fmt: str) -> float:
  """Stored bytes per cached value: 4 / 2 / 2 for the float formats, 34/32 for q8_0, 18/32 for
  q4_0 (scales included)."""
  if fmt in FLOAT_FORMATS:
    return jnp.dtype(fmt).itemsize
  return kv_quant.bytes_per_value(fmt)


def encode(fmt: str, x: jax.Array) -> tuple:
  """Planes of values x [..., Dh] (any float dtype) in `fmt`: (x cast,) or (codes, scales)."""
  if fmt in FLOAT_FORMATS:
    return (x.astype(fmt),)
  return kv_quant.quantize(fmt, x)


def decode(fmt: str, planes: tuple) -> jax.Array:
  """[..., Dh] float32 values of `planes` in `fmt` (the inverse of `encode` up to its rounding)."""
  if fmt in FLOAT_FORMATS:
    return planes[0].astype(jnp.float32)
  return kv_quant.dequantize(fmt, *planes)


def roundtrip(fmt: str, x: jax.Array) -> jax.Array:
  """x [..., Dh] as the cache returns it after a write: decode(encode(x)), float32 (x itself,
  as float32, for "float32")."""
  if fmt == "float32":
    return x.astype(jnp.float32)
  return decode(fmt, encode(fmt, x))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVBuffer:
  """Keys or values of a KV cache in one storage format.

  Attributes:
    planes: arrays [..., S, w_i] sharing all axes but the last (see the module docstring);
      typically [n_layer, Hkv, S, w_i] per sequence (head-major, `layers.write_block`) or
      [B, n_layer, Hkv, S, w_i] for a batch.
    fmt: static; one of FORMATS.
    dim: static; the logical last axis (the head dimension Dh).
  """

  planes: tuple
  fmt: str = dataclasses.field(metadata=dict(static=True))
  dim: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def zeros(cls, fmt: str, lead: tuple, dim: int) -> "KVBuffer":
    """A zeroed buffer of logical shape lead + (dim,) (ValueError from `check_format`)."""
    check_format(fmt, dim)
    planes = jax.eval_shape(lambda: encode(fmt, jnp.zeros((1, dim), jnp.float32)))
    return cls(tuple(jnp.zeros(lead + p.shape[-1:], p.dtype) for p in planes), fmt, dim)

  @property
  def shape(self) -> tuple:
    """The logical shape [..., S, Dh]."""
    return self.planes[0].shape[:-1] + (self.dim,)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return sum(p.size * p.dtype.itemsize for p in self.planes)

  def map(self, fn) -> "KVBuffer":
    """The same buffer with fn(plane) for every plane (fn must keep the last axis)."""
    return dataclasses.replace(self, planes=tuple(fn(p) for p in self.planes))

  def write(self, rows: jax.Array, at: tuple) -> "KVBuffer":
    """rows [..., T, Dh] (float, the buffer's rank) encoded and written at index `at` (one
    dynamic-update-slice per plane: in place on a donated or loop-carried buffer; the last
    axis of `at` must be 0)."""
    return self.put(dataclasses.replace(self, planes=encode(self.fmt, rows)), at)

  def scatter(self, rows: jax.Array, lead: tuple, at_rows: jax.Array) -> "KVBuffer":
    """rows [(1,) n_layer, Hkv, T, Dh] float encoded and written at rows `at_rows` [T] int32 of
    the row axis (the second to last), under leading indices `lead` (a batched buffer's row
    index; rows then carries a leading 1): a ring buffer's wrapped write (in place)."""
    enc = encode(self.fmt, rows[0] if lead else rows)
    if lead:   # numpy indexing: the separated integer indices' axis (T) comes first
      enc = tuple(e.transpose(2, 0, 1, 3) for e in enc)
    idx = tuple(lead) + (slice(None), slice(None), at_rows)
    return dataclasses.replace(self, planes=tuple(
        p.at[idx].set(e.astype(p.dtype)) for p, e in zip(self.planes, enc)))

  def read(self, at: tuple, sizes: tuple) -> jax.Array:
    """The float32 values [*sizes, Dh] of the block at index `at` (one entry per axis, the last
    0) of leading sizes `sizes`: a dynamic slice per plane, then `decode`."""
    return decode(self.fmt, self.cut(at, sizes).planes)

  def put(self, other: "KVBuffer", at: tuple) -> "KVBuffer":
    """other's planes (same format, smaller leading axes) written at index `at`, as stored (no
    re-encoding: prompt-cache restores)."""
    if other.fmt != self.fmt:
      raise ValueError(f"KVBuffer.put: format {other.fmt!r} into a {self.fmt!r} buffer")
    return dataclasses.replace(self, planes=tuple(
        jax.lax.dynamic_update_slice(p, o.astype(p.dtype), at)
        for p, o in zip(self.planes, other.planes)))

  def cut(self, at: tuple, sizes: tuple) -> "KVBuffer":
    """The stored block at index `at` of logical leading sizes `sizes` (without the last axis),
    as a buffer of the same format (prompt-cache copies)."""
    return dataclasses.replace(self, planes=tuple(
        jax.lax.dynamic_slice(p, at, tuple(sizes) + p.shape[-1:]) for p in self.planes))

  def values(self) -> jax.Array:
    """All values, float32 [..., S, Dh] (tests and debugging: materializes the whole cache)."""
    return decode(self.fmt, self.planes)
