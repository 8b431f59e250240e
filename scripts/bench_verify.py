"""Verify-step time: chain (a path of L tokens), autoregressive (one token) and DDTree (1 + budget
tree nodes), one target forward + follow + commit, on a hybrid target (default: the tiny Qwen3.5 Q4_K_M test GGUF with the fixture
DFlash draft in tests/data). Medians over --repeats calls of the compiled functions.

  python scripts/bench_verify.py --budgets 4,8,16,22,32 --json_out verify.json
"""

import dataclasses
import json
import os
import statistics
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TARGET = flags.DEFINE_string("target", os.path.join(ROOT, "tests/data/qwen35_tiny/model-q4_k_m.gguf"),
                              "Target GGUF.")
_DRAFT = flags.DEFINE_string("draft", os.path.join(ROOT, "tests/data/dflash_tiny"),
                             "Draft directory (a test fixture's model.safetensors.xz is unpacked "
                             "to a temp directory first).")
_BUDGETS = flags.DEFINE_list("budgets", ["4", "8", "16", "22", "32"], "DDTree budgets.")
_DRAFT_LENS = flags.DEFINE_list("draft_lens", [], "Chains of the bonus + the draft's first K "
                                 "tokens (K < block_size - 1) to time too: a shorter verify.")
_TREE_TOP_K = flags.DEFINE_integer("tree_top_k", 8, "DDTree candidates per depth.")
_CTX = flags.DEFINE_integer("ctx", 256, "Committed context length before the verify.")
_REPEATS = flags.DEFINE_integer("repeats", 50, "Timed calls per configuration.")
_GDN_COMMITS = flags.DEFINE_list("gdn_commits", ["states"], "Runtime.gdn_commit values to time "
                                 "side by side (states, replay): each row once per value.")
_JSON = flags.DEFINE_string("json_out", None, "Write results JSON here.")


def _verify_fns(t, d):
  """(path_verify(params, cache, tokens), tree_verify(params, cache, logp, root, budget=)):
  one verify forward + follow + commit each, jitted, at start --ctx. A path of one token is the
  autoregressive step, of L tokens the DFlash chain."""
  import jax
  import jax.numpy as jnp
  from dflash_jax import decode as decode_lib
  from dflash_jax import target as target_lib
  from dflash_jax import tree as tree_lib
  cfg, rt, fl, L = t.config, t.runtime, d.config.target_layer_ids, d.config.block_size
  start = jnp.int32(_CTX.value)

  def verify_commit(params, cache, tree, max_depth):
    def choose(logits):
      post = jnp.argmax(logits, -1).astype(jnp.int32)
      path, n_acc, _ = tree_lib.follow(tree, post, max_depth)
      return path, n_acc, post
    r = decode_lib.verify_and_commit(params, cfg, rt, tree, start, cache, choose,
                                     max_ctx=cache.k.shape[2], feature_layers=fl)
    return r.emit, r.feats, target_lib.apply_update(cache, r.update, start)

  path_verify = jax.jit(lambda params, cache, tokens: verify_commit(
      params, cache, tree_lib.path_tree(tokens), tokens.shape[0] - 1))
  tree_verify = jax.jit(lambda params, cache, logp, root, budget: verify_commit(
      params, cache, tree_lib.build_tree(logp, root, budget=budget, top_k=_TREE_TOP_K.value), L - 1),
      static_argnames=("budget",))
  return path_verify, tree_verify


def _draft_dir(path: str) -> str:
  """path, or a temp copy of it with model.safetensors unpacked when the directory stores it as
  model.safetensors.xz (as tests/data/dflash_tiny does)."""
  import lzma
  import shutil
  import tempfile
  xz = os.path.join(path, "model.safetensors.xz")
  if os.path.exists(os.path.join(path, "model.safetensors")) or not os.path.exists(xz):
    return path
  d = tempfile.mkdtemp(prefix="bench_verify_draft_")
  shutil.copy(os.path.join(path, "config.json"), d)
  with lzma.open(xz, "rb") as fin, open(os.path.join(d, "model.safetensors"), "wb") as fout:
    shutil.copyfileobj(fin, fout)
  return d


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import target as target_lib

  t = dj.load_target(_TARGET.value, tokenizer=False)
  d = dj.load_draft(_draft_dir(_DRAFT.value), t)
  cfg = t.config
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, cfg.n_vocab - 1, _CTX.value).astype(np.int32)
  logits_d = jnp.asarray(dj.first_draft_logits(t, d, prompt, max_ctx=_CTX.value + 64))
  cache = jax.jit(lambda p, c: target_lib.prefill(p, cfg, jnp.asarray(prompt), jnp.int32(0),
                                                  jnp.int32(_CTX.value), c, t.runtime).cache)(
      t.params, target_lib.init_cache(cfg, _CTX.value + 64, t.runtime))
  L = d.config.block_size

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
  root = jnp.int32(prompt[-1])
  rows = []
  for gc in _GDN_COMMITS.value:
    tg = dataclasses.replace(t, runtime=dataclasses.replace(t.runtime, gdn_commit=gc))
    path_verify, tree_verify = _verify_fns(tg, d)
    tag = "" if len(_GDN_COMMITS.value) == 1 else f"/{gc}"
    rows += [{"mode": "chain" + tag, "tokens": L,
              "ms": timeit(lambda: path_verify(t.params, cache, block))},
             {"mode": "ar" + tag, "tokens": 1,
              "ms": timeit(lambda: path_verify(t.params, cache, block[:1]))}]
    for k in _DRAFT_LENS.value:
      k = int(k)
      rows.append({"mode": f"chain:{k}{tag}", "tokens": k + 1,
                   "ms": timeit(lambda: path_verify(t.params, cache, block[:k + 1]))})
    for b in _BUDGETS.value:
      b = int(b)
      rows.append({"mode": f"ddtree@{b}{tag}", "tokens": b + 1,
                   "ms": timeit(lambda: tree_verify(t.params, cache, logp, root, budget=b))})
  for r in rows:
    r["ratio_vs_chain"] = r["ms"] / rows[0]["ms"]
  print(f"{'mode':<20}{'tokens':>8}{'verify ms':>12}{'vs chain':>10}")
  for r in rows:
    print(f"{r['mode']:<20}{r['tokens']:>8}{r['ms']:>12.3f}{r['ratio_vs_chain']:>10.2f}")
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
