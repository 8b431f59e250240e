"""Where one SmolLM2 autoregressive decode step goes on XLA:CPU (issue 18, CPU half).

Times (median of N calls, after compile): the whole AR step (decode_loop, 1 step per call) for
weights quantized / f32 / bf16 and max_ctx 256 / 1024 / 2048; and the pieces in isolation: every
linear of the model (dequantize + dot, per format and shape), attention over S rows, lm_head.
Usage: python bench_out/cpu_profile/profile_step.py [--quick]
"""

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import dflash_jax as dj
from dflash_jax import api, cli, decode as decode_lib, layers
from dflash_jax.runtime import Runtime


def med(f, n=20):
  f()
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    jax.block_until_ready(f())
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def step_ms(target, max_ctx, n=20):
  dec = api.resolve_config(None, mode="ar", max_ctx=max_ctx)
  eog = jnp.asarray([-1], jnp.int32)
  ids = np.arange(1, 33, dtype=np.int32)
  state = api._prefill(target, None, ids, dec, eog)
  run = lambda st: decode_lib.decode_loop(
      target.params, None, st, max_new=jnp.int32(1 << 20), eog_ids=eog, sampling=None,
      max_steps=jnp.int32(1), tcfg=target.config, dcfg=None, dec=dec, rt=target.runtime,
      proposer=decode_lib.dflash_proposer)
  state = run(state)
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    state = run(state)
    jax.block_until_ready(state.out)
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def main():
  path = cli.default_target_path()
  out = {"steps": {}, "linears": {}, "attention": {}}
  rows = []
  for weights in ("quantized", "f32", "bf16"):
    t = dj.load_target(path, weights=weights, tokenizer=False)
    for mc in ((256, 1024, 2048) if weights == "quantized" else (1024,)):
      ms = step_ms(t, mc)
      out["steps"][f"{weights}@{mc}"] = ms
      rows.append((f"AR step, weights={weights}, max_ctx={mc}", ms))
    if weights == "quantized":
      tq = t
  # Pieces, quantized weights, M = 1.
  rt = Runtime()
  lay = tq.params.layers[0]
  mats = {"qkv": lay.qkv.groups[0], "wo": lay.wo, "gate_up": lay.ffn.gate_up.groups[0],
          "down": lay.ffn.down, "lm_head": tq.params.lm_head}
  x_by_k = {}
  for name, w in mats.items():
    k = w.shape[1]
    x = x_by_k.setdefault(k, jnp.ones((1, k), jnp.float32))
    f = jax.jit(lambda x, w: layers.linear(x, w, rt))
    jax.tree.map(lambda a: a, w)
    deq = jax.jit(lambda w: dj.quants.dequantize(w))
    ms = med(lambda: f(x, w))
    ms_deq = med(lambda: deq(w))
    wd = deq(w)
    dot = jax.jit(lambda x, wd: jnp.dot(x, wd.T, precision=jax.lax.Precision.HIGHEST))
    ms_dot = med(lambda: dot(x, wd))
    out["linears"][name] = {"fmt": w.fmt, "shape": w.shape, "linear_ms": ms, "dequant_ms": ms_deq,
                            "f32_dot_ms": ms_dot, "packed_MB": w.nbytes / 1e6}
    rows.append((f"linear {name} {w.fmt} {w.shape}: dequant+dot / dequant / f32 dot", (ms, ms_deq, ms_dot)))
  cfg = tq.config
  for s in (256, 1024, 2048):
    q = jnp.ones((1, cfg.n_head, cfg.head_dim), jnp.float32)
    k = jnp.ones((s, cfg.n_kv_head, cfg.head_dim), jnp.float32)
    mask = jnp.ones((1, s), bool)
    f = jax.jit(layers.attention)
    ms = med(lambda: f(q, k, k, mask))
    out["attention"][s] = ms
    rows.append((f"attention one layer, S={s}", ms))
  len(cfg.attn_layers)
  out["n_layer"] = cfg.n_layer
  for name, v in rows:
    print(f"{name:70s} {v if isinstance(v, tuple) else round(v, 3)}")
  print(json.dumps(out, default=str))


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  main()
