"""Experiment (session 49): SmolLM2 generate with the layer loop as one lax.scan instead of 30 unrolled
copies, to weigh compile time against run time. Arguments: {unrolled, scan, prestacked} {ar, chain}.
"scan" stacks the layer params inside the jitted calls (a copy per call); "prestacked" stacks them
once outside (what a stacked load would do). Dense targets only (asserts no recurrent layer).
  python bench_out/ci/layer_scan.py prestacked chain
"""
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

import dflash_jax as dj
from dflash_jax import cli, target as T, layers
scan = sys.argv[1] in ("scan", "prestacked")
pre = sys.argv[1] == "prestacked"
mode = sys.argv[2]
def _trunk(params, cfg, x, cache, start, pos, local_mask, gdn_mixer, feature_layers, rt,
           live_bound=None, kv_row=None, ordered=None):
  assert not any(cfg.recurrent)
  stacked = params.layers[0] if pre else jax.tree.map(lambda *xs: jnp.stack(xs), *params.layers)
  n = jax.tree.leaves(stacked)[0].shape[0]
  def body(x, pi):
    p, i = pi
    o, k, v = T._attn_layer(x, p, cfg, cache.k, cache.v, i, start, pos, local_mask,
                            params.rope_freqs, rt, live_bound, kv_row, ordered)
    x = x + o
    x = x + T.ffn(layers.rms_norm(x, p.ffn.norm, cfg.rms_eps), p.ffn, cfg, rt)
    return x, (x, k, v)
  x, (xs, k, v) = jax.lax.scan(body, x, (stacked, jnp.arange(n, dtype=jnp.int32)))
  feat = jnp.concatenate([xs[l] for l in feature_layers], axis=-1) if feature_layers else None
  return x, feat, k, v, cache, []
if scan:
  T._trunk = _trunk
smol = dj.load_target(cli.default_target_path())
draft = dj.load_draft(cli.find_draft_dir(smol), smol) if mode != "ar" else None
if pre:
  st = jax.tree.map(lambda *xs: jnp.stack(xs), *smol.params.layers)
  smol = dataclasses.replace(smol, params=dataclasses.replace(smol.params, layers=(st,)))
prompt = cli.build_prompt(smol, cli.CHAT_PROMPTS[0], chat=True)
t = time.time(); r1 = dj.generate(smol, draft, prompt, max_new_tokens=48, mode=mode, max_ctx=256, eog_ids=())
t1 = time.time() - t
t = time.time(); r2 = dj.generate(smol, draft, prompt, max_new_tokens=48, mode=mode, max_ctx=256, eog_ids=())
t2 = time.time() - t
print(sys.argv[1:], f"first {t1:.1f} s second {t2:.2f} s tok/s {48/t2:.1f}", r1.tokens[:12], sum(r1.accept_lens)/len(r1.accept_lens))
