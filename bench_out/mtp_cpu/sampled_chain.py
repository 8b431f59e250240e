"""Acceptance of the MTP draft's sampled chain on the tiny MTP fixtures (tests/data/qwen35mtp_tiny,
qwen35moemtp_tiny): ancestral drafting (each block step draws its token, the next step feeds the
draw: decode._ancestral_chain, the default) against draws along the block's argmax path (the
rows a DFlash draft gives, decode.draft_rows). Temperature 0.8, 2 prompts x 8 seeds x 32 tokens.
One variant per process (the compiled loop is cached per process):

  python bench_out/mtp_cpu/sampled_chain.py ancestral
  python bench_out/mtp_cpu/sampled_chain.py argmax_rows

Prints one JSON line per fixture: mean acceptance length and steps."""

import json
import lzma
import os
import shutil
import sys
import tempfile

import numpy as np

import dflash_jax as dj
from dflash_jax import decode

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data")


def main(variant: str):
  if variant == "argmax_rows":
    decode._ancestral_chain = lambda tp, dp, s, plan, key: decode._ROWS_PROPOSER(
        tp, dp, s, plan=plan, key=key, sampled=True)
  elif variant != "ancestral":
    raise SystemExit(f"variant {variant!r}: expected ancestral or argmax_rows")
  with tempfile.TemporaryDirectory() as tmp:
    for fx in ("qwen35mtp_tiny", "qwen35moemtp_tiny"):
      path = os.path.join(tmp, fx + ".gguf")
      with lzma.open(os.path.join(DATA, fx, "model-f32.gguf.xz")) as src, open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
      t = dj.load_target(path, weights="f32", tokenizer=False)
      d = dj.load_draft("mtp", t)
      tokens = np.load(os.path.join(DATA, fx, "reference.npz"))["tokens"]
      lens = []
      for r in range(2):
        for seed in range(8):
          out = dj.generate(t, d, tokens[r][:12], max_new_tokens=32, max_ctx=96, eog_ids=(),
                            mode="chain", temperature=0.8, seed=seed)
          lens += out.accept_lens
      print(json.dumps({"fixture": fx, "variant": variant, "mean_accept_len": float(np.mean(lens)),
                        "steps": len(lens)}))


if __name__ == "__main__":
  main(sys.argv[1])
