"""The DFlash training objective (arXiv:2602.06036; SpecForge's public trainer): anchors sampled
inside the response; per anchor a block `[x_anchor, MASK x (L-1)]` that sees target features
strictly before the anchor and its own block (bidirectional), never other blocks; cross-entropy
on offsets k = 1..L-1 weighted by exp(-(k-1)/gamma), plus a distillation term (KL from the
target's next-token distribution at the same positions, as ModelOpt / SpecForge add); the
target's embedding and lm_head are frozen and shared.

Target features are computed online: the training step runs the frozen target's prefill over
each stored token sequence inside the same jit as the draft loss (no feature cache on disk).
Data-parallel over a mesh's "data" axis.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax import draft as draft_lib
from dflash_jax import draft2
from dflash_jax import layers
from dflash_jax import target as target_lib
from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.quants import dequantize
from dflash_jax.runtime import Runtime


def sample_anchors(rng: np.random.Generator, prompt_len: int, length: int, n_anchors: int):
  """Anchor positions inside the response: distinct, sorted, from [prompt_len, length-2] (each
  anchor has at least one label). Returns (anchors [n_anchors] int32, valid [n_anchors] bool);
  when fewer positions exist, the rest are padding (valid False, anchor = prompt_len)."""
  cand = np.arange(prompt_len, length - 1)
  k = min(n_anchors, cand.size)
  chosen = np.sort(rng.choice(cand, size=k, replace=False)) if k else np.zeros(0, np.int64)
  anchors = np.full(n_anchors, prompt_len, np.int32)
  anchors[:k] = chosen
  valid = np.arange(n_anchors) < k
  return anchors, valid


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
  """A training batch (B sequences of T tokens, A anchors each, block size L).

  Attributes:
    tokens: [B, T] int32 prompt + response ids (zero past a sequence's end).
    lengths: [B] int32 real tokens per row.
    block_ids: [B, A, L] int32 draft block inputs [x_anchor, MASK x (L-1)].
    anchors: [B, A] int32 positions of the blocks' first rows.
    labels: [B, A, L-1] int32 the tokens at anchor+1..anchor+L-1.
    label_valid: [B, A, L-1] bool labels inside the sequence of a real anchor.
    positions, segments: None (one sequence per row), or [B, T] int32 for packed rows
      (`make_packed_batch`): each row's position inside its own sequence and which sequence
      it belongs to; the target and the draft then see each sequence as if it were alone.
  """

  tokens: jax.Array
  lengths: jax.Array
  block_ids: jax.Array
  anchors: jax.Array
  labels: jax.Array
  label_valid: jax.Array
  positions: Optional[jax.Array] = None
  segments: Optional[jax.Array] = None


def window(rng: np.random.Generator, s, seq_len: int):
  """(tokens, prompt_len) of sequence s, or of a random window of seq_len tokens inside it
  (starting >= 0, the prompt length clipped to >= 1) when it is longer."""
  t, p = np.asarray(s.tokens), int(s.prompt_len)
  if t.size > seq_len:
    start = int(rng.integers(0, t.size - seq_len + 1))
    t = t[start:start + seq_len]
    p = max(p - start, 1)
  return t, p


def make_batch(rng: np.random.Generator, seqs, cfg: DraftConfig, *, seq_len: int,
               n_anchors: int, mask_token_id: int) -> Batch:
  """Pad sequences (objects with `.tokens` [N] int and `.prompt_len`, e.g. shards.TokenSeq) to
  seq_len and sample anchors in their responses. A longer sequence keeps a random window that
  contains response rows (its features are then those of the window alone: keep seq_len above
  the data's longest sequence where possible). Returns a Batch of numpy arrays."""
  L = cfg.block_size
  B = len(seqs)
  tokens = np.zeros((B, seq_len + L), np.int32)
  anchors = np.zeros((B, n_anchors), np.int32)
  avalid = np.zeros((B, n_anchors), bool)
  lengths = np.zeros((B,), np.int32)
  for i, s in enumerate(seqs):
    t, p = window(rng, s, seq_len)
    tokens[i, :t.size] = t
    lengths[i] = t.size
    anchors[i], avalid[i] = sample_anchors(rng, p, t.size, n_anchors)
  lab_end = np.broadcast_to(lengths[:, None], anchors.shape)
  block_ids, labels, lvalid = _block_fields(tokens, anchors, lab_end, avalid, L, mask_token_id)
  return Batch(tokens=tokens[:, :seq_len], lengths=lengths, block_ids=block_ids,
               anchors=anchors, labels=labels, label_valid=lvalid)


def _block_fields(tokens, anchors, lab_end, avalid, L, mask_token_id):
  """(block_ids [B, A, L], labels [B, A, L-1], label_valid) of anchors in padded rows; lab_end
  [B, A]: the end (exclusive) of each anchor's own sequence."""
  B, n_anchors = anchors.shape
  offs = np.arange(L)
  block_ids = np.full((B, n_anchors, L), mask_token_id, np.int32)
  block_ids[..., 0] = np.take_along_axis(tokens, anchors, 1)
  lab_pos = anchors[..., None] + offs[None, None, 1:]                   # [B, A, L-1]
  labels = np.take_along_axis(tokens, lab_pos.reshape(B, -1), 1).reshape(lab_pos.shape)
  lvalid = avalid[..., None] & (lab_pos < lab_end[..., None])
  return block_ids, labels, lvalid


def pack_rows(rng: np.random.Generator, lengths: np.ndarray, n_rows: int, row_len: int,
              max_misses: int = 4) -> list[list[int]]:
  """Which sequences fill n_rows rows of row_len tokens: sequences drawn uniformly at random
  (with replacement) go to the first row with room (first fit, in draw order; one longer than
  row_len takes a row of its own, windowed by `make_packed_batch`) until max_misses draws have
  fit nowhere. The last gaps of a row take whatever short sequence fits, so short sequences are
  drawn a little more often than long ones; max_misses trades that against padding. On
  SmolLM2's shards (mean 394 tokens): rows of 2048 are 96 % real tokens and the drawn mean
  length 378; rows of 1024 are 78 % real (drawn mean 367; unpacked rows of 800: 49 % real).
  lengths: [N] tokens per sequence. Returns n_rows lists of indices into lengths (each
  non-empty)."""
  n = len(lengths)
  if n == 0:
    raise ValueError("pack_rows: no sequences")
  fill = [0] * n_rows
  rows: list[list[int]] = [[] for _ in range(n_rows)]
  misses = 0
  while misses < max_misses:
    i = int(rng.integers(n))
    size = min(int(lengths[i]), row_len)
    r = next((r for r in range(n_rows) if fill[r] + size <= row_len), None)
    if r is None:
      misses += 1
      continue
    rows[r].append(i)
    fill[r] += size
  for r in range(n_rows):          # a row no draw fitted (every sequence longer than its gap)
    if not rows[r]:
      rows[r].append(int(rng.integers(n)))
  return rows


def _spread_anchors(rng: np.random.Generator, sizes: Sequence[int], n_anchors: int) -> np.ndarray:
  """Sorted distinct indices into the concatenation of groups of `sizes` candidates: n_anchors
  split equally between the groups (a group with fewer candidates gives all of them), then
  what is left drawn uniformly from the candidates not yet chosen (at most all of them)."""
  n = len(sizes)
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  quota = np.full(n, n_anchors // n) + (np.arange(n) < n_anchors % n)
  chosen = [starts[j] + rng.choice(sizes[j], size=min(int(quota[j]), sizes[j]), replace=False)
            for j in range(n)]
  chosen = np.concatenate(chosen).astype(np.int64) if chosen else np.zeros(0, np.int64)
  left = min(n_anchors, int(starts[-1])) - chosen.size
  if left > 0:
    rest = np.setdiff1d(np.arange(starts[-1]), chosen)
    chosen = np.concatenate([chosen, rng.choice(rest, size=left, replace=False)])
  return np.sort(chosen)


def make_packed_batch(rng: np.random.Generator, rows: Sequence[Sequence], cfg: DraftConfig, *,
                      seq_len: int, n_anchors: int, mask_token_id: int) -> Batch:
  """Packed rows: each row's sequences (objects with `.tokens` [N] int and `.prompt_len`) back to
  back in seq_len tokens, with per-row positions and segment ids (`Batch`), and n_anchors
  anchors per row split equally between its sequences (as one sequence per row gets its own
  n_anchors, DFlash's anchors per sample: drawn per token instead, a row's long responses would
  take most of them, e.g. on SmolLM2's shards 33 % of anchors in a response's first 128 tokens
  instead of 45 %), each drawn uniformly from its sequence's response rows with a label in the
  same sequence; labels never cross into the next sequence. A sequence longer than seq_len
  keeps a random window (as `make_batch`). Training on it computes, for every block, what the
  same block computes in an unpacked batch (`batch_loss`), with less padding (`pack_rows`).
  Raises ValueError when a row's sequences exceed seq_len (`pack_rows` never does)."""
  L = cfg.block_size
  B = len(rows)
  tokens = np.zeros((B, seq_len + L), np.int32)
  positions = np.zeros((B, seq_len), np.int32)
  segments = np.zeros((B, seq_len), np.int32)
  lengths = np.zeros((B,), np.int32)
  anchors = np.zeros((B, n_anchors), np.int32)
  avalid = np.zeros((B, n_anchors), bool)
  lab_end = np.zeros((B, n_anchors), np.int32)
  for b, row in enumerate(rows):
    at, cand, ends = 0, [], []
    for j, s in enumerate(row):
      t, p = window(rng, s, seq_len)
      if at + t.size > seq_len:
        raise ValueError(f"make_packed_batch: row {b} holds more than seq_len={seq_len} tokens")
      tokens[b, at:at + t.size] = t
      positions[b, at:at + t.size] = np.arange(t.size)
      segments[b, at:at + t.size] = j
      c = np.arange(at + p, at + t.size - 1)
      cand.append(c)
      ends.append(np.full(c.size, at + t.size, np.int32))
      at += t.size
    segments[b, at:] = len(row)                          # padding: a segment of its own
    positions[b, at:] = np.arange(seq_len - at)
    lengths[b] = at
    pick = _spread_anchors(rng, [c.size for c in cand], n_anchors)
    cand, ends = np.concatenate(cand), np.concatenate(ends)
    k = pick.size
    anchors[b, :k], lab_end[b, :k] = cand[pick], ends[pick]
    avalid[b, :k] = True
  block_ids, labels, lvalid = _block_fields(tokens, anchors, lab_end, avalid, L, mask_token_id)
  return Batch(tokens=tokens[:, :seq_len], lengths=lengths, block_ids=block_ids,
               anchors=anchors, labels=labels, label_valid=lvalid, positions=positions,
               segments=segments)


def loss_weights(block_size: int, gamma: float, n_offsets: int = 0) -> np.ndarray:
  """[K] float32 weights exp(-(k-1)/gamma) for offsets k = 1..K (DFlash's position decay), K =
  n_offsets, 0 meaning all L-1 = block_size - 1. `batch_loss` computes the loss (and pays the
  lm_head) on the first K offsets of each block only; the draft still runs the whole block, so
  decoding sees the block it was trained on. Raises ValueError for K outside [0, L-1]."""
  if not 0 <= n_offsets <= block_size - 1:
    raise ValueError(f"loss offsets {n_offsets} outside [0, block_size - 1 = {block_size - 1}] "
                     "(0: all)")
  k = np.arange(1, (n_offsets or block_size - 1) + 1)
  return np.exp(-(k - 1) / gamma).astype(np.float32)


def target_pass(tparams, tcfg: TargetConfig, tokens: jax.Array, length: jax.Array,
                feature_layers: tuple[int, ...], rt: Runtime, positions=None, segments=None):
  """The frozen target over one sequence (positions 0.., the rows from `length` on padding), or
  over a packed row of several (positions / segments [T] int32 given), through
  `target.forward_packed` (its layers a `lax.scan`; each sequence's rows equal its own `prefill`
  from position 0 up to float rounding): (features [T, F*D] float32 at `feature_layers`, final
  hidden [T, D] float32), no gradient. tokens: [T] int32 of which `length` are real."""
  if positions is None:              # one sequence; the padding rows are a segment of their own
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    positions, segments = rows, (rows >= length).astype(jnp.int32)
  hidden, feats = target_lib.forward_packed(tparams, tcfg, tokens, positions, segments, rt,
                                            feature_layers=feature_layers)
  return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(hidden)


def batch_targets(tparams, tcfg: TargetConfig, batch: Batch, feature_layers: tuple[int, ...],
                  rt: Runtime = Runtime()):
  """`target_pass` over every row of a batch: (features [B, T, F*D], hidden [B, T, D]) float32,
  to pass as `batch_loss(targets=...)` when several drafts with the same target_layer_ids train
  on one batch (the target's prefill, most of a small draft's step, is then paid once)."""
  return jax.vmap(lambda t, n, p, s: target_pass(tparams, tcfg, t, n, feature_layers, rt, p, s))(
      batch.tokens, batch.lengths, batch.positions, batch.segments)


def data_vocab(seqs, n_vocab: int) -> np.ndarray:
  """The loss vocabulary of a restricted-vocabulary run: [N] int32, the sorted distinct token ids
  of `seqs` (objects with `.tokens`), so every label a batch of them can hold is in it. EAGLE-3
  trains its draft over a reduced vocabulary for the same reason (the lm_head's softmax dominates
  a small draft's step); here decoding keeps the target's whole lm_head and only the loss's
  softmax is restricted. Raises ValueError for no tokens or an id outside [0, n_vocab)."""
  seen = np.zeros(n_vocab, bool)
  for s in seqs:
    t = np.asarray(s.tokens)
    if t.size and (t.min() < 0 or t.max() >= n_vocab):
      raise ValueError(f"data_vocab: token id outside [0, {n_vocab})")
    seen[t] = True
  if not seen.any():
    raise ValueError("data_vocab: no tokens")
  return np.flatnonzero(seen).astype(np.int32)


def distill_kl(t_logits: jax.Array, d_logits: jax.Array) -> jax.Array:
  """KL(p_target || q_draft) per position: sum_v p (log p - log q), natural log, float32.
  t_logits, d_logits: [..., V]. Returns [...]."""
  lp = jax.nn.log_softmax(t_logits.astype(jnp.float32), axis=-1)
  lq = jax.nn.log_softmax(d_logits.astype(jnp.float32), axis=-1)
  return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def vocab_index(vocab_ids, labels):
  """Labels as indices into a restricted vocabulary. vocab_ids: [N] int32 sorted distinct token
  ids; labels: [...] int32 token ids. Returns (idx [...] int32 in [0, N), in_vocab [...] bool:
  the label is vocab_ids[idx]); a label outside vocab_ids gets in_vocab False (its idx is any)."""
  idx = jnp.clip(jnp.searchsorted(vocab_ids, labels), 0, vocab_ids.shape[0] - 1)
  return idx.astype(jnp.int32), vocab_ids[idx] == labels


def head_logits(tparams, tcfg: TargetConfig, hidden, head, rt: Runtime = Runtime()):
  """The target's logits over the rows of `head`: its output norm (RMSNorm, tparams.out_norm)
  of hidden [T, D] (the last layer's residual stream), times head [N, D] (the target's lm_head
  rows of a restricted vocabulary, float32), in rt.cdt with float32 accumulation -> [T, N]
  float32; with all V rows it is `target.logits` up to the matmul's precision."""
  return jnp.einsum("td,vd->tv", layers.rms_norm(hidden, tparams.out_norm, tcfg.rms_eps)
                    .astype(rt.cdt), head.astype(rt.cdt), preferred_element_type=jnp.float32)


def weighted_ce(logits, labels, w, norm):
  """The weighted mean negative log-likelihood of labels: sum(w x -log softmax(logits)[label]) /
  norm. logits: [..., V] float32; labels: [...] int32 indices into V; w: [...] float32 (zero
  where a label does not count); norm: scalar float32 (normally max(sum(w), eps))."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * w) / norm


def top1_accuracy(logits, labels, valid, first):
  """(acc, acc1): the share of valid labels that are the argmax of logits, over all of them and
  over those where `first` holds (the first block offset / TTT step). logits: [..., V]; labels:
  [...] int32; valid: [...] bool; first: bool broadcastable to labels. Empty sets give 0."""
  return hit_rates(jnp.argmax(logits, -1) == labels, valid, first)


def hit_rates(hit, valid, first):
  """(acc, acc1) of per-label hits (top-1 correct): the share of valid labels hit, over all of
  them and over those where `first` holds. hit, valid: [...] bool; first: bool broadcastable to
  them. Empty sets give 0."""
  hit = hit & valid
  acc = jnp.sum(hit) / jnp.maximum(jnp.sum(valid), 1)
  acc1 = jnp.sum(hit & first) / jnp.maximum(jnp.sum(valid & first), 1)
  return acc, acc1


HEAD_CHUNK = 2048


def fused_head_loss(h, head, labels, ce_w, kl_w=None, t_lp=None, t_idx=None, *,
                    chunk: int = HEAD_CHUNK, compute_dtype=jnp.float32):
  """The draft's lm_head, cross-entropy and KL in one pass over chunks of rows, never holding
  the [R, N] logits (the step's largest arrays: 24 packed rows of 245 blocks x 15 offsets over
  a 29k-id loss vocabulary are 10 GB in float32 per copy), with its gradient formed in the
  same pass (cut cross-entropy / fused linear cross-entropy, as Liger-Kernel and Apple's
  CCE do; here the lm_head and the target are frozen, so only h gets a gradient).

  Per row r: z = h_r @ head^T (compute_dtype operands, float32 accumulation), log q =
  log_softmax(z), nll_r = -log q[labels_r], kl_r = sum_v p (log p - log q) with log p =
  t_lp[t_idx_r] (the target's log-probabilities over the same N ids); loss = sum_r ce_w_r nll_r
  + kl_w_r kl_r, and dloss/dz_r = ce_w_r (q - onehot(labels_r)) + kl_w_r (q - p), so dloss/dh_r =
  that @ head, computed chunk by chunk in the forward pass and scaled by the loss's cotangent.

  h: [R, D] float32; head: [N, D] float (frozen: its cotangent is zero, as are t_lp's);
  labels: [R] int32 in [0, N); ce_w, kl_w: [R] float32 (a row with both zero does not count);
  t_lp: [M, N] float32 log-probabilities and t_idx [R] int32 rows of it, or all three None (no
  KL term). chunk: static rows per pass (R is padded to a multiple). Returns (loss [] float32,
  nll [R], kl [R] (zeros without t_lp), hit [R] bool: argmax z == label); the last three are
  metrics, outside the gradient. Equal to the materialized form (`batch_loss(head_chunk=0)`)
  up to float rounding (tests/test_train.py)."""
  has_kl = t_lp is not None
  if (kl_w is None) != (t_lp is None) or (t_idx is None) != (t_lp is None):
    raise ValueError("fused_head_loss: kl_w, t_lp and t_idx are given together or not at all")
  r, d = h.shape
  c = max(1, min(int(chunk), r))
  if not has_kl:
    kl_w, t_idx = jnp.zeros((r,), jnp.float32), jnp.zeros((r,), jnp.int32)

  def pass_(head_c, t_lp_, x):
    hc, lab, a, b, ti = x
    z = jnp.dot(hc.astype(compute_dtype), head_c.T, preferred_element_type=jnp.float32)
    lq = jax.nn.log_softmax(z, axis=-1)
    q = jnp.exp(lq)
    nll = -jnp.take_along_axis(lq, lab[:, None], axis=-1)[:, 0]
    g = a[:, None] * (q - jax.nn.one_hot(lab, z.shape[-1], dtype=jnp.float32))
    kl = jnp.zeros_like(nll)
    if has_kl:
      lp = t_lp_[ti]
      p = jnp.exp(lp)
      kl = jnp.sum(p * (lp - lq), axis=-1)
      g = g + b[:, None] * (q - p)
    dh = jnp.dot(g.astype(compute_dtype), head_c, preferred_element_type=jnp.float32)
    return nll, kl, jnp.argmax(z, -1) == lab, dh

  def fwd(h_, head_, labels_, ce_w_, kl_w_, t_lp_, t_idx_):
    pad = -r % c
    xs = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, c, *a.shape[1:])
               for a in (h_, labels_, ce_w_, kl_w_, t_idx_))
    head_c = head_.astype(compute_dtype)
    nll, kl, hit, dh = jax.lax.map(lambda x: pass_(head_c, t_lp_, x), xs)
    nll, kl, hit = (v.reshape(-1)[:r] for v in (nll, kl, hit))
    loss = jnp.sum(ce_w_ * nll) + jnp.sum(kl_w_ * kl)
    return (loss, nll, kl, hit), dh.reshape(-1, d)[:r].astype(h_.dtype)

  @jax.custom_vjp
  def f(h_, head_, labels_, ce_w_, kl_w_, t_lp_, t_idx_):
    return fwd(h_, head_, labels_, ce_w_, kl_w_, t_lp_, t_idx_)[0]

  def bwd(dh, cts):                  # only h is trained: the head and the target are frozen
    return dh * cts[0], None, None, None, None, None, None

  f.defvjp(fwd, bwd)
  loss, nll, kl, hit = f(h, jax.lax.stop_gradient(head), labels, ce_w, kl_w,
                         None if t_lp is None else jax.lax.stop_gradient(t_lp), t_idx)
  return loss, jax.lax.stop_gradient(nll), jax.lax.stop_gradient(kl), hit


def batch_loss(params, cfg: DraftConfig, batch: Batch, tparams, tcfg: TargetConfig, lm_head_w,
               weights, kl_weight: float = 0.0, rt: Runtime = Runtime(), vocab_ids=None,
               targets=None, head_chunk: int = HEAD_CHUNK, remat_attention: bool = False):
  """Weighted cross-entropy on the target's tokens plus kl_weight x the weighted KL from the
  target's next-token distribution (its logits at position anchor+k-1 predict the label at
  anchor+k), both normalised by the label weights; target features computed online
  (`target_pass`). lm_head_w: [V, D] frozen (the target's). kl_weight: static. weights: [K]
  float32 (`loss_weights`), K <= L-1: the loss covers offsets 1..K of each block (the draft runs
  the whole block; only K rows per block go through the lm_head), so K = L-1 with zero weights
  past offset K' gives the same loss as K = K'.

  DFlash-2 drafts (cfg.dflash2): the draft's logits are `draft2.cap_logits` of the lm_head
  outputs (the selector's unary term) and the distribution trained is the selector's,
  teacher-forced: scores = unary + `draft2.pairwise_scores` with each row's true predecessor
  (the anchor, then the labels), over the whole vocabulary. The z-lab package ships no
  objective; this one is ours: loss = CE(scores) + CE(unary) (so the label is among the
  unary top-k the selector rescores at decode time) + kl_weight x KL(target || scores).

  vocab_ids: None (the whole vocabulary) or [N] int32 sorted distinct ids (`data_vocab`): the
  softmaxes of the cross-entropy and of both sides of the KL run over these N ids only (the
  target's distribution renormalised over them), so the lm_head matmuls of the draft rows and of
  the target's KL rows cost N / V of the full ones. Labels must lie in it (`data_vocab` of the
  sequences guarantees it; a valid label outside it would count as invalid). DFlash-1 only.
  targets: None (the target's prefill runs here) or `batch_targets` of this batch for
  cfg.target_layer_ids (computed once for several drafts).
  head_chunk: static; > 0: a DFlash-1 draft's lm_head, softmaxes and their gradient run
  `fused_head_loss` over chunks of that many label rows (the [B, A, K, N] logits, the target's
  gathered log-probabilities and their gradients are never materialized); 0: the materialized
  form (the reference it is tested against; DFlash-2 drafts always take it).
  remat_attention: static; the draft's attention scores are recomputed in the backward pass
  (`draft.train_hidden`), for memory.
  Returns (loss, metrics {"ce", "kl", "acc": top-1 accuracy over valid labels, "acc1": at
  offset 1; DFlash-2 adds "ce_unary"}); ce / kl / acc are the selector's for DFlash-2.
  Raises ValueError for vocab_ids with a DFlash-2 draft.
  """
  L = cfg.block_size
  K = weights.shape[0]
  if not 1 <= K <= L - 1:
    raise ValueError(f"batch_loss: {K} loss weights for block size {L} (1..{L - 1})")
  two = cfg.dflash2 is not None
  labels, label_valid = batch.labels[..., :K], batch.label_valid[..., :K]
  head = lm_head_w
  if vocab_ids is not None:
    if two:
      raise ValueError("a restricted loss vocabulary (vocab_ids) is for DFlash-1 drafts only")
    head = lm_head_w[vocab_ids]                                              # [N, D]
    labels, in_vocab = vocab_index(vocab_ids, labels)
    label_valid = label_valid & in_vocab

  fused = head_chunk > 0 and not two
  if vocab_ids is None:
    t_logits = lambda x: target_lib.logits(tparams, tcfg, x, rt)          # noqa: E731
  else:                                  # the target's output norm, then its lm_head rows in N
    t_logits = lambda x: head_logits(tparams, tcfg, x, head, rt)          # noqa: E731

  def one(tokens, length, block_ids, anchors, tgt, positions, segments):
    feats, hidden = tgt if tgt is not None else target_pass(
        tparams, tcfg, tokens, length, cfg.target_layer_ids, rt, positions, segments)
    fwd = draft2.train_hidden if two else draft_lib.train_hidden
    h = fwd(params, cfg, feats, block_ids, anchors, tparams.embed, rt, positions, segments,
            remat_attention)
    rows = jnp.clip(anchors[:, None] + jnp.arange(K), 0, tokens.shape[0] - 1)       # [A, K]
    if fused:                            # the target's log-probabilities and their row per label
      if not kl_weight:
        return h[:, 1:K + 1], None, None
      if rows.size >= tokens.shape[0]:   # blocks overlap: every position's once, indexed
        return h[:, 1:K + 1], jax.nn.log_softmax(t_logits(hidden), axis=-1), rows
      return (h[:, 1:K + 1], jax.nn.log_softmax(t_logits(hidden[rows.reshape(-1)]), axis=-1),
              jnp.arange(rows.size, dtype=jnp.int32).reshape(rows.shape))
    d = jnp.einsum("ald,vd->alv", h[:, 1:K + 1].astype(rt.cdt), head.astype(rt.cdt),
                   preferred_element_type=jnp.float32)
    sel = d
    if two:
      d = draft2.cap_logits(d, cfg)
      sel = d + draft2.pairwise_scores(params, h[:, 1:K + 1], tokens[rows], rt)
    if not kl_weight:
      return d, sel, jnp.zeros(d.shape[:2], jnp.float32)
    if rows.size >= tokens.shape[0]:     # blocks overlap: every position's logits once, gathered
      t = t_logits(hidden)[rows.reshape(-1)].reshape(d.shape)
    else:
      t = t_logits(hidden[rows.reshape(-1)]).reshape(d.shape)
    return d, sel, distill_kl(t, sel)

  out = jax.vmap(one)(batch.tokens, batch.lengths, batch.block_ids, batch.anchors, targets,
                      batch.positions, batch.segments)
  w = weights[None, None, :] * label_valid
  norm = jnp.maximum(jnp.sum(w), 1e-6)
  first = jnp.arange(K) == 0
  if fused:
    hk, t_lp, t_rows = out                                  # [B, A, K, D], [B, M, N], [B, A, K]
    ce_w = jax.lax.stop_gradient(w / norm).reshape(-1)
    kw = None
    if kl_weight:
      t_rows = t_rows + t_lp.shape[1] * jnp.arange(t_lp.shape[0], dtype=jnp.int32)[:, None, None]
      t_lp, t_rows = t_lp.reshape(-1, t_lp.shape[-1]), t_rows.reshape(-1)
      kw = kl_weight * ce_w
    total, nll, kl, hit = fused_head_loss(
        hk.reshape(-1, hk.shape[-1]), head, labels.reshape(-1), ce_w, kw, t_lp, t_rows,
        chunk=head_chunk, compute_dtype=rt.cdt)
    acc, acc1 = hit_rates(hit.reshape(w.shape), label_valid, first)
    return total, {"ce": jnp.sum(ce_w * nll), "kl": jnp.sum(ce_w * kl), "acc": acc, "acc1": acc1}
  unary, logits, kl = out
  ce = weighted_ce(logits, labels, w, norm)
  kl = jnp.sum(kl * w) / norm
  acc, acc1 = top1_accuracy(logits, labels, label_valid, first)
  metrics = {"ce": ce, "kl": kl, "acc": acc, "acc1": acc1}
  loss = ce + kl_weight * kl
  if two:
    metrics["ce_unary"] = weighted_ce(unary, labels, w, norm)
    loss = loss + metrics["ce_unary"]
  return loss, metrics


def frozen_target_tensors(target):
  """(target params, lm_head [V, D] float32): the frozen target the step runs (features, KL)
  and its lm_head shared with the draft, never trained."""
  return target.params, dequantize(target.params.lm_head, jnp.float32)


def make_train_step(cfg: DraftConfig, tcfg: TargetConfig, optimizer, weights, *,
                    kl_weight: float = 0.0, mesh=None, rt: Runtime = Runtime(),
                    head_chunk: int = HEAD_CHUNK, remat_attention: bool = False):
  """A jitted train step (params, opt_state, batch, tparams, lm_head_w, vocab_ids=None,
  targets=None) -> (params, opt_state, metrics) (vocab_ids: `batch_loss`'s restricted loss
  vocabulary; targets: `batch_targets` of the batch, computed once for several drafts;
  head_chunk, remat_attention: as in `batch_loss`). With a
  mesh, the batch is sharded over its 'data' axis (data parallel) and params / optimizer state /
  target are replicated; XLA inserts the gradient all-reduce."""
  return jit_step(lambda params, batch, tparams, lm_head_w, vocab_ids, targets: batch_loss(
      params, cfg, batch, tparams, tcfg, lm_head_w, weights, kl_weight, rt, vocab_ids, targets,
      head_chunk, remat_attention), optimizer, mesh)


def jit_step(loss_fn, optimizer, mesh=None):
  """The jitted optimizer step of a loss: loss_fn(params, batch, tparams, lm_head_w, vocab_ids,
  targets) -> (loss, metrics); returns call(params, opt_state, batch, tparams, lm_head_w,
  vocab_ids=None, targets=None) -> (params, opt_state, metrics + loss, grad_norm), params and
  optimizer state donated. With a mesh, the batch (and targets) are sharded over its 'data' axis
  (data parallel), everything else replicated; XLA inserts the gradient all-reduce."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  def step(params, opt_state, batch, tparams, lm_head_w, vocab_ids, targets):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch, tparams, lm_head_w, vocab_ids, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  if mesh is None:
    jitted = jax.jit(step, donate_argnums=(0, 1))
  else:
    rep = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("data"))
    jitted = jax.jit(step, donate_argnums=(0, 1),
                     in_shardings=(rep, rep, data, rep, rep, rep, data),
                     out_shardings=(rep, rep, rep))

  def call(params, opt_state, batch, tparams, lm_head_w, vocab_ids=None, targets=None):
    return jitted(params, opt_state, batch, tparams, lm_head_w, vocab_ids, targets)

  return call
