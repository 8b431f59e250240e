"""What batch-invariant decoding (`--invariant_rows 23`: 32 slots) costs on this
CPU, side by side in one process: SmolLM2 + the shipped draft, q4_0 KV cache, the first 3 chat
prompts of scripts/bench.py, 64 tokens, greedy, each (mode, invariant_rows) compiled first, then timed 3 times (median decode
tok/s, prefill excluded), plus whether each output equals AR's with the same setting.

  python scripts/studies/invariant_cost.py > bench_out/kv_cpu/invariant_cost.json
"""

import json

import jax
import numpy as np

import dflash_jax as dj
from dflash_jax import cli


def main():
  t = dj.load_target(cli.default_target_path(), kv_dtype="q4_0")
  draft = dj.load_draft(cli.find_draft_dir(t), t)
  prompts = [cli.build_prompt(t, text, chat=True) for text in cli.CHAT_PROMPTS[:3]]
  res = {"target": "SmolLM2-135M-Instruct.Q4_1.gguf", "kv_dtype": "q4_0", "n_gen": 64,
         "device": str(jax.devices()[0]), "rows": []}
  for inv in (0, 23):
    outs = {}
    for mode in ("ar", "chain", "ddtree"):
      run = lambda p: dj.generate(t, draft, p, max_new_tokens=64, mode=mode, max_ctx=256,
                                  eog_ids=(), invariant_rows=inv)
      run(prompts[0])
      tok_s, toks, acc = [], [], []
      for p in prompts:
        times = []
        for _ in range(3):
          r = run(p)
          times.append(r.decode_s)
        tok_s.append((len(r.tokens) - 1) / float(np.median(times)))
        toks.append(r.tokens)
        acc.append(float(np.mean(r.accept_lens)))
      outs[mode] = toks
      res["rows"].append(dict(invariant_rows=inv, mode=mode, decode_tok_s_median=float(np.median(tok_s)),
                              mean_accept_len=float(np.mean(acc)),
                              outputs_equal_ar=[a == b for a, b in zip(toks, outs["ar"])]))
  print(json.dumps(res, indent=1))


if __name__ == "__main__":
  main()
