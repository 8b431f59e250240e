"""Batch-invariant decoding (`DecodeConfig.invariant_rows`): every decode forward runs R rows
with `layers.attention_ordered`, so a token's logits and K/V are the same float32 bits whichever
mode (AR step, chain, DDTree) computed them. References: a float64 numpy attention over the same
keys (tolerance), and, for the invariance itself, bitwise equality of rows computed in different
surroundings and exact token equality of chain / DDTree with AR in every KV format."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import cli, decode_flags, kv_cache, layers
from dflash_jax import tree as tree_lib
from test_draft_and_decode import _oracle_run
from test_kv_cache import _with_kv

R = 23      # DDTree at budget 22: the largest verify of the default modes


def test_ordered_sum_is_a_sum_in_a_fixed_order():
  """ordered_sum == the float64 sum within 1e-5 relative (odd lengths padded); and a row's
  result has the same bits whatever the batch around it (a jnp.sum of the same row need not)."""
  rng = np.random.default_rng(0)
  for n in (1, 7, 64, 129):
    x = rng.standard_normal((5, n)).astype(np.float32)
    got = np.asarray(layers.ordered_sum(jnp.asarray(x)))
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)
  x = rng.standard_normal((23, 9, 128)).astype(np.float32)
  f = jax.jit(lambda a: layers.ordered_sum(a, -1))
  whole = np.asarray(f(jnp.asarray(x)))
  for i in (0, 11, 22):
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[i:i + 1])))[0], whole[i])


def _random_tree(rng, n, n_valid):
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n_valid)] + [-1] * (n - n_valid)
  depths = [0] * n
  for i in range(1, n_valid):
    depths[i] = depths[parents[i]] + 1
  t = tree_lib.Tree(tokens=jnp.zeros((n,), jnp.int32), parents=jnp.asarray(parents, jnp.int32),
                    depths=jnp.asarray(depths, jnp.int32),
                    valid=jnp.asarray([True] * n_valid + [False] * (n - n_valid)),
                    scores=jnp.zeros((n,), jnp.float32), max_depth=max(depths))
  return t, np.asarray(parents), np.asarray(depths)


def _cache(fmt, rows_k, rows_v, cap):
  """A one-layer cache [1, Hkv, cap, D] holding rows_k / rows_v [n, Hkv, D] at rows 0..n-1."""
  hkv, dh = rows_k.shape[1:]
  k = layers.write_block(kv_cache.KVBuffer.zeros(fmt, (1, hkv, cap), dh), 0,
                         jnp.asarray(rows_k)[None])
  v = layers.write_block(kv_cache.KVBuffer.zeros(fmt, (1, hkv, cap), dh), 0,
                         jnp.asarray(rows_v)[None])
  return k, v


@pytest.mark.parametrize("fmt", ["float32", "q8_0"])
def test_attention_ordered_equals_float64_attention(fmt):
  """A 12-node tree (9 valid) over 37 committed rows of a 72-row cache read in 16-row chunks
  (the last one slid back): each node's output == float64 softmax attention over the committed
  rows (as the cache returns them) and its ancestors' rows at depth order, max abs < 1e-5; the
  same for the dense form (the whole 72-row capacity as one chunk, `Runtime.attention`)."""
  rng = np.random.default_rng(1)
  t, h, hkv, dh, cap, start = 12, 4, 2, 32, 72, 37
  tree, parents, depths = _random_tree(rng, t, 9)
  q = rng.standard_normal((t, h, dh)).astype(np.float32)
  ck = rng.standard_normal((start, hkv, dh)).astype(np.float32)
  cv = rng.standard_normal((start, hkv, dh)).astype(np.float32)
  bk = np.asarray(kv_cache.roundtrip(fmt, jnp.asarray(rng.standard_normal((t, hkv, dh)),
                                                          jnp.float32)))
  bv = np.asarray(kv_cache.roundtrip(fmt, jnp.asarray(rng.standard_normal((t, hkv, dh)),
                                                          jnp.float32)))
  k_all, v_all = _cache(fmt, ck, cv, cap)
  got, dense = (np.asarray(layers.attention_ordered(
      jnp.asarray(q), k_all, v_all, 0, jnp.int32(start), jnp.asarray(bk), jnp.asarray(bv),
      tree.ancestors_by_depth(), tree.depths, chunk=16, dense=d)) for d in (False, True))
  ck_c = np.asarray(kv_cache.roundtrip(fmt, jnp.asarray(ck)), np.float64)
  cv_c = np.asarray(kv_cache.roundtrip(fmt, jnp.asarray(cv)), np.float64)
  for i in range(t):
    path, j = [], i
    while j >= 0:
      path.append(j)
      j = parents[j]
    path = path[::-1]
    assert len(path) == depths[i] + 1
    keys = np.concatenate([ck_c, bk[path].astype(np.float64)])          # [S, Hkv, Dh]
    vals = np.concatenate([cv_c, bv[path].astype(np.float64)])
    for hh in range(h):
      g = hh // (h // hkv)
      s = keys[:, g] @ q[i, hh].astype(np.float64) / np.sqrt(dh)
      p = np.exp(s - s.max())
      want = (p / p.sum()) @ vals[:, g]
      np.testing.assert_allclose(got[i, hh], want, atol=1e-5, rtol=0)
      np.testing.assert_allclose(dense[i, hh], want, atol=1e-5, rtol=0)


def test_attention_ordered_rows_do_not_depend_on_their_surroundings():
  """Node 7 of a tree, the same path as rows of a chain, and its last token alone after its
  ancestors were committed to the cache (an autoregressive step): the same float32 bits, though
  the blocks and row indices differ (q8_0 cache)."""
  rng = np.random.default_rng(2)
  fmt, t, h, hkv, dh, cap, start = "q8_0", 12, 4, 2, 32, 96, 40
  tree, parents, depths = _random_tree(rng, t, 12)
  i = int(np.argmax(depths))
  path, j = [], i
  while j >= 0:
    path.append(j)
    j = parents[j]
  path = path[::-1]
  q = jnp.asarray(rng.standard_normal((t, h, dh)), jnp.float32)
  ck = rng.standard_normal((start, hkv, dh)).astype(np.float32)
  cv = rng.standard_normal((start, hkv, dh)).astype(np.float32)
  bk = kv_cache.roundtrip(fmt, jnp.asarray(rng.standard_normal((t, hkv, dh)), jnp.float32))
  bv = kv_cache.roundtrip(fmt, jnp.asarray(rng.standard_normal((t, hkv, dh)), jnp.float32))
  k_all, v_all = _cache(fmt, ck, cv, cap)
  att = jax.jit(lambda q, k_all, v_all, start, bk, bv, anc, dep: layers.attention_ordered(
      q, k_all, v_all, 0, start, bk, bv, anc, dep))
  in_tree = np.asarray(att(q, k_all, v_all, jnp.int32(start), bk, bv, tree.ancestors_by_depth(),
                           tree.depths))[i]
  # the path as a chain (rows 0..d), padded with other rows to t
  order = path + [n for n in range(t) if n not in path]
  chain = tree_lib.pad_tree(tree_lib.path_tree(jnp.zeros((len(path),), jnp.int32)), t)
  in_chain = np.asarray(att(q[jnp.asarray(order)], k_all, v_all, jnp.int32(start),
                            bk[jnp.asarray(order)], bv[jnp.asarray(order)], chain.ancestors_by_depth(),
                            chain.depths))[len(path) - 1]
  # AR: the ancestors committed to the cache (as stored), the node alone at row 0
  k_ar, v_ar = _cache(fmt, np.concatenate([ck, np.asarray(bk)[path[:-1]]]),
                      np.concatenate([cv, np.asarray(bv)[path[:-1]]]), cap)
  root = tree_lib.pad_tree(tree_lib.path_tree(jnp.zeros((1,), jnp.int32)), t)
  rows = jnp.asarray([i] + [n for n in range(t) if n != i])
  alone = np.asarray(att(q[rows], k_ar, v_ar, jnp.int32(start + len(path) - 1), bk[rows], bv[rows],
                         root.ancestors_by_depth(), root.depths))[0]
  assert len(path) >= 3
  np.testing.assert_array_equal(in_tree, in_chain)
  np.testing.assert_array_equal(in_tree, alone)


def test_pad_tree_and_config_checks():
  """pad_tree keeps the nodes and adds invalid roots; a batch-invariant verify runs its rows
  rounded up to a multiple of 32 slots; invariant_rows below a mode's verify size is refused
  naming the field (and the flag, from flags)."""
  from dflash_jax import target as target_lib
  assert [target_lib.invariant_slots(r) for r in (1, 16, 23, 32, 33)] == [32, 32, 32, 32, 64]
  t = tree_lib.pad_tree(tree_lib.path_tree(jnp.asarray([5, 6, 7], jnp.int32)), 6)
  assert not t.is_path and t.n == 6 and t.max_depth == 2
  assert np.asarray(t.parents).tolist() == [-1, 0, 1, -1, -1, -1]
  assert np.asarray(t.valid).tolist() == [True] * 3 + [False] * 3
  with pytest.raises(ValueError, match="3 nodes do not fit in 2"):
    tree_lib.pad_tree(tree_lib.path_tree(jnp.asarray([5, 6, 7], jnp.int32)), 2)
  with pytest.raises(ValueError, match=r"DecodeConfig.invariant_rows=16: a ddtree verify has 23"):
    dj.DecodeConfig(mode="ddtree", block_size=16, invariant_rows=16)
  dj.DecodeConfig(mode="ar", invariant_rows=1)
  dj.DecodeConfig(mode="chain", block_size=16, invariant_rows=16)
  from absl import flags
  fv = flags.FlagValues()
  f = decode_flags.define(fv)
  fv(["prog", "--mode=chain", "--block_size=16", "--invariant_rows=8"])
  with pytest.raises(ValueError, match=r"--invariant_rows=8: a chain verify has 16"):
    decode_flags.config(f)


def test_verify_rows_are_bitwise_invariant_tiny_hybrid(qwen_f32, qwen_ref):
  """Tiny Qwen3.5 hybrid, q4_0 cache, invariant_rows 23: 12 tokens verified (a) one at a time,
  each committed before the next (autoregressive), (b) as one chain, (c) as one root path
  inside a 23-node tree whose other nodes are random branches interleaved with it: every path
  node's logits, K, V and Gated DeltaNet state are the same float32 bits in all three.
  (With exactly 23 slots, not rounded up to 32, (c) failed on an AVX-512 machine for path nodes
  in slots >= 16: a row-wise norm's partial last tile; it had passed on earlier VMs.)"""
  from dflash_jax import target as target_lib
  t = _with_kv(qwen_f32, "q4_0")
  cfg, rt = t.config, t.runtime
  prompt = np.asarray(qwen_ref["tokens"][2, :16], np.int32)
  cont = np.asarray(dj.generate(t, None, prompt, max_new_tokens=12, mode="ar", max_ctx=128,
                                eog_ids=()).tokens, np.int32)
  n0 = len(prompt)
  cache = jax.jit(lambda c: target_lib.prefill(t.params, cfg, jnp.asarray(prompt), jnp.int32(0),
                                               jnp.int32(n0), c, rt).cache)(
      target_lib.init_cache(cfg, 128, rt))
  ver = jax.jit(lambda tree, start, c: target_lib.verify(t.params, cfg, tree, start, c, rt,
                                                         invariant_rows=R))

  def fields(v, rows):
    rows = jnp.asarray(rows)
    return [np.asarray(v.logits[rows]), np.asarray(v.k[:, rows]), np.asarray(v.v[:, rows]),
            np.asarray(v.steps.ssm[:, rows])]

  chain = fields(ver(tree_lib.path_tree(jnp.asarray(cont)), jnp.int32(n0), cache),
                 range(len(cont)))
  rng = np.random.default_rng(3)
  at = sorted(rng.choice(np.arange(1, R), len(cont) - 1, replace=False).tolist())
  rows = [0] + at
  parents, tokens, depths = [-1] * R, [0] * R, [0] * R
  for d, r in enumerate(rows):
    parents[r], tokens[r], depths[r] = (rows[d - 1] if d else -1), int(cont[d]), d
  for r in range(1, R):
    if r not in rows:
      parents[r] = int(rng.integers(0, r))
      tokens[r], depths[r] = int(rng.integers(0, cfg.n_vocab)), depths[parents[r]] + 1
  tree = tree_lib.Tree(tokens=jnp.asarray(tokens, jnp.int32),
                       parents=jnp.asarray(parents, jnp.int32),
                       depths=jnp.asarray(depths, jnp.int32), valid=jnp.ones((R,), bool),
                       scores=jnp.zeros((R,), jnp.float32), max_depth=max(depths))
  in_tree = fields(ver(tree, jnp.int32(n0), cache), rows)
  c, ar = cache, []
  for i, tok in enumerate(cont):
    v = ver(tree_lib.path_tree(jnp.asarray([tok])), jnp.int32(n0 + i), c)
    ar.append(fields(v, [0]))
    c = target_lib.commit_path(c, v, jnp.int32(n0 + i), jnp.zeros((1,), jnp.int32), jnp.int32(1),
                               rows_in_place=True)
  ar = [np.concatenate([a[j] for a in ar], axis=0 if j == 0 else 1) for j in range(4)]
  for name, a, b, x in zip(("logits", "k", "v", "ssm"), ar, chain, in_tree):
    np.testing.assert_array_equal(a, b, err_msg=name)
    np.testing.assert_array_equal(a, x, err_msg=name)


@pytest.mark.optimized_xla   # bound by running the decode steps, not by compiling them
def test_invariant_rows_exact_tiny_hybrid(qwen_f32, qwen_draft, qwen_ref):
  """Tiny Qwen3.5 hybrid (Gated DeltaNet tree states beside the attention caches), a q4_0 cache
  (the coarsest format; the formats share every code path but their encoding, which
  test_kv_cache checks per format), invariant_rows 23: an oracle chain committing 1..16 tokens
  a step and DDTree with the fixture draft equal autoregressive greedy output token for token
  (no tie allowance)."""
  t = _with_kv(qwen_f32, "q4_0", "")
  prompt = qwen_ref["tokens"][2, :16]
  truth = dj.generate(t, None, prompt, max_new_tokens=160, mode="ar", max_ctx=256,
                      eog_ids=(), invariant_rows=R).tokens
  r = _oracle_run(t, prompt, np.asarray(truth, np.int32), list(range(15)) + [99], 256,
                  invariant_rows=R)
  assert r.tokens == truth
  assert max(r.accept_lens) == 16
  out = dj.generate(t, qwen_draft, prompt, max_new_tokens=40, mode="ddtree", max_ctx=256,
                    eog_ids=(), invariant_rows=R)
  assert out.tokens == truth[:40]


@pytest.mark.optimized_xla   # bound by running the decode steps, not by compiling them
def test_invariant_rows_exact_smollm2_q4_0(smol):
  """SmolLM2 with the shipped draft and a q4_0 cache on a chat prompt where, without
  invariant_rows, chain and DDTree output left AR's at a near tie (on the 2-core CPU: at token
  31 for chain, 47 for DDTree; README "Limitations"): with invariant_rows 23, chain and DDTree
  equal AR token for token, drafts accepted."""
  t = _with_kv(smol, "q4_0")
  draft = dj.load_draft(cli.find_draft_dir(smol), t)
  prompt = cli.build_prompt(t, cli.CHAT_PROMPTS[0], chat=True)
  outs = {m: dj.generate(t, draft, prompt, max_new_tokens=48, mode=m, max_ctx=256, eog_ids=(),
                         invariant_rows=R) for m in ("ar", "chain", "ddtree")}
  for m in ("chain", "ddtree"):
    assert outs[m].tokens == outs["ar"].tokens, m
    assert max(outs[m].accept_lens) > 1
