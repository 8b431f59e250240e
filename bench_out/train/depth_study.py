"""Draft depth study (issue 24): drafts of 1, 2, 3, 5 layers trained side by side on the same
batches, with held-out chain acceptance measured along the way.

All depths start from one trained draft (`draft_io.resize_depth`: fewer layers keep the first
ones; more append identity-initialised copies of the last, so the grown draft starts exactly at
the trained one) and take the same optimizer steps on the same batches; the target's prefill
(the features and the KL logits' hidden states) is computed once per batch for all of them
(`train.batch_targets`). Each draft's step time is measured apart, so the table gives acceptance
at equal steps and the wall time each depth would need alone (prefill + its own step).

Held-out acceptance is the exact greedy chain acceptance, computed teacher-forced
(`train.heldout`): HumanEval 0..n-1 raw prompts x 64 tokens and the chat prompts x 128 tokens
(scripts/bench.py's settings, so `he` / `chat` match its mean_accept_len), plus sequences of
data shards the starting draft never trained on (`corpus`).

    python bench_out/train/depth_study.py --depths 1,2,3,5 --steps 120 \
      --json_out bench_out/train/depth_s28.json
"""

import json
import os
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

_DRAFT = flags.DEFINE_string("draft", os.path.join(ROOT, "checkpoints",
                                                   "smollm2-135m-instruct-dflash"),
                             "The trained draft all depths start from.")
_TARGET = flags.DEFINE_string("target", None, "Target GGUF (default: the embedded SmolLM2).")
_DATA = flags.DEFINE_string("data_dir", os.path.join(ROOT, "checkpoints", "train_data",
                                                     "smollm2-135m-instruct"), "Token shards.")
_TRAIN_SHARDS = flags.DEFINE_integer("train_shards", 27, "Train on the manifest's first N shards.")
_HELD_SHARDS = flags.DEFINE_integer("heldout_shards", 3, "Held-out sequences come from the N "
                                    "shards after the training ones (never trained on).")
_N_CORPUS = flags.DEFINE_integer("n_corpus", 24, "Held-out corpus sequences.")
_CORPUS_NEW = flags.DEFINE_integer("corpus_max_new", 192, "Response tokens kept per held-out "
                                   "corpus sequence.")
_N_HE = flags.DEFINE_integer("n_he", 50, "HumanEval prompts (0..n-1) x 64 tokens; 0: none.")
_N_CHAT = flags.DEFINE_integer("n_chat", 16, "Chat prompts x 128 tokens; 0: none.")
_EVAL_CACHE = flags.DEFINE_string("eval_cache", "/tmp/depth_study_evalsets.npz",
                                  "The held-out AR outputs (made once, reused).")
_DEPTHS = flags.DEFINE_list("depths", ["1", "2", "3", "5"], "Draft depths (layers).")
_STEPS = flags.DEFINE_integer("steps", 100, "Optimizer steps (cosine schedule length).")
_EVAL_AT = flags.DEFINE_list("eval_at", [], "Steps at which to evaluate (0 and the last always).")
_MINUTES = flags.DEFINE_float("minutes", 0, "Stop training after this many minutes (0: none); "
                              "the last evaluation follows.")
_BATCH = flags.DEFINE_integer("batch", 4, "Sequences per step.")
_ANCHORS = flags.DEFINE_integer("anchors", 48, "Blocks per sequence.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 800, "Tokens per sequence.")
_BUCKETS = flags.DEFINE_list("length_buckets", ["256", "512", "600"], "Padded lengths.")
_OFFSETS = flags.DEFINE_integer("loss_offsets", 6, "Block offsets that carry the loss (0: all).")
_LR = flags.DEFINE_float("lr", 3e-4, "Peak learning rate.")
_WARMUP = flags.DEFINE_integer("warmup", 10, "Warm-up steps.")
_SEED = flags.DEFINE_integer("seed", 28, "Batch seed.")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")


def _eval_sets(target, seqs_heldout):
  """{name: [TokenSeq]}: AR greedy continuations (bench.py's settings, `heldout.eval_prompts` /
  `greedy_continuations`) cached in --eval_cache, and held-out corpus sequences cut to
  --corpus_max_new response tokens."""
  import numpy as np
  from dflash_jax import train
  from dflash_jax.train import heldout
  out = {}
  for kind, prompts in heldout.eval_prompts(target, _N_HE.value, _N_CHAT.value).items():
    name = {"humaneval": "he"}.get(kind, kind)
    out[name] = heldout.greedy_continuations(target, prompts, heldout.EVAL_NEW_TOKENS[kind],
                                             cache_path=_EVAL_CACHE.value, cache_prefix=name)
  rng = np.random.default_rng(0)
  pick = rng.choice(len(seqs_heldout), size=min(_N_CORPUS.value, len(seqs_heldout)),
                    replace=False)
  out["corpus"] = [train.TokenSeq(seqs_heldout[i].prompt,
                                  seqs_heldout[i].response[:_CORPUS_NEW.value], int(i))
                   for i in sorted(pick)]
  return out


def main(argv):
  del argv
  import dataclasses
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import cli, draft_io, train
  from dflash_jax.runtime import Runtime
  from dflash_jax.train import heldout, objective, shards

  t0 = time.perf_counter()
  target = dj.load_target(_TARGET.value or cli.default_target_path(), weights="f32")
  cfg0, p0 = draft_io.load(_DRAFT.value, target.config)
  p0 = draft_io.params_from_arrays(draft_io.params_to_arrays(p0), cfg0, weight_fmt="f32")
  entries = shards.read_manifest(_DATA.value)["shards"]
  n_tr, n_ho = _TRAIN_SHARDS.value, _HELD_SHARDS.value
  if n_tr + n_ho > len(entries):
    raise app.UsageError(f"--train_shards {n_tr} + --heldout_shards {n_ho} > the "
                         f"{len(entries)} shards of {_DATA.value}")
  seqs = [s for e in entries[:n_tr] for s in shards.read_shard(_DATA.value, e,
                                                               target.config.n_vocab)]
  held = [s for e in entries[n_tr:n_tr + n_ho] for s in shards.read_shard(
      _DATA.value, e, target.config.n_vocab)]
  evalsets = _eval_sets(target, held)
  print(f"[study] {len(seqs)} training sequences; eval sets "
        f"{ {k: len(v) for k, v in evalsets.items()} }", file=sys.stderr)

  tc = train.TrainConfig(steps=_STEPS.value, batch=_BATCH.value, anchors=_ANCHORS.value,
                         seq_len=_SEQ_LEN.value, lr=_LR.value, warmup=_WARMUP.value,
                         seed=_SEED.value, restrict_vocab=True, loss_offsets=_OFFSETS.value,
                         length_buckets=tuple(int(x) for x in _BUCKETS.value
                                              if int(x) < _SEQ_LEN.value))
  rt = Runtime()
  tparams, lm = train.frozen_target_tensors(target)
  vocab = jnp.asarray(train.data_vocab(seqs, target.config.n_vocab))
  weights = jnp.asarray(train.loss_weights(cfg0.block_size, tc.gamma, tc.loss_offsets))
  runs = {}
  for d in [int(x) for x in _DEPTHS.value]:
    cfg, p = draft_io.resize_depth(p0, cfg0, d)
    opt = train.make_optimizer(tc)
    runs[d] = dict(cfg=cfg, state=train.init_state(p, opt),
                   step=objective.make_train_step(cfg, target.config, opt, weights,
                                                  kl_weight=tc.kl_weight, rt=rt),
                   times=[], evals=[], metrics=[],
                   n_params=int(sum(np.size(x) for x in jax.tree.leaves(p))))
  prefill = jax.jit(lambda b: train.batch_targets(tparams, target.config, b,
                                                  cfg0.target_layer_ids, rt))
  plan = train.batch_plan(tc, seqs)
  eval_at = sorted({0, tc.steps, *[int(x) for x in _EVAL_AT.value]})
  pre_times = []

  def evaluate(step):
    for d, r in runs.items():
      te = time.perf_counter()
      e = {"step": step}
      for name, ss in evalsets.items():
        h = heldout.heldout_accept(r["state"].params, r["cfg"], target, ss, lm_head_w=lm)
        e[name] = h["chain_al"]
        e[name + "_p_offset"] = [round(x, 4) for x in h["p_offset"][:8]]
      cum_pre = float(np.sum(pre_times))
      e["train_wall_s"] = cum_pre + float(np.sum(r["times"]))
      e["eval_s"] = time.perf_counter() - te
      r["evals"].append(e)
      print(f"[study] step {step} depth {d}: " + ", ".join(
          f"{k} {e[k]:.4f}" for k in evalsets) + f" (eval {e['eval_s']:.0f} s)", file=sys.stderr)

  evaluate(0)
  deadline = t0 + 60 * _MINUTES.value if _MINUTES.value else None
  step = 0
  while step < tc.steps:
    if deadline and time.perf_counter() > deadline:
      print(f"[study] --minutes reached at step {step}", file=sys.stderr)
      break
    batch = train.step_batch(tc, cfg0, seqs, step, plan)
    tp = time.perf_counter()
    tg = jax.block_until_ready(prefill(batch))
    pre_times.append(time.perf_counter() - tp)
    for d, r in runs.items():
      st = r["state"]
      st.opt_state = train.with_lr(st.opt_state, train.lr_at(tc, step))
      ts = time.perf_counter()
      st.params, st.opt_state, m = r["step"](st.params, st.opt_state, batch, tparams, lm,
                                             vocab, tg)
      m = {k: float(v) for k, v in m.items()}
      r["times"].append(time.perf_counter() - ts)
      r["metrics"].append(dict(m, step=step))
      st.step += 1
    step += 1
    print(f"[study] step {step}: prefill {pre_times[-1]:.2f} s, " + ", ".join(
        f"d{d} {r['times'][-1]:.2f} s acc1 {r['metrics'][-1]['acc1']:.3f}"
        for d, r in runs.items()), file=sys.stderr)
    if step in eval_at and step != tc.steps:
      evaluate(step)
  if not runs[next(iter(runs))]["evals"] or runs[next(iter(runs))]["evals"][-1]["step"] != step:
    evaluate(step)

  # steady-state times: drop the first step of each compiled shape (the compile)
  n_shapes = 1 if plan.groups is None else len(plan.groups)

  def med(x):
    return float(np.median(x[n_shapes:])) if len(x) > n_shapes else float(np.median(x))

  res = {"command": "python bench_out/train/depth_study.py " + " ".join(sys.argv[1:]),
         "draft": _DRAFT.value, "train_config": dataclasses.asdict(tc),
         "n_train_sequences": len(seqs), "eval_sets": {k: len(v) for k, v in evalsets.items()},
         "steps_done": step, "prefill_s_median": med(pre_times),
         "device": str(jax.devices()[0]), "wall_s": time.perf_counter() - t0, "depths": {}}
  for d, r in runs.items():
    res["depths"][str(d)] = {
        "n_params": r["n_params"], "draft_step_s_median": med(r["times"]),
        "alone_step_s": med(pre_times) + med(r["times"]), "evals": r["evals"],
        "acc1_last10": float(np.mean([m["acc1"] for m in r["metrics"][-10:]])) if r["metrics"]
        else None}
  names = list(evalsets)
  print("\n| layers | params | draft step s | alone step s | " + " | ".join(
      f"{n} AL step 0 | {n} AL step {step}" for n in names) + " |")
  print("|---|---|---|---|" + "---|---|" * len(names))
  for d, r in res["depths"].items():
    e0, e1 = r["evals"][0], r["evals"][-1]
    print(f"| {d} | {r['n_params'] / 1e6:.1f}M | {r['draft_step_s_median']:.2f} | "
          f"{r['alone_step_s']:.2f} | " + " | ".join(f"{e0[n]:.3f} | {e1[n]:.3f}" for n in names)
          + " |")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
