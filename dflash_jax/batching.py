"""Host side of batched decoding: `SlotBatch` holds a batched `DecodeState` of B slots, prefills
sequences into free slots, runs the compiled loop, and reads rows back. `api.generate`,
`api.generate_batch` and the server's continuous batching all drive it.

B comes from a small set of buckets (`BATCH_BUCKETS`) so that a handful of compiled programs
serve every batch size; a sequence joins a free slot between loop calls without recompiling.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import decode as decode_lib
from dflash_jax.sampling import SamplingConfig

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
  """The smallest batch bucket >= n (n <= 64); ValueError above the largest bucket."""
  for b in BATCH_BUCKETS:
    if n <= b:
      return b
  raise ValueError(f"batch size {n} exceeds the largest bucket {BATCH_BUCKETS[-1]}")


@dataclasses.dataclass
class Row:
  """One finished or running row read back from the device.

  tokens: generated ids; accept_lens: tokens committed per step; n_steps: decode steps;
  done: the row stopped (EOG, length budget or context); finite: the prefill logits were finite.
  """

  tokens: list[int]
  accept_lens: list[int]
  n_steps: int
  done: bool
  finite: bool
  pos: int


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
      self.dparams = draft.params if (draft is not None and dec.speculative) else None
      dcfg = draft.config if self.dparams is not None else None
    else:
      self.proposer, self.dparams, dcfg = proposer, proposer_params, None
    self.plan = decode_lib.Plan(target.config, dcfg, dec, target.runtime)
    self.batch = batch
    self.eog = eog
    self.state = decode_lib.init_state(self.plan, batch)
    self.sampled_rows: set[int] = set()

  @property
  def dec(self):
    return self.plan.dec

  def prefill_chunks(self, slot: int, ids: np.ndarray, max_new: int,
                     sampling: SamplingConfig) -> Iterator[None]:
    """Prefill `ids` [P] int32 into `slot`, one chunk per iteration (the server interleaves
    them with decode calls); the row is active after the last one."""
    c = self.dec.prefill_chunk
    samp = (sampling.params() if not sampling.greedy else decode_lib._greedy_params())
    if sampling.greedy:
      self.sampled_rows.discard(slot)
    else:
      self.sampled_rows.add(slot)
    for s0 in range(0, ids.size, c):
      chunk = ids[s0:s0 + c]
      n = chunk.size
      self.state = decode_lib.prefill_chunk(
          self.target.params, self.dparams, self.state, jnp.int32(slot),
          jnp.asarray(np.pad(chunk, (0, c - n))), jnp.int32(s0), jnp.int32(n), self.eog,
          jnp.int32(sampling.seed), jnp.int32(max_new), samp, plan=self.plan,
          sampled=not sampling.greedy)
      yield

  def prefill(self, slot: int, ids: np.ndarray, max_new: int, sampling: SamplingConfig):
    """Prefill the whole prompt into `slot` (see prefill_chunks)."""
    for _ in self.prefill_chunks(slot, ids, max_new, sampling):
      pass

  def release(self, slot: int):
    """Mark `slot` free (done); its next decode rounds leave it untouched."""
    self.sampled_rows.discard(slot)
    self.state = _set_done(self.state, jnp.int32(slot))

  def run(self, max_steps: int, active: Optional[set[int]] = None):
    """Decode rounds while any row is active, at most max_steps. Uses the sampling variant when
    any active row (default: any row prefilled with sampling) samples."""
    rows = self.sampled_rows if active is None else (self.sampled_rows & active)
    self.state = decode_lib.decode_loop(
        self.target.params, self.dparams, self.state, jnp.int32(max_steps), self.eog,
        plan=self.plan, sampled=bool(rows), proposer=self.proposer)

  def progress(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n_out [B], done-or-inactive [B] bool, pos [B]) read from the device."""
    s = self.state
    n_out, pos, act = jax.device_get((s.n_out, s.pos, decode_lib.active_rows(s, self.dec)))
    return np.asarray(n_out), ~np.asarray(act), np.asarray(pos)

  def new_tokens(self, slot: int, start: int, stop: int) -> list[int]:
    return [int(x) for x in np.asarray(self.state.out[slot, start:stop])]

  def row(self, slot: int) -> Row:
    """Read row `slot` back."""
    s = self.state
    n_out, n_steps, done, finite, pos = (int(s.n_out[slot]), int(s.n_steps[slot]),
                                         bool(s.done[slot]), bool(s.finite[slot]), int(s.pos[slot]))
    return Row(tokens=[int(x) for x in np.asarray(s.out[slot, :n_out])],
               accept_lens=[int(x) for x in np.asarray(s.accept_lens[slot, :n_steps])],
               n_steps=n_steps, done=done, finite=finite, pos=pos)


@jax.jit
def _set_done_impl(done, slot):
  return done.at[slot].set(True)


def _set_done(state, slot):
  return dataclasses.replace(state, done=_set_done_impl(state.done, slot))


def now() -> float:
  return time.perf_counter()
