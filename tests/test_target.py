"""Target forward vs transformers and llama.cpp references (tiny Qwen3.5 GGUFs), cache
consistency (prefill + decode == one forward), and chunked == recurrent gated delta rule.

Norms: logits compared by max abs difference (tiny model logits have |max| ~1.5), llama.cpp by
mean KL in nats (it quantizes activations, so it is not bit-comparable).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import gdn, kv_cache, layers
from dflash_jax import target as target_lib
from dflash_jax import tree as tree_lib
from dflash_jax.runtime import Runtime
from dflash_jax.target_params import fuse_projections
from conftest import QWEN, mean_kl, rel_err


@pytest.fixture(scope="module")
def qwen_q(request):
  return {q: dj.load_target(os.path.join(QWEN, f"model-{q}.gguf"), weights="quantized")
          for q in ("q8_0", "q4_k_m")}


def test_f32_logits_match_transformers(qwen_f32, qwen_ref):
  for r in range(3):
    lg = dj.forward_logits(qwen_f32, qwen_ref["tokens"][r])
    assert np.abs(lg - qwen_ref["hf_logits"][r]).max() < 2e-5


@pytest.mark.parametrize("q", ["q8_0", "q4_k_m"])
def test_quantized_logits_match_transformers_with_gguf_weights(qwen_q, qwen_ref, q):
  """vs transformers run on gguf-py-dequantized weights of the same file (exact weights)."""
  for r in range(3):
    lg = dj.forward_logits(qwen_q[q], qwen_ref["tokens"][r])
    assert np.abs(lg - qwen_ref[f"hf_dequant_logits_{q}"][r]).max() < 2e-5


def test_q4_k_m_close_to_llama_cpp(qwen_q, qwen_ref):
  """llama.cpp quantizes activations to Q8_K: measured KL(HF-dequant || llama.cpp) is 1.2e-4."""
  kls = [mean_kl(qwen_ref["llamacpp_logits_q4_k_m_kvf32"][r],
                 dj.forward_logits(qwen_q["q4_k_m"], qwen_ref["tokens"][r])) for r in range(3)]
  assert max(kls) < 5e-4, kls


@pytest.mark.parametrize("q", ["f32", "q8_0", "q4_k_m"])
def test_greedy_matches_transformers_generate(qwen_f32, qwen_q, qwen_ref, q):
  target = qwen_f32 if q == "f32" else qwen_q[q]
  ref = qwen_ref["hf_greedy"] if q == "f32" else qwen_ref[f"hf_dequant_greedy_{q}"]
  for r in range(3):
    res = dj.generate(target, None, qwen_ref["tokens"][r, :16], max_new_tokens=32, mode="ar",
                      max_ctx=128, eog_ids=())
    assert res.tokens == ref[r].tolist()


def test_quantized_weights_stay_packed_on_device(qwen_q):
  t = qwen_q["q4_k_m"]
  assert t.weights == "quantized"
  assert abs(t.device_bytes - t.gguf_tensor_bytes) <= 0.10 * t.gguf_tensor_bytes


def test_prefill_then_decode_equals_full_forward(qwen_f32, qwen_ref):
  """Chunked prefill (3 chunks of 16, last one padded), then verify blocks of 1 and 5 tokens
  with commits of part of the block, must reproduce the logits of one full forward."""
  t = qwen_f32
  cfg = t.config
  toks = qwen_ref["tokens"][1]
  full = dj.forward_logits(t, toks)
  rt = t.runtime
  cache = target_lib.init_cache(cfg, 96, rt)

  @jax.jit
  def prefill(params, tok, s0, n, c):
    pre = target_lib.prefill(params, cfg, tok, s0, n, c, rt)
    return target_lib.logits(params, cfg, pre.hidden, rt), pre.cache

  @jax.jit
  def verify(params, blk, pos, c, keep):
    ver = target_lib.verify(params, cfg, tree_lib.path_tree(blk), pos, c, rt)
    path = jnp.arange(blk.shape[0], dtype=jnp.int32)
    return ver.logits, target_lib.commit_path(c, ver, pos, path, keep, rows_in_place=True)

  got = {}
  p = 37
  for s0 in range(0, p, 16):
    n = min(16, p - s0)
    chunk = np.pad(toks[s0:s0 + 16][:n], (0, 16 - n))
    lg, cache = prefill(t.params, jnp.asarray(chunk), jnp.int32(s0), jnp.int32(n), cache)
    for i in range(n):
      got[s0 + i] = np.asarray(lg[i])
  pos = p
  for block_len, keep in [(1, 1), (5, 3), (5, 5), (1, 1)]:
    blk = toks[pos:pos + block_len]
    if block_len == 5 and keep < 5:
      blk = blk.copy()
      blk[keep:] = (blk[keep:] + 7) % cfg.n_vocab  # rejected tail: must not leak into the state
    lg, cache = verify(t.params, jnp.asarray(blk), jnp.int32(pos), cache, jnp.int32(keep))
    for i in range(keep):
      got[pos + i] = np.asarray(lg[i])
    pos += keep
  rows = sorted(got)
  assert rows == list(range(pos))
  assert np.abs(np.stack([got[i] for i in rows]) - full[:pos]).max() < 2e-5


def _gdn_inputs(rng, t, hv, dk, dv):
  q = rng.standard_normal((t, hv, dk)).astype(np.float32)
  k = rng.standard_normal((t, hv, dk)).astype(np.float32)
  q = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk ** -0.5
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((t, hv, dv)).astype(np.float32)
  g = -rng.uniform(0.01, 2.0, (t, hv)).astype(np.float32)
  beta = rng.uniform(0.05, 0.95, (t, hv)).astype(np.float32)
  s0 = rng.standard_normal((hv, dk, dv)).astype(np.float32) * 0.1
  return q, k, v, g, beta, s0


def _gdn_float64(q, k, v, g, beta, s):
  q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s))
  outs = []
  for t in range(q.shape[0]):
    s = s * np.exp(g[t])[:, None, None]
    delta = (v[t] - np.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
    s = s + np.einsum("hk,hv->hkv", k[t], delta)
    outs.append(np.einsum("hk,hkv->hv", q[t], s))
  return np.stack(outs), s


@pytest.mark.parametrize("t", [1, 37, 64, 150])
def test_chunked_and_recurrent_gated_delta_rule_match_float64(t):
  # Seeded: the row-wise relative error is heavy-tailed (a row of small norm), so unseeded draws
  # would put a rare float32 row past the bound; over 300 seeds the largest was 5.4e-6 / 9.9e-6.
  rng = np.random.default_rng(t)
  inp = _gdn_inputs(rng, t, 3, 16, 24)
  ref_o, ref_s = _gdn_float64(*inp)
  o_r, states = gdn.gated_delta_rule_recurrent(*map(jnp.asarray, inp))
  o_c, s_c = gdn.gated_delta_rule_chunked(*map(jnp.asarray, inp), chunk=64)
  assert rel_err(o_r, ref_o) < 1e-5 and rel_err(states[-1], ref_s) < 1e-5
  assert rel_err(o_c, ref_o) < 1e-4 and rel_err(s_c, ref_s) < 1e-4


def test_chunked_rule_padding_leaves_state_unchanged():
  rng = np.random.default_rng(20)
  q, k, v, g, beta, s0 = _gdn_inputs(rng, 20, 2, 8, 8)
  _, s_ref = gdn.gated_delta_rule_chunked(*map(jnp.asarray, (q[:13], k[:13], v[:13], g[:13],
                                                                 beta[:13], s0)))
  g[13:], beta[13:] = 0.0, 0.0
  _, s_pad = gdn.gated_delta_rule_chunked(*map(jnp.asarray, (q, k, v, g, beta, s0)))
  assert rel_err(s_pad, s_ref) < 1e-6


def test_bf16_compute_and_dequantized_weights_options(qwen_f32_path, qwen_ref):
  """compute_dtype=bfloat16 (GPU speed option) stays close; weights='f32' (dequantize at load)
  gives the same logits as packed weights."""
  toks = qwen_ref["tokens"][0]
  ref = qwen_ref["hf_logits"][0]
  bf = dj.load_target(qwen_f32_path, compute_dtype="bfloat16", tokenizer=False)
  assert rel_err(dj.forward_logits(bf, toks), ref) < 0.05
  q = dj.load_target(os.path.join(QWEN, "model-q4_k_m.gguf"), weights="f32", tokenizer=False)
  assert np.abs(dj.forward_logits(q, toks) - qwen_ref["hf_dequant_logits_q4_k_m"][0]).max() < 2e-5


def _qw(n, k, fmt, rng):
  blk, size = dj.quants.BLOCK_FORMATS[fmt]
  return dj.quants.QuantWeight(rng.integers(0, 255, (n, k // blk * size), dtype=np.uint8), fmt, (n, k))


def test_fuse_projections_groups_by_format_and_keeps_large_tiles():
  """Hand-computed grouping (Qwen3.5-27B Gated DeltaNet inputs, scaled down): attn_qkv and
  attn_gate share a format and fuse; the 48-row ssm_beta/ssm_alpha would shrink the 128-row
  tile of that group (1024+512+48 rows has a 16-row power-of-2 tile), so they fuse with each
  other (96 rows, a 32-row tile); a different format never fuses; fuse=False keeps each apart.
  project() returns each member's rows in member order."""
  rng = np.random.default_rng(0)
  ws = [_qw(1024, 256, "q4_k", rng), _qw(512, 256, "q4_k", rng), _qw(48, 256, "q4_k", rng),
        _qw(48, 256, "q4_k", rng), _qw(256, 256, "q6_k", rng)]
  p = fuse_projections(ws)
  assert p.members == (((0, 1024), (1, 512)), ((2, 48), (3, 48)), ((4, 256),))
  assert [g.shape for g in p.groups] == [(1536, 256), (96, 256), (256, 256)]
  np.testing.assert_array_equal(p.groups[0].data[1024:], ws[1].data)
  assert fuse_projections(ws, fuse=False).members == tuple(((i, w.shape[0]),)
                                                                  for i, w in enumerate(ws))
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
  for y, w in zip(layers.project(x, p, Runtime()), ws):
    np.testing.assert_array_equal(np.asarray(y), np.asarray(layers.linear(x, w, Runtime())))


@pytest.mark.parametrize("q", ["q8_0", "q4_k_m"])
def test_fused_projections_match_unfused(qwen_q, qwen_ref, q):
  """Loading with fuse_projections=True (default) stacks projections (checked: fewer groups than
  members somewhere) and gives the same logits as separate matmuls (max abs < 1e-5)."""
  fused = qwen_q[q]
  sep = dj.load_target(os.path.join(QWEN, f"model-{q}.gguf"), weights="quantized",
                       fuse_projections=False)
  lay = fused.params.layers
  assert any(len(l.in_proj.groups) < 4 for l in lay if hasattr(l, "in_proj"))
  assert any(len(l.qkv.groups) < 3 for l in lay if hasattr(l, "qkv"))
  assert all(len(l.ffn.gate_up.groups) == 1 for l in lay)
  assert all(len(l.ffn.gate_up.groups) == 2 for l in sep.params.layers)
  for r in range(2):
    a = dj.forward_logits(fused, qwen_ref["tokens"][r])
    b = dj.forward_logits(sep, qwen_ref["tokens"][r])
    assert np.abs(a - b).max() < 1e-5


@pytest.mark.parametrize("s_cap,t,start,chunk,tree,kv", [
    (384, 1, 300, 256, False, "float32"),      # AR step; live rows span both chunks
    (384, 16, 100, 256, False, "float32"),     # chain verify inside the first chunk
    (100, 5, 50, 256, False, "float32"),       # S smaller than a chunk
    (640, 23, 500, 128, True, "float32"),      # tree mask, last chunk slid back (640 = 5 x 128)
    (600, 23, 560, 128, True, "bfloat16"),     # S not a multiple of the chunk; bf16 cache
    (600, 23, 560, 128, True, "float16"),
    (384, 16, 300, 128, False, "q8_0"),        # block formats: decoded chunk by chunk
    (600, 23, 560, 128, True, "q4_0"),
    (9000, 16, 8900, None, False, "q8_0"),     # default chunk: layers.live_chunk(9000) = 256
])
def test_attention_live_matches_full_cache_attention(s_cap, t, start, chunk, tree, kv):
  """layers.attention_live (chunked online softmax over the live rows only, each chunk decoded
  from the cache's format), and its dense form (the whole capacity as one static chunk,
  `Runtime.attention` "dense"), against the full-cache masked softmax `layers.attention` on the
  cache's decoded values (kv_cache.KVBuffer.values): max abs < 1e-5."""
  rng = np.random.default_rng(s_cap + t)
  q = jnp.asarray(rng.normal(size=(t, 6, 64)), jnp.float32)
  dv = 48 if kv in kv_cache.FLOAT_FORMATS else 64
  kb = kv_cache.KVBuffer.zeros(kv, (2, 2, s_cap), 64)
  vb = kv_cache.KVBuffer.zeros(kv, (2, 2, s_cap), dv)
  kb = layers.write_block(kb, 0, jnp.asarray(rng.normal(size=(2, s_cap, 2, 64)), jnp.float32))
  vb = layers.write_block(vb, 0, jnp.asarray(rng.normal(size=(2, s_cap, 2, dv)), jnp.float32))
  k = kb.values().transpose(0, 2, 1, 3)    # token-major [n_layer, S, Hkv, Dh] for the reference
  v = vb.values().transpose(0, 2, 1, 3)
  key = np.arange(s_cap)
  if tree:   # committed past plus a random subset of this call's rows (always itself)
    own = rng.random((t, t)) < 0.5
    own[np.arange(t), np.arange(t)] = True
    slot = key - start
    in_call = (slot >= 0) & (slot < t)
    mask = (key[None] < start) | (in_call[None] & own[:, np.clip(slot, 0, t - 1)])
  else:
    mask = key[None] <= (start + np.arange(t))[:, None]
  mask = jnp.asarray(mask)
  ref = layers.attention(q, k[1].astype(jnp.float32), v[1].astype(jnp.float32), mask)
  out = layers.attention_live(q, kb, vb, 1, mask, jnp.int32(start + t), chunk)
  assert out.shape == ref.shape and float(jnp.max(jnp.abs(out - ref))) < 1e-5
  dense = layers.attention_live(q, kb, vb, 1, mask, jnp.int32(start + t), chunk, dense=True)
  assert dense.shape == ref.shape and float(jnp.max(jnp.abs(dense - ref))) < 1e-5


def test_live_chunk_grows_with_the_cache():
  """attention_live's default chunk for a decode step: 128 rows up to 8K-row caches, capacity /
  32 (a power of two) above, at most 2048; always 128 for a prefill chunk (> 32 queries)."""
  assert [layers.live_chunk(s) for s in (100, 2176, 8191, 8256, 16448, 65600, 1 << 20)] == [
      128, 128, 128, 256, 512, 2048, 2048]
  assert layers.live_chunk(65600, 23) == 2048 and layers.live_chunk(65600, 512) == 128


def test_load_progress_in_bytes(qwen_f32_path):
  """load_target(progress=) reports bytes read as tensors are read: increasing, ending at the
  file's tensor bytes (every tensor of this file is used)."""
  seen = []
  dj.load_target(qwen_f32_path, progress=lambda done, total: seen.append((done, total)))
  done = [d for d, _ in seen]
  assert len(seen) > 10 and done == sorted(done) and len({t for _, t in seen}) == 1
  assert done[-1] == seen[-1][1] > 0
