"""Draft-training throughput on this machine: seconds per optimizer step and real (unpadded) tokens
per second, with and without length buckets, at a few anchor counts, on the committed token shards
(SmolLM2 target, the shipped draft's architecture). Median of --steps after one compile step per
shape. Prints JSON rows and a table.

  python bench_out/train/step_time.py --steps 6 --json_out bench_out/train/step_time.json
"""

import json
import statistics
import time

from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 6, "Timed steps per configuration.")
_JSON = flags.DEFINE_string("json_out", None, "Write the rows here too.")
_CONFIGS = flags.DEFINE_list("configs", ["none:16", "256/512:16", "256/512:48"],
                             "Comma-separated configurations buckets:anchors[:batch[:r|f[:K]]] "
                             "(buckets '/'-separated, 'none': always seq_len 800, 'pN': packed "
                             "rows of N tokens, anchors and batch then per row; batch 4 unless "
                             "given; r: restricted loss vocabulary, f: full; K: loss offsets, "
                             "0 = all).")


def main(argv):
  del argv
  import jax
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import cli, draft_io, train

  target = dj.load_target(cli.default_target_path(), weights="f32")
  cfg, p0 = draft_io.load("checkpoints/smollm2-135m-instruct-dflash", target.config)
  params = draft_io.params_from_arrays(draft_io.params_to_arrays(p0), cfg, weight_fmt="f32")
  seqs = train.read_shards(["checkpoints/train_data/smollm2-135m-instruct"], target.config.n_vocab)
  rows = []
  for spec in _CONFIGS.value:
    b, a, *rest = spec.split(":")
    pack = b.startswith("p")
    buckets = () if b == "none" or pack else tuple(int(x) for x in b.split("/"))
    tc = train.TrainConfig(steps=10_000, batch=int(rest[0]) if rest else 4, anchors=int(a),
                           seq_len=int(b[1:]) if pack else 800, length_buckets=buckets, lr=1e-4,
                           pack=pack,
                           restrict_vocab=rest[1:2] == ["r"],
                           loss_offsets=int(rest[2]) if len(rest) > 2 else 0)
    vocab = (jax.numpy.asarray(train.data_vocab(seqs, target.config.n_vocab))
             if tc.restrict_vocab else None)
    st = train.init_state(jax.tree.map(jax.numpy.asarray, params), train.make_optimizer(tc))
    step_fn = train.make_step(target, cfg, tc)
    plan = train.batch_plan(tc, seqs)
    groups = plan.groups
    shapes = [tc.seq_len] if pack else [s for s, _ in groups]
    for i, size in enumerate(shapes):            # compile every shape first (not timed)
      if pack:
        batch = train.step_batch(tc, cfg, seqs, 10_000, plan)
      else:
        batch = train.make_batch(np.random.default_rng(0), [seqs[j] for j in groups[i][1][:tc.batch]],
                                 cfg, seq_len=size, n_anchors=tc.anchors,
                                 mask_token_id=cfg.mask_token_id)
      tp, lm = train.frozen_target_tensors(target)
      st.params, st.opt_state, m = step_fn(st.params, st.opt_state, batch, tp, lm, vocab)
      jax.block_until_ready(m["loss"])
    secs, toks = [], []
    for _ in range(_STEPS.value):
      t0 = time.perf_counter()
      st = train.train(target, cfg, seqs, tc, st, until=st.step + 1, step_fn=step_fn,
                       on_metrics=lambda _s, m: toks.append(m["tokens"]))
      jax.block_until_ready(st.params)
      secs.append(time.perf_counter() - t0)
    toks = sum(toks)
    row = {"buckets": list(buckets), "pack": tc.seq_len if pack else 0, "anchors": tc.anchors,
           "batch": tc.batch,
           "restrict_vocab": tc.restrict_vocab,
           "loss_offsets": tc.loss_offsets or cfg.block_size - 1,
           "loss_vocab": int(vocab.shape[0]) if vocab is not None else target.config.n_vocab,
           "median_step_s": statistics.median(secs), "real_tokens_per_s": toks / sum(secs),
           "blocks_per_s": tc.batch * tc.anchors * len(secs) / sum(secs),
           "shapes": shapes}
    rows.append(row)
    print(json.dumps(row), flush=True)
  print("\nbuckets        batch anchors  vocab  K  step s  real tok/s  blocks/s")
  for r in rows:
    name = f"packed {r['pack']}" if r["pack"] else str(r["buckets"] or "none")
    print(f"{name:<14} {r['batch']:>5} {r['anchors']:>7} "
          f"{r['loss_vocab']:>6} {r['loss_offsets']:>2} {r['median_step_s']:>7.2f} "
          f"{r['real_tokens_per_s']:>11.1f} {r['blocks_per_s']:>9.2f}")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump({"command": "python bench_out/train/step_time.py", "rows": rows}, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
