"""Compile seconds of the programs `generate` runs, per mode, in one process (no persistent
compilation cache): the prefill program of a 20-token prompt and the decode loop, chain then
DDTree@22 then AR, on the embedded SmolLM2 target with the shipped draft. Prints one JSON line.

  python bench_out/compile/compile_study.py --repeats 1   # from the repository root
"""

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import dflash_jax as dj  # noqa: E402
from dflash_jax import cli  # noqa: E402

MAX_CTX = flags.DEFINE_integer("max_ctx", 512, "cache capacity in tokens")


def main(argv):
  del argv
  t = dj.load_target(cli.default_target_path())
  d = dj.load_draft(cli.find_draft_dir(t), t)
  out = {}
  for mode in ("chain", "ddtree", "ar"):
    t0 = time.perf_counter()
    pre = dj.api.precompile(t, d, 20, mode=mode, max_ctx=MAX_CTX.value, loop=False)
    loop = dj.api.precompile(t, d, 20, mode=mode, max_ctx=MAX_CTX.value)
    out[mode] = dict(prefill_s=round(pre, 2), loop_s=round(loop, 2),
                     wall_s=round(time.perf_counter() - t0, 2))
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
