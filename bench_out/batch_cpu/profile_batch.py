"""Per-op XLA:CPU profile of the batched decode loop: python profile_batch.py MODE B (5 rounds after warm-up)."""
import sys, glob, gzip, json, collections, shutil, re
import jax, jax.numpy as jnp, numpy as np
import dflash_jax as dj
from dflash_jax import cli, batching
t = dj.load_target(cli.default_target_path()); d = dj.load_draft(cli.find_draft_dir(t), t)
mode, B = sys.argv[1], int(sys.argv[2])
dec = dj.api.resolve_config(d, mode=mode, max_ctx=1024, budget=4)
b = batching.SlotBatch(t, d, dec, B, jnp.asarray([-1], jnp.int32))
for i in range(B): b.prefill(i, np.arange(100, 140, dtype=np.int32) + i, 1000, dj.SamplingConfig())
b.run(2); jax.block_until_ready(b.state.pos)
shutil.rmtree("/tmp/w/trace", ignore_errors=True)
with jax.profiler.trace("/tmp/w/trace", create_perfetto_trace=True):
  b.run(5); jax.block_until_ready(b.state.pos)
f = sorted(glob.glob("/tmp/w/trace/**/*.json.gz", recursive=True))[-1]
ev = [e for e in json.load(gzip.open(f))["traceEvents"] if e.get("ph") == "X" and not e["name"].startswith(("$", "Thunk", "Pjit", "Common", "Slinky", "end:", "while", "PjRt", "Execute"))]
agg = collections.defaultdict(float); cnt = collections.Counter()
for e in ev:
  k = re.sub(r"\.\d+$", "", e["name"]); agg[k] += e["dur"]; cnt[k] += 1
print("total op ms/step", sum(agg.values()) / 1e3 / 5)
for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:25]:
  print(f"{v/1e3/5:9.3f} ms/step {cnt[k]//5:5d}/step  {k[:80]}")
