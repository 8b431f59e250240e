"""First-call (trace + compile + run) and second-call (run only) seconds of `dflash_jax.generate` in
one process, for the XLA:CPU flags the caller puts in XLA_FLAGS (session 48: does an XLA:CPU option
shorten the compiles that dominate the test suite?). No persistent compile cache: every program
compiles in this process.

  XLA_FLAGS=--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE \
    python bench_out/ci/compile_flags.py tiny chain,ddtree     # tiny Qwen3.5 hybrid + fixture draft
  python bench_out/ci/compile_flags.py smol ar                 # SmolLM2 (runtime effect of a flag)

Prints one JSON line per mode and the whole result last.
"""
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
import numpy as np  # noqa: E402

import dflash_jax as dj  # noqa: E402
from dflash_jax import cli  # noqa: E402


def main(which: str, modes: list[str]):
  out = {"model": which, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  if which == "tiny":
    import conftest
    path = conftest.unxz(os.path.join(conftest.QWEN, "model-f32.gguf.xz"),
                         os.path.join(tempfile.mkdtemp(), "model-f32.gguf"))
    target = dj.load_target(path)
    draft = dj.load_draft(conftest.DRAFT, target)
    prompt, n = np.load(os.path.join(conftest.QWEN, "reference.npz"))["tokens"][1, :16], 40
  else:
    target = dj.load_target(cli.default_target_path())
    draft = dj.load_draft(cli.find_draft_dir(target), target)
    prompt, n = target.tokenizer.encode("def fibonacci(n):\n    "), 64
  for mode in modes:
    d = None if mode == "ar" else draft
    kw = dict(max_new_tokens=n, mode=mode, max_ctx=256, eog_ids=())
    t0 = time.perf_counter()
    dj.generate(target, d, prompt, **kw)
    t1 = time.perf_counter()
    r = dj.generate(target, d, prompt, **kw)
    t2 = time.perf_counter()
    out[mode] = {"first_s": round(t1 - t0, 2), "second_s": round(t2 - t1, 2),
                 "decode_tok_s": round(r.decode_tok_s, 2), "first_tokens": r.tokens[:8]}
    print(json.dumps({mode: out[mode]}), flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2].split(","))
