"""Q8_0 test GGUFs kept as a recipe instead of their bytes: the file's header (metadata and tensor
infos, up to the data section), its tensor table and its sha256. The data section is rebuilt from
the F32 file of the same model: F32 tensors copied, Q8_0 tensors quantized by gguf-py
(`gguf.quants.quantize`, the same arithmetic as ggml's quantize_row_q8_0 and llama.cpp's
converter). The rebuilt file must hash to the recorded sha256, so the tests read exactly the file
llama.cpp's converter wrote (a mismatch is an error, never a silent stand-in).

    write_recipe(q8_path, f32_path, recipe_path)   # tests/data/make_*.py, once
    matches(recipe_path, q8_path)                  # conftest: is the file there and current?
    rebuild(recipe_path, f32_path, q8_path)        # conftest, when it is not
"""

import hashlib
import os

import numpy as np


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def write_recipe(q8_path: str, f32_path: str, recipe_path: str):
  """Record q8_path as a recipe over f32_path; raises ValueError if rebuilding would not give
  q8_path's bytes back (a tensor that is neither a copy nor gguf-py's Q8_0 of the F32 one)."""
  import gguf
  q = gguf.GGUFReader(q8_path)
  with open(q8_path, "rb") as fh:
    raw = fh.read()
  names = [t.name for t in q.tensors]
  recipe = dict(header=np.frombuffer(raw[:q.data_offset], np.uint8), size=np.int64(len(raw)),
                sha256=np.str_(_sha256(raw)), names=np.array(names),
                offsets=np.array([t.data_offset for t in q.tensors], np.int64),
                q8_0=np.array([t.tensor_type == gguf.GGMLQuantizationType.Q8_0
                               for t in q.tensors]))
  np.savez_compressed(recipe_path, **recipe)
  if _build(recipe_path, f32_path) != raw:
    os.remove(recipe_path)
    raise ValueError(f"{q8_path}: not reproducible from {f32_path}")


def _build(recipe_path: str, f32_path: str) -> bytes:
  import gguf
  r = np.load(recipe_path)
  src = {t.name: t for t in gguf.GGUFReader(f32_path).tensors}
  buf = bytearray(int(r["size"]))
  header = r["header"].tobytes()
  buf[:len(header)] = header
  for name, off, q8 in zip(r["names"], r["offsets"], r["q8_0"]):
    data = np.asarray(src[str(name)].data, np.float32)
    if q8:
      data = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    b = np.ascontiguousarray(data).tobytes()
    buf[int(off):int(off) + len(b)] = b
  return bytes(buf)


def matches(recipe_path: str, path: str) -> bool:
  """True when path exists and hashes to the recipe's recorded sha256."""
  if not os.path.exists(path):
    return False
  with open(path, "rb") as fh:
    return _sha256(fh.read()) == str(np.load(recipe_path)["sha256"])


def rebuild(recipe_path: str, f32_path: str, out_path: str):
  """Write the file a recipe describes to out_path (atomically). Raises ValueError naming the
  recipe if the result does not hash to its recorded sha256."""
  data = _build(recipe_path, f32_path)
  want = str(np.load(recipe_path)["sha256"])
  if _sha256(data) != want:
    raise ValueError(f"{recipe_path}: rebuilt file has sha256 {_sha256(data)}, expected {want}")
  tmp = f"{out_path}.{os.getpid()}.tmp"
  with open(tmp, "wb") as fh:
    fh.write(data)
  os.replace(tmp, out_path)
