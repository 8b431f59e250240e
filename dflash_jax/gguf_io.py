"""Reading GGUF files with the `gguf` package: metadata as a plain dict, tensors by GGUF name,
with errors that name the file and tensor instead of tracebacks from numpy.memmap.

`gguf.GGUFReader` trusts the counts and offsets in the file: an array length of 2^40 makes it
loop past the end of the file, and a tensor offset near 2^64 wraps around in uint64 arithmetic.
`_BoundedReader` checks every count and length against the bytes left before reading, refuses
nested arrays, and checks each tensor's type, shape, byte size and offset in Python integers
before anything is mapped (the rules of llama.cpp's ggml/src/gguf.cpp).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Optional

import numpy as np

GGML_MAX_DIMS = 4          # ggml.h
_MAX_ELEMENTS = 1 << 48    # far above any model tensor; keeps products and byte sizes small ints


class GGUFFormatError(ValueError):
  """A GGUF file that is truncated or structurally invalid; the message names the file and, where
  known, the metadata key or tensor."""


@dataclasses.dataclass
class GGUFTensor:
  """One tensor of a GGUF file.

  Attributes:
    name: GGUF tensor name, e.g. "blk.0.attn_q.weight".
    fmt: GGML type name in lower case ("q4_k", "f32", ...).
    shape: numpy-order shape (reversed ggml ne), e.g. (N, K) for a matrix.
    data: numpy view (memmapped); block formats: uint8 [N, row_bytes].
    n_bytes: bytes in the file.
  """

  name: str
  fmt: str
  shape: tuple[int, ...]
  data: np.ndarray
  n_bytes: int


@dataclasses.dataclass
class GGUFFile:
  """An open GGUF file: metadata (key -> value), tensors by name, and the names a loader has
  taken with `tensor` (so it can refuse tensors it does not know)."""

  path: str
  meta: dict[str, Any]
  tensors: dict[str, GGUFTensor]
  used: set[str] = dataclasses.field(default_factory=set)
  on_read: Optional[Callable[[int], None]] = None   # called with each tensor's bytes, once

  def tensor(self, name: str) -> GGUFTensor:
    """The tensor `name`, marked used (and `on_read(its bytes)` the first time). Raises
    ValueError naming the file if it is missing."""
    t = self.tensors.get(name)
    if t is None:
      raise ValueError(f"{self.path}: missing tensor {name!r}")
    if name not in self.used and self.on_read is not None:
      self.on_read(t.n_bytes)
    self.used.add(name)
    return t

  @property
  def n_tensor_bytes(self) -> int:
    return sum(t.n_bytes for t in self.tensors.values())


def _bounded_reader_class():
  """GGUFReader subclass with bounds checks (built lazily: `gguf` is slow to import)."""
  from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
  from gguf.gguf_reader import ReaderField

  class _BoundedReader(GGUFReader):
    _where = "header"

    def _get(self, offset, dtype, count=1, override_order=None):
      count, offset = int(count), int(offset)
      end = offset + np.dtype(dtype).itemsize * count
      if count < 0 or offset < 0 or end > len(self.data):
        raise GGUFFormatError(f"{self._where}: needs bytes [{offset}, {end}) but the file has "
                              f"{len(self.data)} (truncated or corrupt)")
      return super()._get(offset, dtype, count, override_order)

    def _check_room(self, offs: int, count: int, min_item: int, what: str):
      left = len(self.data) - offs
      if count * min_item > left:
        raise GGUFFormatError(f"{self._where}: {what} claims {count} items of >= {min_item} "
                              f"bytes but only {left} bytes are left (corrupt length)")

    def _get_field_parts(self, orig_offs, raw_type):
      try:
        gtype = GGUFValueType(int(raw_type))
      except ValueError:
        raise GGUFFormatError(f"{self._where}: unknown metadata value type {int(raw_type)}") from None
      if gtype != GGUFValueType.ARRAY:
        return super()._get_field_parts(orig_offs, raw_type)
      raw_itype = self._get(orig_offs, np.uint32)
      alen = self._get(orig_offs + 4, np.uint64)
      offs, n = orig_offs + 12, int(alen[0])
      try:
        itype = GGUFValueType(int(raw_itype[0]))
      except ValueError:
        raise GGUFFormatError(f"{self._where}: unknown array item type {int(raw_itype[0])}") from None
      if itype == GGUFValueType.ARRAY:
        raise GGUFFormatError(f"{self._where}: nested arrays are not supported (as in llama.cpp)")
      nptype = self.gguf_scalar_to_np.get(itype)
      if itype == GGUFValueType.STRING:   # >= 8 bytes each (the length)
        self._check_room(offs, n, 8, "string array")
        return self._string_array(offs, n, [raw_itype, alen], [gtype, itype])
      if nptype is None:
        return super()._get_field_parts(orig_offs, raw_type)
      # Scalars: one view of all items (the parent loops creating one array per item).
      self._check_room(offs, n, np.dtype(nptype).itemsize, "array")
      vals = self._get(offs, nptype, n)
      return 12 + int(vals.nbytes), [raw_itype, alen, vals], [2], [gtype, itype]

    def _string_array(self, offs: int, n: int, head: list, types: list):
      """The parts of an array of n strings at offs, as GGUFReader builds them ([length, bytes]
      per item), in one lean loop: the parent recurses per item, ~25 us each, seconds for a
      tokenizer's vocabulary and merges."""
      data = self.data.view(np.ndarray)        # slicing a memmap subclass costs ~5x more
      size = len(data)
      order = sys.byteorder if self.byte_order == "I" else (
          "big" if sys.byteorder == "little" else "little")
      u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
      mv = memoryview(data)
      parts, idxs, start = list(head), [], offs
      for i in range(n):
        if offs + 8 > size:
          raise GGUFFormatError(f"{self._where}: string {i} of {n} starts past the end of the file "
                                "(truncated or corrupt)")
        slen = int.from_bytes(mv[offs:offs + 8], order)
        end = offs + 8 + slen
        if end > size:
          raise GGUFFormatError(f"{self._where}: string {i} of {n} claims {slen} bytes past the "
                                "end of the file (corrupt length)")
        parts.append(data[offs:offs + 8].view(u64))
        parts.append(data[offs + 8:end])
        idxs.append(len(parts) - 1)
        offs = end
      return 12 + offs - start, parts, idxs, types

    def _build_fields(self, offs, count):
      self._check_room(offs, int(count), 8 + 4 + 1, "kv_count")
      for _ in range(int(count)):   # as GGUFReader._build_fields, naming the key in errors
        orig_offs = offs
        klen, kdata = self._get_str(offs)
        self._where = f"metadata key at byte {orig_offs}"
        try:
          key = bytes(kdata).decode("utf-8")
        except UnicodeDecodeError:
          raise GGUFFormatError(f"{self._where}: key is not UTF-8") from None
        self._where = f"metadata key {key!r}"
        offs += int(klen.nbytes + kdata.nbytes)
        raw_kv_type = self._get(offs, np.uint32)
        offs += 4
        size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
        head = [klen, kdata, raw_kv_type]
        if key in self.fields:
          raise GGUFFormatError(f"{self._where}: duplicate key")
        self._push_field(ReaderField(orig_offs, key, head + parts, [i + 3 for i in idxs], types),
                         skip_sum=True)
        offs += size
      self._where = "tensor infos"
      return offs

    def _build_tensor_info(self, offs, count):
      self._check_room(offs, int(count), 8 + 4 + 4 + 8, "tensor_count")
      return super()._build_tensor_info(offs, count)

    def _get_tensor_info_field(self, orig_offs):
      n_dims = int(self._get(orig_offs + 8 + int(self._get(orig_offs, np.uint64)[0]), np.uint32)[0])
      if not 1 <= n_dims <= GGML_MAX_DIMS:
        raise GGUFFormatError(f"tensor info at byte {orig_offs}: n_dims={n_dims} not in "
                              f"[1, {GGML_MAX_DIMS}]")
      return super()._get_tensor_info_field(orig_offs)

    def _build_tensors(self, start_offs, fields):
      _check_tensor_infos(fields, int(start_offs), self.data, self.alignment,
                          GGMLQuantizationType, GGML_QUANT_SIZES)
      super()._build_tensors(start_offs, fields)

  return _BoundedReader


def _check_tensor_infos(fields, start: int, data: np.ndarray, alignment: int, qtypes, sizes):
  """Type, shape, byte size and offset of every tensor, in Python ints. As llama.cpp's
  gguf_init_from_file requires, tensor i's data starts where tensor i-1's (padded to the
  alignment) ends, so a wrapped, misaligned or overlapping offset, or a type or shape changed to
  one of another byte size, is an error; the padding must be zeros (as gguf-py and llama.cpp
  write it), which also catches a type changed to a smaller one within the padding. Raises
  GGUFFormatError naming the tensor."""
  file_size = len(data)
  expect = end = 0
  prev = None
  for field in fields:
    _, name_data, _, dims, raw_dtype, offset = field.parts
    try:
      name = bytes(name_data).decode("utf-8")
    except UnicodeDecodeError:
      raise GGUFFormatError(f"tensor name {bytes(name_data)[:40]!r}: not UTF-8") from None
    where = f"tensor {name!r}"
    try:
      qtype = qtypes(int(raw_dtype[0]))
    except ValueError:
      raise GGUFFormatError(f"{where}: unknown GGML type {int(raw_dtype[0])}") from None
    if qtype not in sizes:
      raise GGUFFormatError(f"{where}: GGML type {qtype.name} has no known block size")
    ne = [int(d) for d in dims]
    n_el = 1
    for d in ne:
      if d < 1 or d > _MAX_ELEMENTS:
        raise GGUFFormatError(f"{where}: bad dimension {d} in shape {ne}")
      n_el *= d
    if n_el > _MAX_ELEMENTS:
      raise GGUFFormatError(f"{where}: shape {ne} has {n_el} elements (corrupt)")
    block, type_size = sizes[qtype]
    if ne[0] % block:
      raise GGUFFormatError(f"{where}: row length {ne[0]} is not a multiple of the "
                            f"{qtype.name} block size {block}")
    n_bytes = n_el // block * type_size
    off = int(offset[0])
    if off == expect and prev is not None and np.any(data[start + end:start + off]):
      raise GGUFFormatError(f"tensor {prev!r}: the padding after its data is not zeros (a "
                            f"changed type or shape?)")
    if off != expect:
      raise GGUFFormatError(
          f"{where}: data offset {off}, expected {expect} (where the previous tensor's "
          f"{'padded data ends' if expect else 'data section starts'}): corrupt offset, or a "
          f"previous tensor's type or shape was changed")
    if start + off + n_bytes > file_size:
      raise GGUFFormatError(f"{where}: {qtype.name} {ne} needs data [{start + off}, "
                            f"{start + off + n_bytes}) but the file has {file_size} bytes: "
                            f"truncated, or a changed type or shape")
    end, prev = off + n_bytes, name
    expect = off + -(-n_bytes // alignment) * alignment
  if fields and (not 0 <= file_size - (start + end) < alignment or np.any(data[start + end:])):
    raise GGUFFormatError(f"the tensor data ends at byte {start + end} but the file has "
                          f"{file_size} bytes: a changed type or shape of the last tensor, or "
                          f"data appended to the file")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
  """Open a GGUF file (memmapped; nothing is copied). Every count, length and offset is checked
  against the file before it is used, so a corrupt file fails fast with bounded memory.

  Raises:
    FileNotFoundError: the file does not exist.
    GGUFFormatError (a ValueError): not a GGUF file, truncated or corrupt (names the file and the
      metadata key or tensor).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    reader = _bounded_reader_class()(path, "r")
  except GGUFFormatError as e:
    raise GGUFFormatError(f"{path}: {e}") from None
  except (ValueError, KeyError, IndexError, OverflowError, TypeError) as e:  # gguf's own checks
    raise GGUFFormatError(f"{path}: not a readable GGUF file (truncated or corrupt?): "
                          f"{type(e).__name__}: {e}") from None
  meta: dict[str, Any] = {}
  for key, field in reader.fields.items():
    try:
      meta[key] = field.contents()
    except (ValueError, IndexError) as e:     # e.g. a string value that is not UTF-8
      raise GGUFFormatError(f"{path}: corrupt metadata value of {key!r}: {e}") from None
  tensors: dict[str, GGUFTensor] = {}
  for t in reader.tensors:
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name.lower(), shape, t.data, int(t.n_bytes))
  return GGUFFile(path, meta, tensors)
