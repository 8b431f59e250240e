"""ms per round of the batched decode loop: python step_ms.py MODE B1,B2,... (16 rounds after warm-up, 40-token prompts)."""
import time, sys, numpy as np, jax, jax.numpy as jnp
import dflash_jax as dj
from dflash_jax import cli, batching
t = dj.load_target(cli.default_target_path())
d = dj.load_draft(cli.find_draft_dir(t), t)
mode = sys.argv[1]
for B in [int(x) for x in sys.argv[2].split(",")]:
  dec = dj.api.resolve_config(d, mode=mode, max_ctx=1024, budget=4)
  b = batching.SlotBatch(t, d, dec, B, jnp.asarray([-1], jnp.int32))
  for i in range(B):
    b.prefill(i, np.arange(100, 140, dtype=np.int32) + i, 1000, dj.SamplingConfig())
  b.run(2); jax.block_until_ready(b.state.pos)
  t0 = time.perf_counter(); b.run(16); jax.block_until_ready(b.state.pos); dt = time.perf_counter()-t0
  print(mode, B, "ms/step", round(dt/16*1000,1), "tok/s agg (AL=1)", round(16*B/dt,1), flush=True)
