"""z-lab DFlash-2 draft forward and candidate selector (PyPI `dflash` 0.1.0, dflash/model.py:
`DFlash2DraftModel`, `GroupedDynamicCausalConv`, `CandidateSelector`; algorithm as written in
tests' fixture README, section 4).

DFlash-2 keeps DFlash-1's one-pass block drafter over `[last token, MASK x (L-1)]` with the
target features of the committed tokens as context (the same context K/V: `draft.ingest_rows`,
the same `draft.DraftCache`, ring buffer included), and adds:
  * grouped dynamic causal convolutions around each layer's attention and MLP: per block row,
    K taps = static `base_kernel` + a dynamic tap per group of G channels projected from the
    row's normed input, mixing the row with the K-1 block rows before it (never context rows);
  * sliding-window attention with the package's causal rule (`DFlash2Fields.causal`);
  * block embeddings x `input_embedding_scale`, logits x `output_multiplier`, then
    `cap * tanh(logits / cap)`;
  * a candidate selector: per row the top-k logits, rescored left to right with a low-rank
    bigram term between the previously chosen token and each candidate, gated by the row's
    hidden state; greedy (argmax) or sampled at T > 0 (returning q over the candidates).

`propose` gives the decode loop the selector's path and scores in DFlash-1's proposal form, and
`tree` a DDTree whose every node's children are scored with that node's own token as their
predecessor (`decode.dflash_proposer` picks them by the draft config and mode). Checked against the z-lab package's
reference arrays (tests/test_dflash2.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from dflash_jax import layers
from dflash_jax import tree as tree_lib
from dflash_jax.config import DraftConfig
from dflash_jax.draft import (ConvParams, DraftCache, DraftParams, block_attention,
                             block_attention_remat, context_rows, kv_rows, queries, context_rope,
                             packed_positions)
from dflash_jax.quants import QuantWeight, take_rows
from dflash_jax.runtime import Runtime


def dynamic_taps(h: jax.Array, conv: ConvParams, cfg: DraftConfig, rt: Runtime) -> jax.Array:
  """Per-row dynamic taps of a convolution: h [..., L, D] (the layer's normed input) ->
  [..., L, 2, K, D/G] (side, tap, group) = kernel_projection(h) reshaped."""
  f = cfg.dflash2
  flat = layers.linear(h.reshape(-1, h.shape[-1]), conv.proj, rt)
  return flat.reshape(h.shape[:-1] + (2, f.conv_kernel, cfg.d_model // f.conv_group))


def causal_conv(u: jax.Array, dyn: jax.Array, base: jax.Array) -> jax.Array:
  """Grouped dynamic causal convolution along the block rows.

  u: [..., L, D] (leading axes: independent blocks); dyn: [..., L, K, D/G] the rows' dynamic
  taps of one side; base: [K, D] its static taps.
  out[t, c] = sum_{o<K} (base[o, c] + dyn[t, o, c // G]) * u[t-o, c], u[t-o] = 0 for t < o.
  Returns [..., L, D] float32.
  """
  n, d = u.shape[-2:]
  k = base.shape[0]
  taps = base + jnp.repeat(dyn, d // dyn.shape[-1], axis=-1)             # [..., L, K, D]
  out = jnp.zeros(u.shape, jnp.float32)
  lead = [(0, 0)] * (u.ndim - 2)
  for o in range(k):
    shifted = jnp.pad(u, lead + [(o, 0), (0, 0)])[..., :n, :]
    out = out + taps[..., o, :] * shifted
  return out


def block_masks(pos: jax.Array, key_pos: jax.Array, cfg: DraftConfig, layer: int,
                in_window: Optional[jax.Array]):
  """(context mask [L, R] or None, block mask [L, L]) of one layer: a key at p_k is visible to
  a query at p_q iff (not causal or p_k <= p_q) and, on sliding layers with a window W,
  p_q - p_k < W and (causal or p_k - p_q < W) (the package's rule; context keys always precede
  the block). in_window: the draft cache's ring-buffer mask [L, R], or None."""
  f = cfg.dflash2
  causal, w = f.causal[layer], cfg.sliding_window if cfg.sliding[layer] else 0
  dq = pos[:, None] - pos[None, :]                    # p_q - p_k inside the block
  blk = jnp.ones(dq.shape, bool)
  if causal:
    blk = blk & (dq >= 0)
  ctx = in_window
  if w:
    blk = blk & (dq < w) & (jnp.bool_(causal) | (-dq < w))
    near = pos[:, None] - key_pos[None, :] < w
    ctx = near if ctx is None else ctx & near
  return ctx, blk


def _layer(x: jax.Array, params: DraftParams, cfg: DraftConfig, i: int, attend, rt: Runtime):
  """One DFlash-2 decoder layer over block rows x [..., L, D] (leading axes: independent blocks):
  the "prepare" convolution, attention (`attend(a [..., L, D]) -> [..., L, H*Dh]` before o_proj:
  over the draft cache when proposing, over the sequence's features when training), the
  "finish" convolution with taps from the same normed input, then the MLP between its own two
  convolutions. Returns (x [..., L, D], the attention part's intermediates under the fixture's
  names: attn_conv_in, attn_conv_dynamic, attn_prepared, attn_out, attn_finished)."""
  ex, lay = params.dflash2, params.layers[i]
  h = layers.rms_norm(x, lay.in_norm, cfg.rms_eps)
  dyn = dynamic_taps(h, ex.attn_conv[i], cfg, rt)
  a = causal_conv(h, dyn[..., 0, :, :], ex.attn_conv[i].base[0])
  o = attend(a)
  ao = layers.linear(o.reshape(-1, o.shape[-1]), lay.wo, rt).reshape(x.shape)
  fin = causal_conv(ao, dyn[..., 1, :, :], ex.attn_conv[i].base[1])
  parts = dict(attn_conv_in=h, attn_conv_dynamic=dyn, attn_prepared=a, attn_out=ao,
               attn_finished=fin)
  x = x + fin
  h = layers.rms_norm(x, lay.post_norm, cfg.rms_eps)
  dyn = dynamic_taps(h, ex.mlp_conv[i], cfg, rt)
  m = causal_conv(h, dyn[..., 0, :, :], ex.mlp_conv[i].base[0])
  y = layers.swiglu_mlp(m.reshape(-1, m.shape[-1]), lay.gate_up, lay.down, rt).reshape(x.shape)
  return x + causal_conv(y, dyn[..., 1, :, :], ex.mlp_conv[i].base[1]), parts


def propose_hidden(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, bonus: jax.Array,
                   start: jax.Array, cache: DraftCache, rt: Runtime, *, trace: bool = False):
  """The DFlash-2 block forward at positions start..start+L-1 over the context cache (rows of
  positions < start; `draft.ingest` writes them, as for DFlash-1).

  bonus: [] int32 the last committed token. Returns hidden [L, D] float32 after the final norm
  (row j+1 proposes position start+1+j), and with trace=True a dict of intermediates
  (`layer_outputs` [n_layer, L, D], layer 0's `attn_conv_in`, `attn_conv_dynamic`,
  `attn_prepared`, `attn_out`, `attn_finished`), the fixture's names.
  """
  f = cfg.dflash2
  L = cfg.block_size
  ids = jnp.concatenate([bonus[None].astype(jnp.int32),
                         jnp.full((L - 1,), cfg.mask_token_id, jnp.int32)])
  pos = start + jnp.arange(L, dtype=jnp.int32)
  x = take_rows(embed, ids).astype(jnp.float32) * f.input_embedding_scale
  key_pos, n_live, in_window = cache.context(start, L)
  rpos, key_fn = context_rope(cache, cfg, start, pos, key_pos)
  aux = {"layer_outputs": []}
  for i, lay in enumerate(params.layers):

    def attend(a):
      k, v = kv_rows(a, lay, rpos, cfg, rt)
      ctx_mask, blk_mask = block_masks(pos, key_pos, cfg, i, in_window)
      o = layers.attention_live(queries(a, lay, rpos, cfg, rt), cache.k, cache.v, i, ctx_mask,
                                n_live, local=(k, v, blk_mask), key_fn=key_fn,
                                dense=rt.dense)
      return o.reshape(L, cfg.n_head * cfg.head_dim)

    x, parts = _layer(x, params, cfg, i, attend, rt)
    if i == 0 and trace:
      aux.update(parts)
    aux["layer_outputs"].append(x)
  hidden = layers.rms_norm(x, params.norm, cfg.rms_eps)
  if trace:
    aux["layer_outputs"] = jnp.stack(aux["layer_outputs"])
    return hidden, aux
  return hidden


def train_hidden(params: DraftParams, cfg: DraftConfig, feats: jax.Array, block_ids: jax.Array,
                 anchors: jax.Array, embed: QuantWeight, rt: Runtime = Runtime(),
                 positions=None, segments=None, remat_attention: bool = False) -> jax.Array:
  """The DFlash-2 forward for many blocks of one sequence at once (training; the math of
  `propose_hidden` over a cache holding positions 0..anchor-1, checked by tests).

  feats: [T, F*D] target features of positions 0..T-1; block_ids: [A, L] int32 rows
  [x_anchor, MASK x (L-1)]; anchors: [A] int32 positions of the blocks' first rows. Block a sees
  context positions < anchors[a] and its own rows (`block_masks`), the convolutions run inside
  each block. positions, segments: None, or [T] int32 for a packed row (`draft.train_hidden`):
  a block sees only its own sequence's rows, at RoPE positions inside it. remat_attention: as
  in `draft.train_hidden`.
  Returns hidden [A, L, D] float32 after the final norm.
  """
  f = cfg.dflash2
  n_ctx = feats.shape[0]
  A, L = block_ids.shape
  H, Hkv, Dh, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_model
  cpos = jnp.arange(n_ctx, dtype=jnp.int32)          # row indices: what the masks compare
  qpos = anchors[:, None] + jnp.arange(L, dtype=jnp.int32)               # [A, L]
  rcpos, rqpos, same = packed_positions(anchors, n_ctx, L, positions, segments)  # RoPE
  before = jnp.broadcast_to(cpos[None, None, :] < anchors[:, None, None], (A, L, n_ctx))
  if same is not None:
    before = before & same[:, None, :]
  c = context_rows(params, feats, cfg, rt)
  x = take_rows(embed, block_ids.reshape(-1)).reshape(A, L, D).astype(jnp.float32)
  x = x * f.input_embedding_scale
  for i, lay in enumerate(params.layers):
    kc, vc = kv_rows(c, lay, rcpos, cfg, rt)

    def attend(a):
      af = a.reshape(A * L, D)
      q = queries(af, lay, rqpos.reshape(-1), cfg, rt).reshape(A, L, Hkv, H // Hkv, Dh)
      kb, vb = kv_rows(af, lay, rqpos.reshape(-1), cfg, rt)
      ctx_mask, blk_mask = jax.vmap(lambda p, m: block_masks(p, cpos, cfg, i, m))(qpos, before)
      o = (block_attention_remat if remat_attention else block_attention)(
          q, kc, vc, kb.reshape(A, L, Hkv, Dh), vb.reshape(A, L, Hkv, Dh), ctx_mask, blk_mask, Dh,
          rt.cdt)
      return o.reshape(A, L, H * Dh)

    x = _layer(x, params, cfg, i, attend, rt)[0]
  return layers.rms_norm(x, params.norm, cfg.rms_eps)


def pairwise_scores(params: DraftParams, hidden: jax.Array, prev: jax.Array,
                    rt: Runtime = Runtime()) -> jax.Array:
  """The selector's pairwise term for every vocabulary token (training, teacher forcing):
  hidden [..., D] the rows' draft hidden states, prev [...] int32 each row's predecessor token ->
  [..., V] float32 sum_r pred[prev, r] * g[r] * succ[v, r], g = hidden_projection(hidden)
  (`select` adds it to the unary logits of its top-k candidates only)."""
  ex = params.dflash2
  g = layers.linear(hidden.reshape(-1, hidden.shape[-1]), ex.sel_proj, rt)
  g = g.reshape(hidden.shape[:-1] + (-1,))
  return jnp.einsum("...r,vr->...v", ex.pred[prev] * g, ex.succ,
                    precision=jax.lax.Precision.HIGHEST)


def draft_logits(hidden: jax.Array, lm_head: QuantWeight, cfg: DraftConfig, rt: Runtime):
  """Logits the selector sees: hidden [P, D] -> lm_head(hidden) * output_multiplier, then
  cap * tanh(logits / cap) when `final_logit_softcapping` is set. [P, V] float32."""
  return cap_logits(layers.linear(hidden, lm_head, rt), cfg)


def cap_logits(z: jax.Array, cfg: DraftConfig) -> jax.Array:
  """z [..., V] float32 raw lm_head outputs -> z * output_multiplier, then soft-capped."""
  f = cfg.dflash2
  z = z * f.output_multiplier
  if f.softcap:
    z = f.softcap * jnp.tanh(z / f.softcap)
  return z


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
  """A selector's path over P block rows.

  Attributes:
    tokens: [P] int32 the proposal (row p proposes position start+1+p).
    candidates: [P, k] int32 each row's top-k tokens (jax.lax.top_k order: logit descending,
      ties by the lower id).
    unary: [P, k] float32 their logits.
    scores: [P, k] float32 unary + pairwise scores along the chosen path.
    chosen: [P] int32 the chosen column per row.
    q: [P, k] float32 softmax(scores / T) (T > 0 or teacher forcing), else one-hot of chosen.
  """

  tokens: jax.Array
  candidates: jax.Array
  unary: jax.Array
  scores: jax.Array
  chosen: jax.Array
  q: jax.Array


def select(params: DraftParams, cfg: DraftConfig, hidden: jax.Array, logits: jax.Array,
           anchor: jax.Array, rt: Runtime, *, temperature=0.0,
           key: Optional[jax.Array] = None, forced: Optional[jax.Array] = None) -> Selection:
  """The candidate selector (`CandidateSelector.select`): a left-to-right decode of a chain
  model over each row's top-k candidates.

  hidden: [P, D] the draft's rows 1..P (after the final norm); logits: [P, V] `draft_logits`;
  anchor: [] int32 the last committed token (the first row's predecessor).
  score[p, j] = unary[p, j] + sum_r pred[prev, r] * g[p, r] * succ[cand[p, j], r], with
  g = hidden_projection(hidden), prev the token chosen for row p-1.
  temperature: a float or a [] float32 array (a decode row's own, traced). With a `key`, a row
  at temperature T > 0 draws from q[p] = softmax(score[p] / T) (ancestral sampling: each draw is
  the next row's predecessor); without one, or at T = 0, the argmax. forced: [P] int32 tokens to
  follow instead (teacher forcing: q of a given path; each must be among its row's candidates).
  q = softmax(score / T) where T > 0, else one-hot of the chosen column.
  Raises ValueError for a Python temperature > 0 with neither key nor forced tokens.
  Returns a Selection.
  """
  ex = params.dflash2
  k = cfg.dflash2.selector_top_k
  unary, cand = jax.lax.top_k(logits, k)
  g = layers.linear(hidden, ex.sel_proj, rt)                               # [P, R]
  n = logits.shape[0]
  if (isinstance(temperature, (int, float)) and temperature > 0 and forced is None
      and key is None):
    raise ValueError("select: temperature > 0 needs a PRNG key (or forced tokens)")
  t = jnp.asarray(temperature, jnp.float32)
  t_safe = jnp.where(t > 0, t, 1.0)
  keys = jax.random.split(key, n) if key is not None else None

  def row(prev, xs):
    u, c, gp, p_idx = xs
    score = u + (ex.pred[prev] * gp) @ ex.succ[c].T                        # [k]
    j = jnp.argmax(score).astype(jnp.int32)
    if forced is not None:
      j = jnp.argmax(c == forced[p_idx]).astype(jnp.int32)
    elif keys is not None:
      drawn = jax.random.categorical(keys[p_idx], score / t_safe).astype(jnp.int32)
      j = jnp.where(t > 0, drawn, j)
    q = jnp.where(t > 0, jax.nn.softmax(score / t_safe),
                  jax.nn.one_hot(j, score.shape[0], dtype=jnp.float32))
    return c[j], (c[j], score, j, q)

  _, (tokens, scores, chosen, q) = jax.lax.scan(
      row, anchor.astype(jnp.int32), (unary, cand, g, jnp.arange(n)))
  return Selection(tokens=tokens, candidates=cand, unary=unary, scores=scores, chosen=chosen, q=q)


def scatter_q(sel: Selection, n_vocab: int) -> jax.Array:
  """The selector's sparse proposal distribution on the vocabulary: [P, V] float32 with q[p]
  at its candidates' ids (zero elsewhere), the q of the rejection rule and its residual
  normalize(max(p - q, 0)) (sampling.residual)."""
  rows = jnp.arange(sel.q.shape[0])[:, None]
  return jnp.zeros((sel.q.shape[0], n_vocab), jnp.float32).at[rows, sel.candidates].add(sel.q)


NOT_PROPOSED = -1e30   # log-probability of a token outside a row's candidates


def _block_selection(params: DraftParams, cfg: DraftConfig, embed: QuantWeight,
                     lm_head: QuantWeight, bonus: jax.Array, start: jax.Array, cache: DraftCache,
                     rt: Runtime, **select_kw) -> Selection:
  """The selector over one block's rows 1..L-1 (`propose_hidden`, `draft_logits`, `select`)."""
  hidden = propose_hidden(params, cfg, embed, bonus, start, cache, rt)
  logits = draft_logits(hidden[1:], lm_head, cfg, rt)
  return select(params, cfg, hidden[1:], logits, bonus, rt, **select_kw)


def propose_path(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
                 bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime, *, n: int,
                 temperature=0.0, key: Optional[jax.Array] = None):
  """One DFlash-2 block as the selector proposes it (`dflash_generate`'s proposal): the
  selector's path over the block rows, greedy, or with a key sampled ancestrally at
  `temperature` ([] float32, a decode row's own; 0 = greedy).

  Returns (tokens [n] int32 for positions start+1..start+n, q_logp [n, V] float32 log of the
  selector's q scattered onto each row's candidates (-inf elsewhere): the proposal
  distribution of the speculative rejection rule).
  """
  sel = _block_selection(params, cfg, embed, lm_head, bonus, start, cache, rt,
                         temperature=temperature, key=key)
  return sel.tokens[:n], jnp.log(scatter_q(sel, cfg.n_vocab)[:n])


def propose(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
            bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime,
            n_logits: Optional[int] = None) -> tuple[jax.Array, DraftCache]:
  """One DFlash-2 block as the decode loop's proposal rows (the DFlash-1 `draft.propose`
  interface): the selector's greedy path, and per row the log-softmax of its path-dependent
  scores over its top-k candidates (NOT_PROPOSED elsewhere).

  So a chain takes the selector's proposal (each row's argmax is its chosen candidate), a
  sampled chain draws from the selector's scores along that path (the rejection rule uses the
  same q: exact), and DDTree grows a best-first tree over the candidates with the selector's
  scores (exact for any proposal). Returns (rows [n_logits, V] float32, the cache unchanged).
  """
  n = cfg.block_size - 1 if n_logits is None else n_logits
  sel = _block_selection(params, cfg, embed, lm_head, bonus, start, cache, rt)
  logp = jax.nn.log_softmax(sel.scores, axis=-1)
  rows = jnp.arange(sel.scores.shape[0])[:, None]
  out = jnp.full((rows.shape[0], cfg.n_vocab), NOT_PROPOSED, jnp.float32)
  return out.at[rows, sel.candidates].set(logp)[:n], cache


def tree(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
         bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime, *, depth: int,
         budget: int, top_k: int, chain_seed: bool = True, temp: float = 1.0) -> tree_lib.Tree:
  """A DDTree over one DFlash-2 block whose every node's children are the next row's candidates
  scored by the selector with that node's own token as their predecessor (`select`'s score
  unary + sum_r pred[token, r] g[r] succ[cand, r]; log_softmax(score / temp) over the row's k
  candidates, NOT_PROPOSED elsewhere), grown best-first by `tree.build_tree_cond`. The top-1
  chain is the selector's greedy path (`propose_path`); a branch off it is scored with its own
  predecessor, where the rows tree (`propose`) scores every node with the greedy path's.
  depth: static, 1..L-1 rows. Returns the tree (bonus at the root)."""
  ex = params.dflash2
  hidden = propose_hidden(params, cfg, embed, bonus, start, cache, rt)[1:depth + 1]
  unary, cand = jax.lax.top_k(draft_logits(hidden, lm_head, cfg, rt), cfg.dflash2.selector_top_k)
  g = layers.linear(hidden, ex.sel_proj, rt)                               # [depth, R]

  def child_fn(d, token, state):
    score = unary[d] + (ex.pred[token] * g[d]) @ ex.succ[cand[d]].T        # [k]
    row = jnp.full((cfg.n_vocab,), NOT_PROPOSED, jnp.float32)
    return row.at[cand[d]].set(jax.nn.log_softmax(score / temp)), state

  return tree_lib.build_tree_cond(child_fn, jnp.asarray(bonus, jnp.int32), jnp.zeros((1,)),
                                  depth=depth, budget=budget, top_k=top_k, chain_seed=chain_seed)
