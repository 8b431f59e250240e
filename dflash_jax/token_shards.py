"""Token-id shards of target-generated data (prompt + response ids, no features: the
training step recomputes target features online), with a manifest that records how each shard
was made and lets generation resume. Read by the draft trainer (`dflash_jax.train`) and by the
n-gram table builder (`ngram.from_shards`).

Layout of a data directory:
  manifest.json   {"format": 1, "shards": [entry, ...]}, entry = {"file", "sha256", "n_seqs",
                  "prompt_tokens", "response_tokens", "first_prompt", "temperature", "seed",
                  "max_new_tokens", "target", "target_sha256", "command", "minutes", "created"}
  shard_00000.npz compressed npz: ids [sum(P_i + R_i)] uint16 (uint32 if the vocabulary needs
                  it), prompt_lens [n] int32, response_lens [n] int32, prompt_index [n] int64
                  (position of the prompt in the corpus order).
A shard is written to a temporary name and renamed, then the manifest is rewritten the same
way, so an interrupted write leaves at most an unlisted file (ignored; overwritten on resume).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Callable, Optional, Sequence

import numpy as np

MANIFEST = "manifest.json"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class TokenSeq:
  """One training sequence: prompt ids then response ids (response cut after its first EOG,
  kept), and where its prompt sits in the corpus order."""

  prompt: np.ndarray     # [P] int32
  response: np.ndarray   # [R] int32
  prompt_index: int

  @property
  def tokens(self) -> np.ndarray:
    """[P + R] int32."""
    return np.concatenate([self.prompt, self.response]).astype(np.int32)

  @property
  def prompt_len(self) -> int:
    return int(self.prompt.size)


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as fh:
    while True:
      b = fh.read(chunk)
      if not b:
        return h.hexdigest()
      h.update(b)


def read_manifest(data_dir: str) -> dict:
  """The data directory's manifest ({"format", "shards": []} if there is none yet).
  Raises ValueError for a manifest that is not valid JSON of this format."""
  path = os.path.join(data_dir, MANIFEST)
  if not os.path.exists(path):
    return {"format": FORMAT, "shards": []}
  try:
    with open(path) as fh:
      m = json.load(fh)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable shard manifest: {e}") from None
  if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("shards"), list):
    raise ValueError(f"{path}: not a shard manifest of format {FORMAT}")
  return m


def _write_json_atomic(path: str, obj):
  tmp = path + ".tmp"
  with open(tmp, "w") as fh:
    json.dump(obj, fh, indent=1)
  os.replace(tmp, path)


def write_shard(data_dir: str, seqs: Sequence[TokenSeq], n_vocab: int, **meta) -> dict:
  """Append one shard of `seqs` to data_dir (created if missing) and list it in the manifest.

  meta: recorded as given (e.g. temperature, seed, max_new_tokens, target, target_sha256,
  command, minutes). Returns the manifest entry. Raises ValueError for an empty shard or ids
  outside [0, n_vocab).
  """
  if not seqs:
    raise ValueError("write_shard: no sequences")
  os.makedirs(data_dir, exist_ok=True)
  man = read_manifest(data_dir)
  dtype = np.uint16 if n_vocab <= 1 << 16 else np.uint32
  ids = np.concatenate([s.tokens for s in seqs])
  if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
    raise ValueError(f"write_shard: token ids outside the vocabulary [0, {n_vocab})")
  name = f"shard_{len(man['shards']):05d}.npz"
  path = os.path.join(data_dir, name)
  tmp = path + ".tmp.npz"
  np.savez_compressed(tmp, ids=ids.astype(dtype),
                      prompt_lens=np.array([s.prompt.size for s in seqs], np.int32),
                      response_lens=np.array([s.response.size for s in seqs], np.int32),
                      prompt_index=np.array([s.prompt_index for s in seqs], np.int64))
  os.replace(tmp, path)
  entry = {"file": name, "sha256": sha256_file(path), "n_seqs": len(seqs),
           "prompt_tokens": int(sum(s.prompt.size for s in seqs)),
           "response_tokens": int(sum(s.response.size for s in seqs)),
           "first_prompt": int(min(s.prompt_index for s in seqs)),
           "created": time.strftime("%Y-%m-%d %H:%M:%S"), **meta}
  man["shards"].append(entry)
  _write_json_atomic(os.path.join(data_dir, MANIFEST), man)
  return entry


def read_shard(data_dir: str, entry: dict, n_vocab: int) -> list[TokenSeq]:
  """The sequences of one manifest entry, validated: the file's sha256 equals the manifest's,
  lengths add up, ids < n_vocab. Raises ValueError naming the file otherwise."""
  path = os.path.join(data_dir, entry["file"])
  if not os.path.exists(path):
    raise ValueError(f"{path}: listed in {MANIFEST} but missing")
  got = sha256_file(path)
  if got != entry["sha256"]:
    raise ValueError(f"{path}: sha256 {got[:16]}... does not match the manifest's "
                     f"{entry['sha256'][:16]}... (corrupt or replaced shard)")
  try:
    with np.load(path) as z:
      ids, plens, rlens, pidx = z["ids"], z["prompt_lens"], z["response_lens"], z["prompt_index"]
  except Exception as e:   # zip / npy errors of a damaged file that still hashes as listed
    raise ValueError(f"{path}: not a readable token shard: {e}") from None
  n = plens.size
  if not (rlens.size == pidx.size == n == entry["n_seqs"]) or (plens < 1).any() or (rlens < 0).any():
    raise ValueError(f"{path}: inconsistent sequence counts or lengths")
  if int(plens.sum() + rlens.sum()) != ids.size:
    raise ValueError(f"{path}: lengths add up to {int(plens.sum() + rlens.sum())} ids, the shard "
                     f"has {ids.size}")
  if ids.size and int(ids.max()) >= n_vocab:
    raise ValueError(f"{path}: token id {int(ids.max())} outside the vocabulary [0, {n_vocab})")
  ids = ids.astype(np.int32)
  out, o = [], 0
  for p, r, i in zip(plens.tolist(), rlens.tolist(), pidx.tolist()):
    out.append(TokenSeq(ids[o:o + p], ids[o + p:o + p + r], i))
    o += p + r
  return out


def read_shards(data_dirs: str | Sequence[str], n_vocab: int,
                max_shards: Optional[int] = None,
                where: Optional[Callable[[dict], bool]] = None) -> list[TokenSeq]:
  """Every sequence of every listed shard of one or more data directories, in manifest order
  (read_shard's validation). max_shards: the first ones of each directory only; where: a test on
  a manifest entry (after max_shards), the shards it passes only. Raises ValueError for a
  directory without shards."""
  dirs = [data_dirs] if isinstance(data_dirs, str) else list(data_dirs)
  out = []
  for d in dirs:
    entries = read_manifest(d)["shards"]
    if not entries:
      raise ValueError(f"{d}: no token shards (no {MANIFEST}, or it lists none)")
    for e in entries[:max_shards]:
      if where is None or where(e):
        out.extend(read_shard(d, e, n_vocab))
  return out


def summary(data_dirs: str | Sequence[str]) -> dict:
  """Totals over the manifests: shards, sequences, prompt / response tokens, minutes."""
  dirs = [data_dirs] if isinstance(data_dirs, str) else list(data_dirs)
  es = [e for d in dirs for e in read_manifest(d)["shards"]]
  return {"shards": len(es), "sequences": sum(e["n_seqs"] for e in es),
          "prompt_tokens": sum(e["prompt_tokens"] for e in es),
          "response_tokens": sum(e["response_tokens"] for e in es),
          "minutes": round(sum(e.get("minutes", 0.0) for e in es), 2)}
