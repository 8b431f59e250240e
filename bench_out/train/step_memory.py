"""What the training step's loss form and attention remat do to its memory and its CPU time
(SmolLM2 target, the shipped draft's architecture, packed rows of 1024, `--restrict_vocab` over
the committed shards, all 15 loss offsets, CE + 0.5 KL).

Variants: `materialized` (head_chunk 0: the [rows, anchors, 15, N] logits of the batch held and
differentiated by JAX), `fused` (`objective.fused_head_loss`, chunks of 2048 label rows, the
default) and `fused+remat` (`remat_attention`: the draft's attention scores recomputed in the
backward pass).

1. XLA's memory analysis of the jitted step (compiled here, not run: temporaries and arguments)
   at the GPU run's shapes (--memory_rows packed rows, 245 anchors a row, bfloat16): what decides
   how many rows a lent GPU takes (`bench_out/gpu/train_run.sh`).
2. Seconds per step on this CPU (float32, --time_rows rows, --time_anchors anchors a row): the
   variants compiled first, then timed round-robin, median of --steps.

  python bench_out/train/step_memory.py --json_out bench_out/train/step_memory_s59.json
"""

import json
import statistics
import time

from absl import app, flags

_MEM_ROWS = flags.DEFINE_list("memory_rows", ["12", "16", "24", "48"], "Packed rows a step for the "
                              "memory analysis (bfloat16, 245 anchors a row).")
_TIME_ROWS = flags.DEFINE_integer("time_rows", 1, "Packed rows a step for the CPU timing.")
_TIME_ANCHORS = flags.DEFINE_integer("time_anchors", 120, "Anchors a row for the CPU timing.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per variant (after one compile step).")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here too.")

VARIANTS = {"materialized": dict(head_chunk=0), "fused": dict(),
            "fused+remat": dict(remat_attention=True)}


def main(argv):
  del argv
  import jax
  from step_setup import Steps

  steps = Steps()
  tp, lm, vocab, setup = steps.tp, steps.lm, steps.vocab, steps.setup

  memory = []
  for rows in (int(r) for r in _MEM_ROWS.value):
    for name, kw in VARIANTS.items():
      tc, st, step_fn, batch = setup(rows, 245, "bfloat16", **kw)
      lowered = jax.jit(lambda p, o, b: step_fn(p, o, b, tp, lm, vocab)).lower(
          st.params, st.opt_state, batch)
      ma = lowered.compile().memory_analysis()
      row = {"rows": rows, "variant": name, "temp_gb": ma.temp_size_in_bytes / 1e9,
             "argument_gb": ma.argument_size_in_bytes / 1e9, "loss_vocab": int(vocab.shape[0])}
      memory.append(row)
      print(json.dumps(row), flush=True)

  runs = {}
  for name, kw in VARIANTS.items():
    tc, st, step_fn, batch = setup(_TIME_ROWS.value, _TIME_ANCHORS.value, "float32", **kw)
    st.params, st.opt_state, m = step_fn(st.params, st.opt_state, batch, tp, lm, vocab)
    jax.block_until_ready(m["loss"])                       # compile
    runs[name] = dict(st=st, fn=step_fn, batch=batch, secs=[], loss=float(m["loss"]))
  for _ in range(_STEPS.value):
    for name, r in runs.items():
      st = r["st"]
      t0 = time.perf_counter()
      st.params, st.opt_state, m = r["fn"](st.params, st.opt_state, r["batch"], tp, lm, vocab)
      jax.block_until_ready(m["loss"])
      r["secs"].append(time.perf_counter() - t0)
  base = statistics.median(runs["materialized"]["secs"])
  timing = []
  for name, r in runs.items():
    med = statistics.median(r["secs"])
    row = {"variant": name, "rows": _TIME_ROWS.value, "anchors": _TIME_ANCHORS.value,
           "median_step_s": med, "x_materialized": med / base, "secs": r["secs"],
           "first_step_loss": r["loss"]}
    timing.append(row)
    print(json.dumps(row), flush=True)

  print("\nXLA temporaries of the bf16 step, GB (245 anchors a row, 1024 tokens a row)")
  print("rows  " + "  ".join(f"{n:>13}" for n in VARIANTS))
  for rows in sorted({r["rows"] for r in memory}):
    vals = {r["variant"]: r["temp_gb"] for r in memory if r["rows"] == rows}
    print(f"{rows:>4}  " + "  ".join(f"{vals[n]:>13.1f}" for n in VARIANTS))
  print(f"\nCPU float32 step, {_TIME_ROWS.value} row(s) x {_TIME_ANCHORS.value} anchors, "
        f"median of {_STEPS.value}")
  for r in timing:
    print(f"{r['variant']:<13} {r['median_step_s']:>7.2f} s  x{r['x_materialized']:.3f}  "
          f"first-step loss {r['first_step_loss']:.6f}")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump({"command": "python bench_out/train/step_memory.py", "memory": memory,
                 "timing": timing}, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
