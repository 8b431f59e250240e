"""The draft training loop and its resumable state: AdamW with linear warm-up and cosine decay,
batches of stored token sequences (`shards`), target features online (`objective`), state saved
as one npz (params, optimizer moments, step) next to the z-lab checkpoint, so an interrupted run
resumes exactly where it stopped (a step's batch depends only on the seed and the step index).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dflash_jax import eagle3
from dflash_jax.config import DraftConfig
from dflash_jax.runtime import Runtime
from dflash_jax.train import eagle3_objective, objective


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Training hyper-parameters.

  steps: optimizer steps in all; batch: sequences per step; anchors: blocks per sequence;
  seq_len: tokens per sequence (padded / windowed); lr: peak learning rate (AdamW), reached after
  `warmup` linear steps, then cosine decay to lr * final_lr_fraction; weight_decay; clip: global
  gradient-norm clip; gamma: loss decay over block offsets; kl_weight: weight of the
  distillation term; seed: batch sampling (and init); compute_dtype: "float32" | "bfloat16";
  length_buckets: padded lengths (tokens, ascending, each <= seq_len) a batch may take instead of
  seq_len: a step draws one bucket (with probability proportional to its sequences) and its batch
  from the sequences that fit it, so short sequences are not padded to seq_len (one compiled
  step per bucket; every sequence keeps the same chance of being drawn). Empty: always seq_len.
  restrict_vocab: the loss's softmaxes over the token ids that occur in the training sequences
  (`objective.data_vocab`: every label is one) instead of the whole vocabulary; DFlash-1 only.
  For SmolLM2's 22 shards that is 17,191 of 49,152 ids, and the lm_head matmuls dominate a small
  draft's step. Decoding always uses the whole lm_head.
  loss_offsets: K, the block offsets 1..K that carry the loss (0: all L-1). The draft still runs
  the whole block; only K rows per block go through the lm_head and the softmaxes. At an
  acceptance length of ~1.5, offsets past ~5 add nothing to decoding, so K ~ 6 puts the step's
  time and the gradient where acceptance is decided.
  pack: several sequences back to back in each row of seq_len tokens (`objective.pack_rows`,
  `objective.make_packed_batch`), each seeing only itself in the target and the draft: batch is
  then rows per step and anchors per row, split equally between its sequences (scale them with
  the sequences a row holds). Less
  padding than one sequence per row, in one compiled shape; not with length_buckets.
  head_chunk: label rows per pass of the fused lm_head + cross-entropy + KL
  (`objective.fused_head_loss`; DFlash-1), which never holds the logits of the whole batch;
  0: the materialized form. remat_attention: recompute the draft's attention scores in the
  backward pass instead of keeping them. Both change memory, not the loss or its gradient
  (XLA's estimate for 24 packed rows of 1024 x 245 anchors over a 29k-id loss vocabulary in
  bfloat16: 101 GB materialized, 54 GB fused, 28 GB with both).
  """

  steps: int = 1000
  batch: int = 4
  anchors: int = 16
  seq_len: int = 1024
  lr: float = 1e-3
  warmup: int = 50
  final_lr_fraction: float = 0.05
  weight_decay: float = 0.01
  clip: float = 1.0
  gamma: float = 7.0
  kl_weight: float = 0.5
  seed: int = 0
  compute_dtype: str = "float32"
  length_buckets: tuple = ()
  restrict_vocab: bool = False
  loss_offsets: int = 0
  pack: bool = False
  head_chunk: int = objective.HEAD_CHUNK
  remat_attention: bool = False

  def __post_init__(self):
    for name in ("steps", "batch", "anchors", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1")
    b = tuple(int(x) for x in self.length_buckets)
    if b and (list(b) != sorted(set(b)) or b[0] < 2 or b[-1] > self.seq_len):
      raise ValueError(f"TrainConfig.length_buckets={b}: ascending, distinct, in [2, seq_len="
                       f"{self.seq_len}]")
    object.__setattr__(self, "length_buckets", b)
    if b and self.pack:
      raise ValueError("TrainConfig: pack and length_buckets exclude each other (a packed row "
                       "has one length, seq_len)")
    if self.loss_offsets < 0:
      raise ValueError(f"TrainConfig.loss_offsets={self.loss_offsets} must be >= 0 (0: all)")
    if self.head_chunk < 0:
      raise ValueError(f"TrainConfig.head_chunk={self.head_chunk} must be >= 0 (0: materialized)")
    if self.lr <= 0 or self.kl_weight < 0 or self.gamma <= 0:
      raise ValueError("TrainConfig: lr and gamma must be > 0, kl_weight >= 0")


def lr_at(tc: TrainConfig, step: int, total: Optional[int] = None) -> float:
  """Learning rate of optimizer step `step` (0-based): linear warm-up from 0 to tc.lr over
  tc.warmup steps, then cosine decay to tc.lr * tc.final_lr_fraction at step `total` (default
  tc.steps), flat after it (optax.warmup_cosine_decay_schedule), evaluated on the host so that
  the schedule's length can be fitted to a time budget after the step has compiled
  (`TrainState.total`, scripts/train_draft.py --fit_schedule) without recompiling it."""
  total = tc.steps if total is None else int(total)
  warmup = min(tc.warmup, max(total - 1, 0))
  sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, warmup, max(total, warmup + 1),
                                             end_value=tc.lr * tc.final_lr_fraction)
  return float(sched(step))


def make_optimizer(tc: TrainConfig):
  """clip_by_global_norm + AdamW whose learning rate is a value in the optimizer state
  (optax.inject_hyperparams), set by `train` before every step from `lr_at` (warm-up + cosine)."""
  return optax.chain(optax.clip_by_global_norm(tc.clip),
                     optax.inject_hyperparams(optax.adamw)(learning_rate=lr_at(tc, 0),
                                                           weight_decay=tc.weight_decay))


def with_lr(opt_state, lr: float):
  """`opt_state` (of `make_optimizer`) with its learning rate set to lr (float)."""
  clip_state, adam_state = opt_state
  hp = dict(adam_state.hyperparams, learning_rate=jnp.asarray(lr, jnp.float32))
  return (clip_state, adam_state._replace(hyperparams=hp))


@dataclasses.dataclass
class TrainState:
  """params (draft pytree), opt_state (optax), step (optimizer steps done), total (the step at
  which the cosine schedule ends and the run stops, when fitted to a time budget; None:
  TrainConfig.steps)."""

  params: object
  opt_state: object
  step: int = 0
  total: Optional[int] = None

  def last_step(self, tc: TrainConfig) -> int:
    """The step count at which the run stops: tc.steps, or the fitted `total` if earlier."""
    return tc.steps if self.total is None else min(self.total, tc.steps)

  def save(self, path: str):
    """Write the state to `path` (npz, atomically: a temporary file renamed)."""
    leaves = jax.tree.leaves((self.params, self.opt_state))
    tmp = path + ".tmp.npz"
    np.savez(tmp, step=self.step, total=-1 if self.total is None else self.total,
             **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)})
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str, like: "TrainState") -> "TrainState":
    """The state saved at `path`, shaped as `like` (a fresh state of the same config).
    Raises ValueError when the file does not match (another draft config or optimizer)."""
    treedef = jax.tree.structure((like.params, like.opt_state))
    want = jax.tree.leaves((like.params, like.opt_state))
    with np.load(path) as z:
      n = sum(1 for k in z.files if k.startswith("leaf_"))
      if n != len(want):
        raise ValueError(f"{path}: {n} arrays, this draft and optimizer have {len(want)}")
      leaves = [z[f"leaf_{i}"] for i in range(n)]
      step = int(z["step"])
      total = int(z["total"]) if "total" in z.files else -1
    for i, (a, b) in enumerate(zip(leaves, want)):
      if a.shape != np.shape(b):
        raise ValueError(f"{path}: array {i} has shape {a.shape}, expected {np.shape(b)}")
    params, opt_state = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])
    return cls(params, opt_state, step, None if total < 0 else total)


def init_state(params, optimizer) -> TrainState:
  params = jax.tree.map(jnp.asarray, params)
  return TrainState(params, optimizer.init(params), 0)


def length_groups(tc: TrainConfig, seqs: Sequence):
  """[(padded length, indices of the sequences it holds)] per non-empty length bucket (a
  sequence goes to the smallest bucket that holds it; longer ones to seq_len, windowed);
  [(seq_len, all)] without buckets."""
  if not tc.length_buckets:
    return [(tc.seq_len, np.arange(len(seqs)))]
  sizes = list(tc.length_buckets) + ([tc.seq_len] if tc.length_buckets[-1] < tc.seq_len else [])
  lens = np.array([len(s.tokens) for s in seqs])
  which = np.searchsorted(np.asarray(sizes), lens)           # smallest size >= len
  which = np.minimum(which, len(sizes) - 1)
  return [(sizes[b], np.flatnonzero(which == b)) for b in range(len(sizes))
          if np.any(which == b)]


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """What `step_batch` draws a step's sequences from, computed once per run (`batch_plan`).

  groups: `length_groups(tc, seqs)` for unpacked rows (one sequence per row); lengths: [N] int,
  every sequence's token count, for packed rows (tc.pack: rows filled by `objective.pack_rows`).
  Exactly one of the two is set."""
  groups: Optional[list] = None
  lengths: Optional[np.ndarray] = None


def batch_plan(tc: TrainConfig, seqs: Sequence) -> BatchPlan:
  """The BatchPlan of `seqs` under tc: sequence lengths when tc.pack, else length groups."""
  if tc.pack:
    return BatchPlan(lengths=np.array([len(s.tokens) for s in seqs]))
  return BatchPlan(groups=length_groups(tc, seqs))


def step_batch(tc: TrainConfig, cfg: DraftConfig, seqs: Sequence, step: int,
               plan: Optional[BatchPlan] = None) -> objective.Batch:
  """The batch of optimizer step `step`: a function of (seed, step) only, so a resumed run sees
  the batches an uninterrupted one would. plan: `batch_plan(tc, seqs)` (computed here when not
  given). Raises ValueError if the plan was made for the other packing mode."""
  plan = batch_plan(tc, seqs) if plan is None else plan
  if (plan.lengths is not None) != bool(tc.pack):
    raise ValueError(f"step_batch: plan made for pack={not tc.pack}, TrainConfig has "
                     f"pack={tc.pack}")
  rng = np.random.default_rng([tc.seed, step])
  ttt = isinstance(cfg, eagle3.Eagle3Config)
  if tc.pack:
    if ttt:
      raise ValueError("TrainConfig.pack: EAGLE-3 drafts train on one sequence per row")
    rows = objective.pack_rows(rng, plan.lengths, tc.batch, tc.seq_len)
    return objective.make_packed_batch(rng, [[seqs[i] for i in r] for r in rows], cfg,
                                       seq_len=tc.seq_len, n_anchors=tc.anchors,
                                       mask_token_id=cfg.mask_token_id)
  groups = plan.groups
  counts = np.array([g[1].size for g in groups], np.float64)
  g = int(rng.choice(len(groups), p=counts / counts.sum())) if len(groups) > 1 else 0
  size, members = groups[g]
  pick = members[rng.choice(members.size, size=tc.batch, replace=members.size < tc.batch)]
  if ttt:
    return eagle3_objective.make_seq_batch(rng, [seqs[i] for i in pick], seq_len=size,
                                           n_steps=cfg.block_size - 1)
  return objective.make_batch(rng, [seqs[i] for i in pick], cfg, seq_len=size,
                              n_anchors=tc.anchors, mask_token_id=cfg.mask_token_id)


def make_step(target, cfg: DraftConfig, tc: TrainConfig, mesh=None):
  """The jitted train step for this target, draft config and TrainConfig (objective.make_train_step
  with the TrainConfig's optimizer, loss weights, kl_weight and compute dtype; for an
  eagle3.Eagle3Config, eagle3_objective.make_train_step over its block_size - 1 draft steps).
  Raises ValueError for loss_offsets or restrict_vocab with an EAGLE-3 draft (its loss covers
  every step, over its own draft vocabulary)."""
  if isinstance(cfg, eagle3.Eagle3Config):
    if tc.loss_offsets or tc.restrict_vocab:
      raise ValueError("TrainConfig.loss_offsets / restrict_vocab are DFlash options; an EAGLE-3 "
                       "draft trains every step over its own draft vocabulary")
    return eagle3_objective.make_train_step(
        cfg, target.config, make_optimizer(tc),
        jnp.asarray(objective.loss_weights(cfg.block_size, tc.gamma)), kl_weight=tc.kl_weight,
        mesh=mesh, rt=Runtime(compute_dtype=tc.compute_dtype))
  return objective.make_train_step(
      cfg, target.config, make_optimizer(tc),
      jnp.asarray(objective.loss_weights(cfg.block_size, tc.gamma, tc.loss_offsets)),
      kl_weight=tc.kl_weight, mesh=mesh, rt=Runtime(compute_dtype=tc.compute_dtype),
      head_chunk=tc.head_chunk, remat_attention=tc.remat_attention)


def train(target, cfg: DraftConfig, seqs: Sequence, tc: TrainConfig, state: TrainState, *,
          until: Optional[int] = None, mesh=None, step_fn=None,
          on_metrics: Optional[Callable[[int, dict], None]] = None,
          on_step: Optional[Callable[[TrainState], None]] = None,
          vocab_ids=None) -> TrainState:
  """Run optimizer steps state.step .. min(until, state.total or tc.steps) - 1 on `seqs`
  (shards.TokenSeq or
  anything with .tokens / .prompt_len) with target features computed online from `target`.
  on_metrics(step, {loss, ce, kl, acc, acc1, grad_norm} floats, tokens: the batch's real
  tokens) after every step; on_step(state)
  after every step (checkpointing, evaluation). step_fn: `make_step(target, cfg, tc, mesh)`,
  made once by a caller that calls train repeatedly (else one is made, and compiled, here).
  vocab_ids: an EAGLE-3 draft's vocabulary ([Vd] int32 sorted target ids, required for one;
  `eagle3_objective.draft_vocab`); for DFlash drafts it comes from tc.restrict_vocab.
  Returns the state (also updated in place). Raises ValueError for an empty sequence list or an
  EAGLE-3 draft without vocab_ids."""
  if not seqs:
    raise ValueError("train: no training sequences")
  tparams, lm_head_w = objective.frozen_target_tensors(target)
  if isinstance(cfg, eagle3.Eagle3Config):
    if vocab_ids is None:
      raise ValueError("train: an EAGLE-3 draft needs its draft vocabulary (vocab_ids)")
    vocab_ids = jnp.asarray(vocab_ids, jnp.int32)
  else:
    vocab_ids = (jnp.asarray(objective.data_vocab(seqs, target.config.n_vocab))
                 if tc.restrict_vocab else None)
  step_fn = step_fn or make_step(target, cfg, tc, mesh)
  last = state.last_step(tc)
  end = last if until is None else min(until, last)
  plan = batch_plan(tc, seqs)
  while state.step < end:
    batch = step_batch(tc, cfg, seqs, state.step, plan)
    state.opt_state = with_lr(state.opt_state, lr_at(tc, state.step, state.total))
    state.params, state.opt_state, m = step_fn(state.params, state.opt_state, batch, tparams,
                                               lm_head_w, vocab_ids)
    state.step += 1
    if on_metrics is not None:
      on_metrics(state.step - 1, dict({k: float(v) for k, v in m.items()},
                                      tokens=int(np.sum(batch.lengths))))
    if on_step is not None:
      on_step(state)
  return state
