"""Batched decoding: B slots in one compiled loop (decode.decode_loop over a batched
DecodeState, batching.SlotBatch, api.generate_batch). Reference: `generate` on each prompt
alone; equality is exact (tokens and acceptance lengths)."""

import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import batching, decode

from conftest import QWEN


def _prompts(qwen_ref):
  t = qwen_ref["tokens"]
  # different lengths (one over a prefill chunk of 32), one that runs into max_ctx=64
  return [t[0, :20], t[1, :7], t[0, :45], t[1, :12], t[0, :3]]


MAX_NEW = [30, 9, 25, 17, 40]


def _check_rows(target, draft, prompts, max_new, eog, **kw):
  res = dj.generate_batch(target, draft, prompts, max_new_tokens=max_new, batch_size=2,
                          eog_ids=eog, seed=[3, 1, 4, 1, 5], max_ctx=64, prefill_chunk=32, **kw)
  reasons = set()
  for i, p in enumerate(prompts):
    alone = dj.generate(target, draft, p, max_new_tokens=max_new[i], eog_ids=eog,
                        seed=[3, 1, 4, 1, 5][i], max_ctx=64, prefill_chunk=32, **kw)
    assert res[i].tokens == alone.tokens, (i, kw)
    assert res[i].accept_lens == alone.accept_lens, (i, kw)
    assert res[i].stop_reason == alone.stop_reason
    reasons.add(alone.stop_reason)
  return reasons


@pytest.fixture(scope="module")
def eog_early(qwen_f32, qwen_ref):
  """An end-of-generation id that prompt 0's greedy output hits at its 6th token (so that row
  stops early)."""
  r = dj.generate(qwen_f32, None, _prompts(qwen_ref)[0], max_new_tokens=8, mode="ar", eog_ids=())
  return (r.tokens[5],)


# Batched AR rows: test_rows_equal_generate_alone_smollm2 and the engine test; the match rule's
# rows differ from rejection's only inside the shared verify (test_sampling checks both rules).
@pytest.mark.parametrize("mode,samp", [
    ("chain", {}),      # greedy DDTree rows: test_rows_equal_generate_alone_quantized
    ("chain", dict(temperature=0.9, top_k=20)),            # rejection rule
    ("ddtree", dict(temperature=0.8, top_p=0.9)),
])
def test_rows_equal_generate_alone_hybrid(qwen_f32, qwen_draft, qwen_ref, eog_early, mode, samp):
  """Five prompts of different lengths and budgets through 2 slots (so three rows join a running
  batch), rows hitting EOG early, max_new_tokens and max_ctx: each row is `generate` alone."""
  reasons = _check_rows(qwen_f32, qwen_draft, _prompts(qwen_ref), MAX_NEW, eog_early,
                        mode=mode, budget=6, **samp)
  if not samp:
    assert {"eog", "max_new_tokens", "max_ctx"} <= reasons


def test_rows_equal_generate_alone_quantized(qwen_draft, qwen_ref, eog_early):
  t = dj.load_target(os.path.join(QWEN, "model-q4_k_m.gguf"))
  _check_rows(t, qwen_draft, _prompts(qwen_ref), MAX_NEW, eog_early, mode="ddtree", budget=5)


def test_greedy_and_sampled_rows_in_one_batch(qwen_f32, qwen_draft, qwen_ref):
  """A greedy row decoded next to sampled rows (the sampling variant of the loop) is the greedy
  output."""
  p = _prompts(qwen_ref)
  b = batching.SlotBatch(qwen_f32, qwen_draft,
                         dj.api.resolve_config(qwen_draft, max_ctx=64, mode="chain"), 2,
                         jnp.asarray([-1], jnp.int32))
  b.prefill(0, np.asarray(p[0], np.int32), 12, dj.SamplingConfig())
  b.prefill(1, np.asarray(p[1], np.int32), 12, dj.SamplingConfig(temperature=1.0, seed=7))
  b.run(1 << 20)
  greedy = dj.generate(qwen_f32, qwen_draft, p[0], max_new_tokens=12, max_ctx=64, eog_ids=(),
                       mode="chain")
  sampled = dj.generate(qwen_f32, qwen_draft, p[1], max_new_tokens=12, max_ctx=64, eog_ids=(),
                        mode="chain",
                        temperature=1.0, seed=7)
  assert b.row(0).tokens == greedy.tokens and b.row(1).tokens == sampled.tokens


def test_no_recompile_when_rows_join_and_leave(qwen_f32, qwen_draft, qwen_ref):
  p = _prompts(qwen_ref)
  kw = dict(max_ctx=64, prefill_chunk=32, batch_size=4, eog_ids=(), mode="chain")
  dj.generate_batch(qwen_f32, qwen_draft, p[:4], max_new_tokens=5, **kw)
  before = (decode.prefill_chunk._cache_size(), decode.decode_loop._cache_size())
  dj.generate_batch(qwen_f32, qwen_draft, p[::-1] + p[:2], max_new_tokens=[3, 9, 1, 12, 6, 2, 7],
                    **kw)
  dj.generate_batch(qwen_f32, qwen_draft, p[1:4], max_new_tokens=4, **kw)   # 3 rows: bucket 4
  assert (decode.prefill_chunk._cache_size(), decode.decode_loop._cache_size()) == before


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_compiled_step_copies_no_cache(qwen_f32, qwen_draft, mode):
  """The optimized HLO of the batched loop has no copy or scatter whose result is a whole KV /
  SSM / draft cache, and no select over a whole KV / draft cache (row writes are in-place
  dynamic-update-slices). The SSM state is recomputed by every step (the commit takes the state
  after the last kept node), so the selects that keep a finished row's state are allowed there."""
  dec = dj.api.resolve_config(qwen_draft, mode=mode, max_ctx=64, budget=6)
  b = batching.SlotBatch(qwen_f32, qwen_draft, dec, 4, jnp.asarray([-1], jnp.int32))
  hlo = decode.decode_loop.lower(qwen_f32.params, b.dparams, b.state, jnp.int32(4), b.eog,
                                 plan=b.plan, sampled=False,
                                 proposer=b.proposer).compile().as_text()
  bad = _whole_cache_ops(hlo, b.state)
  assert not bad, bad


def _whole_cache_ops(hlo: str, st, allow_ssm_select: bool = True) -> list[str]:
  """HLO lines whose result is a whole KV / draft cache made by a copy, select or scatter, or a
  whole SSM state made by a copy or scatter (or a select, unless allowed)."""
  kv = {tuple(x.shape) for x in [st.target.k, st.target.v] + jax.tree.leaves(st.draft)}
  ssm = tuple(st.target.ssm.shape)
  ops = [(tuple(int(x) for x in m.group(1).split(",") if x), m.group(2), line.strip()[:160])
         for line in hlo.splitlines()
         for m in [re.search(r"= \w+\[([\d,]*)\]\{[^}]*\} (copy|select|scatter|copy-start)\(", line)]
         if m]
  assert kv and all(len(s) == 5 for s in kv)
  return [l for shape, op, l in ops
          if (shape in kv) or (shape == ssm and (op != "select" or not allow_ssm_select))]


@pytest.mark.parametrize("mode", ["ar", "chain"])
def test_prefill_chunk_copies_no_cache(qwen_f32, qwen_draft, mode):
  """A prefill chunk reads its row's K/V where it lies in the batch's caches and writes its new
  rows in place: no whole-cache copy, select or scatter (a row sliced out and written back cost
  two copies of the row; reads ordered after the writes cost two copies of the whole cache)."""
  dec = dj.api.resolve_config(qwen_draft, mode=mode, max_ctx=64, budget=6)
  b = batching.SlotBatch(qwen_f32, qwen_draft, dec, 4, jnp.asarray([-1], jnp.int32))
  hlo = decode.prefill_chunk.lower(
      qwen_f32.params, b.dparams, b.state, jnp.int32(1), jnp.zeros(dec.prefill_chunk, jnp.int32),
      jnp.int32(0), jnp.int32(3), jnp.bool_(True), b.eog, jnp.int32(0), jnp.int32(3),
      dj.SamplingConfig().params(), jnp.asarray(batching.tokens_before([], 0)),
      plan=b.plan.prefill).compile().as_text()
  bad = _whole_cache_ops(hlo, b.state, allow_ssm_select=False)
  assert not bad, bad


def test_bad_batch_input(qwen_f32, qwen_draft, qwen_ref):
  p = _prompts(qwen_ref)
  with pytest.raises(ValueError, match="prompt list is empty"):
    dj.generate_batch(qwen_f32, qwen_draft, [], max_new_tokens=4)
  with pytest.raises(ValueError, match=r"prompts\[1\]: prompt has 45 tokens"):
    dj.generate_batch(qwen_f32, qwen_draft, [p[0], p[2]], max_new_tokens=4, max_ctx=40)
  with pytest.raises(ValueError, match=r"prompts\[1\]: empty prompt"):
    dj.generate_batch(qwen_f32, qwen_draft, [p[0], []], max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens: 2 values for 3 prompts"):
    dj.generate_batch(qwen_f32, qwen_draft, p[:3], max_new_tokens=[4, 5])
  with pytest.raises(ValueError, match=r"max_new_tokens\[1\]"):
    dj.generate_batch(qwen_f32, qwen_draft, p[:2], max_new_tokens=[4, 0])
  with pytest.raises(ValueError, match="batch_size=0"):
    dj.generate_batch(qwen_f32, qwen_draft, p[:2], max_new_tokens=4, batch_size=0)
  with pytest.raises(ValueError, match=r"x batch 64: the decode cache .* needs .* GiB.*--batch_size"):
    dj.generate_batch(qwen_f32, qwen_draft, [p[0]] * 64, max_new_tokens=4, batch_size=64,
                      max_ctx=1 << 22)


@pytest.mark.slow
def test_rows_equal_generate_alone_smollm2(smol, smol_prompts):
  prompts = [p["prompt_ids"] for p in smol_prompts[:3]]
  for mode in ("ar", "chain"):
    draft = None
    if mode == "chain":
      from dflash_jax import cli
      draft = dj.load_draft(cli.find_draft_dir(smol), smol)
    res = dj.generate_batch(smol, draft, prompts, max_new_tokens=[24, 40, 16], mode=mode,
                            max_ctx=512, batch_size=2)
    for i, p in enumerate(prompts):
      alone = dj.generate(smol, draft, p, max_new_tokens=[24, 40, 16][i], mode=mode, max_ctx=512)
      assert res[i].tokens == alone.tokens and res[i].accept_lens == alone.accept_lens


# --- the server's continuous batching (serve.Engine, no HTTP) ---------------------------------

def _engine(target, draft, mode, max_batch, **kw):
  from dflash_jax import serve
  dec = dj.api.resolve_config(draft, mode=mode, max_ctx=64, prefill_chunk=32, budget=6)
  eng = serve.Engine(target, draft if mode != "ar" else None, dec, None, "tiny", max_queue=16,
                     max_batch=max_batch, steps_per_call=2, **kw)
  eng.shrink_after_s = 0.0          # shrink as soon as rows leave: exercise row moves
  return eng


def _submit(eng, ids, max_new, samp=None, cancelled=lambda: False):
  texts = []
  fut = eng.submit(ids, max_new, [], samp or dj.SamplingConfig(), texts.append, cancelled)
  return fut, texts


@pytest.mark.parametrize("mode,samp", [("chain", {}), ("ddtree", dict(temperature=0.8, seed=5)),
                                       ("ar", {})])
def test_engine_rows_equal_generate_alone(qwen_f32, qwen_draft, qwen_ref, mode, samp):
  """Requests joining a running batch at different times (a two-chunk prompt prefilled while
  others decode; the batch growing 1 -> 2 -> 4 and shrinking, rows moving with their caches)
  each get exactly the tokens `generate` gives alone, and their streamed text is their text."""
  p = _prompts(qwen_ref)
  eng = _engine(qwen_f32, qwen_draft, mode, 4)
  sc = dj.SamplingConfig(**samp)
  first, texts0 = _submit(eng, p[0], 30, sc)
  while not texts0:                          # the first request is decoding alone (B = 1)
    time.sleep(0.01)
  futs = [(0, first, texts0)] + [(i, *_submit(eng, p[i], MAX_NEW[i], sc)) for i in (2, 1, 3, 4)]
  for i, fut, texts in futs:
    out = fut.result(timeout=600)
    alone = dj.generate(qwen_f32, qwen_draft if mode != "ar" else None, p[i],
                        max_new_tokens=30 if i == 0 else MAX_NEW[i], eog_ids=(), max_ctx=64,
                        prefill_chunk=32, mode=mode, budget=6, sampling=sc)
    assert out.tokens == alone.tokens, i
    assert "".join(t for t in texts if t is not None) == out.text
    assert out.finish_reason == "length"
  assert eng.metrics["batch_rows_peak"] == 4 and eng.metrics["batch_resizes_total"] >= 2
  assert eng.waiting == 0 and not eng._live


def test_engine_cancel_frees_the_slot(qwen_f32, qwen_draft, qwen_ref):
  """A request whose client is gone leaves the batch between decode calls; the others finish
  with their own tokens; a cancelled request still waiting never takes a slot."""
  p = _prompts(qwen_ref)
  eng = _engine(qwen_f32, qwen_draft, "chain", 1)
  gone = [False]
  a, texts = _submit(eng, p[0], 40, cancelled=lambda: gone[0])
  b, _ = _submit(eng, p[1], 9)
  c, _ = _submit(eng, p[3], 9, cancelled=lambda: True)
  while not texts:
    time.sleep(0.01)
  gone[0] = True
  out_a = a.result(timeout=600)
  assert out_a.completion_tokens < 40
  alone = dj.generate(qwen_f32, qwen_draft, p[1], max_new_tokens=9, eog_ids=(), max_ctx=64,
                      prefill_chunk=32, mode="chain", budget=6)
  assert b.result(timeout=600).tokens == alone.tokens
  assert c.result(timeout=600).completion_tokens == 0
  assert eng.metrics["cancelled_total"] == 2 and eng.waiting == 0 and not eng._live


def test_engine_prefix_reuse_smollm2(smol):
  """Prefix reuse (SmolLM2: no recurrent layers): requests after the first go to the slot
  holding the longest shared prompt prefix (the chat template's system prompt; a repeated prompt
  all but its last token) and prefill only the rest, over several chunks; each still gets the
  tokens and acceptance lengths `generate` gives alone (so the reused target K/V and draft
  context rows are that prompt's). Without reuse nothing is skipped."""
  from dflash_jax import cli, serve
  draft = dj.load_draft(cli.find_draft_dir(smol), smol)
  texts = ["Write a Python function that adds two numbers.",
           "Write a Python function that adds two numbers.", "Name three colors."]
  prompts = [cli.build_prompt(smol, t, chat=True) for t in texts]
  dec = dj.api.resolve_config(draft, mode="chain", max_ctx=256, prefill_chunk=32)
  for reuse in (True, False):
    eng = serve.Engine(smol, draft, dec, None, "smol", max_queue=4, max_batch=1,
                       steps_per_call=4,
                       prompt_cache_bytes=(1 << 30) if reuse else 0)
    for i, ids in enumerate(prompts):
      out = _submit(eng, ids, 12)[0].result(timeout=600)
      alone = dj.generate(smol, draft, ids, max_new_tokens=12, max_ctx=256,
                          prefill_chunk=32, mode="chain")
      assert out.tokens == alone.tokens, (reuse, i)
      assert out.stats["mean_acceptance_length"] == pytest.approx(alone.mean_accept_len), (reuse, i)
    n = min(len(prompts[1]), len(prompts[2]))
    shared = int(np.flatnonzero(np.asarray(prompts[1][:n]) != np.asarray(prompts[2][:n]))[0])
    want = len(prompts[1]) - 1 + shared if reuse else 0
    assert shared > 10 and eng.metrics["prompt_tokens_reused_total"] == want
  # A chat's second turn repeats the first turn's prompt and answer: both are reused (the
  # answer's rows but its last token, which was never fed), the output is still `generate`'s.
  eng = serve.Engine(smol, draft, dec, None, "smol", max_queue=4, max_batch=1, steps_per_call=4)
  first = _submit(eng, prompts[2], 12)[0].result(timeout=600)
  msgs = [{"role": "user", "content": texts[2]}, {"role": "assistant", "content": first.text},
          {"role": "user", "content": "And three animals?"}]
  turn2 = smol.tokenizer.encode(smol.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
  before = eng.metrics["prompt_tokens_reused_total"]
  out = _submit(eng, turn2, 12)[0].result(timeout=600)
  alone = dj.generate(smol, draft, turn2, max_new_tokens=12, max_ctx=256, prefill_chunk=32,
                      mode="chain")
  assert out.tokens == alone.tokens
  held = list(prompts[2]) + first.tokens[:-1]
  m = min(len(held), len(turn2) - 1)
  diff = np.flatnonzero(np.asarray(held[:m]) != np.asarray(turn2[:m]))
  want = int(diff[0]) if diff.size else m
  assert want > len(prompts[2]) and out.stats["prompt_tokens_reused"] == want
  assert eng.metrics["prompt_tokens_reused_total"] - before == want
