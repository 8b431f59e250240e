"""Why a multi-token verify costs several autoregressive steps on this CPU: XLA:CPU's float32 matmul
y = x @ W^T for x of M rows against weights the size of SmolLM2's 30 layer blocks (30 x [3072, 576] f32,
212 MB: more than any cache), M = 1 (an autoregressive step) to 16 (a chain verify), in the form the
model uses (`pallas_kernels.dequant_matmul_reference`: W @ x^T at HIGHEST precision) and in the x @ W^T
form; median ms of --repeats calls, one jitted function over all 30 matrices.

    python scripts/studies/cpu_skinny_matmul.py --json_out bench_out/cpu/skinny_matmul.json
    XLA_FLAGS=--xla_cpu_use_xnnpack=true python scripts/studies/cpu_skinny_matmul.py    # other XLA:CPU paths
"""

import json
import os
import statistics
import time

from absl import app, flags

_ROWS = flags.DEFINE_list("rows", ["1", "2", "3", "4", "8", "16"], "M values.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed calls per configuration.")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  hi = jax.lax.Precision.HIGHEST
  rng = np.random.default_rng(0)
  n, k, n_mat = 3072, 576, 30
  ws = [jnp.asarray(rng.standard_normal((n, k), np.float32)) for _ in range(n_mat)]
  forms = {"w_xT": lambda w, x: jnp.dot(w, x.T, precision=hi).T,
           "x_wT": lambda w, x: jnp.dot(x, w.T, precision=hi)}

  def timeit(fn, *args):
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(_REPEATS.value):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

  rows = []
  for m in [int(r) for r in _ROWS.value]:
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    r = {"M": m}
    for name, f in forms.items():
      r[name + "_ms"] = timeit(lambda ws, x, f=f: [f(w, x) for w in ws], ws, x)
    rows.append(r)
  mb = n * k * n_mat * 4 / 1e6
  print(f"weights {mb:.0f} MB f32; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print("| M rows | W @ x^T ms | GB/s | x vs M=1 | x @ W^T ms |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['M']} | {r['w_xT_ms']:.1f} | {mb / r['w_xT_ms']:.1f} | "
          f"{r['w_xT_ms'] / rows[0]['w_xT_ms']:.2f} | {r['x_wT_ms']:.1f} |")
  res = {"weights_mb": mb, "device": str(jax.devices()[0]), "jax": jax.__version__,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "repeats": _REPEATS.value, "rows": rows}
  print(json.dumps(res))
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
