"""DFlash draft training in JAX: `corpus` (prompts), `data` (target responses with features,
npz shards), `objective` (anchors, typed batches, the weighted block loss, the train step).
Checkpoints are written by `dflash_jax.draft_io.save` (z-lab format).
"""

from dflash_jax.train.corpus import (GENERAL_TEMPLATES, PACKAGE_CORPUS, Prompt, build_corpus,
                                     package_functions, topic_words)
from dflash_jax.train.data import TrainSeq, generate_with_features, load_shards, save_shard
from dflash_jax.train.objective import (Batch, batch_loss, frozen_target_tensors, loss_weights,
                                        make_batch, make_train_step, sample_anchors)

__all__ = ["GENERAL_TEMPLATES", "PACKAGE_CORPUS", "Prompt", "build_corpus", "package_functions",
           "topic_words", "TrainSeq", "generate_with_features", "load_shards", "save_shard",
           "Batch", "batch_loss", "frozen_target_tensors", "loss_weights", "make_batch",
           "make_train_step", "sample_anchors"]
