"""The target's own MTP block as a draft (dflash_jax/mtp.py), on tests/data/qwen35mtp_tiny: a
tiny random Qwen3.5 with an MTP block, converted by llama.cpp's converter (MTP tensors as block
n_layer, `blk.4.nextn.*`), with transformers references (tests/data/make_mtp_tiny.py):

- the block's logits under teacher forcing and a 4-token drafted chain equal the transformers
  assembly of the block (vLLM's Qwen3_5MultiTokenPredictor) to float32 rounding;
- the decode loop's MTP cache rows and pending hidden state after chain / DDTree steps equal
  those of one prefill of the committed tokens (every commit wrote the right pairs);
- greedy output with the MTP draft is token-identical to autoregressive decoding (and to
  transformers' greedy continuation), batched too;
- files without an MTP block, and options the block cannot honour, are refused by name.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import batching, draft as draft_lib, mtp
from dflash_jax import target as target_lib
from conftest import DATA, tiny_gguf, tiny_ref

# dense Qwen3.5 (4 layers), and Qwen3.5-MoE (2 layers; the MTP block's FFN is routed experts plus
# the gated shared expert, as in Qwen3.5-35B-A3B)
FIXTURES = ["qwen35mtp_tiny", "qwen35moemtp_tiny"]


@pytest.fixture(scope="module", params=FIXTURES)
def fixture_name(request):
  return request.param


@pytest.fixture(scope="module")
def mtp_target(fixture_name, tmp_path_factory):
  return dj.load_target(tiny_gguf(fixture_name, tmp_path_factory), weights="f32", tokenizer=False)


@pytest.fixture(scope="module")
def mtp_draft(mtp_target):
  return dj.load_draft("mtp", mtp_target)


@pytest.fixture(scope="module")
def ref(fixture_name):
  return tiny_ref(fixture_name)


def _dense_mtp_only(fixture_name):
  """Skip on the MoE MTP fixture (CI time): the tests that call this (loop-state and prompt-cache
  bookkeeping, greedy decoding at 7 MTP steps) exercise the draft loop, not the target's MLP, and
  run on the dense MTP fixture. The MoE fixture still runs the config, teacher-forced logits,
  drafted chain, greedy (3 steps, chain and DDTree) and sampled tests."""
  if fixture_name != FIXTURES[0]:
    pytest.skip("MoE MTP fixture: covered by the dense MTP fixture (CI time)")


def _rel(a, b):
  """max |a - b| / max |b| (the tolerance norm of these checks)."""
  return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def _mtp_cache(target, draft, tokens):
  """(cache, h_prev [T, D]): the block's rows of a whole sequence from one target prefill."""
  cfg, rt = target.config, target.runtime
  n = len(tokens)
  pre = target_lib.prefill(target.params, cfg, jnp.asarray(tokens, jnp.int32), jnp.int32(0),
                           jnp.int32(n), target_lib.init_cache(cfg, n, rt), rt,
                           feature_layers=draft.config.target_layer_ids)
  h = mtp.target_hidden(target.params, cfg, pre.feats)
  h_prev = jnp.concatenate([jnp.zeros_like(h[:1]), h[:-1]])
  k, v = mtp.ingest_rows(draft.params, target.params, cfg, jnp.asarray(tokens, jnp.int32), h_prev,
                         jnp.int32(0), rt)
  cache = draft_lib.init_cache(draft.config, n + 8, rt).write(jnp.int32(0), k, v)
  return cache, h_prev, h


def test_config_and_trunk(mtp_target, mtp_draft, ref, fixture_name):
  import json
  with open(os.path.join(DATA, fixture_name, "config.json")) as fh:
    hf = json.load(fh)
  cfg = mtp_target.config
  assert (cfg.n_layer, cfg.n_nextn, cfg.moe) == (hf["num_hidden_layers"], 1, "num_experts" in hf)
  assert mtp_draft.params.layer.ffn.__class__.__name__ == ("MoEParams" if cfg.moe else "FFNParams")
  assert mtp_draft.is_mtp and mtp_draft.config.block_size == mtp.DEFAULT_STEPS + 1
  ar = dj.generate(mtp_target, None, ref["tokens"][0, :12], max_new_tokens=24, mode="ar",
                   max_ctx=64, eog_ids=())
  assert ar.tokens == ref["hf_greedy"][0].tolist()          # the trunk is transformers' model


def test_teacher_forced_logits_match_transformers(mtp_target, mtp_draft, ref):
  """Row q of the block (pair (x_q, h_{q-1}) over rows < q) = transformers' row q."""
  rt = mtp_target.runtime
  for r, tokens in enumerate(ref["tokens"]):
    cache, h_prev, _ = _mtp_cache(mtp_target, mtp_draft, tokens)
    step = jax.jit(lambda q, tok, hp: mtp.propose(mtp_draft.params, mtp_target.params,
                                                  mtp_target.config, tok, q, hp, cache, rt, n=1))
    got = np.stack([np.asarray(step(jnp.int32(q), jnp.int32(tokens[q]), h_prev[q]))[0]
                    for q in range(len(tokens))])
    assert _rel(got, ref["mtp_logits"][r]) < 1e-4
    # the block is not the trunk: its logits differ from the target's (a test that can fail)
    assert _rel(got, np.asarray(dj.forward_logits(mtp_target, tokens))) > 0.1


def test_drafted_chain_matches_transformers(mtp_target, mtp_draft, ref):
  """Four chained steps (each feeding the previous step's argmax and normed output)."""
  for r, tokens in enumerate(ref["tokens"]):
    s = int(ref["chain_start"][r])
    cache, h_prev, _ = _mtp_cache(mtp_target, mtp_draft, tokens)
    got = np.asarray(mtp.propose(mtp_draft.params, mtp_target.params, mtp_target.config,
                                 jnp.int32(tokens[s]), jnp.int32(s), h_prev[s], cache,
                                 mtp_target.runtime, n=4))
    assert _rel(got, ref["chain_logits"][r]) < 1e-4
    np.testing.assert_array_equal(got.argmax(-1), ref["chain_tokens"][r])


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_loop_state_equals_one_prefill(mtp_target, mtp_draft, ref, mode, fixture_name):
  """After a prefill in two chunks and decode steps, the slot's MTP rows 0..pos-1 and its pending
  hidden state are those of one prefill of the committed tokens."""
  _dense_mtp_only(fixture_name)
  dec = dj.api.resolve_config(mtp_draft, mode=mode, budget=6, max_ctx=96, prefill_chunk=8)
  b = batching.SlotBatch(mtp_target, mtp_draft, dec, 2, jnp.asarray([-1], jnp.int32))
  prompt = np.asarray(ref["tokens"][1, :13], np.int32)
  b.prefill(1, prompt, 20, dj.SamplingConfig())
  b.run(1 << 20)
  out = b.row(1).tokens
  assert len(out) == 20
  committed = np.concatenate([prompt, out[:-1]])
  pos = int(b.state.pos[1])
  assert pos == len(committed)
  cache, _, h = _mtp_cache(mtp_target, mtp_draft, committed)
  st = b.state.draft
  for got, want in ((st.k, cache.k), (st.v, cache.v)):
    g = np.asarray(got.planes[0][1, :, :, :pos])
    w = np.asarray(want.planes[0][:, :, :pos])
    assert _rel(g, w) < 1e-4
  assert _rel(b.state.mtp_h[1], np.asarray(h[-1])) < 1e-4


@pytest.mark.parametrize("mode,steps", [("chain", 3), ("chain", 7), ("ddtree", 3)])
def test_greedy_output_equals_autoregressive(mtp_target, ref, mode, steps, fixture_name):
  if steps == 7:
    _dense_mtp_only(fixture_name)
  draft = dj.load_draft("mtp", mtp_target, mtp_steps=steps)
  lens = []
  for r, tokens in enumerate(ref["tokens"]):
    prompt = tokens[:12]
    ar = dj.generate(mtp_target, None, prompt, max_new_tokens=24, mode="ar", max_ctx=128,
                     eog_ids=())
    sp = dj.generate(mtp_target, draft, prompt, max_new_tokens=24, mode=mode, budget=8,
                     max_ctx=128, eog_ids=())
    assert sp.tokens == ar.tokens == ref["hf_greedy"][r].tolist()
    assert sum(sp.accept_lens) == 23 and max(sp.accept_lens) <= steps + 1
    lens += sp.accept_lens
  # the fixture's block is distilled on the trunk's text: multi-token commits are exercised
  assert np.mean(lens) > 1.3 and max(lens) >= 3


def test_tree_is_a_block_step_per_node(mtp_target, mtp_draft, ref):
  """DDTree with the MTP block runs the block on every node's own path (a real draft tree, not
  the greedy chain's rows): its paths and scores are the enumeration's over the block's rows
  drafted along each path (test_eagle3.check_ar_tree)."""
  from test_eagle3 import check_ar_tree
  check_ar_tree(mtp_target, mtp_draft, ref["tokens"][0, :12], mtp, mtp_target.config)


def test_batched_rows_equal_alone(mtp_target, mtp_draft, ref):
  prompts = [ref["tokens"][0, :9], ref["tokens"][1, :15], ref["tokens"][0, 20:31]]
  kw = dict(max_ctx=96, eog_ids=(), mode="chain")
  rows = dj.generate_batch(mtp_target, mtp_draft, prompts, max_new_tokens=[10, 17, 5],
                           batch_size=2, **kw)
  for p, n, got in zip(prompts, [10, 17, 5], rows):
    assert got.tokens == dj.generate(mtp_target, None, p, max_new_tokens=n, max_ctx=96,
                                     eog_ids=(), mode="ar").tokens


def test_sampled_rows_are_reproducible(mtp_target, mtp_draft, ref):
  kw = dict(max_new_tokens=16, max_ctx=96, eog_ids=(), mode="chain", temperature=0.8, seed=3)
  a = dj.generate(mtp_target, mtp_draft, ref["tokens"][0, :10], **kw)
  b = dj.generate(mtp_target, mtp_draft, ref["tokens"][0, :10], **kw)
  assert a.tokens == b.tokens and len(a.tokens) == 16


def test_refusals(mtp_target, mtp_draft, qwen_f32, smol):
  with pytest.raises(ValueError, match="no multi-token-prediction block"):
    dj.load_draft("mtp", qwen_f32)          # a Qwen3.5 file converted with --no-mtp
  with pytest.raises(ValueError, match="'llama' model has none"):
    dj.load_draft("mtp", smol)
  with pytest.raises(ValueError, match="mtp_steps"):
    dj.load_draft("mtp", mtp_target, mtp_steps=0)
  with pytest.raises(ValueError, match="draft_window"):
    dj.api.resolve_config(mtp_draft, mode="chain", draft_window=64)
  dec = dj.api.resolve_config(mtp_draft, mode="chain", block_size=6)   # any block size
  assert dec.block_size == 6 and dec.draft_window == 0
  assert dataclasses.replace(dec, mode="ddtree").draft_depth == 5


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_prompt_cache_warm_equals_cold(mtp_target, mtp_draft, ref, mode, fixture_name):
  """A next turn restored from the prompt cache (rows, recurrent state and the MTP pending
  hidden state at a checkpoint, then the rest prefilled) leaves the slot's MTP rows and pending
  state as a cold prefill does, and decodes the same tokens with the same acceptance lengths."""
  _dense_mtp_only(fixture_name)
  from dflash_jax import prompt_cache as pc
  kw = dict(mode=mode, budget=6, max_ctx=128, prefill_chunk=16, eog_ids=())
  cache = pc.PromptCache.for_target(mtp_target, 1 << 26)
  t = ref["tokens"]
  p0 = np.asarray(t[0, :20], np.int32)
  first = dj.generate(mtp_target, mtp_draft, p0, max_new_tokens=9, prompt_cache=cache, **kw)
  ids = np.concatenate([p0, np.asarray(first.tokens, np.int32), t[1, :5]])
  dec = dj.api.resolve_config(mtp_draft, **{k: v for k, v in kw.items() if k != "eog_ids"})
  rows = []
  for warm in (False, True):
    b = batching.SlotBatch(mtp_target, mtp_draft, dec, 1, jnp.asarray([-1], jnp.int32))
    n = b.reuse(0, ids, cache) if warm else 0
    assert (n > 0) == warm
    for _ in b.prefill_chunks(0, ids, 14, dj.SamplingConfig(), start=n):
      pass
    rows.append((np.asarray(b.state.draft.k.planes[0][0, :, :, :ids.size]),
                 np.asarray(b.state.mtp_h[0])))
  assert _rel(rows[1][0], rows[0][0]) < 1e-5 and _rel(rows[1][1], rows[0][1]) < 1e-5
  cold = dj.generate(mtp_target, mtp_draft, ids, max_new_tokens=14, **kw)
  warm = dj.generate(mtp_target, mtp_draft, ids, max_new_tokens=14, prompt_cache=cache, **kw)
  assert warm.cached_tokens > 0
  assert warm.tokens == cold.tokens and warm.accept_lens == cold.accept_lens


def test_sampled_chain_matches_autoregressive(mtp_target, mtp_draft, ref):
  """Sampled with the MTP chain (each block step draws its token from its processed distribution,
  the next step feeds the draw; the rejection rule against that q): the first 4 tokens of 1000
  runs at temperature 1 / top_k 3 follow the exact autoregressive joint distribution (Pearson
  chi-square, as tests/test_sampling.py), and the drafts get accepted."""
  import test_sampling as ts
  prompt, joint, _ = ts._exact_joint(mtp_target, {"prompt_ids": ref["tokens"][0, :10]})
  dec = dj.api.resolve_config(mtp_draft, dj.DecodeConfig(mode="chain", **ts.SMALL_CTX))
  samples = ts._sample_many(mtp_target, mtp_draft, prompt, dec, ts.CFG, ts.N_SAMPLES)
  assert ts._chi_square_p(samples, joint) > 1e-4
  r = dj.generate(mtp_target, mtp_draft, prompt, max_new_tokens=24, max_ctx=64, eog_ids=(),
                  mode="chain", temperature=1.0, top_k=3, seed=5)
  assert max(r.accept_lens) >= 2
