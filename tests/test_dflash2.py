"""DFlash-2 draft forward and candidate selector (draft2.py) against the z-lab package's reference
arrays (tests/data/dflash2_tiny, made with PyPI `dflash` 0.1.0 on the tiny Qwen3.5 target; fixture
README section 4). Tolerances as that README suggests for an fp32 implementation with bf16 weights
upcast: hidden / logits / scores max abs <= 1e-4, q <= 1e-5, residual <= 1e-6, candidates, chosen
columns and tokens exact."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from conftest import DATA, unpacked
from dflash_jax import draft as draft_lib
from dflash_jax import draft2, draft_io, sampling
from dflash_jax.config import DFLASH2, DRAFT_ARCHITECTURES, DraftConfig

D2 = os.path.join(DATA, "dflash2_tiny")


@pytest.fixture(scope="module")
def d2_dir():
  """The DFlash-2 fixture as a draft directory (its safetensors is stored xz-compressed)."""
  return unpacked("dflash2_tiny")


@pytest.fixture(scope="module")
def d2(qwen_f32, d2_dir):
  cfg, params = draft_io.load(d2_dir, qwen_f32.config, variants=DRAFT_ARCHITECTURES + (DFLASH2,))
  return cfg, jax.device_put(params)


@pytest.fixture(scope="module")
def ref2():
  return np.load(os.path.join(D2, "reference.npz"))


def _ingest(qwen_f32, cfg, params, feats, capacity=128, window=0, chunks=None, relative=False):
  """A draft context cache holding target features `feats` [C, nF*D] at positions 0..C-1."""
  rt = qwen_f32.runtime
  cache = draft_lib.init_cache(cfg, capacity, rt, window=window, relative=relative)
  start = 0
  for n in (chunks or [feats.shape[0]]):
    cache = draft_lib.ingest(params, cfg, jnp.asarray(feats[start:start + n]), jnp.int32(start),
                             cache, rt)
    start += n
  return cache


def test_config_fields_with_package_precedence():
  """DFlash-2 fields from dflash_config, then the top level, then the package default; the
  variant is refused unless the caller runs it; is_causal absent -> sliding layers causal."""
  raw = json.load(open(os.path.join(D2, "config.json")))
  cfg = DraftConfig.from_json(raw, variants=(DFLASH2,))
  f = cfg.dflash2
  assert (f.conv_kernel, f.conv_group, f.selector_rank, f.selector_top_k) == (2, 16, 32, 16)
  assert (f.output_multiplier, f.softcap, f.input_embedding_scale) == (4.0, 4.0, 1.0)
  assert f.causal == (False,) * 3 and cfg.sliding_window == 20 and cfg.variant == DFLASH2
  top = dict(raw, output_multiplier=2.0, dflash_config={
      k: v for k, v in raw["dflash_config"].items() if k != "output_multiplier"})
  top.pop("is_causal")
  c2 = DraftConfig.from_json(top, variants=(DFLASH2,))
  assert c2.dflash2.output_multiplier == 2.0 and c2.dflash2.causal == (True,) * 3
  assert DraftConfig.from_json(c2.to_json(), variants=(DFLASH2,)) == c2
  with pytest.raises(ValueError, match="architectures=\\['DFlash2DraftModel'\\] is not a supported"):
    DraftConfig.from_json(raw, path="x")
  with pytest.raises(ValueError, match="conv_group_size=48: must divide hidden_size=256"):
    DraftConfig.from_json(dict(raw, dflash_config=dict(raw["dflash_config"], conv_group_size=48)),
                          path="x", variants=(DFLASH2,))


def test_target_features_match_package(qwen_f32, ref2):
  _, feats = dj.forward_logits(qwen_f32, ref2["prompt_ids"], feature_layers=(0, 2, 4, 6))
  assert np.abs(np.asarray(feats) - ref2["target_hidden"]).max() < 1e-4


def test_forward_matches_package(qwen_f32, d2, ref2):
  """The standalone call (24 context rows, block at 24..39): layer-0 conv pieces, every layer's
  output, the final hidden state and the soft-capped logits (window 20 cuts the context)."""
  cfg, params = d2
  cache = _ingest(qwen_f32, cfg, params, ref2["target_hidden"])
  hidden, aux = draft2.propose_hidden(params, cfg, qwen_f32.params.embed,
                                      jnp.int32(ref2["block_ids"][0]), jnp.int32(24), cache,
                                      qwen_f32.runtime, trace=True)
  for name in ("attn_conv_in", "attn_conv_dynamic", "attn_prepared", "attn_out", "attn_finished"):
    assert np.abs(np.asarray(aux[name]) - ref2["l0_" + name]).max() < 1e-4, name
  assert np.abs(np.asarray(aux["layer_outputs"]) - ref2["layer_outputs"]).max() < 1e-4
  assert np.abs(np.asarray(hidden) - ref2["draft_hidden"]).max() < 1e-4
  logits = draft2.draft_logits(hidden[1:], qwen_f32.params.lm_head, cfg, qwen_f32.runtime)
  assert np.abs(np.asarray(logits) - ref2["draft_logits"]).max() < 1e-4
  assert (np.asarray(logits).argmax(-1) == ref2["draft_argmax"]).all()


def _standalone(qwen_f32, d2, ref2, **cache_kw):
  cfg, params = d2
  cache = _ingest(qwen_f32, cfg, params, ref2["target_hidden"], **cache_kw)
  hidden = draft2.propose_hidden(params, cfg, qwen_f32.params.embed,
                                 jnp.int32(ref2["block_ids"][0]), jnp.int32(24), cache,
                                 qwen_f32.runtime)
  logits = draft2.draft_logits(hidden[1:], qwen_f32.params.lm_head, cfg, qwen_f32.runtime)
  return cfg, params, hidden, logits


def test_selector_greedy_matches_package(qwen_f32, d2, ref2):
  """Candidates (lax.top_k order), unary and path scores, chosen columns and the proposal;
  the proposal differs from the plain argmax (the selector acts). A ring-buffer draft cache
  (window 24, written in chunks of 7; also with window-relative positions: keys stored before
  RoPE and rotated as read) and a cache holding all rows propose the same."""
  ring = dict(capacity=24 + 16, window=24, chunks=[7, 7, 7, 3])
  for kw in ({}, ring, dict(ring, relative=True)):
    cfg, params, hidden, logits = _standalone(qwen_f32, d2, ref2, **kw)
    sel = draft2.select(params, cfg, hidden[1:], logits, jnp.int32(ref2["block_ids"][0]),
                        qwen_f32.runtime)
    np.testing.assert_array_equal(np.asarray(sel.candidates), ref2["sel_candidates"])
    assert np.abs(np.asarray(sel.unary) - ref2["sel_unary"]).max() < 1e-4
    assert np.abs(np.asarray(sel.scores) - ref2["sel_scores"]).max() < 1e-4
    np.testing.assert_array_equal(np.asarray(sel.chosen), ref2["sel_chosen"])
    np.testing.assert_array_equal(np.asarray(sel.tokens), ref2["draft_tokens"])
  assert (ref2["draft_tokens"] != ref2["draft_argmax"]).sum() >= 5


def test_selector_sampling_pieces_match_package(qwen_f32, d2, ref2):
  """T = 0.7: q by teacher forcing on the package's sampled path (scores <= 1e-4, q <= 1e-5);
  the rejection decision from the stored uniforms; the residual normalize(max(p - q, 0)) with
  q scattered onto the candidates (<= 1e-6); and sampling from the selector draws candidates."""
  cfg, params, hidden, logits = _standalone(qwen_f32, d2, ref2)
  t = float(ref2["samp_temperature"])
  anchor = jnp.int32(ref2["block_ids"][0])
  sel = draft2.select(params, cfg, hidden[1:], logits, anchor, qwen_f32.runtime,
                      temperature=t, forced=jnp.asarray(ref2["samp_tokens"]))
  np.testing.assert_array_equal(np.asarray(sel.tokens), ref2["samp_tokens"])
  assert np.abs(np.asarray(sel.scores) - ref2["samp_scores"]).max() < 1e-4
  assert np.abs(np.asarray(sel.q) - ref2["samp_q"]).max() < 1e-5
  qv = draft2.scatter_q(sel, qwen_f32.config.n_vocab)
  p = jnp.asarray(ref2["samp_target_probs"])
  toks = ref2["samp_tokens"]
  q_tok = np.asarray(qv)[np.arange(15), toks]
  p_tok = np.asarray(p)[np.arange(15), toks]
  assert np.abs(q_tok - ref2["samp_q_tok"]).max() < 1e-5
  assert np.abs(p_tok - ref2["samp_p_tok"]).max() < 1e-6
  accepted = int(np.cumprod(ref2["samp_uniforms"] * q_tok < p_tok).sum())
  assert accepted == int(ref2["samp_accepted"])
  res = np.exp(np.asarray(sampling.residual(p[:15], qv)))
  assert np.abs(res - ref2["samp_residual"]).max() < 1e-6
  drawn = draft2.select(params, cfg, hidden[1:], logits, anchor, qwen_f32.runtime,
                        temperature=t, key=jax.random.key(3))
  assert all(int(tok) in set(c.tolist()) for tok, c in
             zip(np.asarray(drawn.tokens), np.asarray(drawn.candidates)))
  assert np.allclose(np.asarray(drawn.q).sum(-1), 1.0, atol=1e-5)


def test_traced_calls_match_package(qwen_f32, d2, ref2):
  """Every draft call of the package's loops (exact rollback run and oracle run): the context
  grows by the committed rows, the block starts later; the proposal and candidate sets are
  reproduced exactly with our own target's features (calls the fixture flags as near ties
  excepted)."""
  cfg, params = d2
  for prefix in ("trace_", "oracle_trace_"):
    starts = ref2[prefix + "block_start"]
    out = ref2["oracle_output_ids" if prefix == "oracle_trace_" else "spec_output_ids"]
    _, feats = dj.forward_logits(qwen_f32, out[:int(starts[-1])], feature_layers=(0, 2, 4, 6))
    feats = np.asarray(feats)
    near = (ref2[prefix + "path_margin"] < 1e-4) | (ref2[prefix + "topk_gap"] < 1e-4)
    skip = near | (ref2[prefix + "block_len"] != cfg.block_size)   # the loop's last short blocks
    if prefix == "trace_":   # 39 calls, each an eager forward over a new context length: every 3rd
      skip = skip | (np.arange(len(starts)) % 3 != 0)
    checked = 0
    for c, start in enumerate(starts):
      if skip[c]:
        continue
      cache = _ingest(qwen_f32, cfg, params, feats[:int(start)])
      bonus = jnp.int32(ref2[prefix + "block_ids"][c, 0])
      hidden = draft2.propose_hidden(params, cfg, qwen_f32.params.embed, bonus, jnp.int32(start),
                                     cache, qwen_f32.runtime)
      logits = draft2.draft_logits(hidden[1:], qwen_f32.params.lm_head, cfg, qwen_f32.runtime)
      sel = draft2.select(params, cfg, hidden[1:], logits, bonus, qwen_f32.runtime)
      np.testing.assert_array_equal(np.asarray(sel.tokens), ref2[prefix + "draft_tokens"][c])
      np.testing.assert_array_equal(np.sort(np.asarray(sel.candidates), -1),
                                    np.sort(ref2[prefix + "candidates"][c], -1))
      checked += 1
    assert checked == len(starts) - skip.sum() and near.sum() <= 3 and checked >= 4


@pytest.fixture(scope="module")
def d2_draft(qwen_f32, d2_dir):
  return dj.load_draft(d2_dir, qwen_f32)


def test_decode_with_dflash2_equals_greedy_and_package(qwen_f32, d2_draft, ref2):
  """End to end through the compiled loop: chain and DDTree greedy with the DFlash-2 draft ==
  plain greedy (transformers) on the tiny Qwen3.5 hybrid; the chain's acceptance lengths equal
  the package's run with exact rollback."""
  p = ref2["prompt_ids"]
  greedy = ref2["greedy_output_ids"][len(p):].tolist()
  ch = dj.generate(qwen_f32, d2_draft, p, max_new_tokens=40, mode="chain", max_ctx=256,
                   eog_ids=())
  assert ch.tokens == greedy == ref2["spec_output_ids"][len(p):].tolist()
  assert ch.accept_lens == ref2["spec_acceptance_lengths"].tolist()
  tr = dj.generate(qwen_f32, d2_draft, p, max_new_tokens=40, mode="ddtree", max_ctx=256,
                   eog_ids=(), budget=8)
  assert tr.tokens == greedy
  first = dj.first_draft_logits(qwen_f32, d2_draft, p)     # the selector's path, in row form
  np.testing.assert_array_equal(np.asarray(first).argmax(-1), ref2["draft_tokens"])


@pytest.mark.parametrize("chain_seed", [True, False])
def test_tree_scores_children_with_their_own_predecessor(qwen_f32, d2, ref2, chain_seed):
  """draft2.tree (DDTree mode) = an enumeration of the best top-3 paths whose every row is the
  selector's (`select` on that row with the node's own token as predecessor); its top-1 chain is
  the selector's greedy path, and it differs from the tree over the greedy path's rows (where
  every branch is scored with the path's predecessors)."""
  from dflash_jax import tree as tree_lib
  from test_dspark import _ref_cond_tree
  from test_tree import _paths
  cfg, params = d2
  t, rt = qwen_f32, qwen_f32.runtime
  feats = ref2["target_hidden"]
  start, bonus = feats.shape[0], int(ref2["block_ids"][0])
  cache = _ingest(qwen_f32, cfg, params, feats)
  depth, budget, k = 4, 9, 3
  args = (params, cfg, t.params.embed, t.params.lm_head, jnp.int32(bonus), jnp.int32(start),
          cache, rt)
  got = draft2.tree(*args, depth=depth, budget=budget, top_k=k, chain_seed=chain_seed)
  hidden = draft2.propose_hidden(params, cfg, t.params.embed, jnp.int32(bonus),
                                 jnp.int32(start), cache, rt)[1:]
  logits = draft2.draft_logits(hidden, t.params.lm_head, cfg, rt)
  row_sel = jax.jit(lambda d, tok: draft2.select(
      params, cfg, jax.lax.dynamic_slice_in_dim(hidden, d, 1),
      jax.lax.dynamic_slice_in_dim(logits, d, 1), tok, rt))
  memo = {}

  def rows_fn(d, tok):
    if (d, tok) not in memo:
      sel = row_sel(jnp.int32(d), jnp.int32(tok))
      row = np.full(cfg.n_vocab, draft2.NOT_PROPOSED, np.float64)
      row[np.asarray(sel.candidates[0])] = np.asarray(jax.nn.log_softmax(sel.scores[0]))
      memo[d, tok] = row
    return memo[d, tok]

  want = _ref_cond_tree(rows_fn, bonus, depth, budget, k, chain_seed)
  assert _paths(got) == want and len(want) == budget
  path_tokens = np.asarray(draft2.propose_path(*args, n=depth)[0])
  if chain_seed:                                    # the seeded top-1 chain: the greedy path
    assert tuple(int(x) for x in path_tokens) in want
  rows, _ = draft2.propose(*args, n_logits=depth)
  rows_tree = tree_lib.build_tree(jax.nn.log_softmax(rows), jnp.int32(bonus), budget=budget,
                                  top_k=k, chain_seed=chain_seed)
  assert _paths(rows_tree) != want


def test_oracle_acceptance_lengths_of_the_package(qwen_f32, ref2):
  """The fixture's oracle run (the true continuation with row oracle_pattern[i % 7] wrong):
  acceptance lengths [4, 1, 8, 16, 2, 6, 2] reproduced exactly, output == greedy."""
  from test_draft_and_decode import _oracle_run
  p = ref2["prompt_ids"]
  truth = ref2["greedy_output_ids"][len(p):]
  r = _oracle_run(qwen_f32, p, truth, ref2["oracle_pattern"], 256)
  assert r.tokens == ref2["oracle_output_ids"][len(p):].tolist()
  assert r.accept_lens == ref2["oracle_acceptance_lengths"].tolist()


def test_sampled_chain_with_dflash2_matches_autoregressive(qwen_f32, d2_draft, draft_ref):
  """Speculative sampling with the DFlash-2 draft (drafts drawn from the selector's scores, the
  rejection rule with the same q) has the joint distribution of autoregressive sampling
  (Pearson chi-square over the first tokens of 1000 seeded runs; the rule's negative control is
  tests/test_sampling.py::test_chi_square_catches_a_wrong_rule)."""
  import test_sampling as ts
  prompt, joint, _ = ts._exact_joint(qwen_f32, draft_ref)
  dec = dj.api.resolve_config(d2_draft, dj.DecodeConfig(mode="chain", **ts.SMALL_CTX))
  samples = ts._sample_many(qwen_f32, d2_draft, prompt, dec, ts.CFG, ts.N_SAMPLES)
  assert ts._chi_square_p(samples, joint) > 1e-4


def test_train_forward_equals_decode_path(qwen_f32, d2, ref2):
  """draft2.train_hidden (many blocks of one sequence at once, the training form) equals
  propose_hidden over a cache holding positions 0..anchor-1, per block: window 20 cuts the
  context of the later anchors (max abs <= 1e-4, the fixture's tolerance). The teacher-forced
  pairwise term over the whole vocabulary equals the selector's scores at the candidates when
  it follows the same path (`select(forced=)`)."""
  cfg, params = d2
  rt = qwen_f32.runtime
  seq = ref2["greedy_output_ids"][:56]
  _, feats = dj.forward_logits(qwen_f32, seq, feature_layers=cfg.target_layer_ids)
  feats = np.asarray(feats)
  anchors = np.array([30, 5, 24], np.int32)
  bids = np.full((3, cfg.block_size), cfg.mask_token_id, np.int32)
  bids[:, 0] = seq[anchors]
  h = draft2.train_hidden(params, cfg, jnp.asarray(feats), jnp.asarray(bids),
                          jnp.asarray(anchors), qwen_f32.params.embed, rt)
  for i, a in enumerate(anchors):
    cache = _ingest(qwen_f32, cfg, params, feats[:a])
    ref = draft2.propose_hidden(params, cfg, qwen_f32.params.embed, jnp.int32(seq[a]),
                                jnp.int32(a), cache, rt)
    assert np.abs(np.asarray(ref) - np.asarray(h[i])).max() < 1e-4, a
    logits = draft2.draft_logits(ref[1:], qwen_f32.params.lm_head, cfg, rt)
    path = jnp.asarray(seq[a + 1:a + cfg.block_size])
    sel = draft2.select(params, cfg, ref[1:], logits, jnp.int32(seq[a]), rt,
                        temperature=1.0, forced=path)
    prev = jnp.asarray(seq[a:a + cfg.block_size - 1])
    full = np.asarray(logits + draft2.pairwise_scores(params, ref[1:], prev, rt))
    in_top = (np.asarray(sel.candidates) == np.asarray(path)[:, None]).any(-1)
    rows = np.arange(cfg.block_size - 1)[:, None]
    got = full[rows, np.asarray(sel.candidates)]
    # rows after a forced token outside its row's top-k follow a different predecessor
    ok = np.cumprod(in_top).astype(bool)
    ok = np.concatenate([[True], ok[:-1]])
    assert ok.sum() >= 1
    assert np.abs(got[ok] - np.asarray(sel.scores)[ok]).max() < 1e-4


def _d2_tiny_config(qwen_f32):
  from dflash_jax.config import DraftConfig
  c = qwen_f32.config
  base = DraftConfig(d_model=c.d_model, n_layer=1, n_head=4, n_kv_head=2, head_dim=64, d_ff=512,
                     n_vocab=c.n_vocab, rms_eps=1e-6, rope_theta=1e7, block_size=8,
                     mask_token_id=1023, target_layer_ids=(1, 3, 5), sliding=(False,))
  return base, draft_io.dflash2_config(base, conv_kernel=3, conv_group=32, selector_rank=16,
                                       selector_top_k=8, output_multiplier=2.0, softcap=6.0)


def test_dflash2_config_refuses_bad_sizes(qwen_f32):
  base, _ = _d2_tiny_config(qwen_f32)
  with pytest.raises(ValueError, match="conv_group=48 must divide hidden_size=256"):
    draft_io.dflash2_config(base, conv_group=48)
  with pytest.raises(ValueError, match="selector_top_k=0"):
    draft_io.dflash2_config(base, selector_top_k=0)


def test_upgrade_from_dflash1_starts_at_its_logits(qwen_f32, qwen_draft):
  """A DFlash-1 draft upgraded to DFlash-2 proposes the DFlash-1 draft's logits as its unary term
  (identity convolutions, zero dynamic taps; multiplier 1, no cap; max abs <= 1e-5) and its
  pairwise term starts at zero, so the selector's path is the DFlash-1 argmax."""
  cfg1, rt = qwen_draft.config, qwen_f32.runtime
  cfg2 = draft_io.dflash2_config(cfg1)
  p2 = jax.device_put(draft_io.upgrade_to_dflash2(jax.random.key(0), qwen_draft.params, cfg2))
  assert cfg2.variant == DFLASH2
  seq = np.arange(1, 40, dtype=np.int32) * 7
  _, feats = dj.forward_logits(qwen_f32, seq, feature_layers=cfg1.target_layer_ids)
  cache1 = draft_lib.ingest(qwen_draft.params, cfg1, feats[:30], jnp.int32(0),
                            draft_lib.init_cache(cfg1, 64, rt), rt)
  want, _ = draft_lib.propose(qwen_draft.params, cfg1, qwen_f32.params.embed,
                              qwen_f32.params.lm_head, jnp.int32(seq[30]), jnp.int32(30), cache1, rt)
  cache2 = draft_lib.ingest(p2, cfg2, feats[:30], jnp.int32(0), draft_lib.init_cache(cfg2, 64, rt),
                            rt)
  h = draft2.propose_hidden(p2, cfg2, qwen_f32.params.embed, jnp.int32(seq[30]), jnp.int32(30),
                            cache2, rt)
  got = draft2.draft_logits(h[1:], qwen_f32.params.lm_head, cfg2, rt)
  assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-5
  sel = draft2.select(p2, cfg2, h[1:], got, jnp.int32(seq[30]), rt)
  np.testing.assert_array_equal(np.asarray(sel.tokens), np.asarray(want).argmax(-1))
  assert np.abs(np.asarray(sel.scores - sel.unary)).max() == 0.0


def test_train_save_load_and_decode_a_dflash2_draft(tmp_path, qwen_f32, qwen_ref):
  """A DFlash-2 draft trains with the online-feature trainer (loss falls: selector CE, unary CE,
  KL), saves in the z-lab DFlash-2 format (architectures, dflash_config fields, the codebooks
  without `.weight`), loads back to the same config, and decodes losslessly (chain ==
  autoregressive greedy)."""
  from dflash_jax import train
  from dflash_jax.train import datagen
  prompts = [(r, qwen_ref["tokens"][r % 3, r:r + 12].tolist()) for r in range(4)]
  seqs = datagen.generate_token_seqs(qwen_f32, prompts, max_new_tokens=36, temperature=0.0,
                                     seed=0, batch_size=4, max_ctx=64)
  _, cfg = _d2_tiny_config(qwen_f32)
  tc = train.TrainConfig(steps=20, batch=2, anchors=4, seq_len=48, lr=6e-3, warmup=2,
                         kl_weight=0.5)
  st = train.init_state(draft_io.init_params(jax.random.key(0), cfg, 256, weight_fmt="f32"),
                        train.make_optimizer(tc))
  seen = []
  st = train.train(qwen_f32, cfg, seqs, tc, st, on_metrics=lambda i, m: seen.append(m))
  assert {"ce", "ce_unary", "kl"} <= set(seen[0])
  first, last = np.mean([m["loss"] for m in seen[:2]]), np.mean([m["loss"] for m in seen[-2:]])
  assert last < 0.85 * first, [m["loss"] for m in seen]
  out = tmp_path / "d2"
  draft_io.save(str(out), st.params, cfg)
  conf = json.loads((out / "config.json").read_text())
  assert conf["architectures"] == [DFLASH2]
  assert conf["dflash_config"]["selector_top_k"] == 8 and conf["dflash_config"]["conv_kernel_size"] == 3
  from safetensors import safe_open
  with safe_open(str(out / "model.safetensors"), "np") as f:
    keys = set(f.keys())
  assert "candidate_selector.predecessor_codebook" in keys and keys == set(
      draft_io.expected_shapes(cfg, 256))
  loaded = dj.load_draft(str(out), qwen_f32)
  assert loaded.config == cfg
  prompt = qwen_ref["tokens"][1, :15]
  ar = dj.generate(qwen_f32, None, prompt, max_new_tokens=24, mode="ar", max_ctx=64, eog_ids=())
  r = dj.generate(qwen_f32, loaded, prompt, max_new_tokens=24, mode="chain", max_ctx=64,
                  eog_ids=())       # DDTree with a DFlash-2 draft: the test above
  assert r.tokens == ar.tokens


def test_dflash2_objective_against_float64(qwen_f32, d2):
  """The DFlash-2 training loss (train.batch_loss) against a float64 numpy recomputation from
  the draft's hidden states: unary = cap(lm_head(h) x multiplier) (softcap 4, multiplier 4),
  selector scores = unary + the pairwise term with each row's true predecessor (the anchor, then
  the labels), loss = CE(scores) + CE(unary) + w x KL(target || scores), offset-weighted; the
  target's next-token logits from the independent full forward (`forward_logits`). Rel. 1e-4."""
  from dflash_jax import train
  cfg, params = d2
  rng = np.random.default_rng(4)
  seqs = [train.TokenSeq(rng.integers(0, 1000, 10).astype(np.int32),
                         rng.integers(0, 1000, 30).astype(np.int32), i) for i in range(2)]
  batch = train.make_batch(np.random.default_rng(5), seqs, cfg, seq_len=48, n_anchors=6,
                           mask_token_id=cfg.mask_token_id)
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  w = np.asarray(train.loss_weights(cfg.block_size, 7.0), np.float64)
  loss, m = train.batch_loss(params, cfg, batch, tparams, qwen_f32.config, lm, jnp.asarray(w),
                             0.6, qwen_f32.runtime)
  f64 = lambda x: np.asarray(x, np.float64)
  lsm = lambda z: z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
  ex, f = params.dflash2, cfg.dflash2
  sums = dict(ce=0.0, ce_unary=0.0, kl=0.0)
  den = 0.0
  for i, s in enumerate(seqs):
    toks = np.asarray(batch.tokens[i])
    t_logits, feats = dj.forward_logits(qwen_f32, toks[:int(batch.lengths[i])],
                                        feature_layers=cfg.target_layer_ids)
    pad = np.zeros((48, feats.shape[1]), np.float32)
    pad[:feats.shape[0]] = feats
    h = f64(draft2.train_hidden(params, cfg, jnp.asarray(pad), jnp.asarray(batch.block_ids[i]),
                                jnp.asarray(batch.anchors[i]), qwen_f32.params.embed,
                                qwen_f32.runtime))[:, 1:]                       # [A, L-1, D]
    unary = h @ f64(lm).T * f.output_multiplier
    unary = f.softcap * np.tanh(unary / f.softcap)
    g = h @ f64(ex.sel_proj.data).T
    for a in range(batch.anchors.shape[1]):
      for k in range(1, cfg.block_size):
        if not batch.label_valid[i, a, k - 1]:
          continue
        pos = int(batch.anchors[i, a]) + k - 1          # the row's predecessor position
        prev, label = toks[pos], int(batch.labels[i, a, k - 1])
        score = unary[a, k - 1] + (f64(ex.pred)[prev] * g[a, k - 1]) @ f64(ex.succ).T
        lp_t = lsm(f64(t_logits[pos]))
        lq = lsm(score)
        sums["ce"] += w[k - 1] * -lq[label]
        sums["ce_unary"] += w[k - 1] * -lsm(unary[a, k - 1])[label]
        sums["kl"] += w[k - 1] * np.sum(np.exp(lp_t) * (lp_t - lq))
        den += w[k - 1]
  ref = {k: v / den for k, v in sums.items()}
  for k, v in ref.items():
    assert abs(float(m[k]) - v) < 1e-4 * max(1.0, abs(v)), (k, float(m[k]), v)
  total = ref["ce"] + ref["ce_unary"] + 0.6 * ref["kl"]
  assert abs(float(loss) - total) < 1e-4 * total
