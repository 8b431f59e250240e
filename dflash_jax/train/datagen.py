"""Training data at scale: the target answers the prompt corpus with the batched decoding loop
(`dflash_jax.generate_batch`, B rows at once, autoregressive, greedy or sampled), and the
responses are stored as token-id shards (`shards`), resumable across runs.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional, Sequence

import numpy as np

from dflash_jax.train import shards as shards_lib
from dflash_jax.train.corpus import Prompt


def encode_corpus(target, corpus: Sequence[Prompt], max_prompt: int,
                  exclude: Sequence[str] = ()) -> list[tuple[int, list[int]]]:
  """(corpus index, prompt ids) of every prompt with at most max_prompt tokens (code prompts
  raw, chat prompts through the target's chat template), skipping texts in `exclude` (the
  benchmark prompts). Indices refer to `corpus`, so a resumed run skips what is done."""
  from dflash_jax import cli
  banned = set(exclude)
  out = []
  for i, p in enumerate(corpus):
    if p.text in banned:
      continue
    ids = cli.build_prompt(target, p.text, chat=p.kind == "chat")
    if len(ids) <= max_prompt:
      out.append((i, ids))
  return out


def _prompts_digest(index: np.ndarray, lens: np.ndarray, ids: np.ndarray) -> str:
  """sha256 of a prompt file's arrays (index int64, lens int32, ids int32 bytes)."""
  import hashlib
  return hashlib.sha256(index.astype(np.int64).tobytes() + lens.astype(np.int32).tobytes() +
                        ids.astype(np.int32).tobytes()).hexdigest()


def save_prompts(path: str, prompts: Sequence[tuple[int, Sequence[int]]], meta: dict) -> str:
  """Write encoded prompts ((corpus index, ids) pairs) to a compressed npz, so another machine
  answers exactly these prompts whatever its Python and packages (the corpus is built from the
  installed standard library and packages, so its order differs between machines).

  Layout: index [n] int64, lens [n] int32, ids [sum lens] int32, meta (a JSON string: how the
  corpus was built and encoded), sha256 of the three arrays. Returns the sha256."""
  import json
  index = np.asarray([i for i, _ in prompts], np.int64)
  lens = np.asarray([len(p) for _, p in prompts], np.int32)
  ids = np.concatenate([np.asarray(p, np.int32) for _, p in prompts]) if prompts else \
      np.zeros(0, np.int32)
  digest = _prompts_digest(index, lens, ids)
  tmp = path + ".tmp.npz"
  np.savez_compressed(tmp, index=index, lens=lens, ids=ids, meta=json.dumps(meta),
                      sha256=digest)
  os.replace(tmp, path)
  return digest


def load_prompts(path: str, n_vocab: int, target_sha256: Optional[str] = None
                 ) -> tuple[list[tuple[int, list[int]]], dict]:
  """The (corpus index, ids) pairs and meta written by `save_prompts`.
  Raises ValueError naming the file if it is unreadable, its arrays disagree, its hash does not
  match, an id is >= n_vocab, the indices are not increasing, or (target_sha256 given) its meta
  names another target's sha256."""
  import json
  try:
    with np.load(path) as z:
      index, lens, ids = z["index"], z["lens"], z["ids"]
      meta, digest = json.loads(str(z["meta"])), str(z["sha256"])
  except Exception as e:  # noqa: BLE001 (zip, key, JSON errors alike)
    raise ValueError(f"{path}: not a readable prompt file ({type(e).__name__}: {e})") from None
  if target_sha256 is not None and meta.get("target_sha256") != target_sha256:
    raise ValueError(f"{path} was made for target {meta.get('target')} (sha256 "
                     f"{meta.get('target_sha256')}), not the target of sha256 {target_sha256}")
  if index.shape != lens.shape or int(lens.sum()) != ids.size or (lens <= 0).any():
    raise ValueError(f"{path}: {index.size} indices, {lens.size} lengths summing to "
                     f"{int(lens.sum())} and {ids.size} ids do not agree")
  if _prompts_digest(index, lens, ids) != digest:
    raise ValueError(f"{path}: sha256 of the prompt arrays does not match the one stored")
  if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
    raise ValueError(f"{path}: token id {int(ids.max())} outside the vocabulary [0, {n_vocab})")
  if (np.diff(index) <= 0).any():
    raise ValueError(f"{path}: corpus indices are not increasing")
  splits = np.split(ids, np.cumsum(lens)[:-1]) if lens.size else []
  return [(int(i), s.tolist()) for i, s in zip(index, splits)], meta


def resume_index(data_dir: str, temperature: float, seed: int, lo: int = 0,
                 hi: Optional[int] = None) -> int:
  """The first corpus index after every prompt already answered in data_dir at this
  (temperature, seed) among indices in [lo, hi) (hi None: no bound), or lo if none there. The
  window keeps prompt sets with disjoint index ranges (the corpus, `self_queries` from
  SELF_QUERY_BASE on) from resuming past each other."""
  done = [e["last_prompt"] for e in shards_lib.read_manifest(data_dir)["shards"]
          if e.get("temperature") == temperature and e.get("seed") == seed
          and e["last_prompt"] >= lo and (hi is None or e["last_prompt"] < hi)]
  return max(done) + 1 if done else lo


def generate_token_seqs(target, prompts: Sequence[tuple[int, Sequence[int]]], *,
                        max_new_tokens: int, temperature: float, seed: int, batch_size: int,
                        max_ctx: int, top_p: float = 1.0) -> list[shards_lib.TokenSeq]:
  """The target's responses to `prompts` ((corpus index, ids) pairs) through the batched
  autoregressive loop: greedy (temperature 0) or sampled (row of corpus index i draws with seed
  seed + i, so a response does not depend on its batch). Each response stops after its first
  EOG token (kept) or at max_new_tokens."""
  import dflash_jax as dj
  sampling = dj.SamplingConfig(temperature=temperature, top_p=top_p if temperature > 0 else 1.0)
  res = dj.generate_batch(target, None, [ids for _, ids in prompts], max_new_tokens=max_new_tokens,
                          sampling=sampling, seed=[seed + i for i, _ in prompts],
                          batch_size=batch_size, mode="ar", max_ctx=max_ctx)
  return [shards_lib.TokenSeq(np.asarray(ids, np.int32), np.asarray(r.tokens, np.int32), i)
          for (i, ids), r in zip(prompts, res)]


def generate_shards(target, prompts: Sequence[tuple[int, Sequence[int]]], data_dir: str, *,
                    max_new_tokens: int, temperature: float, seed: int, batch_size: int,
                    max_ctx: int, shard_prompts: int, meta: dict, top_p: float = 1.0,
                    deadline: Optional[float] = None, max_response_tokens: Optional[int] = None,
                    log: Callable[[str], None] = print) -> dict:
  """Answer the prompts not yet in data_dir for this (temperature, seed) (resumed within the
  prompts' index range, `resume_index`), `shard_prompts` per shard, appending shards until the
  prompts run out, time.time() passes `deadline` or the directory holds max_response_tokens
  response tokens. meta (command, target, target_sha256,
  ...) is recorded in every manifest entry. Returns the directory's `shards.summary`."""
  if not prompts:
    return shards_lib.summary(data_dir)
  lo, hi = min(p[0] for p in prompts), max(p[0] for p in prompts) + 1
  start = resume_index(data_dir, temperature, seed, lo, hi)
  todo = [p for p in prompts if p[0] >= start]
  for s in range(0, len(todo), shard_prompts):
    if deadline is not None and time.time() > deadline:
      break
    if max_response_tokens is not None and \
        shards_lib.summary(data_dir)["response_tokens"] >= max_response_tokens:
      break
    part = todo[s:s + shard_prompts]
    t0 = time.perf_counter()
    seqs = generate_token_seqs(target, part, max_new_tokens=max_new_tokens,
                               temperature=temperature, seed=seed, batch_size=batch_size,
                               max_ctx=max_ctx, top_p=top_p)
    minutes = (time.perf_counter() - t0) / 60
    e = shards_lib.write_shard(data_dir, seqs, target.config.n_vocab, temperature=temperature,
                               seed=seed, top_p=top_p if temperature > 0 else 1.0,
                               max_new_tokens=max_new_tokens, last_prompt=part[-1][0],
                               batch_size=batch_size, minutes=round(minutes, 3), **meta)
    log(f"{e['file']}: {e['n_seqs']} sequences, {e['response_tokens']} response tokens in "
        f"{minutes:.1f} min ({e['response_tokens'] / max(minutes * 60, 1e-9):.1f} tok/s)")
  return shards_lib.summary(data_dir)
