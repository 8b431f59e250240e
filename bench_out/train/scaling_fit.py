"""What the shipped draft's lineage would need to reach issue 24's acceptance goals, by its own curve.

  python bench_out/train/scaling_fit.py --json_out bench_out/train/scaling_s63.json

Reads the held-out chain acceptance of the three GPU runs the shipped draft came from
(`gpu26_evals.json`, `gpu27_evals.json`, `gpu46_evals.json`: greedy, block 16, HumanEval 0-49 x 64 and
the 16 chat prompts x 128; each run started from the previous run's draft), chains their training tokens
into one axis (GPU training tokens since the CPU-trained start), and fits

    AL(T) = a + b * ln(T)        (least squares, T = cumulative GPU training tokens, T > 0)

per set, then inverts it for the goals (chain AL 2.5 and 4.0) and converts those token counts to H200
time at session 46's measured rate (28,013,989 tokens in 646 s, the shipped draft's card). The fit is a
description of six points over one decade (3.8M-49.5M tokens) with cosine restarts and growing data
between runs, not a law: its extrapolation says what *more of the same recipe* would cost, which is the
question a device budget is planned on. `--from_point` drops the earliest points (sensitivity).

Prints JSON (and writes it with --json_out) and a table.
"""

import json
import math
import os

from absl import app, flags
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_RUNS = flags.DEFINE_list("runs", ["gpu26", "gpu27", "gpu46"],
                          "Runs in training order; each reads <run>_evals.json beside this script.")
_GOALS = flags.DEFINE_list("goals", ["2.5", "4.0"], "Chain acceptance lengths to invert the fit for.")
_FROM = flags.DEFINE_integer("from_point", 0, "Fit only the chained points from this index on "
                             "(0 = every point with T > 0).")
_RATE = flags.DEFINE_float("tokens_per_s", 28013989 / 646.0,
                           "Training tokens per second of the GPU the cost is quoted for "
                           "(default: session 46's H200 run).")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the result here as well.")


def chained_points(runs: list[str]) -> list[dict]:
  """The runs' eval points on one axis of cumulative training tokens.

  Returns: [{"run", "step", "tokens" (cumulative int), "humaneval", "chat"}], in training order; each
  run's step-0 point (its starting draft, equal to the previous run's last point) is kept only for the
  first run. Raises FileNotFoundError naming a missing `<run>_evals.json`, ValueError if a run's step-0
  point does not match the previous run's last point (the runs would not be one lineage).
  """
  points, offset = [], 0
  for r, run in enumerate(runs):
    path = os.path.join(_HERE, f"{run}_evals.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: no such eval file (--runs names {run!r})")
    with open(path) as fh:
      evals = sorted(json.load(fh)["evals"], key=lambda e: e["train_tokens"])
    if r and evals[0]["train_tokens"] == 0:
      prev = points[-1]
      if any(abs(evals[0][k] - prev[k]) > 1e-9 for k in ("humaneval", "chat")):
        raise ValueError(f"{path}: step 0 ({evals[0]['humaneval']:.4f} / {evals[0]['chat']:.4f}) is "
                         f"not the previous run's last point ({prev['humaneval']:.4f} / "
                         f"{prev['chat']:.4f}): not one lineage")
      evals = evals[1:]
    for e in evals:
      points.append({"run": run, "step": e["step"], "tokens": offset + e["train_tokens"],
                     "humaneval": e["humaneval"], "chat": e["chat"]})
    offset = points[-1]["tokens"]
  return points


def fit_log(tokens: np.ndarray, al: np.ndarray) -> tuple[float, float, float]:
  """Least-squares AL = a + b ln(T). tokens, al: [N] float64, N >= 2. Returns (a, b, rms residual)."""
  b, a = np.polyfit(np.log(tokens), al, 1)
  resid = al - (a + b * np.log(tokens))
  return float(a), float(b), float(np.sqrt(np.mean(resid ** 2)))


def main(argv):
  del argv
  points = chained_points(_RUNS.value)
  fitted = [p for p in points if p["tokens"] > 0][_FROM.value:]
  if len(fitted) < 2:
    raise app.UsageError(f"--from_point {_FROM.value}: {len(fitted)} point(s) left, need >= 2")
  tokens = np.array([p["tokens"] for p in fitted], np.float64)
  result = {"points": points, "fitted_points": len(fitted), "tokens_per_s": _RATE.value, "sets": {}}
  for kind in ("humaneval", "chat"):
    a, b, rms = fit_log(tokens, np.array([p[kind] for p in fitted], np.float64))
    entry = {"a": a, "b_per_e_fold": b, "b_per_10x": b * math.log(10), "rms_residual": rms,
             "last_al": fitted[-1][kind], "goals": {}}
    for goal in map(float, _GOALS.value):
      log_t = (goal - a) / b if b > 0 else math.inf
      t = math.exp(log_t) if log_t < 700 else math.inf
      entry["goals"][f"{goal:g}"] = {"tokens": t, "gpu_hours": t / _RATE.value / 3600,
                                     "times_last_tokens": t / fitted[-1]["tokens"]}
    result["sets"][kind] = entry
  text = json.dumps(result, indent=1)
  print(text)
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as fh:
      fh.write(text + "\n")
  print(f"\n{'set':>10} {'AL now':>7} {'+AL per 10x tokens':>19} {'rms':>6} "
        + " ".join(f"{'tokens for ' + g:>16} {'GPU-hours':>10}" for g in _GOALS.value))
  for kind, e in result["sets"].items():
    row = f"{kind:>10} {e['last_al']:>7.3f} {e['b_per_10x']:>19.3f} {e['rms_residual']:>6.3f} "
    row += " ".join(f"{g['tokens']:>16.3g} {g['gpu_hours']:>10.3g}" for g in e["goals"].values())
    print(row)
  print(f"(fit over {len(fitted)} points, {tokens[0]:.3g}-{tokens[-1]:.3g} cumulative GPU training "
        f"tokens; GPU-hours at {_RATE.value:,.0f} tokens/s)")


if __name__ == "__main__":
  app.run(main)
