"""Do sampled answers (gen_data.py --temperature 0.8) help or hurt the static n-gram table that
`auto` uses? The table counts every shard's continuations and proposes each context's most frequent
next token; sampled text adds counts that greedy decoding would not write. Teacher-forced table
chain acceptance (table proposals over the target's greedy continuation, longest matching order, up
to 15 tokens; `self_queries_study.table_accept`) on HumanEval 0-49 x 64 and the 16 chat prompts x
128, for tables of: the greedy shards only, the shards before --cut, and every shard.

  python bench_out/train/sampled_table_study.py --cut 107 --json_out bench_out/train/sampled_table_s56.json
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# its flags --data_dir, --eval_cache and --json_out serve here too; its table measure too
from self_queries_study import _DATA, _JSON, bench_sets, table_accept  # noqa: E402

_CUT = flags.DEFINE_integer("cut", 107, "Also a table of the shards numbered below this.")


def main(argv):
  del argv
  import dflash_jax as dj
  from dflash_jax import cli, ngram
  from dflash_jax.train import shards
  target = dj.load_target(cli.default_target_path())
  V = target.config.n_vocab
  man = shards.read_manifest(_DATA.value)["shards"]
  sets = bench_sets(target)
  seqs = {e["file"]: shards.read_shard(_DATA.value, e, V) for e in man}
  tok = lambda es: int(sum(e["response_tokens"] for e in es))
  groups = {"greedy shards only": [e for e in man if e["temperature"] == 0],
            f"shards < {_CUT.value}": [e for e in man if int(e["file"][6:11]) < _CUT.value],
            f"all {len(man)} shards": man}
  out = {"tables": {}}
  for name, es in groups.items():
    tab = ngram.build([(s.tokens, s.prompt_len) for e in es for s in seqs[e["file"]]], V)
    row = {"shards": len(es), "response_tokens": tok(es),
           "sampled_tokens": tok([e for e in es if e["temperature"] > 0]), "entries": tab.size}
    for k, ss in sets.items():
      row[f"{k}_chain_al"] = table_accept(tab, ss)[0]
    out["tables"][name] = row
    print(f"{name:<22} {row['response_tokens']:>9} tokens ({row['sampled_tokens']:>7} sampled) "
          f"{row['entries']:>8} entries  HumanEval chain AL {row['humaneval_chain_al']:.4f}  "
          f"chat {row['chat_chain_al']:.4f}", flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
