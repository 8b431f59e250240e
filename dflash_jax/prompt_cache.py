"""Prompt (prefix) cache across requests: a request whose prompt starts with a sequence decoded
before reuses that sequence's cache rows instead of prefilling them again (a chat's next turn
repeats the previous turn's prompt and answer; a shared system prompt; a regenerated answer).

An `Entry` holds, for one finished (or cancelled) sequence of n tokens, copies of its slot's
target K/V rows and draft context rows 0..n-1 (row-padded to a size bucket, `padded_rows`) and,
for targets with recurrent layers (Gated DeltaNet), the SSM and conv state at a few *checkpoint*
lengths: the end of every prefill chunk (the last one is the end of the prompt) and the end of the
sequence. K/V rows are valid for any prefix of
the entry's tokens; a recurrent state only at the length it was taken (llama.cpp keeps such
checkpoints for recurrent models too), so a hybrid target reuses the longest checkpoint inside
the shared prefix and prefills from there. The cache is bounded in bytes (`max_bytes`, the
device arrays it holds) and evicts least recently used entries.

A draft whose context is a ring buffer (DecodeConfig.draft_window, for long contexts) keeps its
whole ring in the entry; restored for a shorter prefix than the entry's, rows the window would
read can hold later positions of the entry, so the draft proposes from a stale context until it
is overwritten: acceptance may drop for that request, output does not change.

Lossless: the restored rows and state are exactly those a cold prefill of the same tokens
writes (the prefill is chunk-invariant), so output equals a cold run token for token
(tests/test_prompt_cache.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def padded_rows(n: int, capacity: int) -> int:
  """Rows an entry of n tokens stores: the smallest of 64 * 2^k and 96 * 2^k >= n (less than
  1.5 n, and few sizes: one extract / restore program per size), capped at the cache
  capacity."""
  size = 64
  while size < n:
    size = size * 3 // 2 if (size & (size - 1)) == 0 else size * 4 // 3
  return min(size, capacity)


@functools.partial(jax.jit, static_argnames=("rows",))
def extract_rows(state, slot: jax.Array, *, rows: int):
  """Copies of slot `slot`'s cache rows 0..rows-1, from a batched decode.DecodeState (read
  only; its recurrent state is copied by batching's `_recurrent_state`). Returns (target k,
  target v, draft k, draft v), each [n_layer, Hkv, rows, Dh] (draft None without a draft)."""
  def cut(c):      # a draft ring buffer (DraftCache.window) may hold fewer rows: all of them
    return c.cut((slot,) + (jnp.int32(0),) * (c.ndim - 1),
                 (1,) + c.shape[1:3] + (min(rows, c.shape[3]),)).map(lambda p: p[0])
  d = state.draft
  return (cut(state.target.k), cut(state.target.v),
          None if d is None else cut(d.k), None if d is None else cut(d.v))


@functools.partial(jax.jit, donate_argnames=("state",))
def restore_rows(state, slot: jax.Array, n: jax.Array, kv, ssm: jax.Array, conv: jax.Array,
                 mtp_h: Optional[jax.Array] = None):
  """Write an entry's rows (see `extract_rows`) into slot `slot` of the donated batched state
  at rows 0.., and its recurrent state (with an MTP draft also its pending hidden state mtp_h
  [D], DecodeState.mtp_h; None: zeros); the other slots and the slot's later rows are untouched
  (in place: dynamic-update-slices). The slot's position becomes n (the restored prefix): the
  decode loop writes a free slot's rows at its position (discarded work), which must land past
  the restored rows while the slot waits for its prefill."""
  z = jnp.int32(0)

  def put(c, r):
    return c.put(r.map(lambda p: p[None]), (slot,) + (z,) * (c.ndim - 1))
  t, d = state.target, state.draft
  t = dataclasses.replace(
      t, k=put(t.k, kv[0]), v=put(t.v, kv[1]),
      ssm=jax.lax.dynamic_update_index_in_dim(t.ssm, ssm.astype(t.ssm.dtype), slot, 0),
      conv=jax.lax.dynamic_update_index_in_dim(t.conv, conv.astype(t.conv.dtype), slot, 0))
  if d is not None:
    d = dataclasses.replace(d, k=put(d.k, kv[2]), v=put(d.v, kv[3]))
  if state.mtp_h is not None:
    h = jnp.zeros(state.mtp_h.shape[1:], state.mtp_h.dtype) if mtp_h is None else mtp_h
    state = dataclasses.replace(
        state, mtp_h=jax.lax.dynamic_update_index_in_dim(state.mtp_h, h, slot, 0))
  return dataclasses.replace(state, target=t, draft=d,
                             pos=jax.lax.dynamic_update_index_in_dim(state.pos, n, slot, 0),
                             done=jax.lax.dynamic_update_index_in_dim(
                                 state.done, jnp.bool_(True), slot, 0))


def layout(state) -> tuple:
  """What an entry's rows must match to be restored into `state`'s slots: (shape without the
  slot and row axes, dtype) of every cache array, the capacity S (rows), and the draft ring's
  window and position convention (its stored keys are rotated or not)."""
  bufs = [state.target.k, state.target.v]
  ring = None
  if state.draft is not None:
    bufs += [state.draft.k, state.draft.v]
    ring = (state.draft.window, state.draft.relative)
  return (tuple((b.fmt,) + tuple((p.shape[1:3] + p.shape[4:], str(p.dtype)) for p in b.planes)
                for b in bufs),
          state.target.k.shape[3], tuple(state.target.ssm.shape[1:]), ring)


@dataclasses.dataclass
class Entry:
  """One cached sequence.

  Attributes:
    tokens: [n] int32 the sequence whose rows 0..n-1 the entry holds.
    kv: device kv_cache.KVBuffers (target k, v, draft k, v or None), each [n_layer, Hkv, R,
      Dh], R >= n, in the state's formats.
    states: {length p: (ssm, conv) or (ssm, conv, mtp_h)} recurrent state after the first p
      tokens, with the MTP draft's pending hidden state when one runs (hybrid targets; empty
      otherwise).
    layout: `layout` of the state it came from.
  """

  tokens: np.ndarray
  kv: tuple
  states: dict
  layout: tuple

  @property
  def nbytes(self) -> int:
    arrs = [a for a in self.kv if a is not None]
    arrs += [a for st in self.states.values() for a in st]
    return int(sum(a.nbytes for a in arrs))


@dataclasses.dataclass(frozen=True)
class Hit:
  """A lookup's answer: restore `entry`'s rows and `state` (None: zeros, no recurrent layers),
  then prefill the prompt from position n."""

  entry: Entry
  n: int
  state: Optional[tuple]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two 1-D int arrays."""
  m = min(a.size, b.size)
  diff = np.flatnonzero(a[:m] != b[:m])
  return int(diff[0]) if diff.size else m


class PromptCache:
  """LRU cache of `Entry`s bounded by `max_bytes` (device bytes held). Thread-safe.

  Args:
    max_bytes: bound on the bytes held (> 0). recurrent: the target has recurrent layers (then
      an entry is usable only up to one of its checkpoint lengths).
  Raises ValueError for max_bytes <= 0.
  """

  def __init__(self, max_bytes: int, *, recurrent: bool):
    if max_bytes <= 0:
      raise ValueError(f"prompt cache max_bytes={max_bytes} must be > 0 (0 disables: pass no cache)")
    self.max_bytes, self.recurrent = int(max_bytes), recurrent
    self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
    self._next = 0
    self._lock = threading.Lock()
    self.stats = {"hits": 0, "misses": 0, "tokens_reused": 0, "evictions": 0, "inserts": 0}

  @property
  def bytes(self) -> int:
    """Bytes held now."""
    with self._lock:
      return sum(e.nbytes for e in self._entries.values())

  @classmethod
  def for_target(cls, target, max_bytes: int) -> "PromptCache":
    """A cache for `target` (an api.Target): recurrent when it has Gated DeltaNet layers."""
    return cls(max_bytes, recurrent=bool(target.config.gdn_layers))

  def __len__(self) -> int:
    return len(self._entries)

  def _usable(self, e: Entry, m: int) -> tuple[int, Optional[tuple]]:
    """(prefix length usable from e given m shared tokens, recurrent state there)."""
    if not self.recurrent:
      return m, None
    p = max((p for p in e.states if p <= m), default=0)
    return p, (e.states[p] if p else None)

  def lookup(self, ids: np.ndarray, layout: tuple) -> Optional[Hit]:
    """The entry sharing the longest usable prefix with `ids` [P] (at most P - 1 tokens: the
    prompt's last token always runs, for its logits), among entries of this `layout`; None when
    no entry gives one token. A hit becomes the most recently used."""
    best: Optional[Hit] = None
    with self._lock:
      for key, e in reversed(self._entries.items()):       # most recent first wins ties
        if e.layout != layout:
          continue
        n, st = self._usable(e, min(common_prefix(e.tokens, ids), ids.size - 1))
        if n > 0 and (best is None or n > best.n):
          best, best_key = Hit(e, n, st), key
      if best is None:
        self.stats["misses"] += 1
        return None
      self._entries.move_to_end(best_key)
      self.stats["hits"] += 1
      self.stats["tokens_reused"] += best.n
    return best

  def insert(self, entry: Entry):
    """Add `entry` (most recently used), merging entries whose tokens are a prefix of its own
    (their checkpoints move into it; their rows are redundant), then evict least recently used
    entries until the bound holds. An entry larger than the bound is not kept."""
    if entry.tokens.size == 0 or entry.nbytes > self.max_bytes:
      return
    with self._lock:
      for key in list(self._entries):
        e = self._entries[key]
        if e.layout == entry.layout and e.tokens.size <= entry.tokens.size and \
            common_prefix(e.tokens, entry.tokens) == e.tokens.size:
          for p, st in e.states.items():
            entry.states.setdefault(p, st)
          del self._entries[key]
      self._entries[self._next] = entry
      self._next += 1
      self.stats["inserts"] += 1
      total = sum(e.nbytes for e in self._entries.values())
      while total > self.max_bytes:
        _, old = self._entries.popitem(last=False)
        total -= old.nbytes
        self.stats["evictions"] += 1

  def clear(self):
    with self._lock:
      self._entries.clear()
