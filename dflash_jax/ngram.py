"""A static n-gram table of the target's own text, as a draft-free proposer: the most frequent
next token after each context of n_min..n_max tokens in a corpus of token sequences (the target's
generated training data, `checkpoints/train_data/<target>/`), looked up inside the compiled decode
loop when the row's own context has no prompt-lookup match.

The idea is llama.cpp's static n-gram cache (`llama-lookup-create` / `--lookup-cache-static`,
after REST, He et al. 2023, "REST: Retrieval-Based Speculative Decoding"): a table of what usually
comes next. Here it is built from the target's own greedy answers, so it proposes what this target
tends to write. Any proposal is verified by the target, so output stays identical to
autoregressive decoding whatever the table holds (hash collisions included: they only cost
acceptance).

Layout: one sorted array of 32-bit context hashes over every order (the order is part of the
hash), with the top next token and its share of the context's occurrences. A lookup is one
`jnp.searchsorted` per order and proposed token.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import compile_cache

FORMAT = 1
MAX_ORDER = 8
_PRIME = 0x01000193            # FNV-1a's 32-bit prime
_SEED = 0x811C9DC5             # FNV-1a's 32-bit offset basis


def context_hash(xp, cols: Sequence, n: int):
  """32-bit FNV-1a-style hash of an n-token context, the order n mixed in first.

  xp: numpy or jax.numpy; cols: n arrays of token ids (any shape, same shape), oldest first.
  Returns uint32 of that shape; the same values under numpy and JAX (uint32 wraps in both)."""
  u = xp.uint32
  h = xp.full(cols[0].shape, _SEED, dtype=u) ^ u(n)
  h = h * u(_PRIME)
  for c in cols:
    h = (h ^ c.astype(u)) * u(_PRIME)
  return h


@functools.partial(jax.tree_util.register_dataclass, data_fields=("keys", "next", "share"),
                   meta_fields=("n_min", "n_max", "vocab"))
@dataclasses.dataclass(frozen=True)
class NgramTable:
  """keys: [K] uint32 sorted context hashes (every order in [n_min, n_max]); next: [K] int32 the
  most frequent next token of that context; share: [K] float32 its share of the context's
  occurrences (0, 1]. vocab: ids are < vocab. A jax pytree (n_min / n_max / vocab static)."""

  keys: np.ndarray
  next: np.ndarray
  share: np.ndarray
  n_min: int
  n_max: int
  vocab: int

  @property
  def size(self) -> int:
    return int(self.keys.shape[0])


def build(seqs: Sequence[tuple[np.ndarray, int]], vocab: int, *, n_min: int = 1, n_max: int = 4,
          min_count: int = 2) -> NgramTable:
  """The table of a corpus.

  seqs: (tokens [T] int, start) pairs: the contexts that predict tokens[start:] are counted (for
    training shards: prompt + response with start = the prompt's length, so the table learns what
    the target writes, with the prompt's end as context). vocab: ids must be < vocab.
  n_min / n_max: context lengths kept (1 <= n_min <= n_max <= MAX_ORDER).
  min_count: a context seen fewer times is left out (fewer, noisier entries).
  Raises ValueError for out-of-range ids or orders."""
  if not 1 <= n_min <= n_max <= MAX_ORDER:
    raise ValueError(f"n-gram orders n_min={n_min}, n_max={n_max}: need 1 <= n_min <= n_max <= "
                     f"{MAX_ORDER}")
  hs, nx = [], []
  for toks, start in seqs:
    t = np.asarray(toks, np.int64)
    if t.size and (t.min() < 0 or t.max() >= vocab):
      raise ValueError(f"token id out of range [0, {vocab}) in the n-gram corpus")
    for n in range(n_min, n_max + 1):
      lo = max(int(start), n)
      if t.size <= lo:
        continue
      idx = np.arange(lo, t.size)
      hs.append(context_hash(np, [t[idx - n + j] for j in range(n)], n))
      nx.append(t[idx])
  if not hs:
    return NgramTable(np.zeros(0, np.uint32), np.zeros(0, np.int32), np.zeros(0, np.float32),
                      n_min, n_max, vocab)
  pair = (np.concatenate(hs).astype(np.uint64) << np.uint64(32)) | np.concatenate(nx).astype(np.uint64)
  up, cnt = np.unique(pair, return_counts=True)               # sorted by (hash, next)
  key = (up >> np.uint64(32)).astype(np.uint32)
  nxt = (up & np.uint64(0xFFFFFFFF)).astype(np.int32)
  first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
  total = np.add.reduceat(cnt, first)
  # the top next token of each context: the first of its largest counts (lowest id on ties)
  seg = np.repeat(np.arange(first.size), np.diff(np.r_[first, key.size]))
  order = np.lexsort((-cnt, seg))
  top = order[first]
  keep = total >= min_count
  return NgramTable(keys=key[first][keep], next=nxt[top][keep],
                    share=(cnt[top] / total).astype(np.float32)[keep], n_min=n_min, n_max=n_max,
                    vocab=vocab)


def _greedy(entry: dict) -> bool:
  return entry.get("temperature", 0.0) == 0


def from_shards(data_dir: str, vocab: int, *, greedy_only: bool = True, **kw) -> NgramTable:
  """`build` over a token-shard directory (`token_shards`, validated as read: a corrupt shard is a
  ValueError naming its file): each sequence's response tokens with its prompt as context.

  greedy_only: count only the shards generated at temperature 0 (the manifest's "temperature";
    an entry without one counts as greedy), when the directory has any: the table proposes what
    greedy decoding writes, and sampled answers lower the shares of its entries (decoded
    acceptance 1.668 -> 1.678 chat, 1.900 -> 1.911 HumanEval without them). A directory of
    sampled shards only is counted whole.
  kw: `build`'s options. Raises ValueError for a directory without shards."""
  from dflash_jax import token_shards as shards
  greedy = greedy_only and any(map(_greedy, shards.read_manifest(data_dir)["shards"]))
  seqs = shards.read_shards(data_dir, vocab, where=_greedy if greedy else None)
  return build([(s.tokens, s.prompt_len) for s in seqs], vocab, **kw)


def save(table: NgramTable, path: str) -> None:
  """Writes the table as a compressed .npz (format tag, arrays, orders, vocab)."""
  np.savez_compressed(path, format=np.int32(FORMAT), keys=table.keys, next=table.next,
                      share=table.share, n_min=np.int32(table.n_min), n_max=np.int32(table.n_max),
                      vocab=np.int64(table.vocab))


def _check(table: NgramTable, path: str, vocab: int) -> NgramTable:
  bad = None
  k = table.keys
  if not (k.ndim == 1 and table.next.shape == k.shape and table.share.shape == k.shape):
    bad = "array shapes differ"
  elif k.size and np.any(k[1:] <= k[:-1]):
    bad = "keys are not strictly increasing"
  elif k.size and (table.next.min() < 0 or table.next.max() >= vocab):
    bad = f"next-token ids outside [0, {vocab})"
  elif k.size and not (np.all(table.share > 0) and np.all(table.share <= 1)):
    bad = "shares outside (0, 1]"
  elif table.vocab != vocab:
    bad = f"built for a vocabulary of {table.vocab}, the target has {vocab}"
  elif not 1 <= table.n_min <= table.n_max <= MAX_ORDER:
    bad = f"orders {table.n_min}..{table.n_max}"
  if bad:
    raise ValueError(f"n-gram table {path}: {bad}")
  return table


def cache_dir() -> str:
  """Where tables built from token-shard directories are kept: $XDG_CACHE_HOME/dflash_jax/ngram
  (~/.cache/dflash_jax/ngram), beside the compile cache."""
  return compile_cache.user_cache_dir("ngram")


def _built_path(data_dir: str, vocab: int) -> str | None:
  """The cache file of the table built from `data_dir` (keyed by its manifest's bytes, which name
  every shard's sha256 and temperature, the table format, the shard selection and vocab), or None
  without a manifest."""
  manifest = os.path.join(data_dir, "manifest.json")
  if not os.path.isfile(manifest):
    return None
  with open(manifest, "rb") as fh:
    key = fh.read() + f"|format {FORMAT}|greedy shards|vocab {vocab}".encode()
  digest = hashlib.sha256(key).hexdigest()
  return os.path.join(cache_dir(), f"{digest[:32]}.npz")


def _from_dir(data_dir: str, vocab: int) -> NgramTable:
  """`from_shards`, kept on disk (`cache_dir()`): building from 5M tokens takes ~5 s on a 2-core
  CPU, reading the built table back ~0.1 s. A cache file that fails to read is rebuilt; one
  that cannot be written is skipped (the table is the same either way)."""
  cached = _built_path(data_dir, vocab)
  if cached and os.path.isfile(cached):
    try:
      return load(cached, vocab)
    except ValueError:
      pass
  table = from_shards(data_dir, vocab)
  if cached:
    try:
      os.makedirs(os.path.dirname(cached), exist_ok=True)
      tmp = f"{cached}.{os.getpid()}.tmp.npz"
      save(table, tmp)
      os.replace(tmp, cached)
    except OSError:
      pass
  return table


def load(path: str, vocab: int) -> NgramTable:
  """A table from `path`: an .npz written by `save`, or a token-shard directory (built by
  `from_shards` with its defaults, and kept built under `cache_dir()` keyed by the directory's
  manifest). Checked against the target's vocabulary; raises FileNotFoundError for a missing path
  and ValueError naming the file for a corrupt or mismatched one."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"n-gram table {path!r} not found (an .npz from "
                            "dflash_jax.ngram.save, or a token-shard directory)")
  if os.path.isdir(path):
    return _check(_from_dir(path, vocab), path, vocab)
  try:
    with np.load(path, allow_pickle=False) as f:
      if int(f["format"]) != FORMAT:
        raise ValueError(f"n-gram table {path}: format {int(f['format'])}, expected {FORMAT}")
      t = NgramTable(keys=f["keys"].astype(np.uint32), next=f["next"].astype(np.int32),
                     share=f["share"].astype(np.float32), n_min=int(f["n_min"]),
                     n_max=int(f["n_max"]), vocab=int(f["vocab"]))
  except ValueError:
    raise
  except Exception as e:   # zip / npy errors of a truncated or foreign file
    raise ValueError(f"n-gram table {path}: unreadable ({type(e).__name__}: {e})") from None
  return _check(t, path, vocab)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime: float, vocab: int) -> NgramTable:
  return load(path, vocab)


def load_cached(path: str, vocab: int) -> NgramTable:
  """`load`, kept in memory per (path, modification time, vocab): every batch of a process that
  names the same table shares one build."""
  if not os.path.exists(path):
    return load(path, vocab)          # raises the clear error
  return _load_cached(os.path.abspath(path), os.path.getmtime(path), vocab)


def next_tokens(table: NgramTable, tokens, positions) -> tuple[np.ndarray, np.ndarray]:
  """Host-side (numpy) table lookups for offline evaluation: for each q of `positions` [N] int,
  the table's (next token, share) predicting tokens[q] from the tokens before it, the longest
  held order first. tokens: [T] int. Returns (tok [N] int64, -1 where no order is held; share
  [N] float32, 0 there)."""
  positions = np.asarray(positions, np.int64)
  tok = np.full(positions.shape, -1, np.int64)
  share = np.zeros(positions.shape, np.float32)
  if table.size == 0:
    return tok, share
  t = np.asarray(tokens, np.int64)
  for n in range(table.n_max, table.n_min - 1, -1):
    ok = (positions >= n) & (tok < 0)
    if not ok.any():
      continue
    q = positions[ok]
    h = context_hash(np, [t[q - n + j] for j in range(n)], n)
    j = np.clip(np.searchsorted(table.keys, h), 0, table.size - 1)
    hit = table.keys[j] == h
    idx = np.flatnonzero(ok)[hit]
    tok[idx] = table.next[j[hit]]
    share[idx] = table.share[j[hit]]
  return tok, share


def _lookup(table: NgramTable, buf: jax.Array, end: int, n_real: jax.Array):
  """The table's top next token after buf[:end] (longest order held first; an order n counts
  only when n <= n_real, the real tokens before `end`): (found [] bool, token [] int32, share []
  float32). buf: [E] int32, end a Python int <= E."""
  keys, nexts, shares = jnp.asarray(table.keys), jnp.asarray(table.next), jnp.asarray(table.share)
  K = keys.shape[0]
  found, tok, share = jnp.bool_(False), jnp.int32(0), jnp.float32(0.0)
  for n in range(table.n_max, table.n_min - 1, -1):   # end >= n_max (see _context)
    cols = [buf[end - n + j] for j in range(n)]
    h = context_hash(jnp, cols, n)
    j = jnp.clip(jnp.searchsorted(keys, h), 0, K - 1)
    hit = (keys[j] == h) & (n_real >= n) & ~found
    tok = jnp.where(hit, nexts[j], tok)
    share = jnp.where(hit, shares[j], share)
    found = found | hit
  return found, tok.astype(jnp.int32), share


def _context(table: NgramTable, history: jax.Array, n_new: int) -> jax.Array:
  """[n_max + n_new] int32: the last n_max tokens of history (zero-padded in front), then room
  for n_new proposed tokens."""
  nmax, H = table.n_max, history.shape[0]
  if H < nmax:
    history = jnp.concatenate([jnp.zeros((nmax - H,), history.dtype), history])
    H = nmax
  return jnp.concatenate([history[H - nmax:], jnp.zeros((n_new,), history.dtype)]).astype(jnp.int32)


def table_path(table: NgramTable, history: jax.Array, n_valid: jax.Array, n_tokens: int,
               min_expected: float) -> tuple[jax.Array, jax.Array]:
  """The table's proposal after `history`: G times, the top next token of the longest context
  (n_max down to n_min tokens, the proposal so far included) the table holds; stops at the first
  context it does not hold. The proposal is kept only when its expected accepted length under the
  table's shares, sum_k prod_{j<=k} share_j, is >= min_expected (else n = 0).

  history: [H] int32, the row's tokens with the bonus token last; only the last n_valid are real.
  Returns (tokens [G] int32, zeros past n; n [] int32). Pure function, vmappable."""
  G, nmax = n_tokens, table.n_max
  if table.size == 0:
    return jnp.zeros((G,), jnp.int32), jnp.int32(0)
  buf = _context(table, history, G)                      # [nmax + G]
  real = jnp.minimum(n_valid, nmax)                      # real tokens before the proposal
  alive, prob, expect = jnp.bool_(True), jnp.float32(1.0), jnp.float32(0.0)
  count = jnp.int32(0)
  for g in range(G):
    end = nmax + g                                       # the context ends before buf[end]
    found, tok, share = _lookup(table, buf, end, real + g)
    alive = alive & found
    prob = jnp.where(alive, prob * share, prob)
    expect = expect + jnp.where(alive, prob, 0.0)
    count = count + alive.astype(jnp.int32)
    buf = buf.at[end].set(jnp.where(alive, tok, 0))
  n = jnp.where(expect >= min_expected, count, 0).astype(jnp.int32)
  tokens = jnp.where(jnp.arange(G) < n, buf[nmax:], 0).astype(jnp.int32)
  return tokens, n


def mix_rows(table: NgramTable, dlogits: jax.Array, history: jax.Array, n_valid: jax.Array,
             weight: float) -> jax.Array:
  """The draft's rows mixed with the table, offset by offset: row k becomes the log of
  q_k = (p_k + w s_k delta_{t_k}) / (1 + w s_k), p_k = softmax(dlogits[k]), where (t_k, s_k) is
  the table's top next token and share after `history` and the mixture's argmax tokens at
  offsets < k (q_k = p_k where the table holds no context). So the chain (the rows' argmax)
  takes the table's token where p_k(t) + w s >= p_k's top probability, and DDTree's best-first
  tree is built over the q's. A DFlash draft's rows do not depend on the tokens chosen before
  them (one forward over [bonus, MASK...]), so the mixture needs no further draft pass.

  dlogits: [D, V] float32 draft logits for offsets 1..D; history: [H] int32 the row's tokens
  with the bonus token last, the last n_valid real; weight: w >= 0 (0 returns log p).
  Returns [D, V] float32 log-probs (valid logits for argmax, sampling and tree building).
  Pure function, vmappable. A two-component mixture whose second component is a point mass: the
  static table (REST; llama.cpp's static lookup cache) as a second expert beside the draft."""
  D = dlogits.shape[0]
  lp = jax.nn.log_softmax(dlogits.astype(jnp.float32), axis=-1)
  if table.size == 0 or weight <= 0:
    return lp
  nmax = table.n_max
  buf = _context(table, history, D)
  real = jnp.minimum(n_valid, nmax)
  top = jnp.argmax(lp, axis=-1).astype(jnp.int32)                 # [D] the draft's top tokens
  top_lp = jnp.max(lp, axis=-1)
  toks, wss = [], []
  for k in range(D):
    # only scalars in the sequential part: the mixed row's argmax is t or the draft's top
    found, tok, share = _lookup(table, buf, nmax + k, real + k)
    ws = jnp.where(found, jnp.float32(weight) * share, 0.0)
    at_t = jnp.logaddexp(lp[k, tok], jnp.log(jnp.maximum(ws, 1e-30)))
    wins = found & ((tok == top[k]) | (at_t > top_lp[k]) | ((at_t == top_lp[k]) & (tok < top[k])))
    buf = buf.at[nmax + k].set(jnp.where(wins, tok, top[k]))
    toks.append(tok)
    wss.append(ws)
  toks, wss = jnp.stack(toks), jnp.stack(wss)                     # [D], [D] (0 where not held)
  at_t = jnp.logaddexp(jnp.take_along_axis(lp, toks[:, None], axis=1)[:, 0],
                       jnp.log(jnp.maximum(wss, 1e-30)))
  mixed = lp.at[jnp.arange(D), toks].set(jnp.where(wss > 0, at_t, lp[jnp.arange(D), toks]))
  return mixed - jnp.log1p(wss)[:, None]
