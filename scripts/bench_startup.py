"""Start-up benchmark: what a user waits for before the first token (issue: first token in seconds).

  python scripts/bench_startup.py --runs 2 --json_out bench_out/startup_cpu/startup.json

Each run launches, as a user would, (1) `scripts/generate.py --prompt ...` and times launch -> first
streamed character on stdout and launch -> exit, and (2) `python -m dflash_jax.serve` and times launch ->
port open (any HTTP answer) -> /health 200 (model loaded and compiled). The first run of each uses
a fresh compile cache directory (cold: everything compiled), later runs the same directory (warm: the
cache read back), so the table shows both. Prints JSON and a table.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from dflash_jax import cli

_RUNS = flags.DEFINE_integer("runs", 2, "Runs of each command (the first cold, the rest warm).")
_PROMPT = flags.DEFINE_string("prompt", "Write a Python function that reverses a string.",
                              "generate.py prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "generate.py --max_new_tokens.")
_EXTRA = flags.DEFINE_list("args", [], "Extra flags for both commands (e.g. --mode=ar).")
_JSON = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _generate(cache: str) -> dict:
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--prompt", _PROMPT.value,
         "--max_new_tokens", str(_MAX_NEW.value), f"--compile_cache_dir={cache}", *_EXTRA.value]
  t0 = time.perf_counter()
  p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
  first = p.stdout.read(1)
  t_first = time.perf_counter() - t0
  _, err = p.communicate()
  if p.returncode != 0 or not first:
    raise RuntimeError(f"generate.py failed ({p.returncode}): {err.decode()[-2000:]}")
  return {"first_token_s": t_first, "exit_s": time.perf_counter() - t0}


def _serve(cache: str) -> dict:
  port = cli.free_port()
  cmd = [sys.executable, "-m", "dflash_jax.serve", f"--port={port}",
         f"--compile_cache_dir={cache}", *_EXTRA.value]
  t0 = time.perf_counter()
  p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
  t_open = None
  try:
    while True:
      if p.poll() is not None:
        raise RuntimeError(f"the server exited ({p.returncode}): {p.stderr.read().decode()[-2000:]}")
      h = cli.health(port)
      if h is not None and t_open is None:
        t_open = time.perf_counter() - t0
      if h is not None and h[0] == 200:
        return {"port_open_s": t_open, "ready_s": time.perf_counter() - t0}
      time.sleep(0.1)
  finally:
    p.terminate()
    p.wait(timeout=30)


def main(argv):
  del argv
  rows = []
  with tempfile.TemporaryDirectory() as d:
    for i in range(_RUNS.value):
      g = _generate(os.path.join(d, "gen"))
      s = _serve(os.path.join(d, "serve"))
      rows.append({"run": i, "cache": "cold" if i == 0 else "warm", **g, **s})
      print(json.dumps(rows[-1]), flush=True)
  print(f"{'run':>3} {'cache':>5} {'gen first token':>16} {'gen exit':>9} {'serve port':>11} "
        f"{'serve ready':>12}")
  for r in rows:
    print(f"{r['run']:>3} {r['cache']:>5} {r['first_token_s']:>15.1f}s {r['exit_s']:>8.1f}s "
          f"{r['port_open_s']:>10.1f}s {r['ready_s']:>11.1f}s")
  if _JSON.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
    with open(_JSON.value, "w") as fh:
      json.dump({"command": " ".join(sys.argv), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
