"""The shipped draft's held-out chain acceptance (`heldout.heldout_accept`: exact teacher-forced
chain acceptance through the training forward's target features) on scripts/bench.py's sets,
HumanEval 0-49 x 64 and the 16 chat prompts x 128; session 60 ran it after the training forward
became a layer scan, to check that it still reproduces the decoded chain acceptance (1.774 / 1.688).

  python bench_out/train/heldout_check.py     # ~5 min with the greedy continuations (cached in /tmp)
"""
import json, time
import dflash_jax as dj
from dflash_jax import cli
from dflash_jax.train import heldout, objective
target = dj.load_target(cli.default_target_path())
d = dj.load_draft("checkpoints/smollm2-135m-instruct-dflash", target)
prompts = heldout.eval_prompts(target, 50, 16)
lm = objective.frozen_target_tensors(target)[1]
out = {}
for kind, ps in prompts.items():
  seqs = heldout.greedy_continuations(target, ps, heldout.EVAL_NEW_TOKENS[kind],
                                      cache_path=f"/tmp/heldout_cont_{kind}.npz")
  t0 = time.time()
  h = heldout.heldout_accept(d.params, d.config, target, seqs, lm_head_w=lm)
  out[kind] = {"chain_al": h["chain_al"], "n_seqs": h["n_seqs"], "secs": time.time() - t0}
  print(kind, out[kind], flush=True)
print(json.dumps(out))
