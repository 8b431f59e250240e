"""DDTree acceptance with conditional draft trees (the default since session 44) against the tree
over the greedy chain's rows (what DDTree used before), side by side in one run, greedy, every
output checked against AR:

  - the MTP block of the tiny converted fixtures (`decode.ar_tree`: a block step on every node's
    own path; before: `decode.draft_rows`, a branch off the chain scored with the chain's
    predecessors), 3 and 7 drafts, budget 8, the fixtures' two 12-token prompts x 24 tokens;
  - the tiny DFlash-2 draft (`draft2.tree`: each node's children scored by the selector with that
    node as their predecessor; before: the selector's greedy-path rows), block 16, budgets 8 and
    22, its fixture prompt and two shorter ones x 40 tokens.

    python bench_out/trees_cpu/tree_acceptance.py > bench_out/trees_cpu/tree_acceptance.jsonl

Prints a JSON line per (draft, fixture, drafts per step, budget, tree)."""

import json
import os
import shutil
import sys
import tempfile

import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

import dflash_jax as dj  # noqa: E402
from dflash_jax import batching, decode  # noqa: E402
from conftest import DATA, unxz  # noqa: E402

CONDITIONAL, ROWS = "conditional (per node)", "greedy chain rows"


def run(target, draft, dec, prompts, n_new, tree):
  """Mean acceptance length over the prompts (each output checked against AR)."""
  lens = []
  for prompt in prompts:
    prompt = np.asarray(prompt, np.int32)
    b = batching.SlotBatch(target, draft, dec, 1, jnp.asarray([-1], jnp.int32))
    if tree == ROWS:
      b.proposer = decode.LogitsProposer(decode.draft_rows)
    b.prefill(0, prompt, n_new, dj.SamplingConfig())
    b.run(1 << 20)
    out = b.row(0)
    ar = dj.generate(target, None, prompt, max_new_tokens=n_new, mode="ar", max_ctx=dec.max_ctx,
                     eog_ids=())
    assert out.tokens == ar.tokens
    lens += list(out.accept_lens)
  return round(float(np.mean(lens)), 3), len(lens)


def main():
  tmp = tempfile.mkdtemp(prefix="trees_")
  for name in ("qwen35mtp_tiny", "qwen35moemtp_tiny"):
    path = unxz(os.path.join(DATA, name, "model-f32.gguf.xz"), os.path.join(tmp, name + ".gguf"))
    target = dj.load_target(path, weights="f32", tokenizer=False)
    prompts = [row[:12] for row in np.load(os.path.join(DATA, name, "reference.npz"))["tokens"]]
    for steps in (3, 7):
      draft = dj.load_draft("mtp", target, mtp_steps=steps)
      dec = dj.api.resolve_config(draft, mode="ddtree", budget=8, max_ctx=128)
      for tree in (CONDITIONAL, ROWS):
        acc, n = run(target, draft, dec, prompts, 24, tree)
        print(json.dumps(dict(draft="mtp", fixture=name, drafts=steps, budget=8, tree=tree,
                              acceptance=acc, steps=n)), flush=True)
  target = dj.load_target(unxz(os.path.join(DATA, "qwen35_tiny", "model-f32.gguf.xz"),
                               os.path.join(tmp, "qwen35.gguf")))
  d2 = os.path.join(tmp, "dflash2")
  os.makedirs(d2)
  shutil.copy(os.path.join(DATA, "dflash2_tiny", "config.json"), d2)
  unxz(os.path.join(DATA, "dflash2_tiny", "model.safetensors.xz"),
       os.path.join(d2, "model.safetensors"))
  draft = dj.load_draft(d2, target)
  p = np.load(os.path.join(DATA, "dflash2_tiny", "reference.npz"))["prompt_ids"]
  prompts = [p, p[:16], p[:8]]
  for budget in (8, 22):
    dec = dj.api.resolve_config(draft, mode="ddtree", budget=budget, max_ctx=256)
    for tree in (CONDITIONAL, ROWS):
      acc, n = run(target, draft, dec, prompts, 40, tree)
      print(json.dumps(dict(draft="dflash2", fixture="dflash2_tiny", drafts=15, budget=budget,
                            tree=tree, acceptance=acc, steps=n)), flush=True)


if __name__ == "__main__":
  main()
