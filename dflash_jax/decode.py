"""Prefill and the speculative decode loop: draft, verify, accept, commit, as one jitted
`lax.while_loop` over a donated `DecodeState`.

Chain DFlash (arXiv:2602.06036): the draft proposes L-1 tokens after the bonus token; the target
verifies `[bonus, d_1..d_{L-1}]` in one forward; the longest prefix with d_i == target argmax is
accepted and the target's argmax after it becomes the next bonus. Rollback needs no replay:
attention KV rows past the length are masked by position, SSM state = the state captured after
the last kept token, conv state = the last K-1 kept inputs. Mode "ar" runs the same loop with
a one-token verify and no draft: the autoregressive baseline.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from dflash_jax import draft as draft_lib
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.config import DecodeConfig, DraftConfig, TargetConfig

# Number of times each jitted function was traced (tests assert no retrace across prompts).
TRACE_COUNTS: collections.Counter = collections.Counter()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything the loop carries (donated between calls). S = DecodeConfig.capacity.

  Attributes:
    out: [S + L] int32 generated tokens; out[:n_out] are final.
    n_out: [] int32 tokens generated so far (the pending bonus included).
    pos: [] int32 committed length = position of the bonus token (not yet in the target cache).
    bonus: [] int32 the last generated token, input of the next step.
    done: [] bool an EOG token or max_new_tokens was reached.
    n_steps: [] int32 decode steps run (verify forwards).
    accept_lens: [S] int32 tokens committed per step (accepted drafts + bonus).
    target: TargetCache for positions < pos.
    draft: DraftCache (context K/V for positions < pos - n_pending).
    pending: [L, F*D] float32 target features of committed rows the draft has not ingested.
    n_pending: [] int32 rows of `pending` that are real.
  """

  out: jax.Array
  n_out: jax.Array
  pos: jax.Array
  bonus: jax.Array
  done: jax.Array
  n_steps: jax.Array
  accept_lens: jax.Array
  target: target_lib.TargetCache
  draft: Optional[draft_lib.DraftCache]
  pending: Optional[jax.Array]
  n_pending: jax.Array


def init_state(tcfg: TargetConfig, dcfg: Optional[DraftConfig], dec: DecodeConfig,
               kv_dtype=jnp.float32) -> DecodeState:
  """Zeroed state; the draft cache and pending features exist only for chain mode with a draft."""
  s, L = dec.capacity, dec.block_size
  use_draft = dec.mode != "ar" and dcfg is not None
  return DecodeState(
      out=jnp.zeros((s + L,), jnp.int32), n_out=jnp.int32(0), pos=jnp.int32(0),
      bonus=jnp.int32(0), done=jnp.bool_(False), n_steps=jnp.int32(0),
      accept_lens=jnp.zeros((s,), jnp.int32),
      target=target_lib.init_cache(tcfg, s, kv_dtype),
      draft=draft_lib.init_cache(dcfg, s) if use_draft else None,
      pending=(jnp.zeros((L, dcfg.n_features * tcfg.d_model), jnp.float32) if use_draft else None),
      n_pending=jnp.int32(0))


def _feature_layers(dcfg, dec):
  return tuple(dcfg.target_layer_ids) if (dcfg is not None and dec.mode != "ar") else ()


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "dec", "compute_dtype"),
                   donate_argnames=("state",))
def prefill_chunk(tparams, dparams, state: DecodeState, tokens: jax.Array, start: jax.Array,
                  n_valid: jax.Array, eog_ids: jax.Array, *, tcfg: TargetConfig,
                  dcfg: Optional[DraftConfig], dec: DecodeConfig,
                  compute_dtype: str = "float32") -> DecodeState:
  """Prefill one chunk of the prompt: tokens [C] int32 (C = dec.prefill_chunk, padded), at
  positions start.., of which n_valid are real. Updates the target cache, feeds the chunk's
  target features to the draft's context cache, and sets the first generated token (greedy
  argmax after the last real row) as the bonus: it is final only after the last chunk."""
  TRACE_COUNTS["prefill_chunk"] += 1
  feature_layers = _feature_layers(dcfg, dec)
  logits, feats, tcache, _ = target_lib.forward(
      tparams, tcfg, tokens, start, state.target, n_valid=n_valid, mode="prefill",
      feature_layers=feature_layers, logits_rows="last", compute_dtype=compute_dtype)
  dcache = state.draft
  if feature_layers:
    dcache = draft_lib.ingest(dparams, dcfg, feats, start, dcache, compute_dtype)
  first = jnp.argmax(logits[0]).astype(jnp.int32)
  return dataclasses.replace(
      state, target=tcache, draft=dcache, pos=start + n_valid, bonus=first,
      out=state.out.at[0].set(first), n_out=jnp.int32(1), done=jnp.any(first == eog_ids),
      n_steps=jnp.int32(0), n_pending=jnp.int32(0))


def dflash_proposer(tparams, dparams, s: DecodeState, *, dcfg: DraftConfig, dec: DecodeConfig,
                    compute_dtype: str = "float32"):
  """The DFlash draft as proposer: ingest pending target features, draft one block.

  Returns (logits [D, V] float32 for positions pos+1..pos+D, new DraftCache), D =
  dec.draft_depth (L-1 for chain; min(budget, L-1) for DDTree). A proposer is any function with
  this signature (tests pass an oracle; it may return up to L-1 rows); chain mode takes the
  argmax per row, DDTree builds a tree from the rows' log-probabilities.
  """
  dcache = draft_lib.ingest(dparams, dcfg, s.pending, s.pos - s.n_pending, s.draft, compute_dtype)
  return draft_lib.propose(dparams, dcfg, tparams.embed, tparams.lm_head, s.bonus, s.pos, dcache,
                           compute_dtype, n_logits=dec.draft_depth)


def _step(tparams, dparams, s: DecodeState, max_new, eog_ids, *, tcfg, dcfg, dec, compute_dtype,
          proposer):
  """One round: draft, verify (chain block or DDTree tree), accept, commit."""
  L = dec.block_size if dec.mode != "ar" else 1
  feature_layers = _feature_layers(dcfg, dec)
  dcache, pending = s.draft, s.pending
  if dec.mode == "ar":
    block = s.bonus[None]
  else:
    dlogits, dcache = proposer(tparams, dparams, s, dcfg=dcfg, dec=dec, compute_dtype=compute_dtype)
  if dec.mode == "ddtree":
    logp = jax.nn.log_softmax(dlogits.astype(jnp.float32) / dec.draft_temp, axis=-1)
    tree = tree_lib.build_tree(logp, s.bonus, budget=dec.budget, top_k=dec.top_k,
                               chain_seed=dec.chain_seed)
    logits, feats, tcache, steps = target_lib.forward(
        tparams, tcfg, tree.tokens, s.pos, s.target, mode="tree", feature_layers=feature_layers,
        logits_rows="all", compute_dtype=compute_dtype, tree_parents=tree.parents,
        tree_depths=tree.depths)
    post = jnp.argmax(logits, axis=-1).astype(jnp.int32)          # [N] target's next tokens
    path, n_acc, _ = tree_lib.follow(tree, post, L - 1)           # path: [L] node ids
    n_commit = n_acc + 1
    emit = post[path]                                             # [L]: accepted drafts, bonus
    tcache = target_lib.commit_path(tcache, steps, s.pos, path, n_commit)
    if feature_layers:
      feats = feats[path]
  else:
    if dec.mode == "chain":
      drafts = jnp.argmax(dlogits, axis=-1).astype(jnp.int32)     # [L-1]
      block = jnp.concatenate([s.bonus[None], drafts])            # [L]
    logits, feats, tcache, steps = target_lib.forward(
        tparams, tcfg, block, s.pos, s.target, mode="verify", feature_layers=feature_layers,
        logits_rows="all", compute_dtype=compute_dtype)
    emit = jnp.argmax(logits, axis=-1).astype(jnp.int32)          # [L] target's next tokens
    if dec.mode == "ar":
      n_acc = jnp.int32(0)
    else:
      n_acc = jnp.sum(jnp.cumprod((drafts == emit[:-1]).astype(jnp.int32))).astype(jnp.int32)
    n_commit = n_acc + 1
    tcache = target_lib.commit(tcache, steps, n_commit)
  # Emit emit[0..n_acc]; stop after the first EOG token among them and at max_new tokens.
  is_eog = jnp.any(emit[:, None] == eog_ids[None, :], axis=-1) & (jnp.arange(L) < n_commit)
  hit = jnp.any(is_eog)
  n_emit = jnp.where(hit, jnp.argmax(is_eog) + 1, n_commit)
  n_emit = jnp.minimum(n_emit, max_new - s.n_out)
  out = jax.lax.dynamic_update_slice_in_dim(s.out, emit, s.n_out, axis=0)
  n_out = s.n_out + n_emit
  if feature_layers:
    pending = feats
  return dataclasses.replace(
      s, out=out, n_out=n_out, pos=s.pos + n_commit, bonus=emit[n_acc],
      done=s.done | hit | (n_out >= max_new), n_steps=s.n_steps + 1,
      accept_lens=s.accept_lens.at[s.n_steps].set(n_commit), target=tcache, draft=dcache,
      pending=pending, n_pending=n_commit)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "dec", "compute_dtype", "proposer"),
                   donate_argnames=("state",))
def decode_loop(tparams, dparams, state: DecodeState, max_new: jax.Array, max_steps: jax.Array,
                eog_ids: jax.Array, *, tcfg: TargetConfig, dcfg: Optional[DraftConfig],
                dec: DecodeConfig, compute_dtype: str = "float32",
                proposer=dflash_proposer) -> DecodeState:
  """Run decode steps until done, max_new tokens, a full cache, or max_steps more steps.

  max_new, max_steps: [] int32 (traced: no recompile across values). eog_ids: [E] int32.
  """
  TRACE_COUNTS["decode_loop"] += 1
  step_limit = state.n_steps + max_steps

  def keep_going(s):
    return (~s.done                                      # no EOG committed
            & (s.n_out < max_new)                        # length budget left
            & (s.pos < dec.max_ctx)                      # context not full (capacity has slack
                                                         # for one more verify block)
            & (s.n_steps < step_limit))                  # host asked for at most max_steps

  def one_round(s):
    return _step(tparams, dparams, s, max_new, eog_ids, tcfg=tcfg, dcfg=dcfg, dec=dec,
                 compute_dtype=compute_dtype, proposer=proposer)

  return jax.lax.while_loop(keep_going, one_round, state)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "dec", "compute_dtype"))
def draft_once(tparams, dparams, state: DecodeState, *, tcfg, dcfg, dec, compute_dtype="float32"):
  """Draft logits [L-1, V] for the state right after prefill (no verify)."""
  logits, _ = draft_lib.propose(dparams, dcfg, tparams.embed, tparams.lm_head, state.bonus,
                                state.pos, state.draft, compute_dtype)
  return logits
