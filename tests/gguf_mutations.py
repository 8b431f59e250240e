"""Structured and random mutations of a GGUF file's header for the fuzz test (test_gguf_fuzz.py).

Every count, length, type and offset of the original file is located by reading it with the
plain `gguf.GGUFReader` (each parsed part is a view into the memmap, so its byte offset is known);
mutations overwrite those bytes with hostile values, flip random header bytes, or truncate.
"""

import dataclasses

import numpy as np

U64 = [0, 1, 2, 255, 1 << 31, 1 << 32, 1 << 40, 1 << 63, (1 << 64) - 1]
U32 = [0, 1, 2, 7, 9, 12, 13, 255, 1 << 16, (1 << 32) - 1]


@dataclasses.dataclass(frozen=True)
class Slot:
  """A header value: byte offset, numpy dtype, what it is (for the case name)."""
  offset: int
  dtype: str
  what: str


def header_slots(path):
  """Slots of every count, length, type id, scalar value, tensor dim/type/offset; and the header
  end (first tensor data byte)."""
  from gguf import GGUFReader
  r = GGUFReader(path)
  base = r.data.__array_interface__["data"][0]
  off = lambda a: a.__array_interface__["data"][0] - base
  slots = []
  for key, f in r.fields.items():
    if key.startswith("GGUF."):
      if key != "GGUF.version":
        slots.append(Slot(off(f.parts[0]), "<u8", key))
      continue
    klen, _, vtype = f.parts[:3]
    slots += [Slot(off(klen), "<u8", f"{key}:key_len"), Slot(off(vtype), "<u4", f"{key}:type")]
    rest = f.parts[3:]
    if len(f.types) > 1:     # array: item type, count, items
      slots += [Slot(off(rest[0]), "<u4", f"{key}:item_type"), Slot(off(rest[1]), "<u8", f"{key}:count")]
      if f.types[-1].name == "STRING":
        slots.append(Slot(off(rest[2]), "<u8", f"{key}:str_len[0]"))
      else:
        slots.append(Slot(off(rest[2]), rest[2].dtype.str, f"{key}:item[0]"))
    elif f.types[0].name == "STRING":
      slots.append(Slot(off(rest[0]), "<u8", f"{key}:str_len"))
    else:
      slots.append(Slot(off(rest[0]), rest[0].dtype.str, f"{key}:value"))
  for t in r.tensors:
    _, _, n_dims, dims, dtype, toff = t.field.parts
    slots += [Slot(off(n_dims), "<u4", f"{t.name}:n_dims"), Slot(off(dims), "<u8", f"{t.name}:ne0"),
              Slot(off(dtype), "<u4", f"{t.name}:type"), Slot(off(toff), "<u8", f"{t.name}:offset")]
    if len(dims) > 1:
      slots.append(Slot(off(dims) + 8, "<u8", f"{t.name}:ne1"))
  return slots, int(r.data_offset)


def write_slot(buf: bytearray, slot: Slot, value):
  """Overwrite `slot` in the file bytes `buf` with `value` in the slot's dtype."""
  dt = np.dtype(slot.dtype)
  buf[slot.offset:slot.offset + dt.itemsize] = np.array([value]).astype(dt).tobytes()


def _values(slot, rng):
  dt = np.dtype(slot.dtype)
  if dt.kind == "f":
    return [0.0, -1.0, np.nan, np.inf, 1e30, float(rng.normal())]
  if dt.kind == "b":
    return [2, 255]
  vals = U64 if dt.itemsize == 8 else U32 if dt.itemsize == 4 else [0, 1, 255]
  return [v % (1 << (8 * dt.itemsize)) for v in vals]


def mutations(path, n_cases, seed=0):
  """Yields (name, bytes): n_cases mutated copies of the file at `path` (fixed seed): about 3/5 set one
  header slot to a hostile value, 1/5 flip random header bytes, the rest truncate or set a tensor
  offset that wraps, misaligns or overlaps."""
  rng = np.random.default_rng(seed)
  raw = open(path, "rb").read()
  slots, data_start = header_slots(path)
  for i in range(n_cases):
    buf = bytearray(raw)
    kind = rng.integers(10)
    if kind < 6:
      slot = slots[rng.integers(len(slots))]
      vals = _values(slot, rng)
      v = vals[rng.integers(len(vals))]
      write_slot(buf, slot, v)
      name = f"{slot.what}={v}"
    elif kind < 8:
      k = int(rng.integers(1, 9))
      at = rng.integers(0, data_start, size=k)
      for a in at:
        buf[a] = int(rng.integers(256))
      name = f"flip{k}@{sorted(int(a) for a in at)}"
    elif kind < 9:
      cut = int(rng.integers(0, len(raw)))
      buf = buf[:cut]
      name = f"truncate@{cut}"
    else:
      slot = [s for s in slots if s.what.endswith(":offset")][rng.integers(len(slots) // 8 or 1) % 8]
      v = int([(1 << 64) - 1, 0, 1, 32, (1 << 64) - 32][rng.integers(5)])
      write_slot(buf, slot, v)
      name = f"{slot.what}={v}"
    yield f"{i}:{name}", bytes(buf)
