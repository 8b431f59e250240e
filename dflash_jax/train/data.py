"""Training data: the frozen target answers prompts (greedy, or sampled), batched with vmap, and
its features at the draft's `target_layer_ids` are captured in the same pass; the sequences are
stored as npz shards.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import decode as decode_lib
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib


@dataclasses.dataclass(frozen=True)
class TrainSeq:
  """One training sequence (host arrays).

  Attributes:
    tokens: [P+R] int32 prompt then response (cut after its first EOG token, kept).
    feats: [P+R-1, F*D] float16 target features of every token that was fed (row p = the
      residual-stream output of the feature layers at token p).
    prompt_len: P.
  """

  tokens: np.ndarray
  feats: np.ndarray
  prompt_len: int


def _bucket(n: int, m: int) -> int:
  return -(-n // m) * m


@functools.partial(jax.jit, static_argnames=("cfg", "rt", "feature_layers"))
def _batched_prefill(params, tokens, n_valid, cache, *, cfg, rt, feature_layers):
  def one(tok, n, c):
    pre = target_lib.prefill(params, cfg, tok, jnp.int32(0), n, c, rt,
                             feature_layers=feature_layers)
    last = jax.lax.dynamic_slice_in_dim(pre.hidden, n - 1, 1, axis=0)
    return jnp.argmax(target_lib.logits(params, cfg, last, rt)[0]).astype(jnp.int32), pre.feats, pre.cache
  return jax.vmap(one)(tokens, n_valid, cache)


def _pick(logits, key, temperature):
  """Greedy (temperature 0) or a sample from softmax(logits / temperature)."""
  if temperature <= 0:
    return jnp.argmax(logits).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "rt", "feature_layers", "temperature"),
                   donate_argnames=("cache",))
def _batched_step(params, tok, pos, cache, key, *, cfg, rt, feature_layers, temperature=0.0):
  """One autoregressive step per sequence: verify the root-only tree, commit it."""
  def one(t, p, c, k):
    tree = tree_lib.path_tree(t[None])
    choose = lambda logits: (jnp.zeros((1,), jnp.int32), jnp.int32(0),
                             _pick(logits[0], k, temperature)[None])
    r = decode_lib.verify_and_commit(params, cfg, rt, tree, p, c, choose,
                                     max_ctx=c.k.shape[2], feature_layers=feature_layers)
    return r.emit[0], r.feats[0], target_lib.apply_update(c, r.update, p)
  return jax.vmap(one)(tok, pos, cache, jax.random.split(key, tok.shape[0]))


def _decode_batch(target, prompts_ids, n_gen, feature_layers, pad_to, temperature, seed):
  """(generated [B, n_gen] int32, prompt feats [B, P_max, F*D] f16, step feats [B, n_gen-1, F*D]
  f16, prompt lengths [B])."""
  cfg, rt = target.config, target.runtime
  B = len(prompts_ids)
  p_max = _bucket(max(len(p) for p in prompts_ids), pad_to)
  toks = np.zeros((B, p_max), np.int32)
  for i, p in enumerate(prompts_ids):
    toks[i, :len(p)] = p
  n_valid = np.array([len(p) for p in prompts_ids], np.int32)
  cache = jax.vmap(lambda _: target_lib.init_cache(cfg, p_max + n_gen + 1, rt))(jnp.arange(B))
  nxt, pfeats, cache = _batched_prefill(target.params, jnp.asarray(toks), jnp.asarray(n_valid),
                                        cache, cfg=cfg, rt=rt, feature_layers=feature_layers)
  gen, step_feats = [np.asarray(nxt)], []
  pos = jnp.asarray(n_valid)
  key = jax.random.key(seed)
  for _ in range(n_gen - 1):
    key, sub = jax.random.split(key)
    nxt, f, cache = _batched_step(target.params, nxt, pos, cache, sub, cfg=cfg, rt=rt,
                                  feature_layers=feature_layers, temperature=float(temperature))
    step_feats.append(np.asarray(f, np.float16))
    gen.append(np.asarray(nxt))
    pos = pos + 1
  pfeats = np.asarray(pfeats, np.float16)
  sfeats = np.stack(step_feats, 1) if step_feats else np.zeros((B, 0, pfeats.shape[-1]), np.float16)
  return np.stack(gen, 1), pfeats, sfeats, n_valid


def generate_with_features(target, prompts_ids: list[list[int]], *, n_gen: int,
                           feature_layers: tuple[int, ...], eog_ids: Iterable[int],
                           pad_to: int = 64, temperature: float = 0.0,
                           seed: int = 0) -> list[TrainSeq]:
  """Responses of a batch of prompts (greedy, or sampled at `temperature` > 0 after the first
  token), batched with vmap, capturing target features at `feature_layers`; one TrainSeq per
  prompt, the response cut after its first EOG token (kept)."""
  gen, pfeats, sfeats, n_valid = _decode_batch(target, prompts_ids, n_gen, feature_layers, pad_to,
                                               temperature, seed)
  eog = set(int(x) for x in eog_ids)
  out = []
  for i in range(len(prompts_ids)):
    P = int(n_valid[i])
    resp = gen[i].tolist()
    resp = resp[:next((j + 1 for j, t in enumerate(resp) if t in eog), len(resp))]
    # features exist for every token that was fed: prompt rows + generated rows except the last
    feats = np.concatenate([pfeats[i, :P], sfeats[i, :len(resp) - 1]], 0)
    out.append(TrainSeq(np.asarray(list(prompts_ids[i]) + resp, np.int32), feats, P))
  return out


def save_shard(path: str, seqs: list[TrainSeq]):
  """One npz per shard: concatenated tokens/feats with offsets (written atomically)."""
  tmp = path + ".tmp.npz"
  np.savez(tmp, tokens=np.concatenate([s.tokens for s in seqs]),
           feats=np.concatenate([s.feats for s in seqs]),
           lens=np.array([s.tokens.size for s in seqs], np.int64),
           flens=np.array([s.feats.shape[0] for s in seqs], np.int64),
           prompt_lens=np.array([s.prompt_len for s in seqs], np.int64))
  os.replace(tmp, path)


def load_shards(data_dir: str) -> list[TrainSeq]:
  """Every sequence of data_dir/shard_*.npz, in file order (interrupted writes skipped)."""
  seqs = []
  for path in sorted(glob.glob(os.path.join(data_dir, "shard_*.npz"))):
    if path.endswith(".tmp.npz"):   # an interrupted write
      continue
    with np.load(path) as z:   # each z[key] re-reads the file: read every array once
      toks, feats = z["tokens"], z["feats"]
      lens, flens, plens = z["lens"], z["flens"], z["prompt_lens"]
    t0 = f0 = 0
    for n, fn, p in zip(lens, flens, plens):
      seqs.append(TrainSeq(toks[t0:t0 + n], feats[f0:f0 + fn], int(p)))
      t0 += n
      f0 += fn
  return seqs
