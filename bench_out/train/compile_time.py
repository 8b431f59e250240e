"""What the training step costs to build and to run, for two checkouts side by side (session 60:
the packed target forward's layers as a `lax.scan`, `target.forward_packed`, against the
unrolled layer loop before it).

For each tree (a directory holding a `dflash_jax` package; each measured in its own process with
that tree first on PYTHONPATH, alternating trees for --repeats rounds), the SmolLM2 target, the
shipped draft's architecture, packed rows of 1024 tokens, `--restrict_vocab` over the committed
shards, all 15 loss offsets, CE + 0.5 KL, the default fused head loss:

1. the GPU run's step (bfloat16, --rows rows, 245 anchors a row), built on this CPU: seconds to
   trace + lower it (`jax.jit(...).lower`), to compile it with XLA:CPU, the optimized HLO's
   size, and XLA's temporary memory (what decides the rows a GPU takes);
2. the CPU step (float32, --time_rows rows x --time_anchors anchors): first call (trace +
   compile + run) and the median of --steps calls after it, and the first step's loss (the same
   batch in every tree).

  git worktree add /tmp/base <commit>
  python bench_out/train/compile_time.py --trees .,/tmp/base --json_out bench_out/train/compile_time_s60.json
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

_TREES = flags.DEFINE_list("trees", ["."], "Checkouts to measure (the first is the one reported "
                           "against the others).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Rounds; each round measures every tree once.")
_ROWS = flags.DEFINE_integer("rows", 24, "Packed rows of the bfloat16 (GPU run) step.")
_TIME_ROWS = flags.DEFINE_integer("time_rows", 1, "Packed rows of the timed float32 CPU step.")
_TIME_ANCHORS = flags.DEFINE_integer("time_anchors", 120, "Anchors a row of the timed CPU step.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed CPU steps after the first call.")
_CHILD = flags.DEFINE_bool("child", False, "Internal: measure the tree on PYTHONPATH, print JSON.")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here too.")


def measure() -> dict:
  """One process's measurements (the `dflash_jax` on sys.path)."""
  import jax
  from step_setup import Steps

  steps = Steps()
  tp, lm, vocab = steps.tp, steps.lm, steps.vocab

  def setup(rows, anchors, dtype):
    return steps.setup(rows, anchors, dtype)[1:]

  st, step_fn, batch = setup(_ROWS.value, 245, "bfloat16")
  t0 = time.perf_counter()
  lowered = jax.jit(lambda p, o, b: step_fn(p, o, b, tp, lm, vocab)).lower(
      st.params, st.opt_state, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  out = {"gpu_step": {"rows": _ROWS.value, "lower_s": t1 - t0, "compile_s": t2 - t1,
                      "hlo_chars": len(compiled.as_text()),
                      "temp_gb": compiled.memory_analysis().temp_size_in_bytes / 1e9}}
  del lowered, compiled

  st, step_fn, batch = setup(_TIME_ROWS.value, _TIME_ANCHORS.value, "float32")
  t0 = time.perf_counter()
  st.params, st.opt_state, m = step_fn(st.params, st.opt_state, batch, tp, lm, vocab)
  loss = float(m["loss"])
  first = time.perf_counter() - t0
  secs = []
  for _ in range(_STEPS.value):
    t0 = time.perf_counter()
    st.params, st.opt_state, m = step_fn(st.params, st.opt_state, batch, tp, lm, vocab)
    jax.block_until_ready(m["loss"])
    secs.append(time.perf_counter() - t0)
  out["cpu_step"] = {"rows": _TIME_ROWS.value, "anchors": _TIME_ANCHORS.value, "first_call_s": first,
                     "median_step_s": statistics.median(secs), "secs": secs,
                     "first_step_loss": loss}
  return out


def main(argv):
  del argv
  if _CHILD.value:
    print("RESULT " + json.dumps(measure()), flush=True)
    return
  runs = []
  args = [f"--rows={_ROWS.value}", f"--time_rows={_TIME_ROWS.value}",
          f"--time_anchors={_TIME_ANCHORS.value}", f"--steps={_STEPS.value}"]
  for rnd in range(_REPEATS.value):
    for tree in _TREES.value:
      tree = os.path.abspath(tree)
      env = dict(os.environ, PYTHONPATH=tree)
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args],
                            cwd=tree, env=env, capture_output=True, text=True, check=False)
      line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
      if line is None:
        raise SystemExit(f"{tree}: no result\n{proc.stderr[-3000:]}")
      row = dict(json.loads(line[len("RESULT "):]), tree=tree, round=rnd)
      runs.append(row)
      print(json.dumps(row), flush=True)

  def med(tree, part, key):
    return statistics.median(r[part][key] for r in runs if r["tree"] == os.path.abspath(tree))

  print(f"\nmedian of {_REPEATS.value} processes per tree; GPU-run step: bfloat16, "
        f"{_ROWS.value} rows x 245 anchors, built with XLA:CPU; CPU step: float32, "
        f"{_TIME_ROWS.value} row(s) x {_TIME_ANCHORS.value} anchors")
  print(f"{'tree':<28} {'lower s':>8} {'compile s':>9} {'HLO MB':>7} {'temp GB':>8} "
        f"{'CPU 1st call s':>14} {'CPU step s':>10}  first loss")
  for tree in _TREES.value:
    loss = next(r["cpu_step"]["first_step_loss"] for r in runs
                if r["tree"] == os.path.abspath(tree))
    print(f"{tree[-28:]:<28} {med(tree, 'gpu_step', 'lower_s'):>8.2f} "
          f"{med(tree, 'gpu_step', 'compile_s'):>9.2f} "
          f"{med(tree, 'gpu_step', 'hlo_chars') / 1e6:>7.2f} {med(tree, 'gpu_step', 'temp_gb'):>8.2f} "
          f"{med(tree, 'cpu_step', 'first_call_s'):>14.2f} {med(tree, 'cpu_step', 'median_step_s'):>10.2f}"
          f"  {loss:.6f}")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump({"command": "python bench_out/train/compile_time.py --trees "
                 + ",".join(_TREES.value), "runs": runs}, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
