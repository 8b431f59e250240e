"""Per-op XLA:CPU profile of one decode step (jitted _step, not in the while loop) for
`mode [budget] weights compute_dtype`, from a jax.profiler perfetto trace."""
import time, sys, glob, gzip, json, collections, functools, shutil, re
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_platforms", "cpu")
import dflash_jax as dj
from dflash_jax import api, cli, decode as decode_lib
path = cli.default_target_path()
mode = sys.argv[1]
target = dj.load_target(path, tokenizer=False, weights=sys.argv[-2], compute_dtype=sys.argv[-1])
draft = dj.load_draft(cli.find_draft_dir(target), target)
kw = dict(mode=mode, max_ctx=1024)
if mode == "ddtree": kw["budget"] = int(sys.argv[2])
dec = api.resolve_config(draft, **kw)
dcfg = api._draft_config(draft, dec)
eog = jnp.asarray([-1], jnp.int32)
state = api._prefill(target, draft, np.arange(1, 65, dtype=np.int32), dec, eog)
@functools.partial(jax.jit, donate_argnums=(0,))
def step(s):
  return decode_lib._step(target.params, draft.params if dcfg else None, s, jnp.int32(1 << 20), eog, None,
                          tcfg=target.config, dcfg=dcfg, dec=dec, rt=target.runtime, proposer=decode_lib.dflash_proposer)
for _ in range(3): state = step(state)
jax.block_until_ready(state.out)
t0 = time.perf_counter()
for _ in range(10): state = step(state)
jax.block_until_ready(state.out)
print(mode, "ms/step", (time.perf_counter() - t0) / 10 * 1e3)
shutil.rmtree("/tmp/h/trace3", ignore_errors=True)
with jax.profiler.trace("/tmp/h/trace3", create_perfetto_trace=True):
  for _ in range(5): state = step(state)
  jax.block_until_ready(state.out)
f = sorted(glob.glob("/tmp/h/trace3/**/*.json.gz", recursive=True))[-1]
ev = [e for e in json.load(gzip.open(f))["traceEvents"] if e.get("ph") == "X" and not e["name"].startswith(("$", "Thunk", "Pjit", "Common", "Slinky", "end:"))]
agg = collections.defaultdict(float); cnt = collections.Counter(); big = collections.defaultdict(float)
for e in ev:
  k = re.sub(r"\.\d+$", "", e["name"]); agg[k] += e["dur"]; cnt[k] += 1
  big[e["name"]] += e["dur"]
print("total op ms/step", sum(agg.values()) / 1e3 / 5)
for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:12]:
  print(f"{v/1e3/5:9.3f} ms/step {cnt[k]//5:5d}/step  {k[:80]}")
print("-- biggest single ops")
for k, v in sorted(big.items(), key=lambda kv: -kv[1])[:12]:
  print(f"{v/1e3/5:9.3f} ms/step  {k[:80]}")
