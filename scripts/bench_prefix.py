"""Turn-2 time to first token with the prompt cache: a chat whose first turn carries ~1k tokens
(a Python reference text that ships with Python), then a short second turn. Cold: turn 2's whole
prompt prefilled; warm: the cache holds turn 1 (prompt and answer), so only the new tokens are
prefilled. Side by side in one run, medians over --repeats, per mode; prints JSON and a table.

  python scripts/bench_prefix.py --modes ar,chain --repeats 5 \
      --json_out bench_out/prefix_cpu/turn2.json
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags

from dflash_jax import target_flags

_TF = target_flags.define()
flags.adopt_module_key_flags(target_flags)
_MODES = flags.DEFINE_list("modes", ["auto"], "Decode modes to measure (ar, chain, ddtree, auto).")
_PREFIX = flags.DEFINE_integer("prefix_tokens", 1000, "Tokens of reference text in turn 1.")
_ANSWER = flags.DEFINE_integer("answer_tokens", 32, "Tokens generated per turn.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Measurements per figure (median).", lower_bound=1)
_MAX_CTX = flags.DEFINE_integer("max_ctx", 2048, "Context (cache rows).")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here too.")


def reference_text(tok, n_tokens: int) -> str:
  """About n_tokens tokens of Python's own reference text (pydoc_data topics, in key order)."""
  import pydoc_data.topics as topics
  out, n = [], 0
  for key in sorted(topics.topics):
    part = topics.topics[key]
    out.append(part)
    n += len(tok.encode(part))
    if n >= n_tokens:
      break
  ids = tok.encode("".join(out))[:n_tokens]
  return tok.decode(ids)


def main(argv):
  del argv
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import cli

  target = target_flags.load(_TF)
  draft = dj.load_draft(cli.find_draft_dir(target), target)
  tok = target.tokenizer
  text = reference_text(tok, _PREFIX.value)
  turn1 = [{"role": "user", "content": "Read this and summarize it.\n\n" + text}]
  rows = []
  for mode in _MODES.value:
    kw = dict(mode=mode, max_ctx=_MAX_CTX.value, max_new_tokens=_ANSWER.value)
    p1 = tok.encode_chat(turn1, add_generation_prompt=True)
    cold_s, warm_s, cached = [], [], []
    for rep in range(_REPEATS.value + 1):             # the first round compiles (not counted)
      cache = dj.PromptCache.for_target(target, 1 << 30)
      first = dj.generate(target, draft, p1, prompt_cache=cache, **kw)
      msgs = turn1 + [{"role": "assistant", "content": tok.decode(first.tokens)},
                      {"role": "user", "content": "Now say it in one sentence."}]
      p2 = tok.encode_chat(msgs, add_generation_prompt=True)
      warm = dj.generate(target, draft, p2, prompt_cache=cache, **kw)
      cold = dj.generate(target, draft, p2, **kw)
      if warm.tokens != cold.tokens:
        raise SystemExit(f"mode {mode}: warm and cold outputs differ")
      if rep:
        cold_s.append(cold.prefill_s)
        warm_s.append(warm.prefill_s)
        cached.append(warm.cached_tokens)
    row = {"mode": warm.mode, "requested_mode": mode, "turn1_prompt_tokens": len(p1),
           "turn2_prompt_tokens": len(p2), "cached_tokens": int(np.median(cached)),
           "cold_ttft_s": statistics.median(cold_s), "warm_ttft_s": statistics.median(warm_s),
           "cold_all": cold_s, "warm_all": warm_s}
    row["warm_over_cold"] = row["warm_ttft_s"] / row["cold_ttft_s"]
    rows.append(row)
    print(json.dumps(row), flush=True)
  out = {"command": "scripts/bench_prefix.py " + " ".join(sys.argv[1:]),
         "target": os.path.basename(target.path), "device": str(__import__("jax").devices()[0]),
         "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
  print("\nmode    turn-2 prompt  cached  cold TTFT s  warm TTFT s  warm/cold")
  for r in rows:
    print(f"{r['mode']:<7} {r['turn2_prompt_tokens']:>13} {r['cached_tokens']:>7} "
          f"{r['cold_ttft_s']:>12.3f} {r['warm_ttft_s']:>12.3f} {r['warm_over_cold']:>10.3f}")
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    with open(_JSON.value, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  app.run(main)
