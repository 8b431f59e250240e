"""Sampling: the processed target distribution and the lossless speculative acceptance rules.

The processed distribution follows llama.cpp's default sampler chain for these four settings
(common/sampling.cpp; src/llama-sampling.cpp): top-k -> top-p -> min-p -> temperature -> draw.
  * top-k (k > 0): keep the k highest logits.
  * top-p (p < 1): softmax over the kept tokens, sort descending, keep the shortest prefix whose
    probability mass reaches p (at least one token).
  Ties exactly at a top-k / top-p boundary are all kept (llama.cpp keeps the subset its
  unstable sort happens to put first).
  * min-p (m > 0): keep tokens whose logit >= max logit + log(m), i.e. p(x) >= m * p(top).
  * temperature T > 0: softmax(logits / T) over the kept tokens. (T = 0 is greedy decoding, which
    does not come here: the decode loop takes the argmax.)
Truncation thus happens on the untempered logits, as in llama.cpp.

Before them, as first links of llama.cpp's chain (logit_bias, then penalties), and for greedy
rows too (`apply_rules`):
  * logit_bias: a value added to the logit of each listed token (OpenAI's -100..100; -100 bans).
  * penalties (llama_sampler_penalties_apply) over the last `penalty_last_n` tokens of the
    sequence, prompt included (each tree node: the sequence up to and including that node): a
    token seen c > 0 times gets logit * repeat_penalty (logit <= 0) or / repeat_penalty
    (logit > 0), then - c * frequency_penalty - presence_penalty.
Every verified node gets the rules of its own path, so greedy / sampled speculative output is
exactly autoregressive output under the same rules.

Speculative rules (all exact: the distribution of generated sequences equals autoregressive
sampling from the processed target distribution):
  * "match" (sample-and-match; the z-lab DFlash and DDTree reference loops): at each node of
    the verified tree, draw the target's token from its processed distribution with the key
    of the position it predicts (`draw_at`: fold_in(row key, position), the key autoregressive
    decoding and the prefill's first token use too), and follow the child carrying that token
    (`tree.follow` with the draws as the posterior). Every emitted token is a fresh target draw
    given its own prefix (a position's key is used once along the followed path, and the tree
    does not depend on it), and it is the very token AR draws there with the same seed: AR,
    lookup, DDTree and a match chain give a seed the same text. Works for any tree; it is what
    DDTree uses here.
  * "rejection" (the standard speculative sampling rule, Leviathan et al. 2023 / Chen et al.
    2023; PyPI dflash 0.1.0 `_rejection_sample`): chain drafts are drawn from the draft's
    processed distribution q; draft d_i is accepted with probability min(1, p_i(d_i)/q_i(d_i));
    at the first rejection the token is drawn from normalize(max(p_i - q_i, 0)); after a fully
    accepted block the bonus is drawn from p_L.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.config import check_int, check_number

# The target's token at position p of a sequence is drawn with fold_in(row key, p), at the end
# of prefill and in every decode step alike (`draw_at`); the draft's draws and the rejection rule
# use per-step keys fold_in(row key, 2**31 - 1 - n) for step n, apart from those.
MAX_LOGIT_BIAS = 300          # tokens a logit_bias may list (static size of the row's table)
PENALTY_WINDOW = 256          # largest penalty_last_n (the recent-token window a row carries)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Sampling settings as a user gives them (host side).

  Attributes:
    temperature: 0 = greedy (bit-identical to the greedy decoder); > 0 samples.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in (0, 1] (1 = off).
    min_p: relative probability floor in [0, 1) (0 = off). seed: base of the PRNG key.
    logit_bias: ((token id, bias), ...) added to those logits (at most MAX_LOGIT_BIAS distinct
      ids, bias in [-100, 100]; ids are checked against the vocabulary by the decoder's caller).
    repeat_penalty (> 0, 1 = off), presence_penalty, frequency_penalty ([-2, 2], 0 = off) over
      the last penalty_last_n tokens ([0, PENALTY_WINDOW]; 64 as llama.cpp's default).
    All apply to greedy rows too (greedy = the argmax of the adjusted logits).

  Raises ValueError naming the field for a value out of range.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int = 0
  logit_bias: tuple = ()
  repeat_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  penalty_last_n: int = 64

  def __post_init__(self):
    check_number(self, "temperature", 0.0, 1e4)
    check_number(self, "top_p", 0.0, 1.0, lo_open=True)
    check_number(self, "min_p", 0.0, 1.0)
    check_int(self, "top_k", 0, 2**31 - 1)
    check_int(self, "seed", 0, 2**31 - 1)
    check_number(self, "repeat_penalty", 0.0, 100.0, lo_open=True)
    check_number(self, "presence_penalty", -2.0, 2.0)
    check_number(self, "frequency_penalty", -2.0, 2.0)
    check_int(self, "penalty_last_n", 0, PENALTY_WINDOW)
    bias = self.logit_bias
    if isinstance(bias, dict):
      bias = tuple(bias.items())
    try:
      bias = tuple((int(t), float(b)) for t, b in bias)
    except (TypeError, ValueError):
      raise ValueError("SamplingConfig.logit_bias: expected (token id, bias) pairs") from None
    ids = [t for t, _ in bias]
    if len(set(ids)) != len(ids) or len(ids) > MAX_LOGIT_BIAS or any(t < 0 for t in ids):
      raise ValueError(f"SamplingConfig.logit_bias: at most {MAX_LOGIT_BIAS} distinct "
                       "non-negative token ids")
    if any(not -100.0 <= b <= 100.0 for _, b in bias):
      raise ValueError("SamplingConfig.logit_bias: biases must be in [-100, 100]")
    object.__setattr__(self, "logit_bias", tuple(sorted(bias)))

  @property
  def has_rules(self) -> bool:
    """True when logit_bias or a penalty is on."""
    return bool(self.logit_bias) or (self.penalty_last_n > 0 and (
        self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or
        self.frequency_penalty != 0.0))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def params(self) -> "SamplingParams":
    """The traced form a row of the decode loop carries (temperature 0 = a greedy row)."""
    ids = np.zeros(MAX_LOGIT_BIAS, np.int32)
    vals = np.zeros(MAX_LOGIT_BIAS, np.float32)
    for i, (t, b) in enumerate(self.logit_bias):
      ids[i], vals[i] = t, b
    return SamplingParams(temperature=jnp.float32(self.temperature), top_k=jnp.int32(self.top_k),
                          top_p=jnp.float32(self.top_p), min_p=jnp.float32(self.min_p),
                          bias_ids=jnp.asarray(ids), bias_vals=jnp.asarray(vals),
                          repeat=jnp.float32(self.repeat_penalty),
                          presence=jnp.float32(self.presence_penalty),
                          frequency=jnp.float32(self.frequency_penalty),
                          last_n=jnp.int32(self.penalty_last_n))

  def describe(self) -> str:
    rules = ""
    if self.logit_bias:
      rules += f", logit_bias on {len(self.logit_bias)} tokens"
    if self.has_rules and self.penalty_last_n:
      rules += (f", penalties repeat {self.repeat_penalty:g} presence {self.presence_penalty:g} "
                f"frequency {self.frequency_penalty:g} last_n {self.penalty_last_n}")
    if self.greedy:
      return "greedy" + rules
    return (f"temperature {self.temperature:g}, top_k {self.top_k}, top_p {self.top_p:g}, "
            f"min_p {self.min_p:g}, seed {self.seed}" + rules)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Sampling settings as traced values (changing them does not recompile): temperature [] f32
  (> 0), top_k [] int32 (0 = off), top_p [] f32 (1 = off), min_p [] f32 (0 = off); the rules:
  bias_ids [MAX_LOGIT_BIAS] int32 / bias_vals [MAX_LOGIT_BIAS] f32 (unused entries: bias 0),
  repeat, presence, frequency [] f32, last_n [] int32."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  bias_ids: jax.Array
  bias_vals: jax.Array
  repeat: jax.Array
  presence: jax.Array
  frequency: jax.Array
  last_n: jax.Array


def rules_on(sp: SamplingParams) -> jax.Array:
  """[] bool (or [B] for a batch of rows' params): a logit_bias entry or a penalty is on."""
  return jnp.any(sp.bias_vals != 0, axis=-1) | ((sp.last_n > 0) & (
      (sp.repeat != 1.0) | (sp.presence != 0.0) | (sp.frequency != 0.0)))


def apply_rules(logits: jax.Array, sp: SamplingParams, recent: jax.Array, recent_pos: jax.Array,
                tokens: jax.Array, token_pos: jax.Array, anc: jax.Array, end: jax.Array) -> jax.Array:
  """logit_bias, then llama.cpp's penalties, per node (see the module docstring).

  logits: [N, V] float; recent: [W] int32 tokens of the committed sequence at positions
  recent_pos [W] int32 (negative: no token); tokens: [N] int32 the nodes' own tokens at
  token_pos [N] int32 (negative: none); anc: [N, N] bool anc[i, j] = node j is node i or its
  ancestor; end: [N] int32 the position of the last token node i's logits follow (its window
  is positions (end - last_n, end]). Returns [N, V] float32. Work is sparse: only the tokens
  of the window and the nodes are touched (every candidate computes its token's penalized
  value from all its occurrences, so duplicate candidates write the same value).
  """
  x = logits.astype(jnp.float32).at[:, sp.bias_ids].add(sp.bias_vals[None, :])
  n = x.shape[0]
  cand = jnp.concatenate([recent, tokens])                                  # [C]
  cpos = jnp.concatenate([recent_pos, token_pos])
  member = jnp.concatenate([jnp.ones((n, recent.shape[0]), bool), anc], axis=1)   # [N, C]
  occ = member & (cpos[None, :] >= 0) & (cpos[None, :] <= end[:, None]) & \
      (cpos[None, :] > end[:, None] - sp.last_n)
  same = (cand[:, None] == cand[None, :]).astype(jnp.float32)              # [C, C]
  count = jnp.dot(occ.astype(jnp.float32), same, precision=jax.lax.Precision.HIGHEST)   # [N, C]
  v = jnp.take_along_axis(x, jnp.broadcast_to(cand[None, :], count.shape), axis=1)
  pen = jnp.where(v <= 0, v * sp.repeat, v / sp.repeat) - count * sp.frequency - sp.presence
  v = jnp.where(count > 0, pen, v)
  return x.at[jnp.arange(n)[:, None], cand[None, :]].set(v)


def _order_key(x: jax.Array) -> jax.Array:
  """float32 -> uint32 with the same order (IEEE bits, sign folded)."""
  i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, ok) -> jax.Array:
  """Per row, the largest t in uint32 with ok(t) [R] bool true, by 32 bisection steps; ok must
  be true at t = 0 and monotone (true up to the answer, false above). keys: [R, V] uint32 (only
  the row count is used). Returns [R, 1] uint32."""
  r = keys.shape[0]

  def body(_, c):
    lo, hi = c
    d = hi - lo
    mid = lo + (d >> 1) + (d & 1)                     # ceil((lo + hi) / 2), no overflow
    good = ok(mid[:, None])
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid - 1)

  lo, _ = jax.lax.fori_loop(0, 32, body, (jnp.zeros((r,), jnp.uint32),
                                          jnp.full((r,), 0xFFFFFFFF, jnp.uint32)))
  return lo[:, None]


def _top_k_mask(x: jax.Array, k: jax.Array) -> jax.Array:
  """[R, V] bool: logits >= the k-th largest of the row (k >= 1; ties at the boundary all kept)."""
  keys = _order_key(x)
  k = jnp.minimum(k, x.shape[-1])
  t = _largest_threshold(keys, lambda t: jnp.sum(keys >= t, axis=-1) >= k)
  return keys >= t


def _top_p_mask(x: jax.Array, keep: jax.Array, top_p: jax.Array) -> jax.Array:
  """[R, V] bool: the most likely kept tokens whose softmax mass (over `keep`) first reaches
  top_p: probabilities >= the largest threshold t with mass(p >= t) >= top_p (ties at the
  boundary all kept)."""
  probs = jax.nn.softmax(jnp.where(keep, x, -jnp.inf), axis=-1)
  keys = _order_key(probs)
  t = _largest_threshold(
      keys, lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0), axis=-1) >= top_p)
  return keep & (keys >= t)


def _truncation_mask(x: jax.Array, sp: SamplingParams) -> jax.Array:
  """[R, V] bool: tokens kept by top-k then top-p. Both find their cut by bisection on the
  values' bit patterns (32 passes over the row, no sort: a sort of [16, 49152] costs ~55 ms
  on 2 CPU cores), each run only when on (lax.cond on the traced settings)."""
  all_ = jnp.ones(x.shape, bool)
  keep = jax.lax.cond(sp.top_k > 0, lambda: _top_k_mask(x, sp.top_k), lambda: all_)
  return jax.lax.cond(sp.top_p < 1.0, lambda: _top_p_mask(x, keep, sp.top_p), lambda: keep)


def process_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """Log-probabilities of the processed distribution (llama.cpp chain: top-k, top-p, min-p,
  temperature). logits: [R, V] float; returns [R, V] float32, -inf for removed tokens."""
  x = logits.astype(jnp.float32)
  keep = _truncation_mask(x, sp)
  top = jnp.max(jnp.where(keep, x, -jnp.inf), axis=-1, keepdims=True)
  keep = keep & ((sp.min_p <= 0) | (x >= top + jnp.log(jnp.maximum(sp.min_p, 1e-30))))
  return jax.nn.log_softmax(jnp.where(keep, x / sp.temperature, -jnp.inf), axis=-1)


def step_stream(n: jax.Array) -> jax.Array:
  """The fold_in value of decode step n's own key (the draft's draws, the rejection rule):
  2**31 - 1 - n, apart from the positions `draw_at` folds in."""
  return jnp.int32(2**31 - 1) - n


def draw_at(key: jax.Array, positions: jax.Array, logp: jax.Array) -> jax.Array:
  """One token per row from log-probabilities logp [R, V], row r's drawn with
  fold_in(key, positions[r]) (positions [R] int32: where the drawn tokens go in the sequence).
  [R] int32."""
  keys = jax.vmap(lambda p: jax.random.fold_in(key, p))(positions)
  return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)


def draw(key: jax.Array, logp: jax.Array) -> jax.Array:
  """One token per row from log-probabilities logp [R, V], independent keys per row. [R] int32."""
  keys = jax.random.split(key, logp.shape[0])
  return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)


def accept_prob(p: jax.Array, q: jax.Array, d: jax.Array) -> jax.Array:
  """min(1, p(d) / q(d)) per row: p, q [R, V] probabilities, d [R] int32 drafts (drawn from q,
  so q(d) > 0). Returns [R] float32."""
  pd = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
  qd = jnp.take_along_axis(q, d[:, None], axis=-1)[:, 0]
  return jnp.minimum(1.0, pd / jnp.maximum(qd, 1e-30))


def residual(p: jax.Array, q: jax.Array) -> jax.Array:
  """normalize(max(p - q, 0)) per row, as log-probabilities [R, V]; where p == q (nothing left,
  a rejection then has probability 0) it falls back to p."""
  r = jnp.maximum(p - q, 0.0)
  s = jnp.sum(r, axis=-1, keepdims=True)
  return jnp.log(jnp.where(s > 0, r / jnp.where(s > 0, s, 1.0), p))


def rejection_chain(key: jax.Array, p_logp: jax.Array, q_logp: jax.Array, drafts: jax.Array):
  """The standard speculative sampling rule over a chain of D drafts.

  p_logp: [D + 1, V] processed target log-probs at the chain's nodes (node i predicts the token
  after it); q_logp: [D, V] processed draft log-probs of the drafts; drafts: [D] int32, drafts[i]
  drawn from q_logp[i] and placed at node i + 1. Returns (n_acc [] int32 accepted drafts,
  bonus [] int32: the residual draw at the first rejection, or a draw from p at node D).
  """
  d = drafts.shape[0]
  k_u, k_res, k_bonus = jax.random.split(key, 3)
  p, q = jnp.exp(p_logp), jnp.exp(q_logp)
  u = jax.random.uniform(k_u, (d,))
  ok = u < accept_prob(p[:d], q, drafts)
  n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32))).astype(jnp.int32)
  i = jnp.minimum(n_acc, d - 1)
  res = jax.random.categorical(k_res, residual(p[i][None], q[i][None])[0]).astype(jnp.int32)
  full = jax.random.categorical(k_bonus, p_logp[d]).astype(jnp.int32)
  return n_acc, jnp.where(n_acc == d, full, res)
