"""Constrained decoding: a regular language over the tokenizer's vocabulary (a JSON schema, a
tool call) as a token-level automaton the compiled decode loop applies as a logit mask.

The automaton comes from `outlines-core` (the Rust core of Outlines: regex -> byte DFA ->
token-level index over the vocabulary; JSON Schema -> regex with `build_regex_from_schema`).
Chosen over xgrammar because it is one small wheel with no torch / CUDA dependency (xgrammar
0.2.8's wheel requires torch, transformers and triton), builds the
index of a typical response schema over SmolLM2's 49,152 tokens in 0.06-0.3 s (a generic JSON
object, nesting depth 3: ~10 s, cached), and its output is a plain transition table that can
live on the device; xgrammar's pushdown automaton needs its host-side matcher per token, which
a fused verify of a whole tree cannot call.

Device form (`GrammarTables`, no per-token host work): tokens that behave the same in every
state (same next state, or refused, everywhere) share a class, so the transition table is
[states, classes] (e.g. 78 states x 93 classes for a 3-field schema, 1,623 x 138 for any JSON
object) plus a [V] token -> class map. The loop carries each row's state; a tree node's state
is its parent's advanced by the node's token, so every verified node is masked under its own
path's state (speculative output = constrained autoregressive output, token for token), and
the draft's chain is drafted left to right under the same automaton (acceptance stays high).

End of generation: the row's end-of-generation tokens are allowed exactly in accepting states
(where the automaton stays); control tokens are never allowed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

NO_GRAMMAR = -1          # a row's state when it is unconstrained
DEAD = -2                # a tree node whose path the grammar refuses (never accepted)


@dataclasses.dataclass(frozen=True)
class Grammar:
  """A token-level automaton (host side).

  Attributes:
    regex: the regular expression it accepts (over the decoded text's bytes).
    token_class: [V] int32 class of each token id.
    next_state: [S, C] int32 next state per (state, class); -1 = the class is not allowed.
    final: [S] bool accepting states (end-of-generation allowed).
    initial: the start state.
  """

  regex: str
  token_class: np.ndarray
  next_state: np.ndarray
  final: np.ndarray
  initial: int

  @property
  def n_states(self) -> int:
    return int(self.next_state.shape[0])

  @property
  def n_classes(self) -> int:
    return int(self.next_state.shape[1])

  def allowed(self, state: int) -> np.ndarray:
    """[V] bool tokens allowed in `state` (reference for tests and host checks)."""
    return self.next_state[state][self.token_class] >= 0

  def advance(self, state: int, token: int) -> int:
    """The state after `token` (-1: not allowed)."""
    return int(self.next_state[state, self.token_class[token]])

  def accepts(self, tokens: Sequence[int], state: Optional[int] = None) -> bool:
    """Whether `tokens` (end-of-generation tokens included or not) is a complete match."""
    s = self.initial if state is None else state
    for t in tokens:
      s = self.advance(s, t)
      if s < 0:
        return False
    return bool(self.final[s])


def _pattern_body(pattern: str, where: str) -> str:
  """A JSON-Schema `pattern` as the whole-string regex constrained decoding uses: a leading `^`
  and a trailing unescaped `$` dropped (each optional: a pattern always matches the whole string,
  as in outlines-core and llama.cpp's grammar converter). Raises ValueError naming `where` for
  what a finite automaton cannot express: look-around, back-references, word boundaries, and
  anchors anywhere but at the ends."""
  body = pattern[1:] if pattern.startswith("^") else pattern
  if body.endswith("$"):
    slashes = len(body) - 1 - len(body[:-1].rstrip("\\"))    # backslashes before the "$"
    if slashes % 2 == 0:
      body = body[:-1]
  i, in_class = 0, False
  while i < len(body):
    c = body[i]
    if c == "\\":
      nxt = body[i + 1:i + 2]
      if not in_class and (nxt.isdigit() and nxt != "0" or nxt in ("k", "b", "B")):
        what = "a word boundary" if nxt in ("b", "B") else "a back-reference"
        raise ValueError(f"{where}: the pattern {pattern!r} uses {what} (\\{nxt}), which a "
                         "finite automaton cannot express")
      i += 2
      continue
    if in_class:
      in_class = c != "]"
    elif c == "[":
      in_class = True
      if body[i + 1:i + 2] == "^":
        i += 1
      if body[i + 1:i + 2] == "]":
        i += 1
    elif body[i:i + 3] in ("(?=", "(?!") or body[i:i + 4] in ("(?<=", "(?<!"):
      raise ValueError(f"{where}: the pattern {pattern!r} uses a look-around assertion, which a "
                       "finite automaton cannot express")
    elif c in "^$":
      raise ValueError(f"{where}: the pattern {pattern!r} has the anchor {c!r} inside it; only a "
                       "leading '^' and a trailing '$' are supported (a pattern matches the whole "
                       "string)")
    i += 1
  return body


def _with_pattern_bodies(node: Any, where: str) -> Any:
  """The schema with every string-valued `pattern` replaced by its `_pattern_body`."""
  if isinstance(node, dict):
    return {k: (_pattern_body(v, f"{where}.{k}") if k == "pattern" and isinstance(v, str)
                else _with_pattern_bodies(v, f"{where}.{k}")) for k, v in node.items()}
  if isinstance(node, list):
    return [_with_pattern_bodies(v, f"{where}[{i}]") for i, v in enumerate(node)]
  return node


def json_schema_regex(schema: Any, *, param: str = "response_format") -> str:
  """The regex of a JSON Schema (dict or JSON text) by outlines-core, whitespace limited to
  at most one space between tokens (so a model cannot loop on blanks). A string `pattern`
  matches the whole string, its `^` / `$` anchors optional (`_pattern_body`). Raises ValueError
  naming `param` (and the pattern's place) for a schema it cannot compile."""
  from outlines_core.json_schema import build_regex_from_schema
  try:
    node = json.loads(schema) if isinstance(schema, str) else schema
  except json.JSONDecodeError as e:
    raise ValueError(f"{param}: the JSON schema is not valid JSON: {e}") from None
  node = _with_pattern_bodies(node, param)
  try:
    return build_regex_from_schema(json.dumps(node), whitespace_pattern=r"[ ]?")
  except Exception as e:  # outlines-core raises its own error types
    raise ValueError(f"{param}: cannot compile this JSON schema: {e}") from None


# Any JSON object (OpenAI's response_format json_object), nesting up to 3 levels.
JSON_OBJECT_SCHEMA = {"type": "object"}


class GrammarCompiler:
  """Compiles regexes over one tokenizer's vocabulary, caching the last `cache_size`.

  Args:
    tokenizer: tokenizer.GGUFTokenizer (token_bytes, control_ids, n_vocab).
    eog_ids: end-of-generation ids (allowed in accepting states).
    n_vocab: the target's vocabulary size (logits width; >= the tokenizer's).
  """

  def __init__(self, tokenizer, eog_ids: Sequence[int], n_vocab: Optional[int] = None,
               cache_size: int = 16):
    from outlines_core import Vocabulary
    self.n_vocab = int(n_vocab or tokenizer.n_vocab)
    self.eog_ids = tuple(sorted({int(i) for i in eog_ids}))
    if not self.eog_ids:
      raise ValueError("constrained decoding needs at least one end-of-generation token")
    banned = set(tokenizer.control_ids) | set(self.eog_ids)
    table: dict[bytes, list[int]] = {}
    for i in range(tokenizer.n_vocab):
      if i not in banned:
        b = tokenizer.token_bytes(i)
        if b:
          table.setdefault(b, []).append(i)
    self._vocab = Vocabulary(self.eog_ids[0], table)
    self._cache: collections.OrderedDict[str, Grammar] = collections.OrderedDict()
    self._size = cache_size
    self._lock = threading.Lock()

  def compile(self, regex: str, *, param: str = "response_format") -> Grammar:
    """The Grammar of `regex` (cached). Raises ValueError naming `param` when outlines-core
    rejects the regex or no token sequence can match it."""
    with self._lock:
      if regex in self._cache:
        self._cache.move_to_end(regex)
        return self._cache[regex]
    g = self._build(regex, param)
    with self._lock:
      self._cache[regex] = g
      while len(self._cache) > self._size:
        self._cache.popitem(last=False)
    return g

  def _build(self, regex: str, param: str) -> Grammar:
    from outlines_core import Index
    try:
      index = Index(regex, self._vocab)
    except Exception as e:  # outlines-core raises its own error types
      raise ValueError(f"{param}: cannot build a token automaton for this format: {e}") from None
    trans = index.get_transitions()
    finals = set(index.get_final_states())
    states = sorted(set(trans) | finals)
    sid = {s: k for k, s in enumerate(states)}
    eos = self.eog_ids[0]
    V, S = self.n_vocab, len(states)
    # Token classes: a 64-bit rolling hash of each token's column of the transition table,
    # verified exactly below (a collision would fail the check, not go unnoticed).
    h = np.zeros(V, np.uint64)
    edges = []
    mul = np.uint64(0x9E3779B97F4A7C15)
    for s in states:
      d = {t: n for t, n in trans.get(s, {}).items() if t != eos}
      toks = np.fromiter(d.keys(), np.int64, len(d))
      nxt = np.fromiter((sid[n] for n in d.values()), np.int64, len(d))
      edges.append((toks, nxt))
      h *= mul
      h[toks] += (nxt + 1).astype(np.uint64)
    eog = np.asarray(self.eog_ids, np.int64)
    eog = eog[eog < V]
    h[eog] = np.uint64(2**64 - 1)                         # their own class
    _, rep, cls = np.unique(h, return_index=True, return_inverse=True)
    cls = cls.astype(np.int32).reshape(V)
    C = rep.size
    nxt_tab = np.full((S, C), -1, np.int32)
    final = np.zeros(S, bool)
    sizes = np.bincount(cls, minlength=C)
    for k, s in enumerate(states):
      toks, nxt = edges[k]
      nxt_tab[k, cls[toks]] = nxt
      final[k] = s in finals
      allowed = np.zeros(C, np.int64)
      np.add.at(allowed, cls[toks], 1)
      hit = nxt_tab[k] >= 0
      if not np.array_equal(np.where(hit, sizes, 0), allowed) or \
          not np.array_equal(nxt_tab[k, cls[toks]], nxt):
        raise AssertionError("grammar token classes collided (please report)")
    ec = cls[eog[0]] if eog.size else None
    if ec is not None:
      nxt_tab[:, ec] = np.where(final, np.arange(S, dtype=np.int32), -1)
    if not final.any():
      raise ValueError(f"{param}: no token sequence can match this format")
    return Grammar(regex=regex, token_class=cls, next_state=nxt_tab, final=final,
                   initial=sid[index.get_initial_state()])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GrammarTables:
  """The batch's automata on the device (a bank: rows' grammars side by side).

  Attributes:
    token_class: [G, V] int32 token -> class of each placed grammar.
    next_state: [S, C] int32 (bank state, class) -> bank state; -1 = not allowed.
    owner: [S] int32 the grammar (row of token_class) each bank state belongs to.
  """

  token_class: jax.Array
  next_state: jax.Array
  owner: jax.Array


def allowed(t: GrammarTables, states: jax.Array) -> jax.Array:
  """[N, V] bool tokens allowed at each of `states` [N] int32; a negative state (no grammar,
  or a node whose path left the grammar: it can never be accepted) allows every token."""
  st = jnp.maximum(states, 0)
  row = t.next_state[st]                                 # [N, C]
  cls = t.token_class[t.owner[st]]                       # [N, V]
  ok = jnp.take_along_axis(row, cls, axis=1) >= 0
  return ok | (states < 0)[:, None]


def mask_logits(logits: jax.Array, t: GrammarTables, states: jax.Array) -> jax.Array:
  """[N, V] float32 logits with the tokens `states` [N] refuse set to -inf."""
  return jnp.where(allowed(t, states), logits.astype(jnp.float32), -jnp.inf)


def advance(t: GrammarTables, states: jax.Array, tokens: jax.Array) -> jax.Array:
  """The bank states after `tokens` (same shape as `states`); negative states stay negative
  (-1: no grammar), a refused token gives -1."""
  st = jnp.maximum(states, 0)
  nxt = t.next_state[st, t.token_class[t.owner[st], tokens]]
  return jnp.where(states < 0, states, nxt)


def node_states(t: GrammarTables, root: jax.Array, parents: jax.Array, depths: jax.Array,
                tokens: jax.Array, max_depth: int) -> jax.Array:
  """[N] int32 the state after each tree node's path (node 0, the root / bonus token: `root`,
  the row's state). Nodes come in any order; depth level d is resolved from level d-1, so
  max_depth static rounds. A node whose token its parent's state refuses gets DEAD (-2) and so
  do its descendants: they can never be accepted, since the verify masks the parent."""
  st = jnp.full(tokens.shape, root, jnp.int32)
  for d in range(1, max_depth + 1):
    par = st[jnp.maximum(parents, 0)]
    nxt = jnp.where(par < 0, DEAD, advance(t, jnp.maximum(par, 0), tokens))
    nxt = jnp.where(nxt < 0, DEAD, nxt)
    st = jnp.where(depths == d, nxt, st)
  return jnp.where(root < 0, root, st)



class GrammarBank:
  """Host-side placement of the grammars of a batch's rows into one GrammarTables of fixed
  capacity (so changing grammars never recompiles): each distinct grammar gets a range of bank
  states and a token-class row while some slot uses it.

  Args:
    n_vocab: logits width. max_states, max_classes, max_grammars: the bank's static capacity.
  """

  def __init__(self, n_vocab: int, max_states: int = 4096, max_classes: int = 512,
               max_grammars: int = 8):
    self.n_vocab, self.max_states = n_vocab, max_states
    self.max_classes, self.max_grammars = max_classes, max_grammars
    self._placed: dict[int, tuple[Grammar, int, int]] = {}   # id(grammar) -> (g, gid, offset)
    self._users: dict[int, set[int]] = {}                   # id(grammar) -> slots
    self._slot: dict[int, int] = {}                         # slot -> id(grammar)
    self._device: Optional[GrammarTables] = None

  def check(self, g: Grammar, *, param: str = "response_format"):
    """ValueError naming `param` when `g` can never fit this bank."""
    if g.n_states > self.max_states or g.n_classes > self.max_classes:
      raise ValueError(f"{param}: the format compiles to {g.n_states} states x {g.n_classes} "
                       f"token classes, more than this decoder's grammar capacity "
                       f"({self.max_states} x {self.max_classes}); simplify the schema")

  def place(self, slot: int, g: Grammar) -> Optional[int]:
    """Give `slot` grammar `g`; returns its initial bank state, or None when the bank is full
    now (other rows' grammars take the room: retry after they finish)."""
    self.check(g)
    key = id(g)
    if self._slot.get(slot) == key:            # already placed for this slot (a reservation)
      return self._placed[key][2] + g.initial
    self.release(slot)
    if key not in self._placed:
      spans = sorted((off, off + gg.n_states) for gg, _, off in self._placed.values())
      gids = {p[1] for p in self._placed.values()}
      free_gid = next((i for i in range(self.max_grammars) if i not in gids), None)
      off, at = None, 0
      for lo, hi in spans + [(self.max_states, self.max_states)]:
        if lo - at >= g.n_states:
          off = at
          break
        at = max(at, hi)
      if off is None or free_gid is None:
        return None
      self._placed[key] = (g, free_gid, off)
      self._device = None
    self._users.setdefault(key, set()).add(slot)
    self._slot[slot] = key
    return self._placed[key][2] + g.initial

  def release(self, slot: int):
    """`slot` no longer uses a grammar (its grammar leaves the bank when no slot uses it)."""
    key = self._slot.pop(slot, None)
    if key is None:
      return
    users = self._users[key]
    users.discard(slot)
    if not users:
      del self._users[key], self._placed[key]

  def moved(self, slots: Sequence[int]) -> "GrammarBank":
    """A bank for a resized batch whose row i is this batch's row slots[i]."""
    new = GrammarBank(self.n_vocab, self.max_states, self.max_classes, self.max_grammars)
    new._placed = dict(self._placed)
    for i, s in enumerate(slots):
      if s in self._slot:
        key = self._slot[s]
        new._slot[i] = key
        new._users.setdefault(key, set()).add(i)
    new._placed = {k: v for k, v in new._placed.items() if k in new._users}
    return new

  @property
  def active(self) -> bool:
    """Whether any slot has a grammar."""
    return bool(self._slot)

  def tables(self) -> GrammarTables:
    """The device tables (rebuilt only after a grammar was placed)."""
    if self._device is None:
      cls = np.zeros((self.max_grammars, self.n_vocab), np.int32)
      nxt = np.full((self.max_states, self.max_classes), -1, np.int32)
      owner = np.zeros(self.max_states, np.int32)
      for g, gid, off in self._placed.values():
        cls[gid, :g.token_class.size] = g.token_class
        n = g.next_state
        nxt[off:off + g.n_states, :g.n_classes] = np.where(n >= 0, n + off, -1)
        owner[off:off + g.n_states] = gid
      self._device = GrammarTables(jnp.asarray(cls), jnp.asarray(nxt), jnp.asarray(owner))
    return self._device
