"""DeepSeek DSpark drafts (dspark.py) against DeepSpec's own PyTorch model: a tiny random
`Qwen3DSparkModel` for the tiny Qwen3.5 target saved by its `save_pretrained`, with the package's
block hidden states, logits, greedy Markov chains and confidence logits for two blocks, each
Markov head type (tests/data/dspark_tiny, made by tests/data/make_dspark_tiny.py). Tolerances as
for the DFlash-2 fixture (fp32 math over bf16 weights): hidden / logits / confidence max abs <=
1e-4 (smallest top-2 margin on the chains: 0.009), tokens exact. Decoding with it: chain, DDTree
and sampled chains equal autoregressive decoding (greedy: token-exact; sampled: chi-square)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from conftest import DATA
from test_tree import _paths
from dflash_jax import draft as draft_lib
from dflash_jax import draft_io, dspark
from dflash_jax.config import DRAFT_ARCHITECTURES, DSPARK, DraftConfig

DS = os.path.join(DATA, "dspark_tiny")
VARIANTS = ("vanilla", "gated", "rnn", "none")
TOL = 1e-4


def variant_dir(tmp_path, name: str, ship_embeddings=None) -> str:
  """The fixture as DeepSpec would have saved variant `name`: the backbone of model.safetensors(.xz)
  with that variant's heads (heads_<name>.safetensors) and config fields (heads.json); with
  ship_embeddings (a target) also embed_tokens / lm_head, as DeepSpec's checkpoints carry them."""
  from conftest import unxz
  from safetensors.numpy import load_file, save_file
  d = tmp_path / f"dspark_{name}"
  d.mkdir()
  conf = json.load(open(os.path.join(DS, "config.json")))
  arrays = load_file(unxz(os.path.join(DS, "model.safetensors.xz"), d / "model.safetensors"))
  if name != "vanilla":
    arrays = {k: v for k, v in arrays.items()
              if not k.startswith(("markov_head.", "confidence_head."))}
    heads = os.path.join(DS, f"heads_{name}.safetensors")
    if os.path.exists(heads):
      arrays.update(load_file(heads))
    for k, v in json.load(open(os.path.join(DS, "heads.json")))[name].items():
      if v is None:
        conf.pop(k, None)
      else:
        conf[k] = v
  if ship_embeddings is not None:
    from dflash_jax.quants import dequantize
    import ml_dtypes
    emb = np.asarray(dequantize(ship_embeddings.params.embed)).astype(ml_dtypes.bfloat16)
    arrays["embed_tokens.weight"] = emb
    arrays["lm_head.weight"] = emb
  save_file(arrays, str(d / "model.safetensors"), metadata={"format": "pt"})
  (d / "config.json").write_text(json.dumps(conf))
  return str(d)


@pytest.fixture(scope="module")
def ref():
  return dict(np.load(os.path.join(DS, "reference.npz")))


@pytest.fixture(scope="module")
def drafts(qwen_f32, tmp_path_factory):
  """variant -> (DraftConfig, DraftParams) read by draft_io.load."""
  tmp = tmp_path_factory.mktemp("dspark")
  out = {}
  for name in VARIANTS:
    cfg, params = draft_io.load(variant_dir(tmp, name), qwen_f32.config,
                                variants=DRAFT_ARCHITECTURES + (DSPARK,))
    out[name] = (cfg, jax.device_put(params))
  return out


def _cache(qwen_f32, cfg, params, feats, start):
  rt = qwen_f32.runtime
  cache = draft_lib.init_cache(cfg, 64, rt)
  return draft_lib.ingest(params, cfg, jnp.asarray(feats[:start]), jnp.int32(0), cache, rt)


def _features(ref):
  """The package's context features: layers 2 and 6 of dflash2_tiny's target_hidden."""
  r2 = np.load(os.path.join(DATA, "dflash2_tiny", "reference.npz"))
  th = r2["target_hidden"]
  return th.reshape(th.shape[0], 4, -1)[:, ref["layer_cols"]].reshape(th.shape[0], -1)


def test_config_fields_and_refusals():
  """DeepSpec's top-level fields parse (and round-trip through to_json); a DFlash-1 config
  carrying a Markov head, an unknown head type, a confidence head on a missing Markov
  embedding, or a DSpark draft for a caller that does not run DSpark are refused by name."""
  raw = json.load(open(os.path.join(DS, "config.json")))
  both = DRAFT_ARCHITECTURES + (DSPARK,)
  cfg = DraftConfig.from_json(raw, variants=both)
  f = cfg.dspark
  assert (f.markov_rank, f.markov_head, f.confidence, f.confidence_with_markov) == (
      16, "vanilla", True, True)
  assert cfg.variant == DSPARK and cfg.block_size == 8 and cfg.target_layer_ids == (2, 6)
  assert cfg.mask_token_id == 1021
  assert DraftConfig.from_json(cfg.to_json(), variants=both) == cfg
  with pytest.raises(ValueError, match="Qwen3DSparkModel drafts are read by api.load_draft"):
    DraftConfig.from_json(raw, path="x")
  with pytest.raises(ValueError, match="markov_rank=16 belongs to a DSpark draft"):
    DraftConfig.from_json({**raw, "architectures": ["DFlashDraftModel"]}, variants=both)
  with pytest.raises(ValueError, match="markov_head_type"):
    DraftConfig.from_json({**raw, "markov_head_type": "lstm"}, variants=both)
  with pytest.raises(ValueError, match="needs a Markov head"):
    DraftConfig.from_json({**raw, "markov_rank": 0}, variants=both)
  with pytest.raises(ValueError, match="embedding-output feature"):
    DraftConfig.from_json({**raw, "target_layer_ids": [-1, 3]}, variants=both)
  with pytest.raises(ValueError, match="full_attention"):
    DraftConfig.from_json({**raw, "layer_types": ["sliding_attention"], "sliding_window": 4},
                          variants=both)


@pytest.mark.parametrize("block", [0, 1])
def test_block_and_chains_match_deepspec(qwen_f32, drafts, ref, block):
  """The backbone's block hidden states and lm_head logits, and every head type's greedy Markov
  chain (tokens, corrected logits) and confidence logits, against DeepSpec's for the same
  context features and anchor."""
  feats = _features(ref)
  start, anchor = int(ref["block_start"][block]), int(ref["anchor"][block])
  rt = qwen_f32.runtime
  tp = qwen_f32.params
  for name in VARIANTS:
    cfg, params = drafts[name]
    cache = _cache(qwen_f32, cfg, params, feats, start)
    if name == "vanilla":
      hid = draft_lib.block_hidden(params, cfg, tp.embed, jnp.int32(anchor), jnp.int32(start),
                                   cache, rt)
      np.testing.assert_allclose(np.asarray(hid), ref[f"block_hidden_{block}"], atol=TOL, rtol=0)
    toks, rows, q, hid, prev = dspark.chain(params, cfg, tp.embed, tp.lm_head, jnp.int32(anchor),
                                            jnp.int32(start), cache, rt)
    assert q is None
    np.testing.assert_array_equal(np.asarray(toks), ref[f"tokens_{name}_{block}"], err_msg=name)
    np.testing.assert_allclose(np.asarray(rows), ref[f"logits_{name}_{block}"], atol=TOL, rtol=0,
                               err_msg=name)
    if name == "none":
      np.testing.assert_allclose(np.asarray(rows), ref[f"base_logits_{block}"], atol=TOL, rtol=0)
    if f"confidence_{name}_{block}" in ref:
      conf = dspark.confidence(params.dspark, cfg.dspark, hid, prev)
      np.testing.assert_allclose(np.asarray(conf), ref[f"confidence_{name}_{block}"], atol=TOL,
                                 rtol=0, err_msg=name)
    else:
      with pytest.raises(ValueError, match="no confidence head"):
        dspark.confidence(params.dspark, cfg.dspark, hid, prev)
  # The Markov head matters on this fixture: the vanilla chain differs from the bare backbone's.
  assert not np.array_equal(ref[f"tokens_vanilla_{block}"], ref[f"tokens_none_{block}"])


def test_checkpoint_shipping_embeddings_loads_and_bad_tensors_refused(qwen_f32, tmp_path):
  """DeepSpec's checkpoints carry embed_tokens / lm_head (frozen copies of the target's): read
  and checked for shape; a missing head tensor or a wrong-shaped one is named."""
  from safetensors.numpy import load_file, save_file
  both = DRAFT_ARCHITECTURES + (DSPARK,)
  d = variant_dir(tmp_path, "vanilla", ship_embeddings=qwen_f32)
  cfg, params = draft_io.load(d, qwen_f32.config, variants=both)
  assert params.dspark.w1.shape == (1024, 16)
  st = os.path.join(d, "model.safetensors")
  arrays = load_file(st)
  save_file({**arrays, "lm_head.weight": arrays["lm_head.weight"][:10]}, st)
  with pytest.raises(ValueError, match="'lm_head.weight' has shape"):
    draft_io.load(d, qwen_f32.config, variants=both)
  save_file({k: v for k, v in arrays.items() if k != "markov_head.markov_w2.weight"}, st)
  with pytest.raises(ValueError, match="missing tensor 'markov_head.markov_w2.weight'"):
    draft_io.load(d, qwen_f32.config, variants=both)


@pytest.fixture(scope="module")
def loaded(qwen_f32, tmp_path_factory):
  """variant -> dj.Draft (dj.load_draft of the variant's directory)."""
  tmp = tmp_path_factory.mktemp("dspark_loaded")
  return {name: dj.load_draft(variant_dir(tmp, name), qwen_f32) for name in ("vanilla", "rnn")}


def test_decode_block_size_and_rows(qwen_f32, loaded, ref):
  """A DSpark block of L = 8 slots proposes 8 tokens: the decode block size defaults to 9 (8
  drafts + the bonus), may be set lower, not higher; the loop's first proposal is the draft's
  greedy Markov chain over the prompt's target features."""
  d = loaded["vanilla"]
  assert dj.api.resolve_config(d, mode="chain").block_size == 9
  assert dj.api.resolve_config(d, mode="chain", block_size=4).draft_depth == 3
  with pytest.raises(ValueError, match="proposes at most 8 tokens"):
    dj.api.resolve_config(d, mode="chain", block_size=10)
  p = [int(x) for x in ref["prompt_ids"]]
  rows = np.asarray(dj.first_draft_logits(qwen_f32, d, p))
  assert rows.shape == (8, 1024)
  # the same chain computed directly: the prompt's features, the greedy bonus, dspark.chain
  logits, feats = dj.forward_logits(qwen_f32, p, feature_layers=d.config.target_layer_ids)
  cache = _cache(qwen_f32, d.config, d.params, feats, len(p))
  toks, chain_rows, *_ = dspark.chain(d.params, d.config, qwen_f32.params.embed,
                                      qwen_f32.params.lm_head, jnp.int32(logits[-1].argmax()),
                                      jnp.int32(len(p)), cache, qwen_f32.runtime)
  np.testing.assert_allclose(rows, np.asarray(chain_rows), atol=TOL, rtol=0)
  np.testing.assert_array_equal(rows.argmax(-1), np.asarray(toks))


def test_greedy_decode_with_rnn_dspark_equals_autoregressive(qwen_f32, loaded, ref):
  """Chain (block 9) and a chain of block 4 (3 of the 8 slots) with the RNN-head DSpark draft
  (its recurrent state carried through the slots inside the loop) give autoregressive greedy
  decoding's tokens (accepted DSpark chains and trees: the test below)."""
  d = loaded["rnn"]
  p = [int(x) for x in ref["prompt_ids"]]
  ar = dj.generate(qwen_f32, None, p, max_new_tokens=32, mode="ar", max_ctx=128, eog_ids=())
  for kw in (dict(mode="chain"), dict(mode="chain", block_size=4)):
    res = dj.generate(qwen_f32, d, p, max_new_tokens=32, max_ctx=128, eog_ids=(), **kw)
    assert res.tokens == ar.tokens, kw


def test_sampled_chain_with_dspark_matches_autoregressive(qwen_f32, loaded, draft_ref):
  """Speculative sampling with the DSpark draft (each slot drawn from its processed corrected
  row, the next slot's Markov bias from the draw: DeepSpec's `sample_block_tokens`; the
  rejection rule with the same q) has the joint distribution of autoregressive sampling
  (Pearson chi-square over the first tokens of 1000 seeded runs)."""
  import test_sampling as ts
  d = loaded["vanilla"]
  prompt, joint, _ = ts._exact_joint(qwen_f32, draft_ref)
  dec = dj.api.resolve_config(d, dj.DecodeConfig(mode="chain", **ts.SMALL_CTX))
  samples = ts._sample_many(qwen_f32, d, prompt, dec, ts.CFG, ts.N_SAMPLES)
  assert ts._chi_square_p(samples, joint) > 1e-4


def _bigram_draft(d, successor: dict, n_vocab: int, strength: float = 50.0):
  """`d` with its Markov head replaced by an exact bigram table of rank V (w1 = I, w2 = T^T with
  T[a, successor[a]] = strength): each slot then proposes the successor of the token before it,
  whatever the backbone says (~O(1) logits)."""
  import dataclasses
  from dflash_jax.config import DSparkFields
  from dflash_jax.quants import QuantWeight
  t = np.zeros((n_vocab, n_vocab), np.float32)
  for a, b in successor.items():
    t[a, b] = strength
  heads = draft_lib.DSparkParams(w1=jnp.eye(n_vocab, dtype=jnp.float32),
                                 w2=QuantWeight(jnp.asarray(t.T), "f32", (n_vocab, n_vocab)))
  cfg = dataclasses.replace(d.config, dspark=DSparkFields(n_vocab, "vanilla", False, False))
  return dj.api.Draft(cfg, dataclasses.replace(d.params, dspark=heads), d.path + "#bigram")


def test_accepted_dspark_chains_and_trees_are_lossless(qwen_f32, loaded, ref):
  """A DSpark draft whose Markov head is the greedy continuation's own successor map proposes
  the true continuation wherever it is unambiguous: chain steps of up to 9 tokens (8 drafts +
  the bonus) and DDTree steps are accepted, and the output still equals autoregressive greedy
  decoding, token for token (with a head that maps every token to one wrong successor instead,
  the chain accepts nothing and the output is the same)."""
  p = [int(x) for x in ref["prompt_ids"]]
  ar = dj.generate(qwen_f32, None, p, max_new_tokens=48, mode="ar", max_ctx=128, eog_ids=())
  seq = [p[-1]] + ar.tokens
  succ = {}
  for a, b in zip(seq, seq[1:]):
    succ.setdefault(a, b)          # the first successor of a repeated token
  good = _bigram_draft(loaded["vanilla"], succ, qwen_f32.config.n_vocab)
  for kw in (dict(mode="chain"), dict(mode="ddtree", budget=8)):
    res = dj.generate(qwen_f32, good, p, max_new_tokens=48, max_ctx=128, eog_ids=(), **kw)
    assert res.tokens == ar.tokens, kw
    assert max(res.accept_lens) >= 5, (kw, res.accept_lens)
    assert max(res.accept_lens) <= 9
  bad = _bigram_draft(loaded["vanilla"], {a: (b + 1) % 1024 for a, b in succ.items()},
                      qwen_f32.config.n_vocab)
  res = dj.generate(qwen_f32, bad, p, max_new_tokens=48, mode="chain", max_ctx=128, eog_ids=())
  assert res.tokens == ar.tokens and max(res.accept_lens) == 1


def test_sharded_checkpoint_loads_the_same(qwen_f32, tmp_path):
  """A checkpoint saved in shards (model.safetensors.index.json + its shard files, as
  save_pretrained writes one above its shard size) reads as the single file does; a missing
  shard is named."""
  from safetensors.numpy import load_file, save_file
  both = DRAFT_ARCHITECTURES + (DSPARK,)
  d = variant_dir(tmp_path, "vanilla", ship_embeddings=qwen_f32)
  st = os.path.join(d, "model.safetensors")
  arrays = load_file(st)
  _, want = draft_io.load(d, qwen_f32.config, variants=both)
  os.remove(st)
  keys = sorted(arrays)
  shards = {"model-00001-of-00002.safetensors": keys[::2],
            "model-00002-of-00002.safetensors": keys[1::2]}
  for name, ks in shards.items():
    save_file({k: arrays[k] for k in ks}, os.path.join(d, name), metadata={"format": "pt"})
  with open(st + ".index.json", "w") as fh:
    json.dump({"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}, fh)
  _, got = draft_io.load(d, qwen_f32.config, variants=both)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
  with pytest.raises(ValueError, match="shard .*model-00002-of-00002.safetensors is missing"):
    draft_io.load(d, qwen_f32.config, variants=both)


def _ref_cond_tree(rows_fn, root, depth, budget, k, chain_seed=True):
  """Independent reference of the conditional best-first tree: enumerate every path whose each
  step is among its parent's top-k children (rows_fn(d, token) -> logp [V], parent-dependent),
  score = sum of log-probs; the tree = the top-1 chain (if seeded) plus the best-scoring other
  paths (scores fall along a path, so the best ones form a prefix-closed set). Returns the set of
  token paths (tuples, root excluded)."""
  paths = {}

  def walk(path, tok, score, d):
    if d == depth:
      return
    lp = np.asarray(rows_fn(d, tok), np.float64)
    for c in np.argsort(-lp)[:k]:
      p = path + (int(c),)
      paths[p] = score + lp[c]
      walk(p, int(c), score + lp[c], d + 1)

  walk((), root, 0.0, 0)
  chain, tok = [], root
  if chain_seed:
    for d in range(min(depth, budget)):
      tok = int(np.argmax(rows_fn(d, tok)))
      chain.append(tuple(chain[-1]) + (tok,) if chain else (tok,))
  rest = sorted((p for p in paths if p not in chain), key=lambda p: -paths[p])
  return set(chain) | set(rest[:budget - len(chain)])


@pytest.mark.parametrize("chain_seed", [True, False])
def test_conditional_tree_against_enumeration_and_build_tree(chain_seed):
  """tree.build_tree_cond (children's rows depend on the parent's token) equals an enumeration
  of the best-scoring top-k paths; with rows that ignore the parent it builds exactly
  tree.build_tree's tree from those rows."""
  from dflash_jax import tree as tree_lib
  rng = np.random.default_rng(7)
  V, D, B, K = 12, 4, 9, 3
  table = rng.standard_normal((D, V, V)).astype(np.float32) * 2.0   # [depth, parent token, child]
  logp = jax.nn.log_softmax(jnp.asarray(table), axis=-1)

  def child_fn(d, token, state):
    return logp[d, token], state + 1.0

  got = jax.jit(lambda: tree_lib.build_tree_cond(child_fn, jnp.int32(5), jnp.zeros((2,)), depth=D,
                                                 budget=B, top_k=K, chain_seed=chain_seed))()
  want = _ref_cond_tree(lambda d, t: np.asarray(logp[d, t]), 5, D, B, K, chain_seed)
  assert _paths(got) == want and len(want) == B
  rows = logp[:, 0, :]                                    # parent-independent rows
  a = tree_lib.build_tree_cond(lambda d, t, s: (rows[d], s), jnp.int32(5), jnp.zeros((1,)),
                               depth=D, budget=B, top_k=K, chain_seed=chain_seed)
  b = tree_lib.build_tree(rows, jnp.int32(5), budget=B, top_k=K, chain_seed=chain_seed)
  for x, y in zip((a.tokens, a.parents, a.depths, a.valid), (b.tokens, b.parents, b.depths, b.valid)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_allclose(np.asarray(a.scores), np.asarray(b.scores), rtol=1e-6)


def test_dspark_tree_branches_continue_with_their_own_token(qwen_f32, loaded, ref):
  """A bigram Markov head whose first choice after the anchor is wrong (the true successor
  second): DDTree over the greedy chain's rows continues the right sibling with the wrong token's
  successors (the true path is 1 token deep in the tree), the conditional tree with the right
  token's (the true continuation runs 6+ deep, and the loop's first step accepts 7+ tokens);
  the output == AR."""
  p = [int(x) for x in ref["prompt_ids"]]
  ar = dj.generate(qwen_f32, None, p, max_new_tokens=24, mode="ar", max_ctx=128, eog_ids=())
  logits, feats = dj.forward_logits(qwen_f32, p, feature_layers=(2, 6))
  bonus = int(logits[-1].argmax())
  assert bonus == ar.tokens[0]
  truth = ar.tokens[1:]                                  # the drafts a perfect tree would hold
  succ = {}
  for a, b in zip(ar.tokens, ar.tokens[1:]):
    succ.setdefault(a, b)
  wrong = (succ[bonus] + 1) % 1024
  d = _bigram_draft(loaded["vanilla"], succ, 1024)
  t = np.asarray(d.params.dspark.w2.data).T.copy()       # T[a, b]
  t[bonus, wrong] = 52.0           # the anchor's first choice: wrong (the true one ~2 nats behind)
  from dflash_jax.quants import QuantWeight
  import dataclasses
  d = dj.api.Draft(d.config, dataclasses.replace(d.params, dspark=dataclasses.replace(
      d.params.dspark, w2=QuantWeight(jnp.asarray(t.T), "f32", (1024, 1024)))), d.path)
  cache = _cache(qwen_f32, d.config, d.params, feats, len(p))
  rt, tp = qwen_f32.runtime, qwen_f32.params
  args = (d.params, d.config, tp.embed, tp.lm_head, jnp.int32(bonus), jnp.int32(len(p)), cache, rt)
  from dflash_jax import tree as tree_lib

  def depth_of_truth(tree):
    paths = _paths(tree)
    return max([n for n in range(len(truth) + 1) if tuple(truth[:n]) in paths or n == 0])

  cond = dspark.tree(*args, depth=8, budget=16, top_k=4)
  rows, _ = dspark.propose(*args, n_logits=8)
  flat = tree_lib.build_tree(jax.nn.log_softmax(rows, axis=-1), jnp.int32(bonus), budget=16,
                             top_k=4)
  assert depth_of_truth(flat) == 1
  assert depth_of_truth(cond) >= 6
  res = dj.generate(qwen_f32, d, p, max_new_tokens=24, max_ctx=128, eog_ids=(), mode="ddtree",
                    budget=16)
  assert res.tokens == ar.tokens and res.accept_lens[0] >= 7
