"""DDTree: tree construction vs brute force, tree Gated DeltaNet and conv vs the chain recurrence
along each root path, lossless decoding through non-top-1 siblings, chain-shaped tree == chain."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import gdn
from dflash_jax import tree as tree_lib
from dflash_jax.runtime import Runtime
from conftest import rel_err
from kernel_inputs import root_path
from test_draft_and_decode import _compiled_counts, _oracle_run


def _brute_force_best(logp, budget, top_k):
  """All prefixes over the per-depth top-k, best `budget` by summed log-prob."""
  D = logp.shape[0]
  order = np.argsort(-logp, axis=1, kind="stable")[:, :top_k]
  scored = []
  for d in range(1, D + 1):
    for ranks in itertools.product(range(top_k), repeat=d):
      toks = tuple(int(order[i, r]) for i, r in enumerate(ranks))
      scored.append((sum(float(logp[i, order[i, r]]) for i, r in enumerate(ranks)), toks))
  scored.sort(key=lambda x: -x[0])
  return {t for _, t in scored[:budget]}


def _paths(tree):
  toks, par, val = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
  out = set()
  for i in range(1, toks.size):
    if not val[i]:
      continue
    path, j = [], i
    while j > 0:
      path.append(int(toks[j]))
      j = int(par[j])
    out.add(tuple(reversed(path)))
  return out


@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_rows_matches_numpy_stable_sort(k):
  rng = np.random.default_rng(k)
  x = rng.normal(size=(5, 300)).astype(np.float32)
  x[0, [7, 9, 200]] = 5.0                                   # ties: lower index first
  x[1, :] = np.round(x[1, :])                               # many ties
  x[2, :298] = -np.inf                                      # 2 finite entries: k > 2 reaches -inf
  vals, ids = jax.jit(lambda a: tree_lib.top_k_rows(a, k))(jnp.asarray(x))
  order = np.argsort(-x, axis=1, kind="stable")[:, :k]      # independent reference
  np.testing.assert_array_equal(np.asarray(ids), order)
  ref = np.take_along_axis(x, order, axis=1)
  ref = np.maximum(ref, np.finfo(np.float32).min)
  np.testing.assert_array_equal(np.asarray(vals), ref)
  assert all(len(set(r)) == k for r in np.asarray(ids).tolist())
  with pytest.raises(ValueError, match="k=301"):
    tree_lib.top_k_rows(jnp.asarray(x), 301)


def test_build_tree_hand_computed():
  # depth 1: token 2 (-0.1), token 0 (-0.5); depth 2: token 1 (-0.2), token 3 (-0.3)
  logp = jnp.log(jnp.array([[0.2, 0.05, 0.7, 0.05], [0.05, 0.6, 0.05, 0.3]]))
  t = tree_lib.build_tree(logp, jnp.int32(9), budget=4, top_k=2, chain_seed=False)
  # best-first: [2] -0.36, [2,1] -0.87, [2,3] -1.56, [0] -1.61
  assert np.asarray(t.tokens).tolist() == [9, 2, 1, 3, 0]
  assert np.asarray(t.parents).tolist() == [-1, 0, 1, 1, 0]
  assert np.asarray(t.depths).tolist() == [0, 1, 2, 2, 1]
  assert np.asarray(t.valid).all()
  t = tree_lib.build_tree(logp, jnp.int32(9), budget=4, top_k=1, chain_seed=True)
  assert np.asarray(t.tokens).tolist()[:3] == [9, 2, 1]
  assert np.asarray(t.valid).tolist() == [True, True, True, False, False]  # only 2 prefixes exist


@pytest.mark.parametrize("seed", range(4))
def test_build_tree_is_the_best_prefix_set(seed):
  rng = np.random.default_rng(seed)
  D, V, budget, k = 4, 12, 9, 3
  logp = np.log(rng.dirichlet(np.ones(V) * 0.5, size=D)).astype(np.float32)
  t = tree_lib.build_tree(jnp.asarray(logp), jnp.int32(0), budget=budget, top_k=k, chain_seed=False)
  assert _paths(t) == _brute_force_best(logp, budget, k)
  par = np.asarray(t.parents)
  assert all(par[i] < i for i in range(1, budget + 1))
  # chain seed: the top-1 chain is always present
  t = tree_lib.build_tree(jnp.asarray(logp), jnp.int32(0), budget=budget, top_k=k, chain_seed=True)
  top1 = tuple(int(x) for x in logp.argmax(1))
  assert all(top1[:d] in _paths(t) for d in range(1, D + 1))


def _random_tree(rng, n):
  parents = np.full(n, -1, np.int32)
  for i in range(1, n):
    parents[i] = rng.integers(0, i)
  depths = np.zeros(n, np.int32)
  for i in range(1, n):
    depths[i] = depths[parents[i]] + 1
  return parents, depths


@pytest.mark.parametrize("n", [1, 7, 23])
def test_tree_deltanet_and_conv_equal_chain_along_every_path(n):
  rng = np.random.default_rng(n)  # seeded: float32 tolerances on random data
  parents, depths = _random_tree(rng, n)
  hv, dk, dv, C, K = 2, 8, 8, 6, 4
  q = rng.standard_normal((n, hv, dk)).astype(np.float32) * 0.3
  k = rng.standard_normal((n, hv, dk)).astype(np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((n, hv, dv)).astype(np.float32)
  g = -rng.uniform(0.05, 1.0, (n, hv)).astype(np.float32)
  beta = rng.uniform(0.1, 0.9, (n, hv)).astype(np.float32)
  s0 = rng.standard_normal((hv, dk, dv)).astype(np.float32) * 0.1
  x = rng.standard_normal((n, C)).astype(np.float32)
  conv0 = rng.standard_normal((K - 1, C)).astype(np.float32)
  w = rng.standard_normal((C, K)).astype(np.float32)
  o, states = gdn.gated_delta_rule_tree(*map(jnp.asarray, (q, k, v, g, beta, s0)),
                                        jnp.asarray(parents), Runtime())
  anc = tree_lib.ancestors(jnp.asarray(parents), K - 1)
  y = gdn.causal_conv_tree(jnp.asarray(x), jnp.asarray(conv0), jnp.asarray(w), anc,
                              jnp.asarray(depths))
  for i in range(n):
    path = root_path(parents, i)
    o_ref, st_ref = gdn.gated_delta_rule_recurrent(
        *(jnp.asarray(a[path]) for a in (q, k, v, g, beta)), jnp.asarray(s0))
    assert rel_err(o[i], o_ref[-1]) < 1e-5 and rel_err(states[i], st_ref[-1]) < 1e-5
    y_ref = gdn.causal_conv(jnp.asarray(x[path]), jnp.asarray(conv0), jnp.asarray(w))
    assert rel_err(y[i], y_ref[-1]) < 1e-5


@pytest.mark.parametrize("which", ["tiny_hybrid", "smollm2"])
def test_ddtree_lossless_through_second_ranked_siblings(which, qwen_f32, qwen_ref, smol,
                                                        smol_prompts):
  target, prompt = ((qwen_f32, qwen_ref["tokens"][1, :16]) if which == "tiny_hybrid"
                    else (smol, np.asarray(smol_prompts[0]["prompt_ids"], np.int32)))
  # 100 tokens: the six asserted steps take 44 (chain) and 75 (tree) of them
  truth = np.asarray(dj.generate(target, None, prompt, max_new_tokens=100, mode="ar",
                                 max_ctx=256, eog_ids=()).tokens, np.int32)
  pattern = [0, 3, 99, 7, 12, 1, 14]
  chain = _oracle_run(target, prompt, truth, pattern, 256, second=True)
  tree = _oracle_run(target, prompt, truth, pattern, 256, mode="ddtree", second=True, budget=22,
                     tree_top_k=4)
  assert chain.tokens == truth.tolist() and tree.tokens == truth.tolist()
  n = 6
  assert chain.accept_lens[:n] == [min(p + 1, 16) for p in pattern[:n]]
  # chain seed (15 nodes), then 7 nodes: the true sibling at depth p+1 and 6 top-1 descendants,
  # so p + 7 accepted drafts (+ bonus), capped at the block
  assert tree.accept_lens[:n] == [min(p + 8, 16) for p in pattern[:n]]


def test_chain_shaped_tree_reproduces_chain(qwen_f32, qwen_draft, draft_ref):
  p = draft_ref["prompt_ids"]
  ch = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=40, mode="chain", max_ctx=256)
  tr = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=40, mode="ddtree", max_ctx=256,
                   budget=15, tree_top_k=1)
  assert tr.tokens == ch.tokens and tr.accept_lens == ch.accept_lens
  # a budget below L-1: the draft computes logits for 4 depths only; still lossless, <= 4 + bonus
  tr = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=40, mode="ddtree", max_ctx=256,
                   budget=4, tree_top_k=2)
  assert tr.tokens == ch.tokens and max(tr.accept_lens) <= 5
  # (DDTree on the dense SmolLM2: test_ddtree_lossless_through_second_ranked_siblings)


def test_ddtree_fixture_draft_lossless_and_no_recompile(qwen_f32, qwen_draft, qwen_ref, draft_ref):
  p = draft_ref["prompt_ids"]
  r = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=40, mode="ddtree", max_ctx=256)
  assert r.tokens == draft_ref["greedy_output_ids"][len(p):].tolist()
  dj.generate(qwen_f32, None, qwen_ref["tokens"][0, :5], max_new_tokens=3, mode="ar",
              max_ctx=256, eog_ids=())  # compile the autoregressive configuration first
  before = _compiled_counts()
  for row, (n, m) in enumerate([(9, 20), (30, 7)]):
    ar = dj.generate(qwen_f32, None, qwen_ref["tokens"][row, :n], max_new_tokens=m, mode="ar",
                     max_ctx=256, eog_ids=())
    tr = dj.generate(qwen_f32, qwen_draft, qwen_ref["tokens"][row, :n], max_new_tokens=m,
                     mode="ddtree", max_ctx=256, eog_ids=())
    assert tr.tokens == ar.tokens
  assert _compiled_counts() == before  # new prompts, lengths and accepted paths


def test_gdn_commit_replay_lossless_and_same_as_states(qwen_f32, qwen_draft, draft_ref, qwen_ref):
  """`Runtime.gdn_commit="replay"` (the verify keeps each node's k/v/g/beta, the commit replays
  the accepted path): on the tiny Qwen3.5 hybrid, autoregressive, chain and DDTree greedy output
  equal the per-node-states run's autoregressive output token for token, with the same
  acceptance lengths as the states runs, and the committed SSM state after a DDTree verify
  equals the stored state of the accepted node (float32 rounding, <= 1e-6 relative)."""
  from dflash_jax import target as target_lib
  rep = dataclasses.replace(qwen_f32, runtime=dataclasses.replace(qwen_f32.runtime,
                                                                 gdn_commit="replay"))
  assert rep.runtime.gdn_commit == "replay" and qwen_f32.runtime.gdn_commit == "states"
  p = draft_ref["prompt_ids"]
  truth = dj.generate(qwen_f32, None, p, max_new_tokens=40, mode="ar", max_ctx=256).tokens
  for mode, kw in (("ar", {}), ("chain", {}), ("ddtree", dict(budget=22, tree_top_k=4))):
    st = dj.generate(qwen_f32, qwen_draft if mode != "ar" else None, p, max_new_tokens=40,
                     mode=mode, max_ctx=256, **kw)
    rp = dj.generate(rep, qwen_draft if mode != "ar" else None, p, max_new_tokens=40,
                     mode=mode, max_ctx=256, **kw)
    assert rp.tokens == st.tokens == truth, mode
    assert rp.accept_lens == st.accept_lens, mode
  # one DDTree verify of a random tree, committed both ways
  cfg = qwen_f32.config
  prompt = np.asarray(qwen_ref["tokens"][1, :12], np.int32)
  rng = np.random.default_rng(7)
  n = 9
  parents, depths = (a.tolist() for a in _random_tree(rng, n))
  tree = tree_lib.Tree(tokens=jnp.asarray(rng.integers(0, cfg.n_vocab, n), jnp.int32),
                       parents=jnp.asarray(parents, jnp.int32),
                       depths=jnp.asarray(depths, jnp.int32), valid=jnp.ones((n,), bool),
                       scores=jnp.zeros((n,), jnp.float32), max_depth=max(depths))
  path = root_path(parents, int(np.argmax(depths)))
  pad = jnp.asarray(path + [path[-1]] * (max(depths) + 1 - len(path)), jnp.int32)
  for n_keep in (1, len(path)):
    caches = []
    for rt in (qwen_f32.runtime, rep.runtime):
      c = target_lib.prefill(qwen_f32.params, cfg, jnp.asarray(prompt), jnp.int32(0),
                             jnp.int32(len(prompt)), target_lib.init_cache(cfg, 64, rt), rt).cache
      ver = target_lib.verify(qwen_f32.params, cfg, tree, jnp.int32(len(prompt)), c, rt)
      assert (ver.steps.ssm is None) == (rt.gdn_commit == "replay")
      caches.append(target_lib.commit_path(c, ver, jnp.int32(len(prompt)), pad,
                                           jnp.int32(n_keep)))
    assert rel_err(caches[1].ssm, caches[0].ssm) < 1e-6
    assert np.array_equal(np.asarray(caches[1].conv), np.asarray(caches[0].conv))
  with pytest.raises(ValueError, match="gdn_commit"):
    Runtime(gdn_commit="nodes")
