"""The persistent compile cache: a second process reads every program back instead of
compiling it (JAX's cache events counted), a corrupt entry is a warning and a recompile, not a
crash, and the scripts' --compile_cache_dir / --nocompile_cache do what they say."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import sys, collections, jax
sys.path.insert(0, ROOT)
from jax import monitoring
counts = collections.Counter()
monitoring.register_event_listener(lambda name, **kw: counts.update([name]))
import dflash_jax as dj
from dflash_jax import compile_cache
compile_cache.enable(CACHE)
t = dj.load_target(GGUF, tokenizer=False)
r = dj.generate(t, None, [3, 14, 15, 92, 65], max_new_tokens=6, mode="ar", max_ctx=32, eog_ids=())
print("TOKENS", r.tokens)
print("MISSES", counts["/jax/compilation_cache/cache_misses"], "HITS",
      counts["/jax/compilation_cache/cache_hits"])
"""


def _child(gguf, cache):
  code = _CHILD.replace("ROOT", repr(ROOT)).replace("GGUF", repr(gguf)).replace("CACHE", repr(cache))
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-3000:]
  out = dict(l.split(" ", 1) for l in r.stdout.splitlines() if l.startswith(("TOKENS", "MISSES")))
  misses, hits = out["MISSES"].split()[0], out["MISSES"].split()[2]
  return out["TOKENS"], int(misses), int(hits), r.stderr


def test_second_process_compiles_nothing_and_corrupt_entries_recompile(tmp_path, qwen_f32_path):
  cache = str(tmp_path / "xla")
  tok1, miss1, _, _ = _child(qwen_f32_path, cache)
  assert miss1 > 0 and os.listdir(cache)           # programs written
  tok2, miss2, hits2, _ = _child(qwen_f32_path, cache)
  assert tok2 == tok1 and miss2 == 0 and hits2 >= miss1   # every program read back
  for name in os.listdir(cache):                   # corrupt every entry
    path = os.path.join(cache, name)
    if os.path.isfile(path):
      with open(path, "wb") as fh:
        fh.write(b"not an executable")
  tok3, miss3, _, err = _child(qwen_f32_path, cache)
  assert tok3 == tok1 and miss3 > 0 and "persistent compilation cache" in err


def test_generate_script_cache_flags(tmp_path):
  script = os.path.join(ROOT, "scripts", "generate.py")
  base = [sys.executable, script, "--nochat", "--prompt", "def f():", "--max_new_tokens", "2",
          "--draft", "none", "--mode", "ar", "--max_ctx", "64"]
  on = tmp_path / "on"
  r = subprocess.run(base + ["--compile_cache_dir", str(on)], capture_output=True, text=True,
                     timeout=600, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  assert f"compile cache: {on}" in r.stderr and os.listdir(on)
  off = tmp_path / "off"
  r = subprocess.run(base + ["--nocompile_cache", "--compile_cache_dir", str(off)],
                     capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "compile cache: off" in r.stderr and not off.exists()
  bad = tmp_path / "file"
  bad.write_text("x")
  r = subprocess.run(base + ["--compile_cache_dir", str(bad / "sub")], capture_output=True,
                     text=True, timeout=600, cwd=ROOT)
  assert r.returncode == 1 and "--compile_cache_dir" in r.stderr and "Traceback" not in r.stderr
