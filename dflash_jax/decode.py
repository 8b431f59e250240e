"""Prefill and the speculative decode loop, as one jitted `lax.while_loop` over a donated
`DecodeState`. One step: propose -> build tree -> verify -> follow -> commit.

Every mode verifies a tree in one target forward (`target.verify`): DFlash chain (arXiv:
2602.06036) verifies the path `[bonus, d_1..d_{L-1}]` of the draft's top-1 tokens; DDTree
(arXiv:2604.12989) a best-first tree of the draft's likeliest prefixes; autoregressive decoding
the root alone. `tree.follow` accepts the longest root path the target's argmax agrees with; the
target's argmax after it is the next bonus token. `target.commit_path` commits it without
replay: KV rows gathered onto the path (in place for a path tree), SSM state = the state
captured after the last kept node, conv state = the last K-1 kept inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from dflash_jax import draft as draft_lib
from dflash_jax import sampling as sampling_lib
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.config import DecodeConfig, DraftConfig, TargetConfig
from dflash_jax.runtime import Runtime


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
    draft: DraftCache (context K/V for positions < pos - n_pending), None without a draft.
    pending: [L, F*D] float32 target features of committed rows the draft has not ingested.
    n_pending: [] int32 rows of `pending` that are real.
    key: base PRNG key of the sampler (step n draws from fold_in(key, n); unused when greedy).
    finite: [] bool the logits the first token came from (end of prefill) were all finite
      (False: corrupt weights or metadata; `api.generate` raises).
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
  key: jax.Array
  finite: jax.Array


def init_state(tcfg: TargetConfig, dcfg: Optional[DraftConfig], dec: DecodeConfig,
               rt: Runtime, seed: int = 0) -> DecodeState:
  """Zeroed state; the draft cache and pending features exist only with a draft (not "ar")."""
  s, L = dec.capacity, dec.L
  use_draft = dec.mode != "ar" and dcfg is not None
  return DecodeState(
      out=jnp.zeros((s + L,), jnp.int32), n_out=jnp.int32(0), pos=jnp.int32(0),
      bonus=jnp.int32(0), done=jnp.bool_(False), n_steps=jnp.int32(0),
      accept_lens=jnp.zeros((s,), jnp.int32),
      target=target_lib.init_cache(tcfg, s, rt),
      draft=draft_lib.init_cache(dcfg, s) if use_draft else None,
      pending=(jnp.zeros((L, dcfg.n_features * tcfg.d_model), jnp.float32) if use_draft else None),
      n_pending=jnp.int32(0), key=jax.random.key(seed), finite=jnp.bool_(True))


def _next_token(logits: jax.Array, key: jax.Array, sampling) -> jax.Array:
  """[R, V] logits -> [R] int32: the argmax (greedy, sampling None) or one draw per row from the
  processed distribution (independent keys)."""
  if sampling is None:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return sampling_lib.draw(key, sampling_lib.process_logits(logits, sampling))


def _feature_layers(dcfg, dec):
  return tuple(dcfg.target_layer_ids) if (dcfg is not None and dec.mode != "ar") else ()


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "dec", "rt"),
                   donate_argnames=("state",))
def prefill_chunk(tparams, dparams, state: DecodeState, tokens: jax.Array, start: jax.Array,
                  n_valid: jax.Array, eog_ids: jax.Array, sampling=None, *, tcfg: TargetConfig,
                  dcfg: Optional[DraftConfig], dec: DecodeConfig, rt: Runtime) -> DecodeState:
  """Prefill one chunk of the prompt: tokens [C] int32 (C = dec.prefill_chunk, padded), at
  positions start.., of which n_valid are real. Updates the target cache, feeds the chunk's
  target features to the draft's context cache, and sets the first generated token (argmax, or
  a draw when `sampling` (SamplingParams) is given, after the last real row) as the bonus: it
  is final only after the last chunk."""
  feature_layers = _feature_layers(dcfg, dec)
  pre = target_lib.prefill(tparams, tcfg, tokens, start, n_valid, state.target, rt,
                           feature_layers=feature_layers)
  dcache = state.draft
  if feature_layers:
    dcache = draft_lib.ingest(dparams, dcfg, pre.feats, start, dcache, rt)
  last = jax.lax.dynamic_slice_in_dim(pre.hidden, n_valid - 1, 1, axis=0)
  key = jax.random.fold_in(state.key, sampling_lib.PREFILL_STREAM)
  logits = target_lib.logits(tparams, tcfg, last, rt)
  first = _next_token(logits, key, sampling)[0]
  return dataclasses.replace(
      state, target=pre.cache, draft=dcache, pos=start + n_valid, bonus=first,
      finite=jnp.all(jnp.isfinite(logits)),
      out=state.out.at[0].set(first), n_out=jnp.int32(1), done=jnp.any(first == eog_ids),
      n_steps=jnp.int32(0), n_pending=jnp.int32(0))


def dflash_proposer(tparams, dparams, s: DecodeState, *, dcfg: DraftConfig, dec: DecodeConfig,
                    rt: Runtime):
  """The DFlash draft as proposer: ingest pending target features, draft one block.

  Returns (logits [D, V] float32 for positions pos+1..pos+D, new DraftCache), D =
  dec.draft_depth (L-1 for chain; min(budget, L-1) for DDTree). A proposer is any function with
  this signature (tests pass an oracle; it may return up to L-1 rows); chain mode takes the
  argmax per row, DDTree builds a tree from the rows' log-probabilities.
  """
  dcache = draft_lib.ingest(dparams, dcfg, s.pending, s.pos - s.n_pending, s.draft, rt)
  return draft_lib.propose(dparams, dcfg, tparams.embed, tparams.lm_head, s.bonus, s.pos, dcache,
                           rt, n_logits=dec.draft_depth)


def _uses_rejection(dec: DecodeConfig, sampling) -> bool:
  return sampling is not None and dec.mode == "chain" and dec.chain_rule == "rejection"


def build_verify_tree(dlogits: Optional[jax.Array], bonus: jax.Array, dec: DecodeConfig,
                      sampling=None, key: Optional[jax.Array] = None):
  """The tree this mode verifies: "ar" the root alone; "chain" the path [bonus, drafts];
  "ddtree" the best-first tree of dec.budget nodes from the rows' log-probs at dec.draft_temp.
  Chain drafts are the rows' argmax, or, under the rejection rule (sampling given and
  dec.chain_rule "rejection"), draws from the processed draft distribution q with `key`.
  dlogits: [D, V] float32 draft logits (None for "ar"); bonus: [] int32.
  Returns (tree, q [D, V] processed draft log-probs under the rejection rule, else None)."""
  if dec.mode == "ar":
    return tree_lib.path_tree(bonus[None]), None
  if dec.mode == "chain":
    q_logp = None
    if _uses_rejection(dec, sampling):
      q_logp = sampling_lib.process_logits(dlogits, sampling)
      drafts = sampling_lib.draw(key, q_logp)
    else:
      drafts = jnp.argmax(dlogits, axis=-1).astype(jnp.int32)
    return tree_lib.path_tree(jnp.concatenate([bonus[None], drafts])), q_logp
  logp = jax.nn.log_softmax(dlogits.astype(jnp.float32) / dec.draft_temp, axis=-1)
  return tree_lib.build_tree(logp, bonus, budget=dec.budget, top_k=dec.tree_top_k,
                             chain_seed=dec.chain_seed), None


def accept(tree: tree_lib.Tree, logits: jax.Array, q_logp: Optional[jax.Array],
           dec: DecodeConfig, sampling, key: jax.Array):
  """Which root path of the verified tree to keep, and the tokens it emits.

  logits: [N, V] target logits per node. Greedy: follow the target's argmax. Sampling, "match":
  follow independent draws of the processed target distribution at each node. Sampling,
  chain "rejection": `sampling.rejection_chain` against q_logp.
  Returns (path [L] int32 node ids, n_acc [] int32 accepted drafts, emit [L] int32: the
  accepted drafts, then the bonus token at emit[n_acc])."""
  L = dec.L
  if _uses_rejection(dec, sampling):
    p_logp = sampling_lib.process_logits(logits, sampling)
    n_acc, bonus = sampling_lib.rejection_chain(key, p_logp, q_logp, tree.tokens[1:])
    nxt = jnp.concatenate([tree.tokens[1:], jnp.zeros((1,), jnp.int32)])
    return (jnp.arange(L, dtype=jnp.int32), n_acc,
            jnp.where(jnp.arange(L) < n_acc, nxt, bonus))
  post = _next_token(logits, key, sampling)                      # target's token per node
  path, n_acc, _ = tree_lib.follow(tree, post, L - 1)            # path: [L] node ids
  return path, n_acc, post if tree.is_path else post[path]


def _advance(s: DecodeState, emit, n_acc, max_new, eog_ids, **changes) -> DecodeState:
  """Emit emit[0..n_acc] (accepted drafts, then the bonus); stop after the first EOG token
  among them and at max_new tokens. emit: [P] int32."""
  n_commit = n_acc + 1
  is_eog = jnp.any(emit[:, None] == eog_ids[None, :], axis=-1) & (jnp.arange(emit.shape[0]) < n_commit)
  hit = jnp.any(is_eog)
  n_emit = jnp.minimum(jnp.where(hit, jnp.argmax(is_eog) + 1, n_commit), max_new - s.n_out)
  n_out = s.n_out + n_emit
  return dataclasses.replace(
      s, out=jax.lax.dynamic_update_slice_in_dim(s.out, emit, s.n_out, axis=0), n_out=n_out,
      pos=s.pos + n_commit, bonus=emit[n_acc], done=s.done | hit | (n_out >= max_new),
      n_steps=s.n_steps + 1, accept_lens=s.accept_lens.at[s.n_steps].set(n_commit),
      n_pending=n_commit, **changes)


def _step(tparams, dparams, s: DecodeState, max_new, eog_ids, sampling, *, tcfg, dcfg, dec, rt,
          proposer):
  """One round: propose -> build tree -> verify -> accept (follow) -> commit."""
  feature_layers = _feature_layers(dcfg, dec)
  k_draft, k_accept = jax.random.split(jax.random.fold_in(s.key, s.n_steps))
  dlogits, dcache = None, s.draft
  if dec.mode != "ar":
    dlogits, dcache = proposer(tparams, dparams, s, dcfg=dcfg, dec=dec, rt=rt)
  tree, q_logp = build_verify_tree(dlogits, s.bonus, dec, sampling, k_draft)
  ver = target_lib.verify(tparams, tcfg, tree, s.pos, s.target, rt, feature_layers=feature_layers)
  path, n_acc, emit = accept(tree, ver.logits, q_logp, dec, sampling, k_accept)
  # Never commit past max_ctx: the output then ends exactly where autoregressive decoding's does
  # (emit[n_acc] stays a target token: an accepted draft or the bonus).
  n_acc = jnp.minimum(n_acc, dec.max_ctx - 1 - s.pos)
  tcache = target_lib.commit_path(ver.cache, ver.steps, s.pos, path, n_acc + 1,
                                  rows_in_place=tree.is_path)
  pending = s.pending
  if feature_layers:
    pending = ver.feats if tree.is_path else ver.feats[path]
  return _advance(s, emit, n_acc, max_new, eog_ids, target=tcache, draft=dcache, pending=pending)


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "dec", "rt", "proposer"),
                   donate_argnames=("state",))
def decode_loop(tparams, dparams, state: DecodeState, max_new: jax.Array, max_steps: jax.Array,
                eog_ids: jax.Array, sampling=None, *, tcfg: TargetConfig,
                dcfg: Optional[DraftConfig], dec: DecodeConfig, rt: Runtime,
                proposer=dflash_proposer) -> DecodeState:
  """Run decode steps until done, max_new tokens, a full cache, or max_steps more steps.

  max_new, max_steps: [] int32 (traced: no recompile across values). eog_ids: [E] int32.
  sampling: None (greedy) or sampling.SamplingParams (traced: new settings do not recompile;
  greedy and sampling are two compiled variants).
  """
  step_limit = state.n_steps + max_steps

  def keep_going(s):
    return (~s.done                                      # no EOG committed
            & (s.n_out < max_new)                        # length budget left
            & (s.pos < dec.max_ctx)                      # context not full (capacity has slack
                                                         # for one more verify block)
            & (s.n_steps < step_limit))                  # host asked for at most max_steps

  def one_round(s):
    return _step(tparams, dparams, s, max_new, eog_ids, sampling, tcfg=tcfg, dcfg=dcfg, dec=dec,
                 rt=rt, proposer=proposer)

  return jax.lax.while_loop(keep_going, one_round, state)


@functools.partial(jax.jit, static_argnames=("dcfg", "rt"))
def draft_once(tparams, dparams, state: DecodeState, *, dcfg: DraftConfig, rt: Runtime):
  """Draft logits [L-1, V] for the state right after prefill (no verify)."""
  logits, _ = draft_lib.propose(dparams, dcfg, tparams.embed, tparams.lm_head, state.bonus,
                                state.pos, state.draft, rt)
  return logits
