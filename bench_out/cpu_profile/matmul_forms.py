"""Micro-benchmark: ms per [3072, 576] f32 matrix (a chain of 30, one jit) for the matmul forms
on XLA:CPU at M = 1, 5, 16 rows. See NOTES.md."""
import time, statistics
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_platforms", "cpu")
L, N, K = 30, 3072, 576
rng = np.random.default_rng(0)
def med(f, *a, n=10):
  jax.block_until_ready(f(*a))
  ts=[]
  for _ in range(n):
    t0=time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter()-t0)
  return statistics.median(ts)*1e3/L
Ws = [jnp.asarray(rng.normal(size=(N, K)), jnp.float32) for _ in range(L)]
H = jax.lax.Precision.HIGHEST
for M in (1, 5, 16):
  x0 = jnp.ones((M, K), jnp.float32)
  def chain(lin):
    def f(ws):
      x = x0
      for w in ws:
        x = x + lin(x, w)[:, :K] * 1e-3
      return x
    return jax.jit(f)
  variants = {
    "dot(W, xT).T": lambda x, w: jnp.dot(w, x.T, precision=H).T,
    "dot(x, WT)": lambda x, w: jnp.dot(x, w.T, precision=H),
    "mulred [N,M]": lambda x, w: jnp.sum(w[:, None, :] * x[None, :, :], -1).T,
    "mulred [M,N]": lambda x, w: jnp.sum(w[None, :, :] * x[:, None, :], -1),
  }
  for name, lin in variants.items():
    print(M, f"{name:16s} {med(chain(lin), Ws):.3f} ms/matrix", flush=True)
