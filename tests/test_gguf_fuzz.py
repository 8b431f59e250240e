"""GGUF fuzzing (issue: hostile input). A few hundred structured and random mutations of the tiny
Q8_0 Qwen3.5 file (fixed seed) are loaded in a child process under a 6 GiB address-space limit
and a 30 s alarm per case. Every case must either load and give logits equal to the original's
(or, where the mutation changed a metadata value into another valid one, finite logits), or
fail with a ValueError / NotImplementedError naming the file; generate() refuses non-finite
logits. No hang, no traceback of another type, bounded memory."""

import collections
import json
import os
import subprocess
import sys

from conftest import QWEN

HERE = os.path.dirname(os.path.abspath(__file__))
N_CASES = 400


def test_gguf_fuzz(tmp_path):
  src = os.path.join(QWEN, "model-q8_0.gguf")
  proc = subprocess.run(
      [sys.executable, os.path.join(HERE, "gguf_fuzz_child.py"), src, str(N_CASES), "7",
       str(tmp_path), str(6 << 30), "30"],
      capture_output=True, text=True, timeout=900, cwd=HERE)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
  rows, summary = lines[:-1], lines[-1]
  assert len(rows) == N_CASES
  counts = collections.Counter(r["outcome"] for r in rows)
  bad = [r for r in rows if r["outcome"] == "bad"
         or (r["outcome"] == "error" and "mutated.gguf" not in r["msg"])]
  assert not bad, bad[:5]
  # The mutations reach the loader's checks (not only the magic / first bytes).
  assert counts["error"] > N_CASES // 2 and counts["same"] > 0, counts
  assert max(r["s"] for r in rows) < 20.0
  assert summary["maxrss_kb"] < 3 << 20, summary      # < 3 GiB resident at peak
