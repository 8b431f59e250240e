"""In-process A/B of the verify step: the pre-refactor package (dflash_jax_old, commit c35c6b9)
and the current one, same process, same inputs, alternating rounds; medians per variant."""
import sys, time, statistics, json, functools
sys.path.insert(0, "/tmp/oldpkg")
import jax, jax.numpy as jnp, numpy as np
import dflash_jax as new
import dflash_jax_old as old
from dflash_jax import target as tn, tree as trn
from dflash_jax_old import target as to, tree as tro

T = "/work/main/tests/data/qwen35_tiny/model-q4_k_m.gguf"
D = "/work/main/tests/data/dflash_tiny"
CTX, REPS, ROUNDS = 256, 20, 6
tN = new.load_target(T, tokenizer=False); dN = new.load_draft(D, tN)
tO = old.load_target(T, tokenizer=False); dO = old.load_draft(D, tO)
cfgN, cfgO, rt = tN.config, tO.config, tN.runtime
fl = dN.config.target_layer_ids; L = dN.config.block_size
rng = np.random.default_rng(0)
prompt = rng.integers(0, cfgN.n_vocab - 1, CTX).astype(np.int32)
logits_d = jnp.asarray(new.first_draft_logits(tN, dN, prompt, max_ctx=CTX + 64))
logp = jax.nn.log_softmax(logits_d, -1)
block = jnp.concatenate([jnp.asarray(prompt[-1:]), jnp.argmax(logits_d, -1).astype(jnp.int32)])
start = jnp.int32(CTX)
cacheN = jax.jit(lambda p, c: tn.prefill(p, cfgN, jnp.asarray(prompt), jnp.int32(0), jnp.int32(CTX), c, rt).cache)(tN.params, tn.init_cache(cfgN, CTX + 64, rt))
cacheO = jax.jit(lambda p, c: to.forward(p, cfgO, jnp.asarray(prompt), jnp.int32(0), c, mode="prefill", logits_rows="none")[2])(tO.params, to.init_cache(cfgO, CTX + 64))

def new_vc(params, cache, tree, md):
  v = tn.verify(params, cfgN, tree, start, cache, rt, feature_layers=fl)
  post = jnp.argmax(v.logits, -1).astype(jnp.int32)
  path, n_acc, _ = trn.follow(tree, post, md)
  feats = v.feats if tree.is_path else v.feats[path]
  return post, feats, tn.commit_path(v.cache, v.steps, start, path, n_acc + 1, rows_in_place=tree.is_path)

new_path = jax.jit(lambda p, c, toks: new_vc(p, c, trn.path_tree(toks), toks.shape[0] - 1))
new_tree = jax.jit(lambda p, c, lp, b: new_vc(p, c, trn.build_tree(lp, block[0], budget=b, top_k=8), L - 1), static_argnames=("b",))

@jax.jit
def old_path(p, c, toks):
  lg, feats, c2, steps = to.forward(p, cfgO, toks, start, c, mode="verify", feature_layers=fl)
  post = jnp.argmax(lg, -1).astype(jnp.int32)
  d = toks[1:]
  n_acc = jnp.sum(jnp.cumprod((d == post[:-1]).astype(jnp.int32))).astype(jnp.int32)
  return post, feats, to.commit(c2, steps, n_acc + 1)

@functools.partial(jax.jit, static_argnames=("b",))
def old_tree(p, c, lp, b):
  tr = tro.build_tree(lp, block[0], budget=b, top_k=8)
  lg, feats, c2, steps = to.forward(p, cfgO, tr.tokens, start, c, mode="tree", feature_layers=fl, tree_parents=tr.parents, tree_depths=tr.depths)
  post = jnp.argmax(lg, -1)
  path, n_acc, _ = tro.follow(tr, post, L - 1)
  return post, feats[path], to.commit_path(c2, steps, start, path, n_acc + 1)

cases = {
  "chain": (lambda: old_path(tO.params, cacheO, block), lambda: new_path(tN.params, cacheN, block)),
  "ar": (lambda: old_path(tO.params, cacheO, block[:1]), lambda: new_path(tN.params, cacheN, block[:1])),
  "ddtree@4": (lambda: old_tree(tO.params, cacheO, logp, b=4), lambda: new_tree(tN.params, cacheN, logp, b=4)),
  "ddtree@22": (lambda: old_tree(tO.params, cacheO, logp, b=22), lambda: new_tree(tN.params, cacheN, logp, b=22)),
}
# same outputs
for name, (fo, fn) in cases.items():
  a, b = fo(), fn()
  assert np.array_equal(np.asarray(a[0]), np.asarray(b[0])), name
  assert np.allclose(np.asarray(a[2].ssm), np.asarray(b[2].ssm), atol=1e-6), name
times = {n: {"before": [], "after": []} for n in cases}
for r in range(ROUNDS):
  for name, (fo, fn) in cases.items():
    order = (("before", fo), ("after", fn)) if r % 2 == 0 else (("after", fn), ("before", fo))
    for side, f in order:
      jax.block_until_ready(f())
      for _ in range(REPS):
        t0 = time.perf_counter(); jax.block_until_ready(f()); times[name][side].append(time.perf_counter() - t0)
res = {}
print(f"{'mode':<10}{'before ms':>11}{'after ms':>10}{'after/before':>14}")
for name in cases:
  b = statistics.median(times[name]["before"]) * 1e3; a = statistics.median(times[name]["after"]) * 1e3
  res[name] = {"before_ms": b, "after_ms": a, "ratio": a / b}
  print(f"{name:<10}{b:>11.3f}{a:>10.3f}{a / b:>14.3f}")
print(json.dumps({"rounds": ROUNDS, "reps_per_round": REPS, "ctx": CTX, "rows": res}))
