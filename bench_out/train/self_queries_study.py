"""Is the self-written query data (gen_data.py --self_queries, Magpie) closer to the benchmark
sets than the corpus is? Two measurements, no training:

1. The shipped draft's held-out chain acceptance (`heldout.heldout_accept`, exact teacher-forced
   greedy chain, block 16, first 128 response tokens) on: the benchmark chat prompts (16 x 128)
   and HumanEval 0-49 x 64, answers to corpus chat prompts and corpus code prompts the draft never
   saw (shards 53-68), and answers to self-written queries (never seen either). A draft fitted to
   its training distribution accepts its own kind of text better; where a set sits between the
   corpus and the benchmark says how far from the benchmark the training text is.
2. A static n-gram table (`dflash_jax.ngram`, orders 1-4) of the committed shards without and with
   the self-query shards: its teacher-forced next-token accuracy and chain acceptance (table
   proposals over the target's greedy continuation, longest matching order, up to 15 tokens) on
   the benchmark sets. Text closer to the benchmark's raises both.
A control for (1): the target's own mean top-1 probability at the same positions (a set the target
itself is unsure of is hard for any draft, whatever it was trained on).

  python bench_out/train/self_queries_study.py --json_out bench_out/train/self_queries_s51.json
  python bench_out/train/self_queries_study.py --n_seqs 64 --table_cuts 76,83,89 --json_out ...s53.json
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dflash_jax.runtime import Runtime

_DATA = flags.DEFINE_string("data_dir", "checkpoints/train_data/smollm2-135m-instruct", "Shards.")
_N = flags.DEFINE_integer("n_seqs", 48, "Sequences sampled from each held-out shard set.")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")
_CACHE = flags.DEFINE_string("eval_cache", "/tmp/self_queries_eval.npz", "Greedy continuations.")
_CUTS = flags.DEFINE_list("table_cuts", [], "Also tables of the corpus plus the self-query shards "
                          "numbered below each cut (e.g. 76,83: the table's growth with this data).")


def _table_chain(table, tokens, start, max_len=15):
  """m(p) for p >= start: leading table predictions (true context, longest order first) equal to
  tokens[p + 1 ..]; and the per-position next-token accuracy."""
  from dflash_jax import ngram
  t = np.asarray(tokens, np.int64)
  pred = np.full(t.size, -1, np.int64)
  pred[start:] = ngram.next_tokens(table, t, np.arange(start, t.size))[0]
  ok = pred == t                                           # ok[q]: table right about tokens[q]
  m = np.zeros(t.size, np.int64)
  for p in range(t.size - 2, start - 1, -1):               # anchor p: bonus tokens[p], guesses p+1..
    m[p] = (m[p + 1] + 1 if ok[p + 1] else 0) if p + 1 < t.size else 0
  m = np.minimum(m, max_len)
  return m[start:t.size - 1], ok[start + 1:]


def bench_sets(target) -> dict:
  """{"humaneval", "chat"}: the target's greedy continuations of bench.py's prompt sets (HumanEval
  0-49, the 16 chat prompts), cached in --eval_cache."""
  from dflash_jax.train import heldout
  return {kind: heldout.greedy_continuations(target, prompts, heldout.EVAL_NEW_TOKENS[kind],
                                             cache_path=_CACHE.value, cache_prefix=kind)
          for kind, prompts in heldout.eval_prompts(target, 50, 16).items()}


def table_accept(table, seqs) -> tuple[float, float]:
  """The table's teacher-forced chain acceptance over seqs (`_table_chain` walked as the decode loop
  walks a chain, mean over sequences) and its next-token accuracy over all their positions."""
  from dflash_jax.train import heldout
  als, oks = [], []
  for s in seqs:
    m, ok = _table_chain(table, s.tokens, s.prompt_len)
    als.append(float(np.mean(heldout.walk_chain(m, s.tokens.size - s.prompt_len))))
    oks.append(ok)
  return float(np.mean(als)), float(np.mean(np.concatenate(oks)))


def main(argv):
  del argv
  import dflash_jax as dj
  from dflash_jax import cli, ngram
  from dflash_jax.train import heldout, objective, shards
  from dflash_jax.train.self_queries import SELF_QUERY_BASE
  target = dj.load_target(cli.default_target_path())
  d = dj.load_draft("checkpoints/smollm2-135m-instruct-dflash", target)
  V = target.config.n_vocab
  man = shards.read_manifest(_DATA.value)["shards"]
  corpus_seqs, self_seqs = [], []
  for e in man:
    (self_seqs if e["first_prompt"] >= SELF_QUERY_BASE else corpus_seqs).append(e)
  read = lambda es: [s for e in es for s in shards.read_shard(_DATA.value, e, V)]
  shard_no = lambda e: int(e["file"][6:11])
  unseen = read([e for e in corpus_seqs if 53 <= shard_no(e) <= 68])
  sets = {"bench_" + kind: ss for kind, ss in bench_sets(target).items()}
  rng = np.random.default_rng(0)
  pick = lambda ss: [ss[i] for i in rng.choice(len(ss), size=min(_N.value, len(ss)), replace=False)]
  sets["corpus_chat_unseen"] = pick([s for s in unseen if int(s.tokens[0]) == 1])
  sets["corpus_code_unseen"] = pick([s for s in unseen if int(s.tokens[0]) != 1])
  new_by_shard = [(shard_no(e), read([e])) for e in self_seqs]      # each shard read once
  new = [s for _, ss in new_by_shard for s in ss]
  if new:
    sets["self_queries"] = pick(new)
  out = {"n_self_query_seqs": len(new),
         "self_query_response_tokens": int(sum(s.response.size for s in new)), "draft": {},
         "table": {}}
  lm = objective.frozen_target_tensors(target)[1]

  @jax.jit
  def top1(tokens, length):                      # the target's top-1 probability per position
    _, hid = objective.target_pass(target.params, target.config, tokens, length,
                                   d.config.target_layer_ids, Runtime())
    lg = objective.head_logits(target.params, target.config, hid, lm)
    return jnp.max(jax.nn.softmax(lg, -1), -1)

  for name, ss in sets.items():
    h = heldout.heldout_accept(d.params, d.config, target, ss, max_new=128, lm_head_w=lm)
    conf = []
    for sq_ in ss:
      t = np.asarray(sq_.tokens[:sq_.prompt_len + 128], np.int32)
      tp = np.zeros(-(-t.size // 64) * 64, np.int32)
      tp[:t.size] = t
      conf.append(np.asarray(top1(jnp.asarray(tp), jnp.int32(t.size)))[sq_.prompt_len:t.size - 1])
    c = float(np.mean(np.concatenate(conf)))
    out["draft"][name] = {k: h[k] for k in ("chain_al", "n_seqs", "n_anchors")} | {
        "p_offset_1": h["p_offset"][0], "target_top1_prob": c}
    print(f"draft {name:<20} chain AL {h['chain_al']:.3f}  offset-1 {h['p_offset'][0]:.3f} "
          f"target top-1 {c:.3f} ({h['n_seqs']} seqs)", flush=True)
  corpus = read(corpus_seqs)
  pairs = lambda ss: [(s.tokens, s.prompt_len) for s in ss]
  tables = {"corpus": ngram.build(pairs(corpus), V)}
  for cut in map(int, _CUTS.value):
    part = [s for no, ss in new_by_shard if no < cut for s in ss]
    tables[f"corpus+self_queries<{cut}"] = ngram.build(pairs(corpus + part), V)
    out[f"self_query_response_tokens<{cut}"] = int(sum(s.response.size for s in part))
  if new:
    tables["corpus+self_queries"] = ngram.build(pairs(corpus + new), V)
  for tname, tab in tables.items():
    for name in ("bench_humaneval", "bench_chat"):
      al, acc = table_accept(tab, sets[name])
      r = {"chain_al": al, "next_token_acc": acc, "entries": tab.size}
      out["table"][f"{tname}/{name}"] = r
      print(f"table {tname:<20} {name:<16} chain AL {r['chain_al']:.3f}  next-token "
            f"{r['next_token_acc']:.3f}  ({tab.size} entries)", flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
