"""The GPU run's training step on the SmolLM2 target, for the step benchmarks of this folder
(`step_memory.py`, `compile_time.py`): the shipped draft's architecture, packed rows of 1024
tokens, `--restrict_vocab` over the committed shards, all 15 loss offsets, CE + 0.5 KL."""

import jax


class Steps:
  """Loads the target, the shipped draft and the committed shards once; `setup` builds a step."""

  def __init__(self):
    import dflash_jax as dj
    from dflash_jax import cli, draft_io, train
    self.target = dj.load_target(cli.default_target_path(), weights="f32")
    self.cfg, p0 = draft_io.load("checkpoints/smollm2-135m-instruct-dflash", self.target.config)
    self.arrays = draft_io.params_to_arrays(p0)
    self.seqs = train.read_shards(["checkpoints/train_data/smollm2-135m-instruct"],
                                  self.target.config.n_vocab)
    self.vocab = jax.numpy.asarray(train.data_vocab(self.seqs, self.target.config.n_vocab))
    self.tp, self.lm = train.frozen_target_tensors(self.target)

  def setup(self, rows: int, anchors: int, dtype: str, **kw):
    """(TrainConfig, fresh TrainState, step fn, the first batch) for `rows` packed rows of 1024 with
    `anchors` anchors a row in compute dtype `dtype`; kw: more TrainConfig fields."""
    from dflash_jax import draft_io, train
    tc = train.TrainConfig(steps=10_000, batch=rows, anchors=anchors, seq_len=1024, lr=1e-4,
                           pack=True, restrict_vocab=True, compute_dtype=dtype, **kw)
    params = jax.tree.map(jax.numpy.asarray,
                          draft_io.params_from_arrays(self.arrays, self.cfg, weight_fmt="f32"))
    st = train.init_state(params, train.make_optimizer(tc))
    return tc, st, train.make_step(self.target, self.cfg, tc), train.step_batch(tc, self.cfg,
                                                                                self.seqs, 0)

