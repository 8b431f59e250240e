"""DeepSeek DSpark drafts (DeepSpec `Qwen3DSparkModel`; DSpark paper, Cheng et al. 2026; code:
deepspec/modeling/dspark/qwen3/modeling.py, markov_head.py, eval/dspark/draft_ops.py).

The backbone is z-lab's DFlash-1 draft (`draft.block_hidden`: [anchor, MASK x (L-1)] over the
context K/V of the target features) with an anchor-first layout: slot j's hidden state h_j
predicts position anchor+1+j, so a block of L slots proposes L tokens. On top, a semi-
autoregressive Markov head adds a bias to each slot's logits from the token chosen for the slot
before it (the anchor for slot 0), chained left to right:

  logits_j = lm_head(h_j) + bias_j,   bias_j = W2 z_j,   e_j = W1[prev_j]
  vanilla: z_j = e_j;   gated: z_j = sigmoid(G [h_j; e_j] + g) * e_j;
  rnn:     [a; c; o] = J [s_{j-1}; e_j; h_j] + b,  s_j = sig(a) s_{j-1} + (1 - sig(a)) tanh(c),
           z_j = tanh(o),  s_{-1} = 0

and a confidence head gives each slot a logit of the chance the chain is accepted up to it:
conf_j = C [h_j; e_j] + c (or C h_j + c without the Markov input).

The decode loop uses the rows of the greedy chain (`propose`, the DFlash-2 contract: row j is
the chain's corrected logits at slot j); for a sampled chain it draws each slot from its
processed row and feeds the draw to the next slot (`chain` with a draw function; DeepSpec's
`sample_block_tokens`); for DDTree it grows each node's children from the head conditioned on
that node's token (`tree`). The embedding and lm_head are the target's (DeepSpec trains the draft
with frozen copies of them; a checkpoint that ships the copies is accepted, draft_io).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from dflash_jax import draft as draft_lib
from dflash_jax import layers
from dflash_jax import tree as tree_lib
from dflash_jax.config import DraftConfig, DSparkFields
from dflash_jax.draft import DraftCache, DraftParams, DSparkParams
from dflash_jax.quants import QuantWeight
from dflash_jax.runtime import Runtime


def _block(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
           bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime,
           n: Optional[int]) -> tuple[jax.Array, jax.Array]:
  """The block's first n slots (static, 1..L, default L; ValueError outside): hidden [n, D]
  float32 and their lm_head logits [n, V] float32, before the Markov bias."""
  n = draft_lib.check_n_logits(cfg, n, cfg.block_size)
  hidden = draft_lib.block_hidden(params, cfg, embed, bonus, start, cache, rt)[:n]
  return hidden, layers.linear(hidden, lm_head, rt)


def _step(p: DSparkParams, f: DSparkFields, h: jax.Array, prev: jax.Array, state: jax.Array,
          rt: Runtime) -> tuple[jax.Array, jax.Array]:
  """One slot of the Markov head. h: [D] float32 the slot's hidden state; prev: [] int32 the
  token chosen for the slot before; state: [r] float32 (RNN heads; else passed through).
  Returns (bias [V] float32, the new state)."""
  e = jnp.take(p.w1, prev, axis=0)
  if f.markov_head == "gated":
    z = jax.nn.sigmoid(layers.linear(jnp.concatenate([h, e]), p.gate, rt) + p.gate_b) * e
  elif f.markov_head == "rnn":
    r = f.markov_rank
    proj = layers.linear(jnp.concatenate([state, e, h]), p.joint, rt) + p.joint_b
    gate = jax.nn.sigmoid(proj[:r])
    state = gate * state + (1.0 - gate) * jnp.tanh(proj[r:2 * r])
    z = jnp.tanh(proj[2 * r:])
  else:
    z = e
  return layers.linear(z, p.w2, rt), state


def confidence(p: DSparkParams, f: DSparkFields, hidden: jax.Array, prev: jax.Array) -> jax.Array:
  """Confidence logits of a chain (DeepSpec `predict_confidence_step`): hidden [n, D] float32
  the slots' hidden states, prev [n] int32 each slot's predecessor (the anchor, then the chain's
  tokens). Returns [n] float32 (sigmoid: the predicted probability that the chain is accepted
  through that slot given it is through the one before). Raises ValueError without a head."""
  if not f.confidence:
    raise ValueError("this DSpark draft has no confidence head (enable_confidence_head false)")
  x = hidden
  if f.confidence_with_markov:
    x = jnp.concatenate([hidden, jnp.take(p.w1, prev, axis=0)], axis=-1)
  return x @ p.conf + p.conf_b


Draw = Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def chain(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
          bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime, *,
          n: Optional[int] = None, draw: Optional[Draw] = None):
  """One DSpark block and its Markov chain over the first n slots.

  bonus: [] int32 the anchor (last committed token, at position `start`); embed / lm_head: the
  target's; context = the cache rows < start. draw: None (greedy: each slot takes the argmax of
  its corrected logits) or `draw(logits [V], j) -> (token [] int32, q [V] float32)` choosing slot
  j's token (a sampled chain: q is the distribution it was drawn from).
  Returns (tokens [n] int32 for positions start+1..start+n, rows [n, V] float32 the corrected
  logits, q [n, V] float32 or None (greedy), hidden [n, D] float32, prev [n] int32 each slot's
  predecessor). Raises ValueError for n outside 1..L.
  """
  f = cfg.dspark
  hidden, base = _block(params, cfg, embed, lm_head, bonus, start, cache, rt, n)
  n = hidden.shape[0]
  bonus = jnp.asarray(bonus, jnp.int32)
  if not f.markov_rank and draw is None:
    toks = jnp.argmax(base, axis=-1).astype(jnp.int32)
    return toks, base, None, hidden, jnp.concatenate([bonus[None], toks[:-1]])
  p = params.dspark
  state0 = jnp.zeros((max(f.markov_rank, 1),), jnp.float32)

  def body(carry, xs):
    prev, state = carry
    row, h, j = xs
    if f.markov_rank:
      bias, state = _step(p, f, h, prev, state, rt)
      row = row + bias
    if draw is None:
      tok, q = jnp.argmax(row).astype(jnp.int32), jnp.zeros((0,), jnp.float32)
    else:
      tok, q = draw(row, j)
      tok = jnp.asarray(tok, jnp.int32)
    return (tok, state), (tok, row, q, prev)

  _, (toks, rows, q, prev) = jax.lax.scan(
      body, (bonus, state0), (base, hidden, jnp.arange(n, dtype=jnp.int32)))
  return toks, rows, (None if draw is None else q), hidden, prev


def propose(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
            bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime,
            n_logits: Optional[int] = None) -> tuple[jax.Array, DraftCache]:
  """One DSpark block as the decode loop's proposal rows (the `draft.propose` interface): the
  greedy Markov chain's corrected logits, row j for position start+1+j (each row's argmax is the
  chain's token there, so a chain verifies the chain; the loop's DDTree uses these rows only
  without a Markov head or under a grammar / table mix, else `tree`). n_logits: static, 1..L
  (default L).
  Returns (rows [n_logits, V] float32, the cache unchanged)."""
  _, rows, _, _, _ = chain(params, cfg, embed, lm_head, bonus, start, cache, rt, n=n_logits)
  return rows, cache


def tree(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
         bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime, *, depth: int,
         budget: int, top_k: int, chain_seed: bool = True, temp: float = 1.0) -> tree_lib.Tree:
  """A DDTree whose every node's children come from the Markov head conditioned on that node's
  own token (and, for RNN heads, its own path's state): `tree.build_tree_cond` over the block's
  slots, child rows log_softmax((lm_head(h_d) + bias(node token)) / temp). The top-1 chain is the
  greedy Markov chain (`chain`); a branch off it continues with its own predecessor instead of
  the chain's (DDTree over `propose`'s rows). depth: static, 1..L. Needs a Markov head."""
  f = cfg.dspark
  if not f.markov_rank:
    raise ValueError("dspark.tree needs a Markov head (markov_rank > 0)")
  hidden, base = _block(params, cfg, embed, lm_head, bonus, start, cache, rt, depth)

  def child_fn(d, token, state):
    bias, state = _step(params.dspark, f, hidden[d], token, state, rt)
    return jax.nn.log_softmax((base[d] + bias) / temp), state

  return tree_lib.build_tree_cond(child_fn, jnp.asarray(bonus, jnp.int32),
                                  jnp.zeros((f.markov_rank,), jnp.float32), depth=depth,
                                  budget=budget, top_k=top_k, chain_seed=chain_seed)
