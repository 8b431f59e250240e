"""Held-out chain acceptance of drafts side by side (`heldout.heldout_accept`: exact teacher-forced
chain acceptance through the training forward's target features) on scripts/bench.py's sets,
HumanEval 0-49 x 64 and the 16 chat prompts x 128. On the shipped draft it reproduces the decoded
chain acceptance (1.774 / 1.688); docs/gpu.md's training run uses it to choose between a new
checkpoint and the shipped draft.

  python scripts/studies/heldout_check.py [DRAFT_DIR ...] [--json_out F]
      # default: the shipped draft; ~5 min with the greedy continuations (cached in /tmp), then
      # ~40 s a draft
"""
import argparse, json, time
import dflash_jax as dj
from dflash_jax import cli
from dflash_jax.train import heldout, objective

ap = argparse.ArgumentParser()
ap.add_argument("drafts", nargs="*", default=["checkpoints/smollm2-135m-instruct-dflash"])
ap.add_argument("--json_out", default=None)
args = ap.parse_args()
target = dj.load_target(cli.default_target_path())
prompts = heldout.eval_prompts(target, 50, 16)
lm = objective.frozen_target_tensors(target)[1]
seqs = {kind: heldout.greedy_continuations(target, ps, heldout.EVAL_NEW_TOKENS[kind],
                                           cache_path=f"/tmp/heldout_cont_{kind}.npz")
        for kind, ps in prompts.items()}
out = {}
for path in args.drafts:
  d = dj.load_draft(path, target)
  for kind, ss in seqs.items():
    t0 = time.time()
    h = heldout.heldout_accept(d.params, d.config, target, ss, lm_head_w=lm)
    out.setdefault(path, {})[kind] = {"chain_al": h["chain_al"], "n_seqs": h["n_seqs"],
                                      "secs": round(time.time() - t0, 1)}
    print(path, kind, out[path][kind], flush=True)
print(f"{'draft':<48}" + "".join(f"{k:>12}" for k in seqs))
for path, r in out.items():
  print(f"{path:<48}" + "".join(f"{r[k]['chain_al']:>12.3f}" for k in seqs))
if args.json_out:
  with open(args.json_out, "w") as fh:
    json.dump(out, fh, indent=1)
