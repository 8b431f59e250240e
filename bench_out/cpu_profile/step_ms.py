"""Median ms per decode step (AR) over calls of --steps=N (default 32) steps, per
`weights:compute_dtype:max_ctx` argument. Used for the CPU A/B in bench_out/cpu_profile/NOTES.md."""
import time, statistics, sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_platforms", "cpu")
import dflash_jax as dj
from dflash_jax import api, cli, decode as decode_lib
path = cli.default_target_path()
def step_ms(target, max_ctx, steps=32, reps=3):
  dec = api.resolve_config(None, mode="ar", max_ctx=max_ctx)
  eog = jnp.asarray([-1], jnp.int32)
  ids = np.arange(1, 33, dtype=np.int32)
  ts = []
  for r in range(reps + 1):
    state = api._prefill(target, None, ids, dec, eog)
    jax.block_until_ready(state.out)
    t0 = time.perf_counter()
    state = decode_lib.decode_loop(target.params, None, state, max_new=jnp.int32(1 << 20), eog_ids=eog, sampling=None,
        max_steps=jnp.int32(steps), tcfg=target.config, dcfg=None, dec=dec, rt=target.runtime, proposer=decode_lib.dflash_proposer)
    jax.block_until_ready(state.out)
    if r: ts.append((time.perf_counter() - t0) / steps)
  return statistics.median(ts) * 1e3
STEPS = int(next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--steps=")), 32))
for spec in [a for a in sys.argv[1:] if not a.startswith("--")]:
  w, cd, mc = spec.split(":")
  t = dj.load_target(path, weights=w, compute_dtype=cd, tokenizer=False)
  print(spec, round(step_ms(t, int(mc), steps=STEPS), 2), "ms/token", flush=True)
