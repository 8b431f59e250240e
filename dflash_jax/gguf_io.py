"""Reading GGUF files with the `gguf` package: metadata as a plain dict, tensors by GGUF name,
with errors that name the file and tensor instead of tracebacks from numpy.memmap."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np


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
  path: str
  meta: dict[str, Any]
  tensors: dict[str, GGUFTensor]

  @property
  def n_tensor_bytes(self) -> int:
    return sum(t.n_bytes for t in self.tensors.values())


def read_gguf(path: str | os.PathLike) -> GGUFFile:
  """Open a GGUF file (memmapped; nothing is copied).

  Raises:
    FileNotFoundError: the file does not exist.
    ValueError: the file is not a GGUF file, or is truncated/corrupt (names the file and, where
      known, the tensor whose data runs past the end of the file).
  """
  from gguf import GGUFReader  # imported lazily: it is slow to import

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  size = os.path.getsize(path)
  try:
    reader = GGUFReader(path, "r")
  except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad headers
    raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): "
                     f"{type(e).__name__}: {e}") from e
  meta: dict[str, Any] = {}
  for key, field in reader.fields.items():
    try:
      meta[key] = field.contents()
    except Exception as e:
      raise ValueError(f"{path}: corrupt metadata field {key!r}: {e}") from e
  tensors: dict[str, GGUFTensor] = {}
  for t in reader.tensors:
    end = int(t.data_offset) + int(t.n_bytes)
    if end > size:
      raise ValueError(f"{path}: truncated file: tensor {t.name!r} needs bytes up to {end}, "
                       f"file has {size}")
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name.lower(), shape, t.data, int(t.n_bytes))
  return GGUFFile(path, meta, tensors)
