"""Plot held-out acceptance length against training tokens from train_draft.py logs.

  python scripts/plot_train_curve.py --logs /work/train_run/online1/train_log.json \
      --out bench_out/train/curve.png

Each log's `evals` (HumanEval and chat prompts, chain, greedy) become one line per prompt kind;
`--labels` names the runs (one colour per run; HumanEval solid, chat dashed). Also prints the
points as JSON and a table.
"""

import json
import os

from absl import app, flags

_LOGS = flags.DEFINE_list("logs", None, "train_log.json files (scripts/train_draft.py).",
                          required=True)
_LABELS = flags.DEFINE_list("labels", None, "One label per log (default: the log's directory).")
_OUT = flags.DEFINE_string("out", "bench_out/train/curve.png", "PNG to write.")


def main(argv):
  del argv
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  labels = _LABELS.value or [os.path.basename(os.path.dirname(os.path.abspath(p)))
                             for p in _LOGS.value]
  if len(labels) != len(_LOGS.value):
    raise app.UsageError(f"--labels: {len(labels)} labels for {len(_LOGS.value)} logs")
  fig, ax = plt.subplots(figsize=(11, 4.6))
  points = []
  colors = plt.cm.tab10.colors
  styles = {"humaneval": "-", "chat": "--"}
  for r, (path, label) in enumerate(zip(_LOGS.value, labels)):
    with open(path) as fh:
      evals = json.load(fh)["evals"]
    kinds = sorted({k for e in evals for k, v in e.items()
                    if k not in ("step", "train_tokens") and isinstance(v, (int, float))})
    for kind in kinds:
      xs = [e["train_tokens"] / 1e6 for e in evals if kind in e]
      ys = [e[kind] for e in evals if kind in e]
      ax.plot(xs, ys, marker="o", color=colors[r % len(colors)],
              linestyle=styles.get(kind, ":"), label=f"{label}: {kind}")
    for e in evals:
      points.append({"run": label, **e})
      print(json.dumps(points[-1]))
  ax.set_xlabel("training tokens seen (millions; real tokens; the first CPU run: sequences x seq_len)")
  ax.set_ylabel("held-out mean acceptance length (chain)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  fig.savefig(_OUT.value, dpi=110)
  kinds = sorted({k for p in points for k, v in p.items()
                  if k not in ("run", "step", "train_tokens") and isinstance(v, (int, float))})
  print(f"{'run':>12} {'step':>6} {'tokens':>10} " + " ".join(f"{k:>10}" for k in kinds))
  for p in points:
    print(f"{p['run']:>12} {p['step']:>6} {p['train_tokens']:>10} "
          + " ".join(f"{p.get(k, float('nan')):>10.3f}" for k in kinds))
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
