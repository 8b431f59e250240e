"""DDTree (Ringel & Romano 2026, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees", arXiv:2604.12989): a best-first tree of the most likely draft prefixes, built on device
with static shapes, and the walk that accepts the longest path the target agrees with.

A tree has N = 1 + budget node slots: node 0 is the root (the bonus token, depth 0); every other
valid node i has parents[i] < i, depth = depth(parent) + 1, and a token drawn from the draft's
top-K at that depth. Node score = sum of draft log-probs along its path; nodes are inserted in
descending score order (ties: lowest candidate slot first), so the node set is the `budget`
best prefixes. With `chain_seed`, the full top-1 chain is inserted first.

Every verify takes a tree: the DFlash chain is a path tree (parents -1, 0, 1, ...; `path_tree`)
and autoregressive decoding a root-only tree; the static `is_path` lets the target pick the
cheaper causal forms for paths behind the same `target.verify` entry point.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tree_gdn import ancestors  # noqa: F401  (re-exported: the one ancestor walk)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
  """A draft tree of N node slots, root first.

  Attributes:
    tokens, parents, depths: [N] int32 (parents[0] = -1; invalid slots: parent -1, depth 0).
    valid: [N] bool. scores: [N] float32 path log-probs (root 0).
    is_path: static; True when parents = [-1, 0, 1, ...] and depths = [0, 1, 2, ...] (chain,
      autoregressive).
    max_depth: static upper bound of the valid nodes' depths.
  """

  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  valid: jax.Array
  scores: jax.Array
  is_path: bool = dataclasses.field(default=False, metadata=dict(static=True))
  max_depth: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def n(self) -> int:
    return self.tokens.shape[0]

  def ancestor_matrix(self) -> jax.Array:
    """[N, N] bool: anc[i, j] = node j is node i or one of its ancestors (causal for a path
    tree)."""
    if self.is_path:
      return jnp.tril(jnp.ones((self.n, self.n), bool))
    return ancestor_matrix(self.parents, self.max_depth)

  def ancestor_columns(self, n_back: int) -> jax.Array:
    """[N, n_back + 1] int32: column j = the j-th ancestor (column 0 = the node), -1 past the root."""
    return ancestors(self.parents, n_back)

  def ancestors_by_depth(self) -> jax.Array:
    """[N, N] int32: [i, d] = node i's ancestor at depth d (itself at d = depths[i]) for
    d <= depths[i]; 0 past it (`layers.attention_ordered` masks those)."""
    anc = self.ancestor_columns(self.max_depth)                      # [N, max_depth + 1]
    d = jnp.arange(self.n, dtype=jnp.int32)
    back = jnp.clip(self.depths[:, None] - d[None], 0, self.max_depth)
    return jnp.maximum(jnp.take_along_axis(anc, back, axis=1), 0)


def path_tree(tokens: jax.Array) -> Tree:
  """The chain [t_0, t_1, ...] as a tree: node i's parent is i-1. tokens: [N] int32."""
  n = tokens.shape[0]
  idx = jnp.arange(n, dtype=jnp.int32)
  return Tree(tokens=tokens.astype(jnp.int32), parents=idx - 1, depths=idx,
              valid=jnp.ones((n,), bool), scores=jnp.zeros((n,), jnp.float32), is_path=True,
              max_depth=n - 1)


def pad_tree(tree: Tree, n: int) -> Tree:
  """`tree` grown to n node slots with invalid nodes (token 0, parent -1, depth 0: roots that
  no valid node descends from, so they change no valid node's output), as a general tree
  (is_path False: the tree forms run even for a chain). Raises ValueError when n < tree.n."""
  if n < tree.n:
    raise ValueError(f"pad_tree: {tree.n} nodes do not fit in {n} slots")
  extra = n - tree.n
  return Tree(tokens=jnp.pad(tree.tokens, (0, extra)),
              parents=jnp.pad(tree.parents, (0, extra), constant_values=-1),
              depths=jnp.pad(tree.depths, (0, extra)), valid=jnp.pad(tree.valid, (0, extra)),
              scores=jnp.pad(tree.scores, (0, extra), constant_values=-jnp.inf),
              is_path=False, max_depth=tree.max_depth)


def lookup_path(history: jax.Array, n_valid: jax.Array, n_tokens: int, ngram_min: int,
                ngram_max: int) -> tuple[jax.Array, jax.Array]:
  """Prompt lookup (n-gram) proposal: the tokens that followed the most recent earlier
  occurrence of the history's longest matching suffix (Saxena 2023, "Prompt Lookup Decoding";
  llama.cpp's `common_ngram` lookup drafts the same way).

  history: [H] int32, the row's tokens in order with the bonus token last; only the last
    n_valid entries are real (n_valid: [] int32, <= H; earlier entries are ignored).
  n_tokens: G, tokens to propose at most. ngram_min / ngram_max: static suffix lengths tried,
    longest first; an occurrence must end before the suffix's own last token (its
    continuation starts at or before the bonus token).
  Returns (tokens [G] int32: the continuation, zeros past its end; n [] int32: how many are
  real, 0 when no suffix of length >= ngram_min occurs earlier). Pure function, vmappable.
  """
  H = history.shape[0]
  G = n_tokens
  idx = jnp.arange(H, dtype=jnp.int32)
  first = H - n_valid                                    # index of the oldest real entry
  best_s, best_n = jnp.int32(-1), jnp.int32(0)
  for n in range(min(ngram_max, H - 1), ngram_min - 1, -1):
    # occurrence start s in [first, H - 1 - n]: history[s:s+n] == history[H-n:], s + n <= H - 1
    m = H - n                                            # candidate starts 0..m-1
    eq = jnp.ones((m,), bool)
    for j in range(n):
      eq = eq & (history[j:j + m] == history[H - n + j])
    ok = eq & (idx[:m] >= first)                         # implies n_valid >= n + 1
    s = jnp.max(jnp.where(ok, idx[:m], -1))
    take = (best_n == 0) & (s >= 0)
    best_s, best_n = jnp.where(take, s, best_s), jnp.where(take, n, best_n)
  start = best_s + best_n                                # the continuation's first index
  cont_idx = start + jnp.arange(G, dtype=jnp.int32)
  count = jnp.where(best_n > 0, jnp.minimum(G, H - start), 0)
  tokens = jnp.where(jnp.arange(G) < count, history[jnp.clip(cont_idx, 0, H - 1)], 0)
  return tokens.astype(jnp.int32), count.astype(jnp.int32)


def graft_path(tree: Tree, tokens: jax.Array, n: jax.Array, max_depth: int) -> Tree:
  """`tree` with the path root -> tokens[0] -> .. -> tokens[n-1] added as a branch: the path
  walks the tree's existing nodes while they match (valid, same parent, same token) and adds
  the rest as new nodes in G = tokens.shape[0] extra slots (unused slots stay invalid: parent
  -1, depth 0, nothing descends from them), so `follow` accepts the longer of the tree's own
  best path and the grafted one. tokens: [G] int32; n: [] int32 (<= G) real tokens;
  max_depth: static bound of the result's depths (>= tree.max_depth and >= G).
  Returns a general tree (is_path False) of tree.n + G slots."""
  G = tokens.shape[0]
  N = tree.n
  t = pad_tree(tree, N + G)
  toks, parents, depths, valid, scores = t.tokens, t.parents, t.depths, t.valid, t.scores
  cur, fresh = jnp.int32(0), jnp.bool_(False)            # fresh: left the old tree
  for j in range(G):
    live = j < n
    hit = valid[:N] & (parents[:N] == cur) & (toks[:N] == tokens[j]) & ~fresh
    found = jnp.any(hit) & live
    new = live & ~found
    slot = N + j
    toks = toks.at[slot].set(jnp.where(new, tokens[j], 0))
    parents = parents.at[slot].set(jnp.where(new, cur, -1))
    depths = depths.at[slot].set(jnp.where(new, j + 1, 0))
    valid = valid.at[slot].set(new)
    scores = scores.at[slot].set(jnp.where(new, 0.0, -jnp.inf))
    cur = jnp.where(found, jnp.argmax(hit).astype(jnp.int32), jnp.where(new, slot, cur))
    fresh = fresh | new
  return Tree(tokens=toks, parents=parents, depths=depths, valid=valid, scores=scores,
              is_path=False, max_depth=max_depth)


def top_k_rows(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k largest entries of each row, by k rounds of argmax (no sort over the vocabulary).

  x: [R, V] float32. Returns (values [R, k] float32 descending, indices [R, k] int32); ties go
  to the lower index, as in `jax.lax.top_k`. -inf entries are treated as the most negative
  finite float (so k distinct indices come back whenever k <= V).

  Why not `jax.lax.top_k`: inside a larger jitted step XLA:CPU lowers it to a full stable sort
  of every row (~55 ms for [15, 49152] on 2 cores, a quarter of a DDTree step), while k argmax
  passes read the rows k times (~0.3 ms each). For the small k of DDTree (top_k ~8) this wins.
  """
  if not 1 <= k <= x.shape[-1]:
    raise ValueError(f"top_k_rows: k={k} must be in [1, {x.shape[-1]}]")
  x = jnp.maximum(x.astype(jnp.float32), jnp.finfo(jnp.float32).min)
  col = jnp.arange(x.shape[-1], dtype=jnp.int32)[None, :]
  vals, ids = [], []
  for _ in range(k):
    i = jnp.argmax(x, axis=-1).astype(jnp.int32)
    vals.append(jnp.max(x, axis=-1))
    ids.append(i)
    x = jnp.where(col == i[:, None], -jnp.inf, x)
  return jnp.stack(vals, axis=-1), jnp.stack(ids, axis=-1)


def _push(cand, n_c, score, parent, depth, rank, ok):
  """Append a candidate (score, parent node, depth, rank among its parent's top-k) to the
  candidate arrays at slot n_c when ok (else to the never-popped sink slot C-1)."""
  c_score, c_parent, c_depth, c_rank = cand
  slot = jnp.where(ok, n_c, c_score.shape[0] - 1)
  cand = (c_score.at[slot].set(jnp.where(ok, score, -jnp.inf)), c_parent.at[slot].set(parent),
          c_depth.at[slot].set(depth), c_rank.at[slot].set(rank))
  return cand, n_c + ok.astype(jnp.int32)


def _seed_chain(nodes, cand, vals, ids, n_seed: int, K: int):
  """Nodes 1..n_seed = the top-1 chain; each chain node's rank-1 sibling becomes a candidate."""
  n_c = jnp.int32(0)
  for d in range(1, n_seed + 1):
    nodes, cand, n_c = _seed_node(nodes, cand, n_c, d, ids[d - 1], vals[d - 1], K)
  return nodes, cand, n_c


def _seed_node(nodes, cand, n_c, d: int, ids, vals, K: int):
  """Chain node d (static) = the best of its parent d-1's children (ids / vals [K], descending);
  the parent's second child becomes a candidate."""
  tokens, parents, depths, scores, valid = nodes
  tokens, parents = tokens.at[d].set(ids[0]), parents.at[d].set(d - 1)
  depths, valid = depths.at[d].set(d), valid.at[d].set(True)
  scores = scores.at[d].set(scores[d - 1] + vals[0])
  if K > 1:
    cand, n_c = _push(cand, n_c, scores[d - 1] + vals[1], jnp.int32(d - 1), jnp.int32(d),
                      jnp.int32(1), jnp.bool_(True))
  return (tokens, parents, depths, scores, valid), cand, n_c


def _pop_best(i, carry, vals, ids, K: int, D: int):
  """Insert the best candidate as node i; push its next sibling and its first child."""
  (tokens, parents, depths, scores, valid), cand, n_c = carry
  c_score, c_parent, c_depth, c_rank = cand
  c = jnp.argmax(c_score)
  ok = c_score[c] > -jnp.inf
  d, r, par, sc = c_depth[c], c_rank[c], c_parent[c], c_score[c]
  nodes = (tokens.at[i].set(jnp.where(ok, ids[d - 1, r], 0)),
           parents.at[i].set(jnp.where(ok, par, -1)), depths.at[i].set(jnp.where(ok, d, 0)),
           scores.at[i].set(jnp.where(ok, sc, -jnp.inf)), valid.at[i].set(ok))
  cand = (c_score.at[c].set(-jnp.inf), c_parent, c_depth, c_rank)
  cand, n_c = _push(cand, n_c, sc - vals[d - 1, r] + vals[d - 1, jnp.minimum(r + 1, K - 1)], par,
                    d, r + 1, ok & (r + 1 < K))                                   # next sibling
  cand, n_c = _push(cand, n_c, sc + vals[jnp.minimum(d, D - 1), 0], i, d + 1, jnp.int32(0),
                    ok & (d < D))                                                 # first child
  return nodes, cand, n_c


def build_tree(logp: jax.Array, root_token: jax.Array, *, budget: int, top_k: int,
               chain_seed: bool = True) -> Tree:
  """Best-first tree from per-depth draft log-probs.

  logp: [D, V] float32 log-probabilities, row d for depth d+1 (D <= block_size - 1; the
    tree is at most D deep).
  root_token: [] int32. budget: nodes besides the root. top_k: candidates per depth (<= budget).
  chain_seed: insert the top-1 chain (depths 1..min(D, budget)) before the best-first expansion.
  """
  D = logp.shape[0]
  K = min(top_k, budget)
  vals, ids = top_k_rows(logp, K)                        # [D, K] descending
  N = budget + 1
  C = 2 * budget + D + 2                                 # candidate slots (each pop adds <= 2)
  nodes = (jnp.zeros((N,), jnp.int32).at[0].set(root_token), jnp.full((N,), -1, jnp.int32),
           jnp.zeros((N,), jnp.int32), jnp.zeros((N,), jnp.float32),
           jnp.zeros((N,), bool).at[0].set(True))
  cand = (jnp.full((C,), -jnp.inf), jnp.zeros((C,), jnp.int32), jnp.ones((C,), jnp.int32),
          jnp.zeros((C,), jnp.int32))
  n_seed = min(D, budget) if chain_seed else 0
  nodes, cand, n_c = _seed_chain(nodes, cand, vals, ids, n_seed, K)
  if not chain_seed:
    cand, n_c = _push(cand, n_c, vals[0, 0], jnp.int32(0), jnp.int32(1), jnp.int32(0),
                      jnp.bool_(True))
  if n_seed + 1 <= budget:
    nodes, _, _ = jax.lax.fori_loop(n_seed + 1, budget + 1,
                                    functools.partial(_pop_best, vals=vals, ids=ids, K=K, D=D),
                                    (nodes, cand, n_c))
  tokens, parents, depths, scores, valid = nodes
  return Tree(tokens=tokens, parents=parents, depths=depths, valid=valid, scores=scores,
              max_depth=min(D, budget))


def build_tree_cond(child_fn, root_token: jax.Array, root_state: jax.Array, *, depth: int,
                    budget: int, top_k: int, chain_seed: bool = True) -> Tree:
  """Best-first tree whose children's log-probs depend on their parent (a draft whose next row
  is conditioned on the token before it: DSpark's Markov head), the tree `build_tree` grows from
  rows that do not.

  child_fn(d, token, state) -> (logp [V] float32, child_state): the log-probabilities of the
    children (at depth d+1) of a node at depth d (d: [] int32, 0..depth-1) holding `token`
    ([] int32) and carrying `state` (its parent's child_state; root_state for the root; any
    fixed-shape float32 array), and the state its own children carry.
  root_token: [] int32. depth: static, the deepest row child_fn gives (the tree is at most that
  deep). budget: nodes besides the root. top_k: children kept per node (<= budget).
  chain_seed: insert the top-1 chain first (each node's best child, depths 1..min(depth, budget)),
  then expand best-first; a node's score is the sum of its path's log-probs.
  Each inserted node calls child_fn once (its children's list: top_k_rows of its row).
  """
  D, K, N = depth, min(top_k, budget), budget + 1
  C = 2 * budget + D + 2
  nodes = (jnp.zeros((N,), jnp.int32).at[0].set(root_token), jnp.full((N,), -1, jnp.int32),
           jnp.zeros((N,), jnp.int32), jnp.zeros((N,), jnp.float32),
           jnp.zeros((N,), bool).at[0].set(True))
  cand = (jnp.full((C,), -jnp.inf), jnp.zeros((C,), jnp.int32), jnp.ones((C,), jnp.int32),
          jnp.zeros((C,), jnp.int32))
  kids = (jnp.full((N, K), -jnp.inf, jnp.float32), jnp.zeros((N, K), jnp.int32),
          jnp.zeros((N,) + root_state.shape, jnp.float32))

  def expand(kids, i, d, token, state):
    """Node i's children list (values [K], ids [K], the state they carry); none at depth D."""
    lp, child_state = child_fn(jnp.minimum(d, D - 1), token, state)
    v, ix = top_k_rows(lp[None], K)
    cv, ci, cs = kids
    return (cv.at[i].set(jnp.where(d < D, v[0], -jnp.inf)), ci.at[i].set(ix[0]),
            cs.at[i].set(child_state.astype(jnp.float32)))

  kids = expand(kids, 0, jnp.int32(0), root_token, root_state)
  n_c = jnp.int32(0)
  n_seed = min(D, budget) if chain_seed else 0
  for d in range(1, n_seed + 1):
    cv, ci, cs = kids
    nodes, cand, n_c = _seed_node(nodes, cand, n_c, d, ci[d - 1], cv[d - 1], K)
    kids = expand(kids, d, jnp.int32(d), ci[d - 1, 0], cs[d - 1])
  if not chain_seed:
    cand, n_c = _push(cand, n_c, kids[0][0, 0], jnp.int32(0), jnp.int32(1), jnp.int32(0),
                      jnp.bool_(True))

  def pop(i, carry):
    (tokens, parents, depths, scores, valid), cand, n_c, kids = carry
    c_score, c_parent, c_depth, c_rank = cand
    c = jnp.argmax(c_score)
    ok = c_score[c] > -jnp.inf
    d, r, par, sc = c_depth[c], c_rank[c], c_parent[c], c_score[c]
    cv, ci, cs = kids
    tok = jnp.where(ok, ci[par, r], 0)
    nodes = (tokens.at[i].set(tok), parents.at[i].set(jnp.where(ok, par, -1)),
             depths.at[i].set(jnp.where(ok, d, 0)), scores.at[i].set(jnp.where(ok, sc, -jnp.inf)),
             valid.at[i].set(ok))
    cand = (c_score.at[c].set(-jnp.inf), c_parent, c_depth, c_rank)
    cand, n_c = _push(cand, n_c, scores[par] + cv[par, jnp.minimum(r + 1, K - 1)], par, d, r + 1,
                      ok & (r + 1 < K))                                           # next sibling
    kids = expand(kids, i, jnp.where(ok, d, D), tok, cs[par])
    cand, n_c = _push(cand, n_c, sc + kids[0][i, 0], i, d + 1, jnp.int32(0),
                      ok & (d < D))                                               # first child
    return nodes, cand, n_c, kids

  if n_seed + 1 <= budget:
    nodes, _, _, _ = jax.lax.fori_loop(n_seed + 1, budget + 1, pop, (nodes, cand, n_c, kids))
  tokens, parents, depths, scores, valid = nodes
  return Tree(tokens=tokens, parents=parents, depths=depths, valid=valid, scores=scores,
              max_depth=min(D, budget))


def ancestor_matrix(parents: jax.Array, max_depth: int) -> jax.Array:
  """[N, N] bool: anc[i, j] = node j is node i or one of its ancestors.

  The result is computed once and materialized (an optimization barrier): it is the attention
  mask of every layer of a verify, and XLA would otherwise duplicate the max_depth-step walk
  into each layer's fusions (DDTree on SmolLM2: ~9,800 of the decode loop's ~34,600 compiled
  HLO instructions; its compile time moved within run-to-run noise)."""
  n = parents.shape[0]
  idx = jnp.arange(n)
  anc = jnp.eye(n, dtype=bool)
  cur = idx
  for _ in range(max_depth):
    cur = jnp.where(cur >= 0, parents[jnp.maximum(cur, 0)], -1)
    anc = anc | ((cur[:, None] == idx[None, :]) & (cur[:, None] >= 0))
  return jax.lax.optimization_barrier(anc)


def follow(tree: Tree, posterior: jax.Array, max_depth: int):
  """Accept the longest root path whose tokens equal the target's posterior at each parent.

  posterior: [N] int32 target argmax at each node. Returns (path [max_depth + 1] int32 node ids
  of the accepted path, root first, padded with the last accepted node; n_acc [] int32 accepted
  drafts; bonus [] int32 = posterior at the last accepted node). A path tree (N = max_depth + 1)
  takes the longest prefix where token i+1 equals the posterior at node i, with path = 0..N-1
  (entries past n_acc are ignored by the commit).
  """
  if tree.is_path:
    if tree.n != max_depth + 1:
      raise ValueError(f"follow: a path tree of {tree.n} nodes with max_depth={max_depth}")
    match = (tree.tokens[1:] == posterior[:-1]).astype(jnp.int32)
    n_acc = jnp.sum(jnp.cumprod(match)).astype(jnp.int32)
    return jnp.arange(tree.n, dtype=jnp.int32), n_acc, posterior[n_acc]
  path = jnp.zeros((max_depth + 1,), jnp.int32)

  def body(d, carry):
    cur, n_acc, alive, path = carry
    want = posterior[cur]
    match = tree.valid & (tree.parents == cur) & (tree.tokens == want)
    has = jnp.any(match) & alive
    child = jnp.argmax(match).astype(jnp.int32)
    cur = jnp.where(has, child, cur)
    n_acc = n_acc + has.astype(jnp.int32)
    path = path.at[d].set(cur)
    return cur, n_acc, alive & has, path

  cur, n_acc, _, path = jax.lax.fori_loop(1, max_depth + 1, body,
                                          (jnp.int32(0), jnp.int32(0), jnp.bool_(True), path))
  return path, n_acc, posterior[cur]
