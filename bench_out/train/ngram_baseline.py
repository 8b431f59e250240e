"""Issue 24 (session 32): how far a plain n-gram table gets on the target's own text: next-token top-1 from
the previous 1 / 2 / 3 tokens, tables from all but the last 500 sequences of the committed shards, scored
on those 500 (response tokens). Compare with the draft's offset-1 acceptance (bench_out/train/README.md).

    PYTHONPATH=. python bench_out/train/ngram_baseline.py
"""
import numpy as np, collections
from dflash_jax.train import shards
seqs = shards.read_shards("checkpoints/train_data/smollm2-135m-instruct", 49152)
print(len(seqs))
tr, te = seqs[:-500], seqs[-500:]
for n in (1, 2, 3):
  tab = collections.defaultdict(collections.Counter)
  for s in tr:
    t = np.concatenate([s.prompt, s.response]).tolist(); P = len(s.prompt)
    for i in range(max(P, n), len(t)):
      tab[tuple(t[i-n:i])][t[i]] += 1
  best = {k: c.most_common(1)[0][0] for k, c in tab.items()}
  hit = tot = miss = 0
  for s in te:
    t = np.concatenate([s.prompt, s.response]).tolist(); P = len(s.prompt)
    for i in range(max(P, n), len(t)):
      tot += 1; k = tuple(t[i-n:i])
      if k in best: hit += best[k] == t[i]
      else: miss += 1
  print(f"{n}-gram context: next-token top-1 {hit/tot:.3f} (unseen contexts {miss/tot:.3f})")
