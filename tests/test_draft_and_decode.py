"""DFlash draft vs the z-lab package, and the speculative loop: chain == autoregressive, token for
token, at every acceptance length; no recompilation across prompts and lengths."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import decode, draft_io
from dflash_jax.config import DraftConfig
from conftest import DRAFT


def test_first_draft_logits_match_zlab(qwen_f32, qwen_draft, draft_ref):
  lg = dj.first_draft_logits(qwen_f32, qwen_draft, draft_ref["prompt_ids"], max_ctx=256)
  scale = np.abs(draft_ref["draft_logits"]).max()
  assert np.abs(lg - draft_ref["draft_logits"]).max() < 1e-5 * max(scale, 1.0)
  assert lg.argmax(-1).tolist() == draft_ref["draft_tokens"].tolist()


def test_target_features_match_zlab(qwen_f32, qwen_draft, draft_ref):
  _, feats = dj.forward_logits(qwen_f32, draft_ref["prompt_ids"],
                               feature_layers=qwen_draft.config.target_layer_ids)
  assert np.abs(feats - draft_ref["target_hidden"]).max() < 1e-5


def test_chain_with_fixture_draft_equals_greedy_and_zlab(qwen_f32, qwen_draft, draft_ref):
  p = draft_ref["prompt_ids"]
  greedy = draft_ref["greedy_output_ids"][len(p):].tolist()
  ar = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=40, mode="ar", max_ctx=256)
  ch = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=40, mode="chain", max_ctx=256)
  assert ar.tokens == greedy and ch.tokens == greedy
  assert ch.tokens == draft_ref["spec_output_ids"][len(p):].tolist()
  assert ch.accept_lens == draft_ref["spec_acceptance_lengths"].tolist()


def make_oracle(n_vocab, second=False):
  """Proposer that drafts the true continuation `seq` with token `pattern[step % len]` wrong
  (a value >= L-1 means the whole block is right). Logits: the drafted token gets 0, all else
  -30; with `second`, the true token at the wrong offset is ranked second (-1), so a tree with
  top_k >= 2 can accept through a non-top-1 sibling."""

  def oracle(tparams, dparams, s, *, dcfg, dec, rt):
    truth = jax.lax.dynamic_slice_in_dim(dparams["seq"], s.pos + 1, dec.block_size - 1)
    off = dparams["pattern"][s.n_steps % dparams["pattern"].shape[0]]
    at_off = jnp.arange(dec.block_size - 1) == off
    drafts = jnp.where(at_off, (truth + 1) % n_vocab, truth)
    logits = jnp.full((dec.block_size - 1, n_vocab), -30.0)
    rows = jnp.arange(dec.block_size - 1)
    if second:
      logits = logits.at[rows, truth].set(jnp.where(at_off, -1.0, -30.0))
    logits = logits.at[rows, drafts].set(0.0)
    return logits, s.draft

  return decode.LogitsProposer(oracle)


def _oracle_run(target, prompt, truth, pattern, max_ctx, block_size=16, mode="chain",
                second=False, **kw):
  seq = np.zeros(max_ctx + 512, np.int32)
  full = np.concatenate([prompt, truth])
  seq[:full.size] = full
  return dj.generate(target, None, prompt, max_new_tokens=len(truth), mode=mode,
                     max_ctx=max_ctx, block_size=block_size, eog_ids=(),
                     proposer=make_oracle(target.config.n_vocab, second),
                     proposer_params={"seq": jnp.asarray(seq),
                                      "pattern": jnp.asarray(pattern, jnp.int32)}, **kw)


def test_oracle_matches_zlab_acceptance(qwen_f32, draft_ref):
  p = draft_ref["prompt_ids"]
  truth = draft_ref["greedy_output_ids"][len(p):]
  r = _oracle_run(qwen_f32, p, truth, draft_ref["oracle_pattern"], 256)
  assert r.tokens == draft_ref["oracle_output_ids"][len(p):].tolist()
  ref = draft_ref["oracle_acceptance_lengths"].tolist()
  assert r.accept_lens == ref       # the last one clipped at max_new_tokens, as the package does


def check_every_acceptance_length(target, prompt, max_new: int, max_ctx: int):
  """An oracle draft wrong at offset 0..14 (acceptance length 1..15), then right (16), over the
  target's own greedy output: the chain reproduces it with exactly those acceptance lengths."""
  truth = dj.generate(target, None, prompt, max_new_tokens=max_new, mode="ar", max_ctx=max_ctx,
                      eog_ids=()).tokens
  pattern = list(range(15)) + [99]
  r = _oracle_run(target, prompt, np.asarray(truth, np.int32), pattern, max_ctx)
  assert r.tokens == truth
  assert r.accept_lens[:16] == [(p + 1 if p < 15 else 16) for p in pattern]
  assert sum(r.accept_lens) == len(truth) - 1      # nothing committed past the output


def test_oracle_every_acceptance_length_tiny_hybrid(qwen_f32, qwen_ref):
  """Error at offset 0..14 -> acceptance length 1..15; offset 99 -> full block (16)."""
  check_every_acceptance_length(qwen_f32, qwen_ref["tokens"][2, :16], 200, 512)


def test_oracle_every_acceptance_length_smollm2(smol, smol_prompts):
  prompt = smol_prompts[0]["prompt_ids"]
  truth = dj.generate(smol, None, prompt, max_new_tokens=140, mode="ar", max_ctx=512,
                      eog_ids=()).tokens
  pattern = [99] + list(range(15))
  r = _oracle_run(smol, np.asarray(prompt, np.int32), np.asarray(truth, np.int32), pattern, 512)
  assert r.tokens == truth
  assert r.accept_lens[:16] == [(p + 1 if p < 15 else 16) for p in pattern]


def _compiled_counts():
  """Compiled variants held by the jitted prefill and decode-loop functions."""
  return (decode.prefill_chunk._cache_size(), decode.decode_loop._cache_size())


def _random_draft(target, n_layer=1, seed=0):
  cfg = draft_io.config_for_target(target.config, n_layer=n_layer)
  return dj.Draft(cfg, jax.device_put(draft_io.init_params(jax.random.key(seed), cfg,
                                                           target.config.d_model)), "random")


def test_chain_random_draft_smollm2_equals_ar_and_stops_at_eog(smol, smol_prompts):
  d = _random_draft(smol)
  for p in smol_prompts[3:5]:  # chat prompts: short answers that end with <|im_end|>
    ar = dj.generate(smol, d, p["prompt_ids"], max_new_tokens=48, mode="ar", max_ctx=512)
    ch = dj.generate(smol, d, p["prompt_ids"], max_new_tokens=48, mode="chain", max_ctx=512)
    assert ch.tokens == ar.tokens
    assert ch.stop_reason == ar.stop_reason
  assert ar.stop_reason == "eog" and ar.tokens[-1] in smol.tokenizer.eog_ids


def test_no_recompile_across_prompts_and_lengths(qwen_f32, qwen_draft, qwen_ref):
  kw = dict(max_ctx=256, mode="chain")
  # one prefill program per forward length: prompts < 32 tokens run 32 rows, < 64 run 64
  dj.generate(qwen_f32, qwen_draft, qwen_ref["tokens"][0, :20], max_new_tokens=5, **kw)
  dj.generate(qwen_f32, qwen_draft, qwen_ref["tokens"][0, :40], max_new_tokens=5, **kw)
  before = _compiled_counts()
  for r, (n, m) in enumerate([(7, 9), (33, 17), (48, 3)]):
    dj.generate(qwen_f32, qwen_draft, qwen_ref["tokens"][r, :n], max_new_tokens=m, **kw)
  dj.generate(qwen_f32, qwen_draft, qwen_ref["tokens"][1, :11], max_new_tokens=12, **kw,
              on_tokens=lambda ids: None, steps_per_call=2)
  assert _compiled_counts() == before


def test_modes_share_one_compiled_prefill(qwen_f32, qwen_draft, qwen_ref):
  """Chain and DDTree with the same draft run the same prefill program (Plan.prefill leaves the
  mode, budget and lookup out of prefill_chunk's static key): the second mode's prefill compiles
  nothing, its first token is the same, and a whole Plan is refused by name."""
  from dflash_jax import batching, sampling
  t, d = qwen_f32, qwen_draft
  ids = np.asarray(qwen_ref["tokens"][0, :20], np.int32)
  plans = [decode.Plan(t.config, d.config,
                       dj.api.resolve_config(d, dj.DecodeConfig(mode=m, max_ctx=256, budget=8)),
                       t.runtime) for m in ("chain", "ddtree")]
  assert plans[0] != plans[1] and plans[0].prefill == plans[1].prefill

  def prefill(plan, key):
    """Prefill the prompt into a fresh one-slot state of `plan`, with `key` as the static plan."""
    toks = np.zeros(32, np.int32)
    toks[:ids.size] = ids
    return decode.prefill_chunk(t.params, d.params, decode.init_state(plan, 1), jnp.int32(0),
                                jnp.asarray(toks), jnp.int32(0), jnp.int32(ids.size),
                                jnp.bool_(True), jnp.asarray([-1], jnp.int32), jnp.int32(0),
                                jnp.int32(8), sampling.SamplingConfig().params(),
                                jnp.asarray(batching.tokens_before([], 0)), plan=key)

  first = prefill(plans[0], plans[0].prefill)
  n = decode.prefill_chunk._cache_size()
  second = prefill(plans[1], plans[1].prefill)
  assert decode.prefill_chunk._cache_size() == n
  assert int(second.bonus[0]) == int(first.bonus[0])
  with pytest.raises(TypeError, match="PrefillPlan"):
    prefill(plans[0], plans[0])


def test_streaming_yields_the_same_tokens(qwen_f32, qwen_draft, qwen_ref):
  seen = []
  r = dj.generate(qwen_f32, qwen_draft, qwen_ref["tokens"][0, :16], max_new_tokens=25,
                  max_ctx=256, on_tokens=seen.extend, steps_per_call=3, mode="chain")
  assert seen == r.tokens and len(r.tokens) == 25


def test_context_limit_stops_generation(qwen_f32, qwen_draft, qwen_ref):
  r = dj.generate(qwen_f32, qwen_draft, qwen_ref["tokens"][0, :40], max_new_tokens=100, max_ctx=64,
                  mode="chain")
  assert r.stop_reason == "max_ctx" and r.mode == "chain"
  ar = dj.generate(qwen_f32, None, qwen_ref["tokens"][0, :40], max_new_tokens=len(r.tokens),
                   mode="ar", max_ctx=128, eog_ids=())
  assert r.tokens == ar.tokens


def test_full_acceptance_stops_exactly_at_max_ctx(qwen_f32, qwen_ref):
  """A draft that is always right must not emit tokens past max_ctx: same length as AR."""
  prompt = np.asarray(qwen_ref["tokens"][1, :20], np.int32)
  truth = np.asarray(dj.generate(qwen_f32, None, prompt, max_new_tokens=200, mode="ar",
                                 max_ctx=50, eog_ids=()).tokens, np.int32)
  seq = np.zeros(50 + 512, np.int32)
  seq[:20 + len(truth)] = np.concatenate([prompt, truth])
  r = dj.generate(qwen_f32, None, prompt, max_new_tokens=200, mode="chain", max_ctx=50,
                  block_size=16, eog_ids=(), proposer=make_oracle(qwen_f32.config.n_vocab),
                  proposer_params={"seq": jnp.asarray(seq), "pattern": jnp.asarray([99], jnp.int32)})
  assert r.stop_reason == "max_ctx" and r.tokens == truth.tolist()
  assert len(truth) == 50 - 20 + 1   # prompt + output = max_ctx + 1 (the last token is not fed)


def test_draft_config_variants():
  with open(os.path.join(DRAFT, "config.json")) as fh:
    base = json.load(fh)
  cfg = DraftConfig.from_json(base)
  assert cfg.block_size == 16 and cfg.target_layer_ids == (1, 3, 5) and cfg.rope_theta == 1e7
  v = dict(base, rope_theta=1e6, dflash_config={"mask_token_id": 5, "block_size": 8})
  v.pop("rope_parameters")
  v["num_target_layers"] = 64
  v["num_hidden_layers"] = 5
  v["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
  v["sliding_window"] = 2048
  cfg = DraftConfig.from_json(v)
  assert cfg.block_size == 8 and cfg.rope_theta == 1e6 and cfg.mask_token_id == 5
  assert cfg.target_layer_ids == (1, 16, 31, 46, 61)  # z-lab default formula
  assert cfg.sliding == (True,) * 4 + (False,) and cfg.sliding_window == 2048
