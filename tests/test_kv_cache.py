"""KV cache formats (kv_cache.KVBuffer): float32 / bfloat16 / float16 / q8_0 / q4_0 storage of
the target's and the draft's caches. References: gguf-py's quantizers (bit-exact blocks, via
kv_quant, tests/test_kv_quant.py), and, for losslessness, autoregressive decoding with the same
cache format (exact token equality)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from conftest import mean_kl
from dflash_jax import cli, kv_cache, kv_quant, layers
from dflash_jax.runtime import Runtime
from test_draft_and_decode import _oracle_run


def _with_kv(target, k, v=""):
  return dataclasses.replace(target, runtime=Runtime(kv_dtype=k, kv_dtype_v=v))


@pytest.mark.parametrize("fmt", kv_cache.FORMATS)
def test_buffer_write_read_cut_put(fmt):
  """A KVBuffer written at rows 5..9 returns exactly decode(encode(rows)) there (for q8_0 /
  q4_0: gguf's blocks of those values) and zeros elsewhere; cut + put copies rows as stored;
  its bytes are the format's bytes per value."""
  rng = np.random.default_rng(0)
  buf = kv_cache.KVBuffer.zeros(fmt, (2, 3, 16), 64)
  assert buf.shape == (2, 3, 16, 64)
  assert buf.nbytes == 2 * 3 * 16 * 64 * kv_cache.bytes_per_value(fmt)
  rows = jnp.asarray(rng.normal(size=(2, 5, 3, 64)), jnp.float32)       # token-major
  buf = layers.write_block(buf, 5, rows)
  got = np.asarray(buf.values())
  want = np.asarray(kv_cache.roundtrip(fmt, layers.kv_rows(rows)))
  np.testing.assert_array_equal(got[:, :, 5:10], want)
  assert not got[:, :, :5].any() and not got[:, :, 10:].any()
  if fmt in kv_quant.FORMATS:   # the stored planes are gguf's blocks of these values
    import gguf
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    ref = gguf.quants.quantize(np.asarray(layers.kv_rows(rows)).reshape(-1, 64), qtype)
    planes = [np.asarray(p[:, :, 5:10]) for p in buf.planes]
    np.testing.assert_array_equal(kv_quant.to_gguf_blocks(planes[0], planes[1]).reshape(-1),
                                  ref.reshape(-1))
  assert 0 < np.abs(want - np.asarray(layers.kv_rows(rows))).max() if fmt != "float32" else True
  part = buf.cut((0, 0, 4, 0), (2, 3, 8))
  moved = kv_cache.KVBuffer.zeros(fmt, (2, 3, 16), 64).put(part, (0, 0, 8, 0))
  np.testing.assert_array_equal(np.asarray(moved.values())[:, :, 8:16], got[:, :, 4:12])


def test_bad_formats_are_refused(qwen_f32_path):
  with pytest.raises(ValueError, match=r"kv_dtype='q8_0' stores blocks of 32 values along the "
                                       r"head dimension, which is 48 here"):
    kv_cache.KVBuffer.zeros("q8_0", (1, 1, 8), 48)
  with pytest.raises(ValueError, match=r"Runtime.kv_dtype='q5_1': expected one of"):
    Runtime(kv_dtype="q5_1")
  with pytest.raises(ValueError, match=r"Runtime.kv_dtype_v='int8'"):
    dj.load_target(qwen_f32_path, kv_dtype_v="int8")


TIE_GAP = 0.5   # logits


def same_up_to_ties(target, prompt, ar: list, spec: list) -> bool:
  """True when spec == ar; else the first divergence must be a near tie (and False is returned).

  A verify computes a row's K/V in a forward of many tokens, AR in a forward of one; the two
  differ in the last bits, as with a float32 cache, where it never moves a token in these tests.
  A quantized (or bfloat16 / float16) cache turns such a difference into a whole rounding step
  when a value sits on a rounding boundary, which can move a later near tie. So a divergence
  must be one: the two tokens are the top two of a third computation (the full-sequence forward
  with the same format) and within TIE_GAP logits of each other. A wrong verify (a row attended
  to as something other than what the cache returns, a wrong commit) diverges at a clear
  choice and fails this."""
  if spec == ar:
    return True
  i = next(j for j in range(min(len(ar), len(spec))) if ar[j] != spec[j])
  lg = np.asarray(dj.forward_logits(target, list(prompt) + ar[:i]))[-1]
  assert set(np.argsort(-lg)[:2].tolist()) == {ar[i], spec[i]}, i
  assert abs(lg[ar[i]] - lg[spec[i]]) < TIE_GAP, (i, lg[ar[i]], lg[spec[i]])
  return False


# float32: every other decode test. One float cast format and one pair of block formats (K and V
# in different formats): the formats share one write / read path (kv_cache.KVBuffer), whose exact
# encode / decode per format test_buffer_write_read_cut_put checks, so losslessness needs one of
# each kind, not each format (the q8_0-only, q4_0-only and float16 runs cost ~2 min of CI).
@pytest.mark.parametrize("k,v", [("bfloat16", ""), ("q4_0", "q8_0")])
def test_cache_formats_lossless_tiny_hybrid(qwen_f32, qwen_draft, qwen_ref, k, v):
  """With a float cast format and block formats (K / V in different formats): greedy output with
  that format == an oracle chain committing 1..16 tokens a step (the verify's own rows are
  attended to as the cache will return them) == DDTree with the fixture draft, up to rounding
  ties (`same_up_to_ties`); on the tiny Qwen3.5 hybrid (Gated DeltaNet rollback beside
  quantized attention caches)."""
  t = _with_kv(qwen_f32, k, v)
  prompt = qwen_ref["tokens"][2, :16]
  truth = dj.generate(t, None, prompt, max_new_tokens=160, mode="ar", max_ctx=256,
                      eog_ids=()).tokens
  r = _oracle_run(t, prompt, np.asarray(truth, np.int32), list(range(15)) + [99], 256)
  if same_up_to_ties(t, prompt, truth, r.tokens):
    assert max(r.accept_lens) == 16
  out = dj.generate(t, qwen_draft, prompt, max_new_tokens=40, mode="ddtree", max_ctx=256,
                    eog_ids=())
  same_up_to_ties(t, prompt, truth[:40], out.tokens)


def test_formats_change_numerics_within_bounds(qwen_f32, qwen_ref):
  """The formats act (logits differ from the float32 cache's) and stay close: the next-token
  distributions of a 64-token prompt (whose attention reads its own rows through the format)
  vs the float32 cache: mean KL < 1e-4 for bfloat16 / float16 / q8_0, < 2e-2 for q4_0."""
  toks = qwen_ref["tokens"][0]
  base = np.asarray(dj.forward_logits(qwen_f32, toks))
  for fmt, bound in (("bfloat16", 1e-4), ("float16", 1e-4), ("q8_0", 1e-4), ("q4_0", 2e-2)):
    lg = np.asarray(dj.forward_logits(_with_kv(qwen_f32, fmt), toks))
    kl = mean_kl(base, lg)
    assert 0 < np.abs(lg - base).max() and kl < bound, (fmt, kl)


def test_quantized_cache_lossless_smollm2(smol, smol_prompts):
  """SmolLM2 with the shipped draft and a q8_0 cache (target and draft context), two prompts:
  chain and DDTree greedy == autoregressive greedy with the same format up to rounding ties
  (`same_up_to_ties`; over three prompts 6 of 6 identical over 64 tokens on an AVX2 machine;
  here 48 tokens, at least 2 of 4 asserted),
  and the drafts are accepted.

  Not q4_0 here: one q4_0 rounding step is 1/8 of a block's largest value, so after a last-bit
  difference rounds one value differently, AR's and a chain's logits part by q4_0's noise
  (measured, HumanEval/2 on an AVX-512 machine: max |AR - chain| logits 0.2 at row 7 of a
  verify, 1-3.5 by row 31; the first divergence sat 1.45 logits apart in the full forward),
  which no tie bound separates from a wrong verify. q4_0's exact check is batch-invariant
  decoding (tests/test_invariant.py::test_invariant_rows_exact_smollm2_q4_0)."""
  t = _with_kv(smol, "q8_0")
  draft = dj.load_draft(cli.find_draft_dir(smol), t)
  identical = 0
  for p in smol_prompts[:2]:
    prompt = list(p["prompt_ids"])
    outs = {m: dj.generate(t, draft, prompt, max_new_tokens=48, mode=m, max_ctx=256,
                           eog_ids=()) for m in ("ar", "chain", "ddtree")}
    for m in ("chain", "ddtree"):
      assert max(outs[m].accept_lens) > 1
      identical += same_up_to_ties(t, prompt, outs["ar"].tokens, outs[m].tokens)
  assert identical >= 2


def test_draft_context_cache_uses_the_format(qwen_f32, qwen_draft):
  """The draft's context cache is stored in the target's K / V formats too."""
  from dflash_jax import decode as decode_lib
  t = _with_kv(qwen_f32, "q8_0", "q4_0")
  dec = dj.api.resolve_config(qwen_draft, mode="chain", max_ctx=128)
  st = jax.eval_shape(lambda: decode_lib.init_row(
      decode_lib.Plan(t.config, qwen_draft.config, dec, t.runtime)))
  assert (st.target.k.fmt, st.target.v.fmt, st.draft.k.fmt, st.draft.v.fmt) == (
      "q8_0", "q4_0", "q8_0", "q4_0")
  assert [p.dtype for p in st.draft.k.planes] == [jnp.int8, jnp.float16]


def test_draft_window_ring_equals_unwrapped_window(qwen_f32, qwen_draft):
  """The draft's ring buffer (window W, R = W + margin rows, wrapped several times by writes of
  5..40 rows) proposes the same logits as a buffer holding every position with the same window
  mask (max abs < 1e-4), and different ones from the unbounded context (the window acts)."""
  from dflash_jax import draft as draft_lib
  rng = np.random.default_rng(0)
  cfg, params, rt = qwen_draft.config, qwen_draft.params, qwen_f32.runtime
  n_feat = len(cfg.target_layer_ids) * qwen_f32.config.d_model
  window, margin, total = 48, 40, 300
  ring = draft_lib.init_cache(cfg, window + margin, rt, window=window)
  flat = draft_lib.init_cache(cfg, 512, rt, window=window)     # never wraps: row = position
  full = draft_lib.init_cache(cfg, 512, rt)                      # no window
  start = 0
  while start < total:
    n = int(rng.integers(5, 41))
    k, v = draft_lib.ingest_rows(params, cfg, jnp.asarray(rng.normal(size=(n, n_feat)),
                                                          jnp.float32), jnp.int32(start), rt)
    ring, flat, full = (c.write(jnp.int32(start), k, v) for c in (ring, flat, full))
    start += n
  prop = lambda c: np.asarray(draft_lib.propose(params, cfg, qwen_f32.params.embed,
                                                qwen_f32.params.lm_head, jnp.int32(7),
                                                jnp.int32(start), c, rt)[0])
  a, b, c = prop(ring), prop(flat), prop(full)
  assert np.abs(a - b).max() < 1e-4 and np.abs(a - c).max() > 1e-3


def test_window_relative_positions_equal_absolute(qwen_f32, qwen_draft):
  """Window-relative RoPE positions (DecodeConfig.draft_positions "window"): the ring stores
  keys before RoPE (so its key plane differs from the absolute ring's) and rotates each chunk
  as it reads it at position - max(0, start - window); since RoPE scores depend only on
  key-query offsets, the proposed logits equal the absolute ring's (max abs < 1e-4), and differ
  (> 1e-2) if the read-time rotation is left out (so the rotation is exercised). A bad value is
  refused naming the field."""
  from dflash_jax import draft as draft_lib
  rng = np.random.default_rng(1)
  cfg, params, rt = qwen_draft.config, qwen_draft.params, qwen_f32.runtime
  n_feat = len(cfg.target_layer_ids) * qwen_f32.config.d_model
  window, margin, total = 48, 40, 300
  absolute = draft_lib.init_cache(cfg, window + margin, rt, window=window)
  relative = draft_lib.init_cache(cfg, window + margin, rt, window=window, relative=True)
  assert relative.relative and not draft_lib.init_cache(cfg, 64, rt, relative=True).relative
  start = 0
  while start < total:
    n = int(rng.integers(5, 41))
    feats = jnp.asarray(rng.normal(size=(n, n_feat)), jnp.float32)
    absolute = draft_lib.ingest(params, cfg, feats, jnp.int32(start), absolute, rt)
    relative = draft_lib.ingest(params, cfg, feats, jnp.int32(start), relative, rt)
    start += n
  assert int(relative.base(jnp.int32(start))) == start - window
  assert np.abs(np.asarray(relative.k.planes[0]) - np.asarray(absolute.k.planes[0])).max() > 1e-2
  prop = lambda c: np.asarray(draft_lib.propose(params, cfg, qwen_f32.params.embed,
                                                qwen_f32.params.lm_head, jnp.int32(7),
                                                jnp.int32(start), c, rt)[0])
  a, r = prop(absolute), prop(relative)
  assert np.abs(a - r).max() < 1e-4
  unrotated = dataclasses.replace(relative, relative=False)    # stored keys read as if rotated
  assert np.abs(prop(unrotated) - a).max() > 1e-2
  with pytest.raises(ValueError, match="draft_positions='relative'"):
    dj.DecodeConfig(draft_positions="relative")


def test_window_relative_positions_in_the_decode_loop(qwen_f32, qwen_draft, qwen_ref):
  """In the compiled loop (prefill chunks and decode steps ingesting into a wrapped 32-row
  window), window-relative positions give the absolute run's draft logits (max abs < 1e-4)
  after the prefill and after 20 steps, and the ring is created relative."""
  from dflash_jax import api, batching
  from dflash_jax import decode as decode_lib
  from dflash_jax.sampling import SamplingConfig
  prompt = np.asarray(qwen_ref["tokens"][1, :40], np.int32)
  out = {}
  for positions in ("absolute", "window"):
    dec = api.resolve_config(qwen_draft, mode="chain", max_ctx=256, prefill_chunk=16,
                             draft_window=32, draft_positions=positions)
    b = batching.SlotBatch(qwen_f32, qwen_draft, dec, 1, np.zeros((0,), np.int32))
    assert b.state.draft.relative == (positions == "window")
    b.prefill(0, prompt, 60, SamplingConfig())
    first = np.asarray(decode_lib.draft_once(qwen_f32.params, qwen_draft.params, b.state,
                                             jnp.int32(0), plan=b.plan))
    b.run(20)
    later = np.asarray(decode_lib.draft_once(qwen_f32.params, qwen_draft.params, b.state,
                                             jnp.int32(0), plan=b.plan))
    out[positions] = (first, later, b.row(0).tokens)
  (fa, la, ta), (fw, lw, tw) = out["absolute"], out["window"]
  assert len(ta) > 20 and ta == tw
  assert np.abs(fa - fw).max() < 1e-4 and np.abs(la - lw).max() < 1e-4


def test_draft_window_decodes_losslessly_in_bounded_memory(qwen_f32, qwen_draft, qwen_ref):
  """A sequence far longer than a small draft window (32) decodes to the same tokens as AR
  (absolute and window-relative positions);
  the draft's state bytes do not depend on max_ctx; window 0 (every position) and a window
  whose ring would not be smaller than the cache reproduce each other exactly."""
  from dflash_jax import api
  prompt = qwen_ref["tokens"][1, :40]
  ar = dj.generate(qwen_f32, None, prompt, max_new_tokens=200, mode="ar", max_ctx=512,
                   eog_ids=()).tokens
  for mode, positions in (("chain", "absolute"), ("chain", "window"), ("ddtree", "window")):
    r = dj.generate(qwen_f32, qwen_draft, prompt, max_new_tokens=200, mode=mode, max_ctx=512,
                    eog_ids=(), draft_window=32, draft_positions=positions)
    assert r.tokens == ar

  unbounded = dj.generate(qwen_f32, qwen_draft, prompt, max_new_tokens=60, mode="chain",
                          max_ctx=256, eog_ids=(), draft_window=0)
  big = dj.generate(qwen_f32, qwen_draft, prompt, max_new_tokens=60, mode="chain",
                    max_ctx=256, eog_ids=(), draft_window=100_000)
  assert unbounded.tokens == big.tokens and unbounded.accept_lens == big.accept_lens
  draft_bytes = []
  for ctx in (1024, 8192):
    dec = api.resolve_config(qwen_draft, mode="chain", max_ctx=ctx, draft_window=32)
    with_d, without = api.state_bytes(qwen_f32, qwen_draft, dec), api.state_bytes(qwen_f32, None, dec)
    draft_bytes.append(with_d - without)
  assert draft_bytes[0] == draft_bytes[1] > 0
