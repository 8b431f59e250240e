"""The EAGLE-3 training objective (arXiv:2503.01840, training-time test; the speculators and
SpecForge trainers): every response position starts a chain of n draft steps unrolled on the
draft's own outputs (`eagle3.ttt_hidden`), step j trained on the token j + 1 after the chain's
start with weight exp(-j / gamma), cross-entropy over the draft vocabulary plus a distillation
term (KL from the target's next-token distribution, renormalised over the draft vocabulary, as
SpecForge distils it). Target features are computed online in the same jit
(`objective.target_pass`); the target's embedding is frozen and shared, the draft's lm_head
(over the draft vocabulary) is trained.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import eagle3
from dflash_jax.config import TargetConfig
from dflash_jax.runtime import Runtime
from dflash_jax.train import objective


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SeqBatch:
  """B whole sequences for the EAGLE-3 objective.

  Attributes:
    tokens: [B, T + n] int32 prompt + response ids, zero past each sequence's end (n = the
      draft steps trained: step j reads tokens[j:j + T], its labels tokens[j + 1:j + 1 + T]).
    lengths: [B] int32 real tokens per row.
    prompt_lens: [B] int32 prompt tokens per row (labels count from there on).
  """

  tokens: jax.Array
  lengths: jax.Array
  prompt_lens: jax.Array


def make_seq_batch(rng: np.random.Generator, seqs, *, seq_len: int, n_steps: int) -> SeqBatch:
  """Pad sequences (objects with `.tokens` [N] int and `.prompt_len`, e.g. shards.TokenSeq) to
  seq_len (+ n_steps); a longer one keeps a random window of seq_len tokens
  (`objective.make_batch`'s rule). Returns a SeqBatch of numpy arrays."""
  b = len(seqs)
  tokens = np.zeros((b, seq_len + n_steps), np.int32)
  lengths = np.zeros((b,), np.int32)
  plens = np.zeros((b,), np.int32)
  for i, s in enumerate(seqs):
    t, p = objective.window(rng, s, seq_len)
    tokens[i, :t.size] = t
    lengths[i], plens[i] = t.size, p
  return SeqBatch(tokens=tokens, lengths=lengths, prompt_lens=plens)


def draft_vocab(seqs, n_vocab: int, size: int) -> np.ndarray:
  """The draft vocabulary of a fresh EAGLE-3 draft: [min(size, n_vocab)] int32, sorted, the ids
  most frequent in the sequences' responses (ties to the lower id; then the most frequent prompt
  ids, then the lowest unused ids, when the responses hold fewer distinct ids), as SpecForge
  picks its draft vocabulary from the target's generated data. Raises ValueError for size < 1 or
  an id outside [0, n_vocab)."""
  if size < 1:
    raise ValueError(f"draft_vocab: size {size} must be >= 1")
  size = min(size, n_vocab)
  resp = np.zeros(n_vocab, np.int64)
  prompt = np.zeros(n_vocab, np.int64)
  for s in seqs:
    t = np.asarray(s.tokens)
    if t.size and (t.min() < 0 or t.max() >= n_vocab):
      raise ValueError(f"draft_vocab: token id outside [0, {n_vocab})")
    p = int(s.prompt_len)
    np.add.at(prompt, t[:p], 1)
    np.add.at(resp, t[p:], 1)
  order = np.lexsort((np.arange(n_vocab), -prompt, -resp))   # resp desc, then prompt, then id
  return np.sort(order[:size]).astype(np.int32)


def ttt_loss(params: eagle3.Eagle3Params, cfg: eagle3.Eagle3Config, batch: SeqBatch, tparams,
             tcfg: TargetConfig, lm_head_w, weights, vocab_ids, kl_weight: float = 0.0,
             rt: Runtime = Runtime(), targets=None):
  """Cross-entropy of the n = len(weights) TTT steps (`eagle3.ttt_hidden`) on the true tokens,
  weighted per step, plus kl_weight x the same-weighted KL(target || draft), both normalised by
  the label weights. A label counts at chain start q >= 1 (row 0 has no predecessor) when it is
  a response token of the row (position >= prompt_len, < length) in the draft vocabulary.

  params: the draft's trainable weights (vocab None). lm_head_w: [V, D] float32 the target's
  (frozen; its rows `vocab_ids` give the KL's target logits). weights: [n] float32
  (`objective.loss_weights(n + 1, gamma)`). vocab_ids: [Vd] int32 sorted, the draft vocabulary
  (row i of params.lm_head is id vocab_ids[i]). kl_weight: static. targets: None (the target's
  prefill runs here) or `objective.batch_targets` of the batch for cfg.target_layer_ids.
  Returns (loss, metrics {"ce", "kl", "acc": top-1 over valid labels, "acc1": at step 0}).
  """
  n = weights.shape[0]
  t_len = batch.tokens.shape[1] - n
  vd = vocab_ids.shape[0]

  def one(tokens, length, tgt):
    feats, hidden = tgt if tgt is not None else objective.target_pass(
        tparams, tcfg, tokens[:t_len], length, cfg.target_layer_ids, rt)
    hs = eagle3.ttt_hidden(params, tparams, cfg, tokens, feats, n, rt)      # [n, T, D]
    d = jnp.einsum("ntd,vd->ntv", hs.astype(rt.cdt), params.lm_head.data.astype(rt.cdt),
                   preferred_element_type=jnp.float32)
    if not kl_weight:
      return d, jnp.zeros(d.shape[:2], jnp.float32)
    tl = objective.head_logits(tparams, tcfg, hidden, lm_head_w[vocab_ids], rt)   # [T, Vd]
    tl = jnp.concatenate([tl, jnp.zeros((n, vd), tl.dtype)])
    t = jnp.stack([tl[j:j + t_len] for j in range(n)])      # step j at q: position q + j
    return d, objective.distill_kl(t, d)

  logits, kl = jax.vmap(one)(batch.tokens, batch.lengths, targets)          # [B, n, T, Vd]
  q = jnp.arange(t_len)
  lab_pos = q[None, :] + jnp.arange(1, n + 1)[:, None]                       # [n, T]
  labels = jnp.stack([batch.tokens[:, j + 1:j + 1 + t_len] for j in range(n)], 1)   # [B, n, T]
  idx, in_vocab = objective.vocab_index(vocab_ids, labels)
  valid = (in_vocab & (q >= 1)[None, None]
           & (lab_pos[None] < batch.lengths[:, None, None])
           & (lab_pos[None] >= batch.prompt_lens[:, None, None]))
  w = weights[None, :, None] * valid
  norm = jnp.maximum(jnp.sum(w), 1e-6)
  ce = objective.weighted_ce(logits, idx, w, norm)
  kl = jnp.sum(kl * w) / norm
  acc, acc1 = objective.top1_accuracy(logits, idx, valid, (jnp.arange(n) == 0)[None, :, None])
  return ce + kl_weight * kl, {"ce": ce, "kl": kl, "acc": acc, "acc1": acc1}


def make_train_step(cfg: eagle3.Eagle3Config, tcfg: TargetConfig, optimizer, weights, *,
                    kl_weight: float = 0.0, mesh=None, rt: Runtime = Runtime()):
  """A jitted EAGLE-3 train step with `objective.make_train_step`'s call signature (params,
  opt_state, batch: SeqBatch, tparams, lm_head_w, vocab_ids: the draft vocabulary (required),
  targets=None) -> (params, opt_state, metrics {loss, ce, kl, acc, acc1, grad_norm}); data
  parallel over a mesh's 'data' axis as that one."""
  step = objective.jit_step(
      lambda params, batch, tparams, lm_head_w, vocab_ids, targets: ttt_loss(
          params, cfg, batch, tparams, tcfg, lm_head_w, weights, vocab_ids, kl_weight, rt,
          targets), optimizer, mesh)

  def call(params, opt_state, batch, tparams, lm_head_w, vocab_ids=None, targets=None):
    if vocab_ids is None:
      raise ValueError("an EAGLE-3 train step needs the draft vocabulary (vocab_ids)")
    return step(params, opt_state, batch, tparams, lm_head_w, vocab_ids, targets)

  return call

