"""A pytest plugin that logs, per test, what JAX compiled and how long each phase took, to find
which programs the suite compiles more than once (across its two xdist workers, or twice in one).

  PYTHONPATH=scripts/studies python -m pytest -q -n 2 --dist loadfile tests -p ci_compile_log \
      --compile-log /tmp/clog
  python scripts/studies/ci_compile_log.py /tmp/clog        # summary

Each worker writes DIR/<worker>.jsonl, one record per test: {"test", "worker", "s" (wall),
"events": {jax monitoring event: seconds summed}, "misses": [[module, key, compile s]],
"hits": [[module, key]]}. Keys are JAX's persistent-cache keys (HLO + options hash), so a key
in two records is one program compiled (or read back) twice.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

_state = {"events": collections.Counter(), "misses": [], "hits": []}


def pytest_addoption(parser):
  parser.addoption("--compile-log", default=None, help="directory for per-worker JSONL logs")


def pytest_configure(config):
  d = config.getoption("--compile-log")
  if not d:
    return
  os.makedirs(d, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  config._compile_log = open(os.path.join(d, f"{worker}.jsonl"), "a")
  config._compile_worker = worker
  from jax import monitoring
  from jax._src import compiler

  def on_duration(event, duration, **kw):
    _state["events"][event] += duration
  monitoring.register_event_duration_secs_listener(on_duration)

  orig_write = compiler._cache_write

  def cache_write(cache_key, compile_time_secs, module_name, backend, executable):
    _state["misses"].append([module_name, cache_key, round(compile_time_secs, 3)])
    return orig_write(cache_key, compile_time_secs, module_name, backend, executable)
  compiler._cache_write = cache_write

  orig_hit = compiler.log_persistent_cache_hit

  def hit(module_name, cache_key):
    _state["hits"].append([module_name, cache_key])
    return orig_hit(module_name, cache_key)
  compiler.log_persistent_cache_hit = hit


def pytest_runtest_protocol(item, nextitem):
  fh = getattr(item.config, "_compile_log", None)
  if fh is None:
    return None
  from _pytest.runner import runtestprotocol
  item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
  t = time.monotonic()
  runtestprotocol(item, nextitem=nextitem)
  rec = {"test": item.nodeid, "worker": item.config._compile_worker,
         "s": round(time.monotonic() - t, 3),
         "events": {k: round(v, 3) for k, v in _state["events"].items()},
         "misses": _state["misses"], "hits": _state["hits"]}
  fh.write(json.dumps(rec) + "\n")
  fh.flush()
  _state["events"].clear()
  _state["misses"] = []
  _state["hits"] = []
  item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
  return True


def summarize(d: str) -> None:
  """Print per-file compile totals and the programs compiled more than once."""
  recs = []
  for f in sorted(os.listdir(d)):
    if f.endswith(".jsonl"):
      with open(os.path.join(d, f)) as fh:
        recs += [json.loads(l) for l in fh if l.strip()]
  per_file = collections.defaultdict(collections.Counter)
  by_key = collections.defaultdict(list)   # key -> [(test, worker, compile s, module)]
  for r in recs:
    f = r["test"].split("::")[0]
    c = per_file[f]
    c["wall"] += r["s"]
    c["compile"] += sum(m[2] for m in r["misses"])
    c["n_miss"] += len(r["misses"])
    c["n_hit"] += len(r["hits"])
    for k, v in r["events"].items():
      c[k.rsplit("/", 1)[-1]] += v
    for m, k, s in r["misses"]:
      by_key[k].append((r["test"], r["worker"], s, m))
  tot = collections.Counter()
  for c in per_file.values():
    tot.update(c)
  cols = ["wall", "compile", "n_miss", "n_hit", "jaxpr_trace_duration",
          "jaxpr_to_mlir_module_duration"]
  print(f"{len(recs)} tests; totals: " + ", ".join(f"{k} {tot[k]:.0f}" for k in cols))
  print(f"{'file':40s} " + " ".join(f"{k[:10]:>10s}" for k in cols))
  for f, c in sorted(per_file.items(), key=lambda kv: -kv[1]["wall"]):
    print(f"{f:40s} " + " ".join(f"{c[k]:10.0f}" for k in cols))
  dup = [(k, v) for k, v in by_key.items() if len(v) > 1]
  dup_s = sum(sum(x[2] for x in v[1:]) for _, v in dup)
  print(f"\nprograms compiled more than once: {len(dup)}, {dup_s:.0f} s of repeat compiles")
  for k, v in sorted(dup, key=lambda kv: -sum(x[2] for x in kv[1][1:]))[:25]:
    print(f"  {v[0][3][:40]:40s} x{len(v)} {sum(x[2] for x in v):7.1f} s  " +
          "; ".join(f"{x[1]}:{x[0].split('::')[0].split('/')[-1]}" for x in v))


if __name__ == "__main__":
  summarize(sys.argv[1])
