"""Why speculative output equals AR output with a quantized KV cache only up to near ties
: XLA:CPU's matmul is not batch-invariant, so a token's K/V computed inside a
16-token chain verify differ in the last bits from the same token's K/V in a 1-token AR step,
and a block format's rounding turns some of those ulps into a whole quantization step.

Measures, on SmolLM2 (default target, float32 cache):
  * matmul: row 0 of x[:M] @ W for M = 1 (AR), 16 (chain), 23 (DDTree@22), 128 (prefill chunk) at
    the model's projection shapes: how many of its outputs differ bitwise from M = 1.
  * K/V: a 64-token prompt prefilled, then the next 16 tokens (the target's own greedy
    continuation) committed (a) one AR verify at a time and (b) in one chain verify; the K/V
    rows of those 16 tokens: max abs difference, and the fraction of q8_0 / q4_0 codes (per
    32-value block, gguf-py's quantizer) that differ.

  python scripts/studies/batch_invariance.py > bench_out/kv_cpu/batch_invariance.json
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType, quants

import dflash_jax as dj
from dflash_jax import cli
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib


def main():
  t = dj.load_target(cli.default_target_path())
  cfg, rt = t.config, t.runtime
  rng = np.random.default_rng(0)
  d, f = cfg.d_model, cfg.d_ff
  res = {"target": t.path, "device": str(jax.devices()[0]), "matmul": []}
  dot = jax.jit(lambda x, w: x @ w)
  for din, dout in [(d, cfg.n_kv_head * cfg.head_dim), (d, f), (f, d), (d, cfg.n_vocab)]:
    w = jnp.asarray(rng.standard_normal((din, dout)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((128, din)), jnp.float32)
    ref = np.asarray(dot(x[:1], w))[0]
    row = {"shape": [din, dout]}
    for m in (16, 23, 128):
      row[f"M{m}_differing_outputs"] = int(np.sum(np.asarray(dot(x[:m], w))[0] != ref))
    row["outputs"] = dout
    res["matmul"].append(row)

  ids = np.asarray(t.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci "
                                      "number.\"\"\"\n" * 4)[:64], np.int32)
  cont = dj.generate(t, None, ids, max_new_tokens=17, mode="ar", eog_ids=()).tokens[:16]
  cap = 256
  cache = target_lib.init_cache(cfg, cap, rt)
  pre = jax.jit(lambda c: target_lib.prefill(t.params, cfg, jnp.asarray(ids), jnp.int32(0),
                                             jnp.int32(len(ids)), c, rt).cache)(cache)
  ver = jax.jit(lambda tok, start, c: target_lib.verify(
      t.params, cfg, tree_lib.path_tree(tok), start, c, rt), static_argnums=())
  chain = ver(jnp.asarray(cont, jnp.int32), jnp.int32(len(ids)), pre)
  k_chain, v_chain = np.asarray(chain.k), np.asarray(chain.v)        # [n_attn, 16, Hkv, Dh]
  c, ks, vs = pre, [], []
  for i, tok in enumerate(cont):
    r = ver(jnp.asarray([tok], jnp.int32), jnp.int32(len(ids) + i), c)
    ks.append(np.asarray(r.k)[:, 0])
    vs.append(np.asarray(r.v)[:, 0])
    c = target_lib.commit_path(c, r, jnp.int32(len(ids) + i), jnp.zeros((1,), jnp.int32),
                               jnp.int32(1), rows_in_place=True)
  k_ar, v_ar = np.stack(ks, 1), np.stack(vs, 1)
  kv = {"k_max_abs_diff": float(np.abs(k_ar - k_chain).max()),
        "v_max_abs_diff": float(np.abs(v_ar - v_chain).max()),
        "k_bitwise_equal_fraction": float(np.mean(k_ar == k_chain)),
        "values": int(k_ar.size)}
  for name, qt in (("q8_0", GGMLQuantizationType.Q8_0), ("q4_0", GGMLQuantizationType.Q4_0)):
    for which, a, b in (("k", k_ar, k_chain), ("v", v_ar, v_chain)):
      qa = quants.quantize(a.reshape(-1, 32), qt)
      qb = quants.quantize(b.reshape(-1, 32), qt)
      kv[f"{which}_{name}_blocks_differing"] = float(np.mean(np.any(qa != qb, axis=-1)))
  res["kv_ar_vs_chain"] = kv
  print(json.dumps(res, indent=1))


if __name__ == "__main__":
  main()
