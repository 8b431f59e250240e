"""The DFlash training objective (arXiv:2602.06036; SpecForge's public trainer): anchors sampled
inside the response; per anchor a block `[x_anchor, MASK x (L-1)]` that sees target features
strictly before the anchor and its own block (bidirectional), never other blocks; cross-entropy
on offsets k = 1..L-1 weighted by exp(-(k-1)/gamma); the target's embedding and lm_head are
frozen and shared. Data-parallel over a mesh's "data" axis.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax import draft as draft_lib
from dflash_jax.config import DraftConfig
from dflash_jax.quants import dequantize
from dflash_jax.runtime import Runtime
from dflash_jax.train.data import TrainSeq


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
  """A training batch (B sequences, A anchors each, block size L).

  Attributes:
    feats: [B, T, F*D] float32 target features (zero past a sequence's end).
    block_ids: [B, A, L] int32 draft block inputs [x_anchor, MASK x (L-1)].
    anchors: [B, A] int32 positions of the blocks' first rows.
    labels: [B, A, L-1] int32 the tokens at anchor+1..anchor+L-1.
    label_valid: [B, A, L-1] bool labels inside the sequence of a real anchor.
  """

  feats: jax.Array
  block_ids: jax.Array
  anchors: jax.Array
  labels: jax.Array
  label_valid: jax.Array


def make_batch(rng: np.random.Generator, seqs: list[TrainSeq], cfg: DraftConfig, *, seq_len: int,
               n_anchors: int, mask_token_id: int) -> Batch:
  """Pad sequences to seq_len (longer ones keep a random window that contains response rows)
  and sample anchors. Returns a Batch of numpy arrays."""
  L = cfg.block_size
  B = len(seqs)
  fd = seqs[0].feats.shape[-1]
  tokens = np.zeros((B, seq_len + L), np.int32)
  feats = np.zeros((B, seq_len, fd), np.float32)
  anchors = np.zeros((B, n_anchors), np.int32)
  avalid = np.zeros((B, n_anchors), bool)
  lengths = np.zeros((B,), np.int32)
  for i, s in enumerate(seqs):
    t, f, p = s.tokens, s.feats, s.prompt_len
    if t.size > seq_len:  # keep a window ending inside the sequence, starting >= 0
      start = rng.integers(0, t.size - seq_len + 1)
      t, f = t[start:start + seq_len], f[start:start + seq_len]
      p = max(p - start, 1)
    tokens[i, :t.size] = t
    feats[i, :f.shape[0]] = f
    lengths[i] = t.size
    anchors[i], avalid[i] = sample_anchors(rng, p, t.size, n_anchors)
  offs = np.arange(L)
  block_ids = np.full((B, n_anchors, L), mask_token_id, np.int32)
  block_ids[..., 0] = np.take_along_axis(tokens, anchors, 1)
  lab_pos = anchors[..., None] + offs[None, None, 1:]                   # [B, A, L-1]
  labels = np.take_along_axis(tokens, lab_pos.reshape(B, -1), 1).reshape(lab_pos.shape)
  lvalid = avalid[..., None] & (lab_pos < lengths[:, None, None])
  return Batch(feats=feats, block_ids=block_ids, anchors=anchors, labels=labels,
               label_valid=lvalid)


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
  """[L-1] weights exp(-(k-1)/gamma) for offsets k = 1..L-1 (DFlash's position decay)."""
  k = np.arange(1, block_size)
  return np.exp(-(k - 1) / gamma).astype(np.float32)


def batch_loss(params, cfg: DraftConfig, batch: Batch, embed, lm_head_w, weights,
               rt: Runtime = Runtime()):
  """Weighted cross-entropy over a batch (vmapped over sequences). lm_head_w: [V, D] frozen.
  Returns (loss, metrics {"acc": top-1 accuracy over valid labels, "acc1": at offset 1})."""

  def one(feats, block_ids, anchors):
    h = draft_lib.train_hidden(params, cfg, feats, block_ids, anchors, embed, rt)
    return jnp.einsum("ald,vd->alv", h[:, 1:].astype(rt.cdt), lm_head_w.astype(rt.cdt),
                      preferred_element_type=jnp.float32)

  logits = jax.vmap(one)(batch.feats, batch.block_ids, batch.anchors)  # [B, A, L-1, V]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch.labels[..., None], axis=-1)[..., 0]
  w = weights[None, None, :] * batch.label_valid
  loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1e-6)
  hit = (jnp.argmax(logits, -1) == batch.labels) & batch.label_valid
  acc = jnp.sum(hit) / jnp.maximum(jnp.sum(batch.label_valid), 1)
  acc1 = jnp.sum(hit[..., 0]) / jnp.maximum(jnp.sum(batch.label_valid[..., 0]), 1)
  return loss, {"acc": acc, "acc1": acc1}


def frozen_target_tensors(target):
  """(embed QuantWeight, lm_head [V, D] float32) shared with the target, never trained."""
  return target.params.embed, dequantize(target.params.lm_head, jnp.float32)


def make_train_step(cfg: DraftConfig, optimizer, weights, *, mesh=None, rt: Runtime = Runtime()):
  """A jitted train step. With a mesh, the batch is sharded over its 'data' axis (data parallel)
  and params/optimizer state are replicated; XLA inserts the gradient all-reduce."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  def step(params, opt_state, batch, embed, lm_head_w):
    (loss, metrics), grads = jax.value_and_grad(batch_loss, has_aux=True)(
        params, cfg, batch, embed, lm_head_w, weights, rt)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=(0, 1))
  rep = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P("data"))
  return jax.jit(step, donate_argnums=(0, 1),
                 in_shardings=(rep, rep, data, rep, rep), out_shardings=(rep, rep, rep))
