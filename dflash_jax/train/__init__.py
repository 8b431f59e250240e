"""DFlash draft training in JAX: `corpus` (prompts), `datagen` + `shards` (the target's responses
as token-id shards, made with the batched decoding loop), `objective` (anchors, typed batches,
the weighted block loss with online target features and distillation, the train step),
`trainer` (the loop, AdamW schedule, resumable state), `heldout` (chain acceptance on held-out
greedy sequences in one teacher-forced pass), `eagle3_objective` (EAGLE-3 drafts: training-time
test over the draft's own outputs, a draft vocabulary from the data). Checkpoints are written by
`dflash_jax.draft_io.save` (z-lab format) or `dflash_jax.eagle3.save` (speculators format).
"""

from dflash_jax.train.corpus import (GENERAL_TEMPLATES, PACKAGE_CORPUS, Prompt, build_corpus,
                                     package_functions, topic_words)
from dflash_jax.train.objective import (HEAD_CHUNK, Batch, batch_loss, batch_targets, data_vocab,
                                        distill_kl, frozen_target_tensors, fused_head_loss,
                                        loss_weights, make_batch,
                                        make_packed_batch, make_train_step, pack_rows,
                                        sample_anchors, target_pass)
from dflash_jax.train.shards import TokenSeq, read_shards
from dflash_jax.train.trainer import (BatchPlan, TrainConfig, TrainState, batch_plan,
                                      init_state, length_groups, lr_at, make_optimizer,
                                      make_step, step_batch, train, with_lr)

__all__ = ["GENERAL_TEMPLATES", "PACKAGE_CORPUS", "Prompt", "build_corpus", "package_functions",
           "topic_words", "HEAD_CHUNK", "Batch", "batch_loss", "fused_head_loss", "batch_targets", "data_vocab", "distill_kl", "frozen_target_tensors",
           "loss_weights", "make_batch", "make_packed_batch", "pack_rows", "make_train_step", "sample_anchors", "target_pass",
           "TokenSeq", "read_shards", "TrainConfig", "TrainState", "init_state", "make_optimizer",
           "make_step", "train", "length_groups", "BatchPlan", "batch_plan", "step_batch", "lr_at", "with_lr"]
