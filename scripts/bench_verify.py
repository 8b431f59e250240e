"""Verify-step time: chain (one block of L tokens) vs DDTree (1 + budget tree nodes), one target
forward + commit, on a hybrid target (default: the tiny Qwen3.5 Q4_K_M test GGUF with the fixture
DFlash draft in tests/data). Medians over --repeats calls of the compiled functions.

  python scripts/bench_verify.py --budgets 4,8,16,22,32 --json_out verify.json
"""

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

_TARGET = flags.DEFINE_string("target", os.path.join(ROOT, "tests/data/qwen35_tiny/model-q4_k_m.gguf"),
                              "Target GGUF.")
_DRAFT = flags.DEFINE_string("draft", os.path.join(ROOT, "tests/data/dflash_tiny"), "Draft directory.")
_BUDGETS = flags.DEFINE_list("budgets", ["4", "8", "16", "22", "32"], "DDTree budgets.")
_TOP_K = flags.DEFINE_integer("top_k", 8, "Candidates per depth.")
_CTX = flags.DEFINE_integer("ctx", 256, "Committed context length before the verify.")
_REPEATS = flags.DEFINE_integer("repeats", 50, "Timed calls per configuration.")
_JSON = flags.DEFINE_string("json_out", None, "Write results JSON here.")


def main(argv):
  del argv
  import functools
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import target as target_lib
  from dflash_jax import tree as tree_lib

  t = dj.load_target(_TARGET.value, tokenizer=False)
  d = dj.load_draft(_DRAFT.value, t)
  cfg, dcfg = t.config, d.config
  L = dcfg.block_size
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.n_vocab - 1, _CTX.value).astype(np.int32)
  logits_d = jnp.asarray(dj.first_draft_logits(t, d, prompt, max_ctx=_CTX.value + 64))
  cap = _CTX.value + 64
  cache = target_lib.init_cache(cfg, cap)
  _, _, cache, _ = jax.jit(functools.partial(target_lib.forward, cfg=cfg, mode="prefill",
                                             logits_rows="none"))(
      t.params, tokens=jnp.asarray(prompt), start=jnp.int32(0), cache=cache)
  fl = dcfg.target_layer_ids

  @jax.jit
  def chain_verify(params, cache, block):
    logits, feats, c, steps = target_lib.forward(params, cfg, block, jnp.int32(_CTX.value), cache,
                                                 mode="verify", feature_layers=fl)
    return jnp.argmax(logits, -1), feats, target_lib.commit(c, steps, jnp.int32(L // 2))

  @functools.partial(jax.jit, static_argnames=("budget",))
  def tree_verify(params, cache, logp, *, budget):
    tr = tree_lib.build_tree(logp, jnp.int32(prompt[-1]), budget=budget, top_k=_TOP_K.value)
    logits, feats, c, steps = target_lib.forward(
        params, cfg, tr.tokens, jnp.int32(_CTX.value), cache, mode="tree", feature_layers=fl,
        tree_parents=tr.parents, tree_depths=tr.depths)
    post = jnp.argmax(logits, -1)
    path, n_acc, _ = tree_lib.follow(tr, post, L - 1)
    return post, feats[path], target_lib.commit_path(c, steps, jnp.int32(_CTX.value), path, n_acc + 1)

  def timeit(fn):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(_REPEATS.value):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3

  block = jnp.concatenate([jnp.asarray(prompt[-1:]), jnp.argmax(logits_d, -1).astype(jnp.int32)])
  logp = jax.nn.log_softmax(logits_d, -1)
  rows = [{"mode": "chain", "tokens": L, "ms": timeit(lambda: chain_verify(t.params, cache, block))}]
  for b in _BUDGETS.value:
    b = int(b)
    rows.append({"mode": f"ddtree@{b}", "tokens": b + 1,
                 "ms": timeit(lambda: tree_verify(t.params, cache, logp, budget=b))})
  for r in rows:
    r["ratio_vs_chain"] = r["ms"] / rows[0]["ms"]
  print(f"{'mode':<12}{'tokens':>8}{'verify ms':>12}{'vs chain':>10}")
  for r in rows:
    print(f"{r['mode']:<12}{r['tokens']:>8}{r['ms']:>12.3f}{r['ratio_vs_chain']:>10.2f}")
  res = {"target": os.path.basename(_TARGET.value), "ctx": _CTX.value, "device": str(jax.devices()[0]),
         "repeats": _REPEATS.value, "rows": rows}
  print(json.dumps(res))
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  app.run(main)
