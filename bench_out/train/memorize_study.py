"""Can the shipped draft, trained by this trainer, fit a handful of sequences? (capacity / machinery check)

  python bench_out/train/memorize_study.py --steps 50 --json_out bench_out/train/memorize_s63.json  # ~7 min

The shipped draft accepts ~1.7 tokens a chain step on held-out text and 0.66 of its training blocks'
first tokens (gpu46), and its curve grows by ~0.1-0.2 acceptance per 10x training tokens
(`scaling_fit.py`). This asks whether that is a limit of the draft + trainer themselves (a structural one:
a mis-set position, a feature alignment, a loss that cannot push later offsets) or of fitting the whole
distribution: the same training step (`train.make_step`, CE + 0.5 KL, every offset, AdamW) runs on the
target's greedy continuations of `--n_fit` HumanEval prompts only, and the exact teacher-forced chain
acceptance (`heldout.heldout_accept`, equal to the decoded chain's) is measured on those sequences and
on the next `--n_fit` prompts, which it never sees. A draft that memorises its training text should
reach far higher acceptance there than anywhere on held-out text; if it stalls low, the limit is
structural. The draft trained here is never saved.

Prints JSON lines per evaluation and a table; --json_out writes the whole record.
"""

import json
import time

from absl import app, flags

_DRAFT = flags.DEFINE_string("draft", "checkpoints/smollm2-135m-instruct-dflash", "Start draft.")
_N_FIT = flags.DEFINE_integer("n_fit", 4, "HumanEval prompts trained on (and as many held out).")
_STEPS = flags.DEFINE_integer("steps", 50, "Optimizer steps.")
_EVERY = flags.DEFINE_integer("eval_every", 25, "Steps between evaluations.")
_ANCHORS = flags.DEFINE_integer("anchors", 48, "Blocks per sequence per step.")
_LR = flags.DEFINE_float("lr", 1e-3, "Peak learning rate (warm-up 10 steps, cosine).")
_N_NEW = flags.DEFINE_integer("n_new", 64, "Greedy response tokens per prompt.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the record here.")


def main(argv):
  del argv
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import cli, draft_io, train
  from dflash_jax.train import heldout, objective

  t0 = time.perf_counter()
  target = dj.load_target(cli.default_target_path(), weights="f32")
  n = _N_FIT.value
  prompts = heldout.eval_prompts(target, 2 * n, 0)["humaneval"]
  seqs = heldout.greedy_continuations(target, prompts, _N_NEW.value,
                                      cache_path=f"/tmp/memorize_cont_{_N_NEW.value}.npz")
  fit, held = seqs[:n], seqs[n:]
  longest = max(len(s.tokens) for s in seqs)
  seq_len = int(2 ** np.ceil(np.log2(longest)))
  cfg, p0 = draft_io.load(_DRAFT.value, target.config)
  params = draft_io.params_from_arrays(draft_io.params_to_arrays(p0), cfg, weight_fmt="f32")
  tc = train.TrainConfig(steps=_STEPS.value, batch=n, anchors=_ANCHORS.value, seq_len=seq_len,
                         lr=_LR.value, warmup=10, kl_weight=0.5, gamma=7.0, seed=0)
  st = train.init_state(params, train.make_optimizer(tc))
  lm = objective.frozen_target_tensors(target)[1]
  step_fn = train.make_step(target, cfg, tc)
  record = {"draft": _DRAFT.value, "n_fit": n, "seq_len": seq_len, "train_config": {
      "steps": tc.steps, "batch": tc.batch, "anchors": tc.anchors, "lr": tc.lr},
            "fit_response_tokens": int(sum(s.response.size for s in fit)), "evals": []}
  metrics = []

  def evaluate():
    e = {"step": st.step, "secs": round(time.perf_counter() - t0, 1)}
    for name, ss in (("fit", fit), ("held", held)):
      h = heldout.heldout_accept(st.params, cfg, target, ss, lm_head_w=lm)
      e[name + "_al"] = round(h["chain_al"], 4)
      e[name + "_p_offset"] = [round(x, 3) for x in h["p_offset"][:6]]
    if metrics:
      last = metrics[-min(len(metrics), 5):]
      e.update({k: round(float(np.mean([m[k] for m in last])), 4) for k in ("loss", "acc", "acc1")})
    record["evals"].append(e)
    print(json.dumps(e), flush=True)

  evaluate()
  while st.step < tc.steps:
    st = train.train(target, cfg, fit, tc, st, until=min(tc.steps, st.step + _EVERY.value),
                     step_fn=step_fn,
                     on_metrics=lambda s, m: metrics.append(m))
    evaluate()
  record["wall_s"] = round(time.perf_counter() - t0, 1)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as fh:
      json.dump(record, fh, indent=1)
  print(f"{'step':>5} {'train acc1':>10} {'train acc':>9} {'fit AL':>7} {'held AL':>8}  "
        f"fit p(offset 1..4)")
  for e in record["evals"]:
    print(f"{e['step']:>5} {e.get('acc1', float('nan')):>10.3f} {e.get('acc', float('nan')):>9.3f} "
          f"{e['fit_al']:>7.3f} {e['held_al']:>8.3f}  {e['fit_p_offset'][:4]}")


if __name__ == "__main__":
  app.run(main)
