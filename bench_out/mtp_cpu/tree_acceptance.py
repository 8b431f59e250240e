"""DDTree acceptance with an autoregressive draft (the MTP block of the tiny converted fixtures):
the real draft tree (`decode.ar_tree`: a block step on every node's own path, the default since
session 44) against the tree built from the greedy chain's rows (`decode.draft_rows`, what
DDTree used before: a branch off the chain is scored with the chain's predecessors), side by
side in one run, greedy, budget 8, the fixtures' two 12-token prompts x 24 tokens. Every output
is checked against AR.

    python bench_out/mtp_cpu/tree_acceptance.py > bench_out/mtp_cpu/tree_acceptance.jsonl

Prints a JSON line per (fixture, drafts per step, tree)."""

import json
import os
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

import dflash_jax as dj  # noqa: E402
from dflash_jax import batching, decode  # noqa: E402
from conftest import DATA, unxz  # noqa: E402


def main():
  tmp = tempfile.mkdtemp(prefix="mtp_tree_")
  for name in ("qwen35mtp_tiny", "qwen35moemtp_tiny"):
    path = unxz(os.path.join(DATA, name, "model-f32.gguf.xz"), os.path.join(tmp, name + ".gguf"))
    target = dj.load_target(path, weights="f32", tokenizer=False)
    tokens = np.load(os.path.join(DATA, name, "reference.npz"))["tokens"]
    for steps in (3, 7):
      draft = dj.load_draft("mtp", target, mtp_steps=steps)
      dec = dj.api.resolve_config(draft, mode="ddtree", budget=8, max_ctx=128)
      for tree in ("draft steps per node", "greedy chain rows"):
        lens = []
        for row in tokens:
          prompt = np.asarray(row[:12], np.int32)
          b = batching.SlotBatch(target, draft, dec, 1, jnp.asarray([-1], jnp.int32))
          if tree == "greedy chain rows":
            b.proposer = decode.LogitsProposer(decode.draft_rows)
          b.prefill(0, prompt, 24, dj.SamplingConfig())
          b.run(1 << 20)
          out = b.row(0)
          ar = dj.generate(target, None, prompt, max_new_tokens=24, mode="ar", max_ctx=128,
                           eog_ids=())
          assert out.tokens == ar.tokens
          lens += list(out.accept_lens)
        print(json.dumps(dict(fixture=name, drafts=steps, budget=8, tree=tree,
                              acceptance=round(float(np.mean(lens)), 3), steps=len(lens))),
              flush=True)


if __name__ == "__main__":
  main()
