"""Prefill and the speculative decode loop over a batch of B sequences (slots), as one jitted
`lax.while_loop` over a donated `DecodeState`. One step per row: propose -> build tree ->
verify -> follow -> commit.

Every mode verifies a tree in one target forward (`target.verify`): DFlash chain (arXiv:
2602.06036) verifies the path `[bonus, d_1..d_{L-1}]` of the draft's top-1 tokens; DDTree
(arXiv:2604.12989) a best-first tree of the draft's likeliest prefixes; autoregressive decoding
the root alone; prompt lookup (`DecodeConfig.lookup`) the path of an n-gram match's continuation
(mode "lookup", a root-only round when no row has a match) or that path grafted into the draft's
tree as one more branch. `tree.follow` accepts the longest root path the target's argmax agrees with; the
target's argmax after it is the next bonus token. `target.commit_path` commits it without
replay: KV rows gathered onto the path (in place for a path tree), SSM state = the state
captured after the last kept node, conv state = the last K-1 kept inputs.

Batching: every leaf of `DecodeState` has a leading row axis [B]. The per-row step is written for
one sequence and `jax.vmap`-ed over the rows inside the loop body (so the weight matmuls of all
rows are one matmul); the `while_loop` itself runs outside the vmap while any row is active, and
rows that are done keep their state (small leaves and SSM / conv state are selected per row; KV
and draft-cache writes of an inactive row land past its committed length, where nothing reads
them). A sequence joins a free slot with `prefill_chunk(..., slot=i)` between loop calls, without
recompiling (continuous batching).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from dflash_jax import draft as draft_lib
from dflash_jax import draft2 as draft2_lib
from dflash_jax import dspark as dspark_lib
from dflash_jax import grammar as grammar_lib
from dflash_jax import layers
from dflash_jax import eagle3 as eagle3_lib
from dflash_jax import mtp as mtp_lib
from dflash_jax import ngram as ngram_lib
from dflash_jax import sampling as sampling_lib
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.config import DecodeConfig, DraftConfig, TargetConfig
from dflash_jax.runtime import Runtime


# Autoregressive drafts with a pending hidden state: one draft step per drafted token.
AR_CONFIGS = (mtp_lib.MTPConfig, eagle3_lib.Eagle3Config)


# Tokens a row carries for prompt lookup (`tree.lookup_path` searches all of them: a long
# prompt's repeats, e.g. code being edited, are found up to this far back; llama.cpp's lookup
# searches the whole context) and the penalties (the last sampling.PENALTY_WINDOW of them).
# The search and the window's update cost the same few microseconds from 256 to 2048 tokens
# on the CPU; 8 KB a row.
RECENT_WINDOW = 2048


def _ar(dcfg):
  """(module, config its functions take) of an autoregressive draft: (eagle3, its Eagle3Config)
  or (mtp, the target's TargetConfig its MTPConfig carries)."""
  if isinstance(dcfg, eagle3_lib.Eagle3Config):
    return eagle3_lib, dcfg
  return mtp_lib, dcfg.tcfg


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything static about a decode call, as one hashable value (changing it recompiles).

  Attributes:
    tcfg: TargetConfig. dcfg: DraftConfig in speculative modes with a DFlash draft, else None
      (autoregressive decoding, or a proposer that replaces the draft). dec: DecodeConfig. rt: the
      target's Runtime.
  """

  tcfg: TargetConfig
  dcfg: Optional[DraftConfig]
  dec: DecodeConfig
  rt: Runtime

  @property
  def uses_draft(self) -> bool:
    """True when a DFlash draft runs in the loop (context cache, target features)."""
    return self.dcfg is not None and self.dec.uses_draft

  @property
  def ar_draft(self) -> bool:
    """True when the draft is autoregressive with a pending hidden state (the target's own MTP
    block, mtp.py, or an EAGLE-3 draft, eagle3.py) rather than a DFlash block draft."""
    return self.prefill.ar_draft

  @property
  def draft_relative(self) -> bool:
    """True when the draft's ring buffer uses window-relative positions (its keys are stored
    before RoPE: DraftCache.relative)."""
    return self.uses_draft and self.dec.draft_ring and self.dec.draft_positions == "window"

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """Target layer ids whose outputs feed the draft (empty without a draft)."""
    return self.prefill.feature_layers

  @property
  def prefill(self) -> "PrefillPlan":
    """The part of the plan a prefill chunk depends on (`prefill_chunk`'s static argument): the
    modes share one compiled prefill (chain and DDTree with the same draft: the same program)."""
    return PrefillPlan(self.tcfg, self.dcfg if self.uses_draft else None, self.rt,
                       self.draft_relative)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PrefillPlan:
  """Everything static about a prefill chunk (`Plan.prefill`), as one hashable value: the decode
  mode, block size, budget and lookup settings are not in it, so one compiled prefill serves
  every mode whose state has the same shapes.

  Attributes:
    tcfg: TargetConfig. dcfg: DraftConfig when a DFlash draft runs (its context cache is fed the
      chunk's target features), else None. rt: the target's Runtime. draft_relative: the
      draft's context keys are stored unrotated (Plan.draft_relative).
  """

  tcfg: TargetConfig
  dcfg: Optional[DraftConfig]
  rt: Runtime
  draft_relative: bool

  @property
  def uses_draft(self) -> bool:
    """True when the chunk's target features feed a DFlash draft's context cache."""
    return self.dcfg is not None

  @property
  def ar_draft(self) -> bool:
    """True when the chunk feeds an autoregressive draft's rows (the MTP block, mtp.py, or
    EAGLE-3, eagle3.py) rather than a DFlash draft's context."""
    return isinstance(self.dcfg, AR_CONFIGS)

  @property
  def feature_layers(self) -> tuple[int, ...]:
    """Target layer ids whose outputs feed the draft (empty without a draft)."""
    return tuple(self.dcfg.target_layer_ids) if self.uses_draft else ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything the loop carries (donated between calls). Every leaf has a leading row axis [B]
  (shapes below are per row). S = DecodeConfig.capacity, L = block size.

  Attributes:
    out: [S + L] int32 generated tokens; out[:n_out] are final.
    n_out: [] int32 tokens generated so far (the pending bonus included).
    max_new: [] int32 the row's length budget (tokens to generate at most).
    pos: [] int32 committed length = position of the bonus token (not yet in the target cache).
    bonus: [] int32 the last generated token, input of the next step.
    done: [] bool an EOG token or max_new was reached, or the slot is free.
    n_steps: [] int32 decode steps run (verify forwards).
    accept_lens: [S] int32 tokens committed per step (accepted drafts + bonus).
    target: TargetCache for positions < pos.
    draft: DraftCache (context K/V for positions < pos), None without a draft.
    key: the row's base PRNG key (step n draws from fold_in(key, n); unused when greedy).
    samp: sampling.SamplingParams of the row (temperature 0 = greedy; read only by the sampling
      variant of the loop).
    finite: [] bool the logits the first token came from (end of prefill) were all finite
      (False: corrupt weights or metadata; `api.generate` raises).
    recent: [W] int32 the tokens at positions pos-W..pos-1 (W = RECENT_WINDOW: prompt lookup
      searches them all, the penalties read the last sampling.PENALTY_WINDOW; entries at
      negative positions are ignored).
    gstate: [] int32 the row's grammar state after the bonus token (a state of the batch's
      grammar.GrammarTables), or grammar.NO_GRAMMAR (-1) for an unconstrained row.
    mtp_h: [D] float32 with an autoregressive draft: the target's normed hidden state of
      position pos - 1, which the MTP block (mtp.py) pairs with the bonus token, or for EAGLE-3
      (eagle3.py) the fc of that position's aux features (zeros before any prefill); else None.
  """

  out: jax.Array
  n_out: jax.Array
  max_new: jax.Array
  pos: jax.Array
  bonus: jax.Array
  done: jax.Array
  n_steps: jax.Array
  accept_lens: jax.Array
  target: target_lib.TargetCache
  draft: Optional[draft_lib.DraftCache]
  key: jax.Array
  samp: sampling_lib.SamplingParams
  finite: jax.Array
  recent: jax.Array
  gstate: jax.Array
  mtp_h: Optional[jax.Array] = None


def init_row(plan: Plan) -> DecodeState:
  """Zeroed state of one row (a free slot: done); the draft cache exists only with a draft."""
  tcfg, dcfg, dec = plan.tcfg, plan.dcfg, plan.dec
  s, L = dec.capacity, dec.L
  return DecodeState(
      out=jnp.zeros((s + L,), jnp.int32), n_out=jnp.int32(0), max_new=jnp.int32(0),
      pos=jnp.int32(0), bonus=jnp.int32(0), done=jnp.bool_(True), n_steps=jnp.int32(0),
      accept_lens=jnp.zeros((s,), jnp.int32),
      target=target_lib.init_cache(tcfg, s, plan.rt),
      draft=(draft_lib.init_cache(dcfg, dec.draft_rows, plan.rt,
                                  window=dec.draft_window if dec.draft_ring else 0,
                                  relative=plan.draft_relative)
             if plan.uses_draft else None),
      key=jax.random.key(0), samp=sampling_lib.SamplingConfig().params(),
      finite=jnp.bool_(True), recent=jnp.zeros((RECENT_WINDOW,), jnp.int32),
      gstate=jnp.int32(grammar_lib.NO_GRAMMAR),
      mtp_h=jnp.zeros((dcfg.d_model,), jnp.float32) if plan.ar_draft else None)


def init_state(plan: Plan, batch: int = 1) -> DecodeState:
  """Zeroed state of `batch` free slots (every leaf [batch, ...])."""
  return jax.vmap(lambda _: init_row(plan))(jnp.arange(batch))


def _safe(sp: sampling_lib.SamplingParams) -> sampling_lib.SamplingParams:
  """The row's params with temperature 0 (a greedy row) replaced by 1, so that processing the
  logits stays finite; the greedy row's draws are discarded by `_is_sampled`."""
  return dataclasses.replace(sp, temperature=jnp.where(sp.temperature > 0, sp.temperature, 1.0))


def _next_token(logits: jax.Array, key: jax.Array, positions: jax.Array, sp,
                sampled: bool) -> jax.Array:
  """[R, V] logits -> [R] int32: the argmax (greedy variant, or a row with temperature 0) or
  one draw per node from the processed distribution, node r's with fold_in(key, positions[r]):
  key is the row's base key and positions [R] int32 the positions of the tokens drawn, so the
  token at a position is drawn with the same key whatever the mode, draft, tree or batch (a
  seeded request's sampled text does not depend on them: `sampling.draw_at`)."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if not sampled:
    return greedy
  drawn = sampling_lib.draw_at(key, positions, sampling_lib.process_logits(logits, _safe(sp)))
  return jnp.where(sp.temperature > 0, drawn, greedy)


def _uses_rejection(dec: DecodeConfig, sampled: bool) -> bool:
  return sampled and dec.mode == "chain" and dec.chain_rule == "rejection"


def _penalty_window(recent: jax.Array, end: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The last sampling.PENALTY_WINDOW tokens of a recent-token window whose last entry sits at
  position `end`, and their positions ([P] int32 each)."""
  w = sampling_lib.PENALTY_WINDOW
  return recent[-w:], end - (w - 1) + jnp.arange(w, dtype=jnp.int32)


def _prefill_row(tparams, dparams, row: DecodeState, k_all, v_all, slot, tokens, start, n_valid,
                 eog_ids, final, before, grammar, gstart, *, plan: PrefillPlan, sampled: bool):
  """One prefill chunk of one row (see `prefill_chunk`). row: the row's state without its K/V
  and draft caches (target.k / .v and draft None); k_all / v_all: the batch's target caches,
  read in place at row `slot`. Returns (new row, target K rows [n_attn, T, Hkv, Dh], V rows,
  draft context K rows [n_draft, T, Hkv, Dh] and V rows, or None without a draft): the caller
  writes the rows."""
  tc = target_lib.TargetCache(k=k_all, v=v_all, ssm=row.target.ssm, conv=row.target.conv)
  pre = target_lib.prefill(tparams, plan.tcfg, tokens, start, n_valid, tc, plan.rt,
                           feature_layers=plan.feature_layers, kv_row=slot)
  dk = dv = None
  mtp_h = row.mtp_h
  if plan.ar_draft:
    dk, dv, mtp_h = _ar_commit(dparams, tparams, plan, tokens, pre.feats, mtp_h, start, n_valid)
  elif plan.uses_draft:
    dk, dv = draft_lib.ingest_rows(dparams, plan.dcfg, pre.feats, start, plan.rt,
                                    rope_keys=not plan.draft_relative)
  last = jax.lax.dynamic_slice_in_dim(pre.hidden, n_valid - 1, 1, axis=0)
  logits = target_lib.logits(tparams, plan.tcfg, last, plan.rt)
  recent = jax.lax.dynamic_slice_in_dim(jnp.concatenate([before, tokens]), n_valid,
                                        RECENT_WINDOW)
  end = start + n_valid - 1                     # the last prompt token's position
  adjusted = jax.lax.cond(
      sampling_lib.rules_on(row.samp),
      lambda x: sampling_lib.apply_rules(x, row.samp, *_penalty_window(recent, end),
                                         jnp.zeros((1,), jnp.int32), jnp.full((1,), -1, jnp.int32),
                                         jnp.ones((1, 1), bool), end[None]),
      lambda x: x.astype(jnp.float32), logits)
  gstate = jnp.int32(grammar_lib.NO_GRAMMAR)
  if grammar is not None:
    adjusted = grammar_lib.mask_logits(adjusted, grammar, gstart[None])
  first = _next_token(adjusted, row.key, (start + n_valid)[None], row.samp, sampled)[0]
  if grammar is not None:
    gstate = grammar_lib.advance(grammar, gstart, first)
  new = dataclasses.replace(
      row, target=dataclasses.replace(row.target, ssm=pre.cache.ssm, conv=pre.cache.conv),
      pos=start + n_valid, bonus=first, finite=jnp.all(jnp.isfinite(logits)), recent=recent,
      gstate=gstate, mtp_h=mtp_h,
      out=row.out.at[0].set(first), n_out=jnp.int32(1),
      done=jnp.any(first == eog_ids) | (row.max_new <= 1) | ~final,
      n_steps=jnp.int32(0))
  return new, pre.k, pre.v, dk, dv


@functools.partial(jax.jit, static_argnames=("plan", "sampled"), donate_argnames=("state",))
def prefill_chunk(tparams, dparams, state: DecodeState, slot: jax.Array, tokens: jax.Array,
                  start: jax.Array, n_valid: jax.Array, final: jax.Array, eog_ids: jax.Array,
                  seed: jax.Array, max_new: jax.Array, samp: sampling_lib.SamplingParams,
                  before: jax.Array, grammar: Optional[grammar_lib.GrammarTables] = None,
                  gstart: Optional[jax.Array] = None, *, plan: PrefillPlan,
                  sampled: bool = False) -> DecodeState:
  """Prefill one chunk of a prompt into row `slot` of the batch (the other rows are untouched).

  tokens: [C] int32 (C = dec.prefill_chunk, padded) at positions start.., of which n_valid are
  real; slot, start, n_valid, seed, max_new: [] int32 (traced: any slot, chunk or prompt length
  reuses one compiled function); final: [] bool, True for the prompt's last chunk (the row stays
  done, i.e. out of the decode loop, until then: a running batch may decode between chunks).
  The row's PRNG key (from `seed`), length budget `max_new` and sampling params `samp`
  (SamplingParams; temperature 0 = greedy) are set on every chunk; before: [W] int32 the
  prompt's tokens at positions start-W..start-1 (W = RECENT_WINDOW; entries at negative
  positions are ignored): the window prompt lookup and the penalties read. grammar: the batch's
  grammar.GrammarTables (None: no row is constrained) and gstart [] int32 the row's initial
  grammar state (grammar.NO_GRAMMAR: unconstrained); the first token is drawn under it.
  Updates the row's
  target cache, feeds the chunk's target features to its draft context cache, and sets the
  first generated token (argmax, or a draw in the `sampled` variant, after the last real row)
  as its bonus: final only after the last chunk, when the row becomes active (done stays False
  unless that token is an EOG token or max_new <= 1).
  Only row `slot` is read and written: its K/V and draft caches in place in the donated state
  (attention reads the row's chunks where they lie; the new rows are dynamic-update-slices), its
  small state (positions, SSM / conv state, ...) sliced out and written back.
  plan: the decode Plan's `prefill` part (a PrefillPlan; raises TypeError for a whole Plan, which
  would compile one prefill per mode).
  """
  if not isinstance(plan, PrefillPlan):
    raise TypeError(f"prefill_chunk: plan must be a PrefillPlan (Plan.prefill), got "
                    f"{type(plan).__name__}")
  tk, tv, dc = state.target.k, state.target.v, state.draft
  small = dataclasses.replace(state, target=dataclasses.replace(state.target, k=None, v=None),
                              draft=None)
  row = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, slot, 0, keepdims=False), small)
  fresh = start == 0          # a new sequence: recurrent state starts from zero (a reused slot
  tc = row.target             # keeps the previous sequence's; stale KV rows are masked by position)
  tc = dataclasses.replace(tc, ssm=jnp.where(fresh, 0.0, tc.ssm), conv=jnp.where(fresh, 0.0, tc.conv))
  row = dataclasses.replace(row, key=jax.random.key(seed), max_new=max_new, samp=samp, target=tc)
  if row.mtp_h is not None:
    row = dataclasses.replace(row, mtp_h=jnp.where(fresh, 0.0, row.mtp_h))
  row, k, v, dk, dv = _prefill_row(tparams, dparams, row, tk, tv, slot, tokens, start, n_valid,
                                   eog_ids, final, before, grammar,
                                   jnp.int32(grammar_lib.NO_GRAMMAR) if gstart is None else gstart,
                                   plan=plan, sampled=sampled)
  # The forward reads the caches inside attention loops; the writes must be ordered after every
  # read, else XLA copies whole caches to keep the reads correct (as in _commit_rows).
  (row, k, v, dk, dv), (tk, tv, dc) = jax.lax.optimization_barrier(((row, k, v, dk, dv),
                                                                    (tk, tv, dc)))
  small = jax.tree.map(lambda x, r: jax.lax.dynamic_update_index_in_dim(x, r, slot, 0), small, row)
  at = (slot, jnp.int32(0), jnp.int32(0), start, jnp.int32(0))
  put = lambda cache, rows: cache.write(layers.kv_rows(rows)[None], at)
  if dk is not None:
    dc = dc.write(start, dk[None], dv[None], lead=(slot,))
  return dataclasses.replace(small, target=dataclasses.replace(small.target, k=put(tk, k),
                                                                v=put(tv, v)), draft=dc)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Proposal:
  """What a proposer hands the verify (one row).

  Attributes:
    tree: tree_lib.Tree rooted at the row's bonus token: the path [bonus, d_1..d_D] (chain), a
      best-first tree (DDTree), or the root alone.
    q: [D, V] float32 log-probabilities of the distribution each chain draft was drawn from,
      when the speculative rejection rule verifies the chain (a sampled chain row), else None.
    cache: the draft's context cache (draft.DraftCache) as the proposer leaves it; the loop
      writes the committed positions' context rows into it after the verify (None: a proposer
      without a draft cache; the state's cache is kept).
  """

  tree: tree_lib.Tree
  q: Optional[jax.Array]
  cache: Optional[draft_lib.DraftCache]


def _ar_propose(dparams, tparams, dcfg, bonus, start, h_pending, cache, rt: Runtime, n: int,
                draw=None):
  """An autoregressive draft's n steps after the bonus token (`mtp.propose` for the MTP block,
  `eagle3.propose` for EAGLE-3; dcfg: its MTPConfig / Eagle3Config; same arguments and returns)."""
  lib, cfg = _ar(dcfg)
  return lib.propose(dparams, tparams, cfg, bonus, start, h_pending, cache, rt, n=n, draw=draw)


def ar_tree(tparams, dparams, s: DecodeState, plan: "Plan") -> tree_lib.Tree:
  """The DDTree of an autoregressive draft (the MTP block or EAGLE-3; one row): every node's
  children come from a draft step on that node (`mtp.step` / `eagle3.step`: its own token, the
  output its parent's step produced, attending to the committed rows and its own path's step
  rows), grown best-first by `tree.build_tree_cond` (EAGLE-2's dynamic draft tree, scored as
  DDTree: a node's score is the sum of its path's log-probs at dec.draft_temp). The top-1 chain
  is the greedy chain `propose` drafts; a branch off it continues from its own state, not the
  chain's. Each inserted node costs one draft step (budget + 1 in all, in sequence)."""
  dcfg, dec = plan.dcfg, plan.dec
  lib, cfg = _ar(dcfg)
  n, dm = dec.draft_depth, dcfg.d_model
  kv_shape = (n, dcfg.n_kv_head, dcfg.head_dim)
  kv = math.prod(kv_shape)

  def child_fn(d, token, state):      # state: [g | path K | path V] of the node's parent
    g, bk, bv = state[:dm], state[dm:dm + kv].reshape(kv_shape), state[dm + kv:].reshape(kv_shape)
    logits, g, bk, bv = lib.step(dparams, tparams, cfg, token, g, d, s.pos, s.draft, bk, bv,
                                 plan.rt)
    return (jax.nn.log_softmax(logits / dec.draft_temp),
            jnp.concatenate([g, bk.reshape(-1), bv.reshape(-1)]))

  root = jnp.concatenate([s.mtp_h.astype(jnp.float32), jnp.zeros((2 * kv,), jnp.float32)])
  return tree_lib.build_tree_cond(child_fn, s.bonus, root, depth=n, budget=dec.budget,
                                  top_k=dec.tree_top_k, chain_seed=dec.chain_seed)


def _ar_commit(dparams, tparams, plan: "PrefillPlan", tokens, feats, h_pending, start, n_keep):
  """An autoregressive draft's K/V rows of committed tokens and its next pending state
  (`mtp.commit_rows` / `eagle3.commit_rows`: same arguments and returns)."""
  lib, cfg = _ar(plan.dcfg)
  return lib.commit_rows(dparams, tparams, cfg, tokens, feats, h_pending, start, n_keep, plan.rt)


def draft_rows(tparams, dparams, s: DecodeState, *, dcfg: DraftConfig, dec: DecodeConfig,
               rt: Runtime):
  """The DFlash draft's rows (one row's state): one block over the context cache (the target
  features of every committed position were ingested when they were committed); DFlash-1
  (`draft.propose`) or DFlash-2 (`draft2.propose`: the selector's greedy path as log-probs over
  its candidates). Returns (logits [D, V] float32 for positions pos+1..pos+D, DraftCache),
  D = dec.draft_depth (L-1 for chain; min(budget, L-1) for DDTree). An MTP draft (mtp.py)
  runs the target's MTP block D times instead (`mtp.propose`; dparams: its MTPParams), an
  EAGLE-3 draft its layer (`eagle3.propose`; dparams: its Eagle3Params)."""
  if isinstance(dcfg, AR_CONFIGS):
    return _ar_propose(dparams, tparams, dcfg, s.bonus, s.pos, s.mtp_h, s.draft, rt,
                       n=dec.draft_depth), s.draft
  return _propose_fn(dcfg)(dparams, dcfg, tparams.embed, tparams.lm_head, s.bonus, s.pos,
                           s.draft, rt, n_logits=dec.draft_depth)


def _propose_fn(dcfg: DraftConfig):
  """The draft forward of the config's variant: draft2.propose (DFlash-2), dspark.propose
  (DSpark: the greedy Markov chain's rows) or draft.propose."""
  if dcfg.dspark is not None:
    return dspark_lib.propose
  return draft2_lib.propose if dcfg.dflash2 is not None else draft_lib.propose


@dataclasses.dataclass(frozen=True)
class LogitsProposer:
  """A proposer from a function giving draft rows, `rows_fn(tparams, dparams, s, *, dcfg, dec,
  rt) -> (logits [D, V] float32, cache)` (`draft_rows`, or a test's oracle): the tree is DFlash-1's
  construction from the rows (`build_verify_tree`: the rows' argmax chain, or draws from the
  processed rows under the rejection rule; DDTree's best-first tree over their log-probs)."""

  rows_fn: object

  def __call__(self, tparams, dparams, s: DecodeState, *, plan: "Plan", key: jax.Array,
               sampled: bool, grammar=None, table=None) -> Proposal:
    dlogits, cache = self.rows_fn(tparams, dparams, s, dcfg=plan.dcfg, dec=plan.dec, rt=plan.rt)
    if table is not None and plan.dec.table_mix > 0:
      hist, n_valid = _history(s)
      dlogits = ngram_lib.mix_rows(table, dlogits, hist, n_valid, plan.dec.table_mix)
    tree, q = build_verify_tree(dlogits, s.bonus, plan.dec, s.samp, key, sampled, grammar,
                                s.gstate)
    return Proposal(tree, q, cache)


_ROWS_PROPOSER = LogitsProposer(draft_rows)


def dflash_proposer(tparams, dparams, s: DecodeState, *, plan: "Plan", key: jax.Array,
                    sampled: bool, grammar=None, table=None) -> Proposal:
  """The DFlash draft as proposer (one row; the loop vmaps it over the batch). A proposer is
  any function with this signature returning a `Proposal` (tests pass oracles through
  `LogitsProposer`).

  DFlash-1: the chain / DDTree construction over the draft's rows (`LogitsProposer`).
  DSpark: a sampled chain drafts ancestrally (`_ancestral_chain`); DDTree with a Markov head grows
  each node's children from the head conditioned on that node's token (`dspark.tree`); otherwise
  the greedy Markov chain's rows, as DFlash-1's.
  MTP block / EAGLE-3: a sampled chain drafts ancestrally; DDTree runs a draft step per node
  (`ar_tree`); otherwise the greedy chain's rows.
  DFlash-2, chain without a grammar: the candidate selector's own path (`draft2.propose_path`),
  greedy, or for a row sampled under the rejection rule drawn ancestrally at the row's
  temperature with q = the selector's softmax over its candidates (the z-lab package's
  sampling); DDTree scores each node's children with that node as their predecessor
  (`draft2.tree`); grammar-constrained chains (and rows mixed with an n-gram table) use the
  selector's rows (its greedy path's scores as log-probs over the candidates) like DFlash-1's.
  key: [] PRNG key for the draws. grammar: the batch's GrammarTables or None. table: the static
  n-gram table the rows are mixed with when dec.table_mix > 0 (`ngram.mix_rows`; DFlash-2 then
  builds from its rows too), else unused.
  """
  dcfg, dec = plan.dcfg, plan.dec
  mixing = table is not None and dec.table_mix > 0
  if ((plan.ar_draft or dcfg.dspark is not None) and dec.mode == "chain" and grammar is None
      and not mixing and _uses_rejection(dec, sampled)):
    return _ancestral_chain(tparams, dparams, s, plan, key)
  if plan.ar_draft and dec.mode == "ddtree" and grammar is None and not mixing:
    return Proposal(ar_tree(tparams, dparams, s, plan), None, s.draft)
  cond_tree = (draft2_lib.tree if dcfg.dflash2 is not None else
               dspark_lib.tree if dcfg.dspark is not None and dcfg.dspark.markov_rank else None)
  if cond_tree is not None and dec.mode == "ddtree" and grammar is None and not mixing:
    tree = cond_tree(dparams, dcfg, tparams.embed, tparams.lm_head, s.bonus, s.pos, s.draft,
                     plan.rt, depth=dec.draft_depth, budget=dec.budget, top_k=dec.tree_top_k,
                     chain_seed=dec.chain_seed, temp=dec.draft_temp)
    return Proposal(tree, None, s.draft)
  if dcfg.dflash2 is None or grammar is not None or dec.mode != "chain" or mixing:
    return _ROWS_PROPOSER(tparams, dparams, s, plan=plan, key=key, sampled=sampled,
                          grammar=grammar, table=table)
  rejection = _uses_rejection(dec, sampled)
  tokens, q = draft2_lib.propose_path(
      dparams, dcfg, tparams.embed, tparams.lm_head, s.bonus, s.pos, s.draft, plan.rt,
      n=dec.draft_depth, temperature=s.samp.temperature if rejection else 0.0,
      key=key if rejection else None)
  tree = tree_lib.path_tree(jnp.concatenate([s.bonus[None], tokens]))
  return Proposal(tree, q if rejection else None, s.draft)


def _ancestral_chain(tparams, dparams, s: DecodeState, plan: "Plan", key: jax.Array) -> Proposal:
  """An MTP or DSpark draft's chain for a row sampled under the rejection rule: each step (an
  MTP block step, a DSpark Markov slot) draws its token from its processed distribution q (the
  row's sampling params) and the next step feeds the drawn token (ancestral sampling, as
  llama.cpp and vLLM draft with MTP and DeepSpec's `sample_block_tokens` with DSpark), so later
  drafts condition on the tokens actually proposed; a greedy row (temperature 0) takes argmaxes.
  The rule verifies each draft against the q it was drawn from: exact."""
  keys = jax.random.split(key, plan.dec.draft_depth)
  sp = _safe(s.samp)

  def draw(logits, j):
    q = sampling_lib.process_logits(logits[None], sp)
    tok = jnp.where(s.samp.temperature > 0, sampling_lib.draw(keys[j], q)[0],
                    jnp.argmax(logits).astype(jnp.int32))
    return tok.astype(jnp.int32), q[0]

  if plan.ar_draft:
    tokens, q = _ar_propose(dparams, tparams, plan.dcfg, s.bonus, s.pos, s.mtp_h, s.draft,
                            plan.rt, n=plan.dec.draft_depth, draw=draw)
  else:
    tokens, _, q, _, _ = dspark_lib.chain(dparams, plan.dcfg, tparams.embed, tparams.lm_head,
                                          s.bonus, s.pos, s.draft, plan.rt,
                                          n=plan.dec.draft_depth, draw=draw)
  return Proposal(tree_lib.path_tree(jnp.concatenate([s.bonus[None], tokens])), q, s.draft)


def _constrained_rows(dlogits, grammar, gstate, sp, key, rejection: bool):
  """The draft's chain under a grammar, left to right: row j is masked by the state after the
  chain's tokens before it. Returns (masked rows [D, V] float32, chain tokens [D] int32, q
  [D, V] processed draft log-probs under the rejection rule else None); rows of a row without
  grammar (gstate -1) are unmasked and give the tokens the unconstrained path gives."""
  keys = jax.random.split(key, dlogits.shape[0]) if rejection else None

  def body(st, xs):
    row, k = xs
    masked = grammar_lib.mask_logits(row[None], grammar, st[None])
    tok = jnp.argmax(masked[0]).astype(jnp.int32)
    q = None
    if rejection:
      q = sampling_lib.process_logits(masked, _safe(sp))[0]
      tok = jnp.where(sp.temperature > 0, jax.random.categorical(k, q).astype(jnp.int32), tok)
    return grammar_lib.advance(grammar, st, tok), (masked[0], tok, q)

  _, (masked, toks, q) = jax.lax.scan(body, gstate, (dlogits, keys))
  return masked, toks, q


def build_verify_tree(dlogits: Optional[jax.Array], bonus: jax.Array, dec: DecodeConfig,
                      sp=None, key: Optional[jax.Array] = None, sampled: bool = False,
                      grammar: Optional[grammar_lib.GrammarTables] = None,
                      gstate: Optional[jax.Array] = None):
  """The tree this mode verifies (one row): "ar" the root alone; "chain" the path [bonus,
  drafts]; "ddtree" the best-first tree of dec.budget nodes from the rows' log-probs at
  dec.draft_temp. Chain drafts are the rows' argmax, or, under the rejection rule (the `sampled`
  variant, a row with temperature > 0 and dec.chain_rule "rejection"), draws from the processed
  draft distribution q with `key`.
  dlogits: [D, V] float32 draft logits (None for "ar"); bonus: [] int32; sp: the row's
  SamplingParams. grammar / gstate: the batch's GrammarTables and the row's state after the
  bonus: the chain is drafted left to right under the grammar and DDTree's per-depth log-probs
  are masked by the chain's states (other branches may hold refused tokens: never accepted).
  Returns (tree, q [D, V] processed draft log-probs under the rejection rule, else None)."""
  if not dec.speculative:
    return tree_lib.path_tree(bonus[None]), None
  if grammar is not None:
    rejection = dec.mode == "chain" and _uses_rejection(dec, sampled)
    dlogits, drafts, q_logp = _constrained_rows(dlogits, grammar, gstate, sp, key, rejection)
    if dec.mode == "chain":
      return tree_lib.path_tree(jnp.concatenate([bonus[None], drafts])), q_logp
  if dec.mode == "chain":
    q_logp = None
    drafts = jnp.argmax(dlogits, axis=-1).astype(jnp.int32)
    if _uses_rejection(dec, sampled):
      q_logp = sampling_lib.process_logits(dlogits, _safe(sp))
      drafts = jnp.where(sp.temperature > 0, sampling_lib.draw(key, q_logp), drafts)
    return tree_lib.path_tree(jnp.concatenate([bonus[None], drafts])), q_logp
  logp = jax.nn.log_softmax(dlogits.astype(jnp.float32) / dec.draft_temp, axis=-1)
  return tree_lib.build_tree(logp, bonus, budget=dec.budget, top_k=dec.tree_top_k,
                             chain_seed=dec.chain_seed), None


def accept(tree: tree_lib.Tree, logits: jax.Array, q_logp: Optional[jax.Array],
           dec: DecodeConfig, sp, key: jax.Array, sampled: bool = False, *,
           row_key: Optional[jax.Array] = None, pos: Optional[jax.Array] = None):
  """Which root path of the verified tree to keep, and the tokens it emits (one row).

  logits: [N, V] target logits per node. Greedy (the greedy variant, or a row with temperature
  0): follow the target's argmax. Sampling, "match": follow draws of the processed target
  distribution at each node, the node at depth d drawing with fold_in(row_key, pos + d + 1) (the
  position of the token it predicts; pos: the root's position), so the followed path's tokens are
  the autoregressive draws at those positions: the same text in every mode for one row key.
  row_key / pos default to key / 0 (draws keyed by depth). Sampling, chain "rejection":
  `sampling.rejection_chain` against q_logp, with `key`.
  Returns (path [L] int32 node ids, n_acc [] int32 accepted drafts, emit [L] int32: the
  accepted drafts, then the bonus token at emit[n_acc])."""
  positions = (jnp.int32(0) if pos is None else pos) + tree.depths + 1
  post = _next_token(logits, key if row_key is None else row_key, positions, sp,
                     sampled and not _uses_rejection(dec, sampled))
  path, n_acc, _ = tree_lib.follow(tree, post, dec.L - 1)        # path: [L] node ids
  emit = post if tree.is_path else post[path]
  if _uses_rejection(dec, sampled):
    # the chain is nodes 0..L-1 (a lookup branch grafted after them is not used by this rule)
    chain = tree.tokens[1:dec.L]
    p_logp = sampling_lib.process_logits(logits[:dec.L], _safe(sp))
    r_acc, r_bonus = sampling_lib.rejection_chain(key, p_logp, q_logp, chain)
    nxt = jnp.concatenate([chain, jnp.zeros((1,), jnp.int32)])
    r_emit = jnp.where(jnp.arange(dec.L) < r_acc, nxt, r_bonus)
    use = sp.temperature > 0
    n_acc, emit = jnp.where(use, r_acc, n_acc), jnp.where(use, r_emit, emit)
    if not tree.is_path:
      path = jnp.where(use, jnp.arange(dec.L, dtype=jnp.int32), path)
  return path, n_acc, emit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Committed:
  """Output of `verify_and_commit`: path [P] int32 accepted node ids (root first); n_acc []
  int32 accepted drafts (capped at the context); emit [P] int32 (accepted drafts, then the
  bonus at emit[n_acc]); update the target.CacheUpdate that commits the path at rows start..
  (not applied: one sequence applies it with `target.apply_update`, the batched loop for all
  rows at once); feats [P, F*D] float32 target features of the path's nodes (None without
  feature layers); logits [N, V] float32 per tree node."""

  path: jax.Array
  n_acc: jax.Array
  emit: jax.Array
  update: target_lib.CacheUpdate
  feats: Optional[jax.Array]
  logits: jax.Array


def verify_and_commit(tparams, tcfg: TargetConfig, rt: Runtime, tree: tree_lib.Tree,
                      start: jax.Array, cache: target_lib.TargetCache, choose, *,
                      max_ctx: int, feature_layers: tuple[int, ...] = (),
                      live_bound=None, invariant_rows: int = 0) -> Committed:
  """The one verify core (decode step, bench_verify, training data): verify `tree` at position
  `start` in one target forward, let `choose(logits [N, V]) -> (path, n_acc, emit)` pick the
  accepted root path, cap the acceptance so nothing is committed past `max_ctx` (the output then
  ends exactly where autoregressive decoding's does: emit[n_acc] stays a target token), and
  build the path's commit (`target.path_update`, no replay). invariant_rows: static, see
  `DecodeConfig.invariant_rows` (0 = off)."""
  ver = target_lib.verify(tparams, tcfg, tree, start, cache, rt, feature_layers=feature_layers,
                          live_bound=live_bound, invariant_rows=invariant_rows)
  path, n_acc, emit = choose(ver.logits)
  n_acc = jnp.minimum(n_acc, max_ctx - 1 - start)
  upd = target_lib.path_update(cache, ver, path, n_acc + 1, rows_in_place=tree.is_path)
  feats = None
  if feature_layers:
    feats = ver.feats if tree.is_path else ver.feats[path]
  return Committed(path, n_acc, emit, upd, feats, ver.logits)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _RowStep:
  """One row's step result before the cache writes: the advanced small state (`state`, with the
  target cache as it was and the draft cache as the proposal left it), the target commit
  `update` at rows `start`, and the draft context rows (k, v [n_layer, P, Hkv, Dh], or None) of
  the committed positions, also at `start`."""

  state: DecodeState
  update: target_lib.CacheUpdate
  start: jax.Array
  draft_k: Optional[jax.Array]
  draft_v: Optional[jax.Array]


def _n_emit(s: DecodeState, emit, n_acc, eog_ids):
  """(tokens of emit[0..n_acc] the row outputs: up to its first EOG token and its max_new
  budget, whether an EOG token is among them)."""
  n_commit = n_acc + 1
  is_eog = jnp.any(emit[:, None] == eog_ids[None, :], axis=-1) & (jnp.arange(emit.shape[0]) < n_commit)
  hit = jnp.any(is_eog)
  return jnp.minimum(jnp.where(hit, jnp.argmax(is_eog) + 1, n_commit), s.max_new - s.n_out), hit


def _advance(s: DecodeState, emit, n_acc, eog_ids) -> DecodeState:
  """Emit emit[0..n_acc] (accepted drafts, then the bonus); stop after the first EOG token
  among them and at the row's max_new tokens. emit: [P] int32. (`_step` caps n_acc there, so
  a finished row's caches hold exactly its prompt and output but the last token.)"""
  n_commit = n_acc + 1
  n_emit, hit = _n_emit(s, emit, n_acc, eog_ids)
  n_out = s.n_out + n_emit
  # the committed tokens: the old bonus (position pos), then the accepted drafts
  recent = jax.lax.dynamic_slice_in_dim(
      jnp.concatenate([s.recent, s.bonus[None], emit[:-1]]), n_commit, s.recent.shape[0])
  return dataclasses.replace(
      s, out=jax.lax.dynamic_update_slice_in_dim(s.out, emit, s.n_out, axis=0), n_out=n_out,
      recent=recent,
      pos=s.pos + n_commit, bonus=emit[n_acc], done=s.done | hit | (n_out >= s.max_new),
      n_steps=s.n_steps + 1, accept_lens=s.accept_lens.at[s.n_steps].set(n_commit))


def _history(s: DecodeState) -> tuple[jax.Array, jax.Array]:
  """The row's recent committed tokens with the bonus token last ([W + 1] int32) and how many of
  them are real (the rest are the window's padding before position 0)."""
  return (jnp.concatenate([s.recent, s.bonus[None]]),
          jnp.minimum(s.pos, s.recent.shape[0]) + 1)


def lookup_proposal(s: DecodeState, dec: DecodeConfig,
                    table: Optional[ngram_lib.NgramTable] = None) -> tuple[jax.Array, jax.Array]:
  """The row's prompt-lookup proposal (`tree.lookup_path` over its recent-token window and the
  bonus token), or where that finds no match and `table` is given, the static n-gram table's
  (`ngram.table_path`, gated by dec.lookup_table_expect): (tokens [dec.lookup] int32, n []
  int32 real tokens, 0 = no proposal)."""
  hist, n_valid = _history(s)
  tok, n = tree_lib.lookup_path(hist, n_valid, dec.lookup, dec.lookup_ngram_min,
                                dec.lookup_ngram_max)
  if table is None:
    return tok, n
  t_tok, t_n = ngram_lib.table_path(table, hist, n_valid, dec.lookup, dec.lookup_table_expect)
  return jnp.where(n > 0, tok, t_tok), jnp.where(n > 0, n, t_n)


def _step(tparams, dparams, s: DecodeState, eog_ids, live_bound, rules, grammar, look=None,
          table=None, *, plan: Plan, sampled: bool, proposer) -> _RowStep:
  """One round of one row: propose -> build tree -> verify -> accept (follow) -> commit (as
  updates for the batched loop to write) -> the draft's context rows of the committed tokens.
  rules: [] bool, the same for every row (not vmapped, so a real branch): some row has
  logit_bias or penalties on (`sampling.apply_rules`; a row without them is left unchanged by
  them). grammar: the batch's grammar.GrammarTables, or None (no row is constrained): each
  verified node is masked under the state of its own path. look: the row's
  `lookup_proposal` when dec.lookup > 0 (mode "lookup": the path verified; a draft mode: grafted
  into the draft's tree), else None. table: the static n-gram table, passed to the proposer when
  dec.table_mix > 0 (the draft's rows mixed with it, `ngram.mix_rows`)."""
  dec = plan.dec
  k_step = jax.random.fold_in(s.key, sampling_lib.step_stream(s.n_steps))
  k_draft, k_accept = jax.random.split(k_step)
  if dec.mode == "lookup":
    prop = Proposal(tree_lib.path_tree(jnp.concatenate([s.bonus[None], look[0]])), None, None)
  elif dec.speculative:
    mix = {"table": table} if dec.table_mix > 0 else {}
    prop = proposer(tparams, dparams, s, plan=plan, key=k_draft, sampled=sampled, grammar=grammar,
                    **mix)
    if look is not None:
      t = prop.tree
      prop = dataclasses.replace(prop, tree=tree_lib.graft_path(
          t, look[0], look[1], max_depth=max(t.max_depth, dec.lookup)))
  else:
    prop = Proposal(tree_lib.path_tree(s.bonus[None]), None, None)
  tree, q_logp = prop.tree, prop.q
  gnodes = None
  if grammar is not None:
    gnodes = grammar_lib.node_states(grammar, s.gstate, tree.parents, tree.depths, tree.tokens,
                                     tree.max_depth)

  def choose(logits):
    # logit_bias and penalties, each node under its own path's window (sampling.apply_rules)
    node_pos = s.pos + tree.depths
    ruled = lambda x: sampling_lib.apply_rules(x, s.samp, *_penalty_window(s.recent, s.pos - 1),
                                               tree.tokens, node_pos, tree.ancestor_matrix(),
                                               node_pos)
    plain = lambda x: x.astype(jnp.float32)
    if plan.rt.rounds:                    # a static loop: no branch (no host round trip)
      logits = jnp.where(rules, ruled(logits), plain(logits))
    else:
      logits = jax.lax.cond(rules, ruled, plain, logits)
    if grammar is not None:
      logits = grammar_lib.mask_logits(logits, grammar, gnodes)
    path, n_acc, emit = accept(tree, logits, q_logp, dec, s.samp, k_accept, sampled,
                               row_key=s.key, pos=s.pos)
    # Commit nothing past the row's last output token (its first EOG token, its max_new
    # budget): the output is the same, and the caches of a finished row then hold exactly its
    # prompt and output but the last token, a state the prompt cache can reuse (a hybrid's
    # recurrent state included). As z-lab's package clips the last acceptance length.
    return path, jnp.minimum(n_acc, _n_emit(s, emit, n_acc, eog_ids)[0] - 1), emit
  c = verify_and_commit(tparams, plan.tcfg, plan.rt, tree, s.pos, s.target, choose,
                        max_ctx=dec.max_ctx, feature_layers=plan.feature_layers,
                        live_bound=live_bound, invariant_rows=dec.invariant_rows)
  dk = dv = None
  mtp_h = s.mtp_h
  if plan.ar_draft:         # the committed path's MTP / EAGLE-3 rows, and the new pending state
    dk, dv, mtp_h = _ar_commit(dparams, tparams, plan.prefill, jnp.take(tree.tokens, c.path),
                               c.feats, mtp_h, s.pos, c.n_acc + 1)
  elif plan.uses_draft:
    dk, dv = draft_lib.ingest_rows(dparams, plan.dcfg, c.feats, s.pos, plan.rt,
                                    rope_keys=not plan.draft_relative)
  new = dataclasses.replace(_advance(s, c.emit, c.n_acc, eog_ids), mtp_h=mtp_h)
  if prop.cache is not None:
    new = dataclasses.replace(new, draft=prop.cache)
  if grammar is not None:
    new = dataclasses.replace(new, gstate=grammar_lib.advance(grammar, gnodes[c.path[c.n_acc]],
                                                              c.emit[c.n_acc]))
  return _RowStep(new, c.update, s.pos, dk, dv)


def active_rows(state: DecodeState, dec: DecodeConfig) -> jax.Array:
  """[B] bool: rows that still decode (not done, length budget left, context not full; the
  capacity has slack for one more verify block)."""
  return ~state.done & (state.n_out < state.max_new) & (state.pos < dec.max_ctx)


def select_rows(mask: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
  """Row b of `new` where mask[b], else row b of `old`. mask: [B] bool; new, old: [B, ...]."""
  return jnp.where(mask.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)


def _commit_rows(act: jax.Array, r: _RowStep, old: DecodeState) -> DecodeState:
  """Apply a batch of row steps: rows not in `act` [B] keep their old small state and SSM /
  conv state; every row's K/V and draft context rows are written at its `start` in place (a
  finished row's land past its committed length, where nothing reads them), so no whole cache
  is copied or selected."""
  pick = functools.partial(select_rows, act)
  # The writes must come after every read of the caches in the step (attention over the
  # committed rows). The rows written do not depend on those reads (a chain's K/V exist before
  # its attention), so XLA could order a write first and then copies the whole cache to keep
  # the read correct; passing the step's outputs (which depend on all reads) and the caches
  # through one barrier orders the writes last, in place.
  r, caches = jax.lax.optimization_barrier((r, (old.target, r.state.draft)))
  old = dataclasses.replace(old, target=caches[0], draft=caches[1])
  small = lambda st: dataclasses.replace(st, target=None, draft=None)
  new = jax.tree.map(pick, small(r.state), small(old))
  tc = old.target
  tc = target_lib.TargetCache(k=layers.write_block_rows(tc.k, r.start, r.update.k),
                              v=layers.write_block_rows(tc.v, r.start, r.update.v),
                              ssm=pick(r.update.ssm, tc.ssm), conv=pick(r.update.conv, tc.conv))
  dc = old.draft
  if r.draft_k is not None:
    for b in range(r.start.shape[0]):
      dc = dc.write(r.start[b], r.draft_k[b][None], r.draft_v[b][None], lead=(jnp.int32(b),))
  return dataclasses.replace(new, target=tc, draft=dc)


@functools.partial(jax.jit, static_argnames=("plan", "sampled", "proposer"),
                   donate_argnames=("state",))
def decode_loop(tparams, dparams, state: DecodeState, max_steps: jax.Array, eog_ids: jax.Array,
                grammar: Optional[grammar_lib.GrammarTables] = None,
                table: Optional[ngram_lib.NgramTable] = None, *, plan: Plan,
                sampled: bool = False, proposer=dflash_proposer) -> DecodeState:
  """Run decode steps while any row is active (not done, length budget and context left), at
  most max_steps more rounds. Each round steps every row at once (`_step` vmapped over the
  rows); inactive rows keep their state. With `Runtime.rounds` R > 0 the loop runs exactly R
  rounds (static trip count; a round with no active row, or past max_steps, changes nothing).

  max_steps: [] int32 (traced: no recompile across values). eog_ids: [E] int32. sampled:
  static; False = greedy variant (argmax everywhere), True = each row samples with its own
  SamplingParams and key from the state (rows with temperature 0 stay greedy). grammar: the
  batch's grammar.GrammarTables when some row is constrained (a separate compiled variant;
  None: no grammar code runs). table: the static n-gram table of dec.lookup_table (required
  then, `ngram.load_cached`), else None.
  """
  dec = plan.dec
  if bool(dec.lookup_table) != (table is not None):
    raise ValueError(f"decode_loop: DecodeConfig.lookup_table={dec.lookup_table!r} but table is "
                     f"{'None' if table is None else 'given'}")

  def stepper(p):
    return jax.vmap(functools.partial(_step, plan=p, sampled=sampled, proposer=proposer),
                    in_axes=(None, None, 0, None, None, None, None, 0, None))

  step = stepper(plan)

  def keep_going(c):
    s, i = c
    return jnp.any(active_rows(s, dec)) & (i < max_steps)

  fixed = plan.rt.rounds

  def one_round(c):
    s, i = c
    act = active_rows(s, dec)
    if fixed:
      act = act & (i < max_steps)
    # Every active row's committed length is below the bound: one chunk walk for the batch.
    # Inactive rows (finished, free, or between prefill chunks) do not raise it: their step is
    # computed over a shorter context and discarded.
    bound = jnp.max(jnp.where(act, s.pos, 0))
    rules = jnp.any(act & sampling_lib.rules_on(s.samp))
    look = (jax.vmap(functools.partial(lookup_proposal, dec=dec, table=table))(s)
            if dec.lookup else None)
    run = lambda f: _commit_rows(act, f(tparams, dparams, s, eog_ids, bound, rules, grammar,
                                        look, table), s)
    if dec.mode == "lookup" and not fixed:
      # a round where no row has a lookup match is an autoregressive step; one branch runs (the
      # predicate is the same for every row, outside the vmap). A static loop verifies the
      # [bonus, proposal] path always (a row without a match accepts the bonus alone).
      ar_step = stepper(dataclasses.replace(plan, dec=dataclasses.replace(dec, mode="ar",
                                                                          lookup=0,
                                                                          lookup_table="")))
      s = jax.lax.cond(jnp.any(act & (look[1] > 0)), lambda: run(step), lambda: run(ar_step))
    else:
      s = run(step)
    return s, i + 1

  if fixed:
    return jax.lax.fori_loop(0, fixed, lambda _, c: one_round(c), (state, jnp.int32(0)))[0]
  return jax.lax.while_loop(keep_going, one_round, (state, jnp.int32(0)))[0]


@functools.partial(jax.jit, static_argnames=("plan",))
def draft_once(tparams, dparams, state: DecodeState, slot: jax.Array, *, plan: Plan):
  """Draft logits [L-1, V] for row `slot` right after its prefill (no verify)."""
  row = jax.tree.map(lambda x: x[slot], state)
  if plan.ar_draft:
    return _ar_propose(dparams, tparams, plan.dcfg, row.bonus, row.pos, row.mtp_h, row.draft,
                       plan.rt, n=plan.dec.L - 1)
  logits, _ = _propose_fn(plan.dcfg)(dparams, plan.dcfg, tparams.embed, tparams.lm_head,
                                     row.bonus, row.pos, row.draft, plan.rt)
  return logits
