"""Host side of batched decoding: `SlotBatch` holds a batched `DecodeState` of B slots, prefills
sequences into free slots, runs the compiled loop, and reads rows back. `api.generate`,
`api.generate_batch` and the server's continuous batching all drive it.

B comes from a small set of buckets (`BATCH_BUCKETS`) so that a handful of compiled programs
serve every batch size; a sequence joins a free slot between loop calls without recompiling.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import decode as decode_lib
from dflash_jax import grammar as grammar_lib
from dflash_jax import ngram as ngram_lib
from dflash_jax import prompt_cache as pc
from dflash_jax.sampling import SamplingConfig

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(n: int) -> int:
  """The smallest batch bucket >= n (n <= 256); ValueError above the largest bucket."""
  for b in BATCH_BUCKETS:
    if n <= b:
      return b
  raise ValueError(f"batch size {n} exceeds the largest bucket {BATCH_BUCKETS[-1]}")


def prefill_sizes(chunk: int) -> tuple[int, ...]:
  """The prefill forward lengths used with DecodeConfig.prefill_chunk = chunk: the chunk, and
  for a prompt shorter than it, the smallest of chunk/2, chunk/4 (those >= 32) that holds it, so
  a short chat prompt does not pay for a whole padded chunk (one compiled program per size)."""
  return (chunk,) + tuple(s for s in (chunk // 2, chunk // 4) if s >= 32)


def prefill_len(n_prompt: int, chunk: int) -> int:
  """Forward length of every prefill chunk of an n_prompt-token prompt: `chunk` for a prompt of
  at least one chunk (its last chunk padded to it), else the smallest `prefill_sizes` >= n."""
  return min((s for s in prefill_sizes(chunk) if s >= n_prompt), default=chunk)


@dataclasses.dataclass
class Row:
  """One row read back from the device: tokens (generated ids), accept_lens (tokens committed per
  step), n_steps (decode steps), pos (tokens in the row's caches: prompt + committed)."""

  tokens: list[int]
  accept_lens: list[int]
  n_steps: int
  pos: int = 0


def tokens_before(ids, start: int) -> np.ndarray:
  """[W] int32: ids[start-W:start] right-aligned, zeros where the position is negative (the
  window of recent tokens a prefill chunk at `start` takes, W = decode.RECENT_WINDOW)."""
  w = decode_lib.RECENT_WINDOW
  out = np.zeros(w, np.int32)
  got = np.asarray(ids[max(0, start - w):start], np.int32)
  if got.size:
    out[w - got.size:] = got
  return out


@functools.partial(jax.jit, static_argnames=("plan", "batch"))
def _move_rows(state, idx, n, *, plan, batch):
  """Rows idx[:n] of `state` as rows 0..n-1 of a fresh state of `batch` rows. idx: [batch]
  int32 (padded), n: [] int32: traced, so one program per (old, new) batch size."""
  fresh = decode_lib.init_state(plan, batch)
  keep = jnp.arange(batch) < n

  return jax.tree.map(
      lambda f, o: decode_lib.select_rows(keep, o[jnp.clip(idx, 0, o.shape[0] - 1)], f),
      fresh, state)


@functools.partial(jax.jit, static_argnames=("dec",))
def _host_view(state, *, dec):
  """What the host polls between loop calls, in one program and one transfer: (n_out [B],
  active [B] bool, out [B, S + L] int32, finite [B] bool)."""
  return state.n_out, decode_lib.active_rows(state, dec), state.out, state.finite


@functools.partial(jax.jit, static_argnames=("dec",))
def _any_active(state, *, dec):
  """[] bool: some row still decodes (one scalar read between `Runtime.rounds` calls)."""
  return jnp.any(decode_lib.active_rows(state, dec))


@jax.jit
def _recurrent_state(state, slot):
  """Copies of row `slot`'s (SSM state, conv state), plus its MTP pending hidden state with an
  MTP draft (DecodeState.mtp_h: like the recurrent state, valid only at the length it was taken)."""
  st = (state.target.ssm[slot], state.target.conv[slot])
  return st + ((state.mtp_h[slot],) if state.mtp_h is not None else ())


@jax.jit
def _row_view(state, slot):
  """Row `slot`'s (out, accept_lens, n_out, n_steps, pos), one program and one transfer."""
  return (state.out[slot], state.accept_lens[slot], state.n_out[slot], state.n_steps[slot],
          state.pos[slot])


class SlotBatch:
  """B decode slots over one target (+ draft or proposer) and one decode plan.

  Args:
    target, draft: api.Target / api.Draft (draft None for "ar" or with a proposer).
    dec: resolved DecodeConfig (mode ar/chain/ddtree). batch: B slots (a bucket).
    eog: [E] int32 device array of end-of-generation ids.
    proposer, proposer_params: replace the DFlash draft (see decode.dflash_proposer).
  """

  def __init__(self, target, draft, dec, batch: int, eog, *, proposer: Optional[Callable] = None,
               proposer_params=None):
    self.target = target
    if proposer is None:
      self.proposer = decode_lib.dflash_proposer
      self.dparams = draft.params if (draft is not None and dec.uses_draft) else None
      dcfg = draft.config if self.dparams is not None else None
    else:
      self.proposer, self.dparams, dcfg = proposer, proposer_params, None
    self.plan = decode_lib.Plan(target.config, dcfg, dec, target.runtime)
    self.eog = eog
    # the static n-gram table of --lookup_table (one build per process and path), on the device
    # once here rather than copied from host arrays at every decode_loop call
    self.table = (jax.device_put(ngram_lib.load_cached(dec.lookup_table, target.config.n_vocab))
                  if dec.lookup_table else None)
    self.state = decode_lib.init_state(self.plan, batch)
    self.grammars = grammar_lib.GrammarBank(target.config.n_vocab)   # constrained rows' automata
    self.sampled_rows: set[int] = set()      # slots last prefilled with temperature > 0
    self._restored: dict[int, int] = {}      # slot -> prefix length `reuse` restored
    self._compiled: set = set()              # programs compiled ahead of time (compile_*)

  @property
  def state(self):
    """The batched decode_lib.DecodeState (device arrays)."""
    return self._state

  @state.setter
  def state(self, value):
    self._state = value
    self._view = None                        # host arrays read from this state (see _host)

  @property
  def dec(self):
    return self.plan.dec

  @property
  def size(self) -> int:
    """B, the number of slots."""
    return int(self.state.done.shape[0])

  def prefill(self, slot: int, ids: np.ndarray, max_new: int, sampling: SamplingConfig,
              start: int = 0, grammar: Optional[grammar_lib.Grammar] = None):
    """Prefill `ids` [P] int32 (from `start`, see `prefill_chunks`) into `slot`, chunk by chunk;
    the row is active after the last chunk (unless its first token ends it)."""
    for _ in self.prefill_chunks(slot, ids, max_new, sampling, start, grammar=grammar):
      pass

  def grammar_fits(self, slot: int, grammar: Optional[grammar_lib.Grammar]) -> bool:
    """Reserve the grammar bank's room for `slot`'s `grammar` (None: nothing to reserve);
    False when other rows' grammars fill the bank now (the next `prefill_chunks` of the slot
    would raise RuntimeError)."""
    return grammar is None or self.grammars.place(slot, grammar) is not None

  def prefill_chunks(self, slot: int, ids: np.ndarray, max_new: int,
                     sampling: SamplingConfig, start: int = 0,
                     checkpoints: Optional[dict] = None,
                     grammar: Optional[grammar_lib.Grammar] = None) -> Iterator[int]:
    """`prefill` one chunk (dec.prefill_chunk tokens, fewer for a short prompt: `prefill_len`)
    per step of the iterator, yielding the tokens prefilled so far: a server interleaves the
    chunks with decode calls of the other rows (the row stays out of the loop until its last
    chunk).

    start: prompt rows 0..start-1 are taken as already in the slot's caches (prefix reuse: they
    were restored by `reuse`, or the slot's previous sequence had the same first `start` tokens).
    On a hybrid target only start = what `reuse` restored (the recurrent state must be the one
    after exactly `start` tokens). Raises ValueError for a start outside [0, len(ids)) or a
    start > 0 on a hybrid target without that restore.
    checkpoints: on a hybrid target, filled with {tokens prefilled: (ssm, conv) copies} at the end
    of every chunk (the prompt cache's checkpoints, `save`).
    grammar: constrain the row's output to this grammar.Grammar (constrained decoding; every
    mode's output is then the constrained autoregressive output). Raises ValueError when the
    grammar can never fit the batch's grammar bank, RuntimeError when the bank is full now
    (see `grammar_fits`)."""
    if not 0 <= start < ids.size:
      raise ValueError(f"prefill start {start} outside [0, {ids.size})")
    if start and self.recurrent and self._restored.get(slot) != start:
      raise ValueError(f"prefill start {start} on a hybrid target needs the recurrent state "
                       "after exactly that many tokens: restore it with SlotBatch.reuse first")
    bad = [t for t, _ in sampling.logit_bias if t >= self.target.config.n_vocab]
    if bad:
      raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary "
                       f"[0, {self.target.config.n_vocab})")
    if grammar is None:
      self.grammars.release(slot)
      gstart = grammar_lib.NO_GRAMMAR
    else:
      gstart = self.grammars.place(slot, grammar)
      if gstart is None:
        raise RuntimeError("the grammar bank is full (other rows' formats); retry later")
    tables = self.grammars.tables() if self.grammars.active else None
    self._restored.pop(slot, None)
    c = prefill_len(ids.size - start, self.dec.prefill_chunk)
    if sampling.greedy:
      self.sampled_rows.discard(slot)
    else:
      self.sampled_rows.add(slot)
    for s0 in range(start, ids.size, c):
      chunk = ids[s0:s0 + c]
      n = chunk.size
      self.state = decode_lib.prefill_chunk(
          self.target.params, self.dparams, self.state, jnp.int32(slot),
          jnp.asarray(np.pad(chunk, (0, c - n))), jnp.int32(s0), jnp.int32(n),
          jnp.bool_(s0 + n >= ids.size), self.eog, jnp.int32(sampling.seed), jnp.int32(max_new),
          sampling.params(), jnp.asarray(tokens_before(ids, s0)), tables, jnp.int32(gstart),
          plan=self.plan.prefill, sampled=not sampling.greedy)
      if checkpoints is not None and self.recurrent:
        checkpoints[s0 + n] = _recurrent_state(self.state, jnp.int32(slot))
      yield s0 + n

  def release(self, slot: int):
    """Take `slot` out of the loop now (a cancelled request): it is done and free for a new
    prefill."""
    self.state = dataclasses.replace(self.state, done=self.state.done.at[slot].set(True))
    self.sampled_rows.discard(slot)
    self.grammars.release(slot)

  def resized(self, batch: int, slots: Sequence[int]) -> "SlotBatch":
    """A SlotBatch of `batch` slots (a bucket) holding rows `slots` of this one as its rows
    0..len(slots)-1, in that order (their caches are copied once; the rest are free). Lets a
    server grow or shrink its batch with its load without recompiling (one program per bucket).
    This batch's state must not be used afterwards."""
    if len(slots) > batch:
      raise ValueError(f"{len(slots)} rows do not fit a batch of {batch}")
    new = SlotBatch.__new__(SlotBatch)
    new.target, new.proposer, new.dparams, new.plan, new.eog, new.table = (
        self.target, self.proposer, self.dparams, self.plan, self.eog, self.table)
    idx = np.zeros(batch, np.int32)
    idx[:len(slots)] = slots
    new.state = _move_rows(self.state, jnp.asarray(idx), jnp.int32(len(slots)), plan=self.plan,
                           batch=batch)
    new.sampled_rows = {i for i, s in enumerate(slots) if s in self.sampled_rows}
    new.grammars = self.grammars.moved(slots)
    new._restored, new._compiled = {}, set()
    self.state = None
    return new

  def _tables(self, grammar: bool):
    """The grammar tables a program takes: the bank's (also when empty) or None."""
    return self.grammars.tables() if grammar else None

  def compile_prefill(self, n_prompt: int, sampling: SamplingConfig, grammar: bool = False) -> float:
    """Compile (ahead of time: lower + compile, nothing runs) the prefill program an
    n_prompt-token prompt takes with this sampling, and the host-view program read after it;
    a later `prefill_chunks` call then only runs them (JAX's caches hold the traced and compiled
    programs; with the persistent compilation cache a warm process only traces). Returns the
    seconds it took (0 when already compiled)."""
    c = prefill_len(n_prompt, self.dec.prefill_chunk)
    key = ("prefill", c, not sampling.greedy, grammar)
    if key in self._compiled:
      return 0.0
    t0 = time.perf_counter()
    z = jnp.int32(0)
    decode_lib.prefill_chunk.lower(
        self.target.params, self.dparams, self.state, z, jnp.zeros((c,), jnp.int32), z, z,
        jnp.bool_(True), self.eog, z, z, sampling.params(), jnp.asarray(tokens_before([], 0)),
        self._tables(grammar), z, plan=self.plan.prefill,
        sampled=not sampling.greedy).compile()
    _host_view.lower(self.state, dec=self.dec).compile()
    self._compiled.add(key)
    return time.perf_counter() - t0

  def compile_loop(self, sampled: Optional[bool] = None, grammar: Optional[bool] = None) -> float:
    """Compile the decode loop `run` will call (ahead of time, as `compile_prefill`), in the
    sampling and grammar variant (default: the ones `run` picks now). Returns the seconds it
    took."""
    sampled = bool(self.sampled_rows) if sampled is None else sampled
    grammar = self.grammars.active if grammar is None else grammar
    key = ("loop", sampled, grammar)
    if key in self._compiled:
      return 0.0
    t0 = time.perf_counter()
    decode_lib.decode_loop.lower(
        self.target.params, self.dparams, self.state, jnp.int32(0), self.eog,
        self._tables(grammar), self.table, plan=self.plan, sampled=sampled,
        proposer=self.proposer).compile()
    _row_view.lower(self.state, jnp.int32(0)).compile()
    self._compiled.add(key)
    return time.perf_counter() - t0

  def run(self, max_steps: int):
    """Decode rounds while any row is active, at most max_steps. Uses the sampling variant of
    the loop when any slot was prefilled with sampling (greedy rows stay greedy in it), and the
    grammar variant when any slot is constrained. With `Runtime.rounds` R > 0 each device call
    runs R rounds, and the host reads whether a row is still active between calls."""
    rounds = self.plan.rt.rounds
    left = max_steps
    while left > 0:
      self.state = decode_lib.decode_loop(
          self.target.params, self.dparams, self.state, jnp.int32(min(left, rounds or left)),
          self.eog, self._tables(self.grammars.active), self.table, plan=self.plan,
          sampled=bool(self.sampled_rows), proposer=self.proposer)
      left -= rounds or left
      if left > 0 and not bool(_any_active(self.state, dec=self.dec)):
        break

  def _host(self):
    """(n_out, active, out, finite) as host arrays, read once per state (cached until the state
    changes: a prefill, release or run)."""
    if self._view is None:
      self._view = tuple(np.asarray(x) for x in
                         jax.device_get(_host_view(self.state, dec=self.dec)))
    return self._view

  def progress(self) -> tuple[np.ndarray, np.ndarray]:
    """(n_out [B] int32, idle [B] bool: done, out of budget or context, or free), one read."""
    n_out, act = self._host()[:2]
    return n_out, ~act

  def finite(self, slot: int) -> bool:
    """Whether the logits at the end of `slot`'s prefill were all finite."""
    return bool(self._host()[3][slot])

  def new_tokens(self, slot: int, start: int, stop: int) -> list[int]:
    """Generated tokens start..stop-1 of `slot` (from the same read as `progress`)."""
    return [int(x) for x in self._host()[2][slot, start:stop]]

  def row(self, slot: int) -> Row:
    """Read row `slot` back (one transfer)."""
    out, acc, n_out, n_steps, pos = jax.device_get(_row_view(self.state, jnp.int32(slot)))
    return Row(tokens=[int(x) for x in out[:int(n_out)]],
               accept_lens=[int(x) for x in acc[:int(n_steps)]], n_steps=int(n_steps),
               pos=int(pos))

  # Prompt (prefix) cache: see prompt_cache.py.

  @property
  def recurrent(self) -> bool:
    """The target has recurrent (Gated DeltaNet) layers: its state is checkpointed, not rows."""
    return bool(self.plan.tcfg.gdn_layers)

  def reuse(self, slot: int, ids: np.ndarray, cache: "pc.PromptCache") -> int:
    """Restore into `slot` the cached sequence sharing the longest usable prefix with `ids` [P]
    (its K/V, draft-context rows and, for a hybrid target, the recurrent state at a checkpoint);
    returns that prefix length n (0: nothing cached): prefill `ids` with start=n next."""
    hit = cache.lookup(ids, pc.layout(self.state))
    if hit is None:
      return 0
    st = hit.state if hit.state is not None else (
        jnp.zeros(self.state.target.ssm.shape[1:], self.state.target.ssm.dtype),
        jnp.zeros(self.state.target.conv.shape[1:], self.state.target.conv.dtype))
    self.state = pc.restore_rows(self.state, jnp.int32(slot), jnp.int32(hit.n), hit.entry.kv,
                                 *st)
    self._restored[slot] = hit.n
    return hit.n

  def save(self, slot: int, ids: np.ndarray, cache: "pc.PromptCache",
           checkpoints: Optional[dict] = None):
    """Put `slot`'s sequence (prompt `ids` and the tokens committed after it, or the prompt
    rows prefilled so far) into `cache`: copies of its cache rows and, for a hybrid target, its
    recurrent state now plus `checkpoints` (from `prefill_chunks`)."""
    out, _, _, _, n = jax.device_get(_row_view(self.state, jnp.int32(slot)))
    n = int(n)
    if n <= 0:
      return
    seq = (np.concatenate([ids, np.asarray(out[:n - ids.size], np.int32)]) if n >= ids.size
           else np.asarray(ids[:n], np.int32))
    kv = pc.extract_rows(self.state, jnp.int32(slot),
                         rows=pc.padded_rows(n, self.state.target.k.shape[3]))
    states = {p: st for p, st in (checkpoints or {}).items() if p <= n}
    if self.recurrent:
      states[n] = _recurrent_state(self.state, jnp.int32(slot))
    cache.insert(pc.Entry(tokens=seq, kv=kv, states=states, layout=pc.layout(self.state)))
