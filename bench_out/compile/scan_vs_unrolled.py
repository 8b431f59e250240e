"""A 30-layer f32 stack of SmolLM2-shaped matmul layers, unrolled vs lax.scan over stacked weights:
compile seconds and the median step time of a 16-token forward (bench_out/compile/README.md)."""

import time, jax, jax.numpy as jnp, numpy as np
L, D, F, T = 30, 576, 1536, 16
ks = jax.random.split(jax.random.key(0), 4)
W = dict(qkv=jax.random.normal(ks[0], (L, D, 3*D))*0.02, o=jax.random.normal(ks[1], (L, D, D))*0.02,
         gu=jax.random.normal(ks[2], (L, D, 2*F))*0.02, dn=jax.random.normal(ks[3], (L, F, D))*0.02)
def layer(x, w):
  y = x @ w["qkv"]; x = x + jnp.tanh(y[:, :D]) @ w["o"]
  g = x @ w["gu"]; x = x + (jax.nn.silu(g[:, :F]) * g[:, F:]) @ w["dn"]
  return x
Wl = [jax.tree.map(lambda a: a[i], W) for i in range(L)]
@jax.jit
def unrolled(x, Wl):
  for w in Wl: x = layer(x, w)
  return x
@jax.jit
def scanned(x, W):
  return jax.lax.scan(lambda x, w: (layer(x, w), None), x, W)[0]
x = jnp.ones((T, D))
for name, f, p in [("unrolled", unrolled, Wl), ("scanned", scanned, W)]:
  t0=time.perf_counter(); c = f.lower(x, p).compile(); tc=time.perf_counter()-t0
  c(x, p).block_until_ready()
  ts=[]
  for _ in range(30):
    t0=time.perf_counter(); c(x, p).block_until_ready(); ts.append(time.perf_counter()-t0)
  print(name, f"compile {tc:.2f}s step {np.median(ts)*1e3:.2f} ms")
