"""Sampled chain acceptance under the two exact rules, on SmolLM2-135M-Instruct Q4_1 with the shipped
draft: "rejection" (drafts drawn from the draft's distribution, accepted with min(1, p/q)) and
"match" (the draft's argmax, accepted while equal to the target's own draw; the rule `--mode auto`
uses so that a seeded request's text is the same in every mode). The 16 chat prompts of
scripts/bench.py, N new tokens each, temperature T, top_p 0.95, seeds 0..S-1.

  python scripts/studies/chain_rule_acceptance.py [--temperature 0.7] [--n_gen 64] [--seeds 2] \
      [--json_out bench_out/cpu/chain_rule_acceptance.json]
"""
import argparse
import json
import statistics
import sys

import dflash_jax as dj
from dflash_jax import cli

ap = argparse.ArgumentParser()
ap.add_argument("--temperature", type=float, default=0.7)
ap.add_argument("--n_gen", type=int, default=64)
ap.add_argument("--seeds", type=int, default=2)
ap.add_argument("--n_prompts", type=int, default=16)
ap.add_argument("--json_out", default=None)
args = ap.parse_args()
target = dj.load_target(cli.default_target_path())
draft = dj.load_draft(cli.find_draft_dir(target), target)
prompts = [cli.build_prompt(target, p, chat=True) for p in cli.CHAT_PROMPTS[:args.n_prompts]]
out = {}
for rule in ("rejection", "match"):
  tokens = steps = 0
  for ids in prompts:
    for seed in range(args.seeds):
      r = dj.generate(target, draft, ids, max_new_tokens=args.n_gen, mode="chain", chain_rule=rule,
                      max_ctx=1024, temperature=args.temperature, top_p=0.95, seed=seed)
      tokens += len(r.tokens) - 1          # the prefill's token is not a step's
      steps += len(r.accept_lens)
  out[rule] = {"acceptance_length": round(tokens / steps, 3), "tokens": tokens, "steps": steps}
  print(rule, out[rule], flush=True)
out["match_over_rejection"] = round(out["match"]["acceptance_length"] /
                                    out["rejection"]["acceptance_length"], 3)
print(out)
if args.json_out:
  with open(args.json_out, "w") as fh:
    json.dump({"machine": "2-core AMD EPYC VM (AVX2), 24 GiB, CPU only",
               "command": "python " + " ".join(sys.argv), "settings": vars(args), **out}, fh,
              indent=1)
