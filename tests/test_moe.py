"""Qwen3.5-MoE targets (`qwen35moe`: Gated DeltaNet + gated attention with routed experts and a
gated shared expert, as Qwen3.5-35B-A3B) on a tiny random model converted by llama.cpp's own
converter (tests/data/make_qwen35moe_tiny.py): logits against transformers and llama.cpp, the
MoE FFN against a float64 numpy reference on gguf-py-dequantized expert tensors, and lossless
speculative decoding.

Norms: logits by max abs difference (|logits| <= 2.5 here); measured ours vs transformers
5.7e-6 / 9.4e-6 (f32) and 7.7e-6 / 6.7e-6 (q8_0 vs transformers on the dequantized q8_0
matrices), llama.cpp f32 vs transformers 8.3e-6.
"""

import dataclasses
import lzma
import os
import shutil

import gguf
import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import layers
from dflash_jax.config import TargetConfig
from dflash_jax.runtime import Runtime
from conftest import DATA
from test_draft_and_decode import _oracle_run, _random_draft

MOE = os.path.join(DATA, "qwen35moe_tiny")


@pytest.fixture(scope="module")
def moe_ref():
  return np.load(os.path.join(MOE, "reference.npz"))


@pytest.fixture(scope="module")
def moe_f32_path(tmp_path_factory):
  out = tmp_path_factory.mktemp("moe") / "model-f32.gguf"
  with lzma.open(os.path.join(MOE, "model-f32.gguf.xz"), "rb") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
  return str(out)


@pytest.fixture(scope="module")
def moe_f32(moe_f32_path):
  return dj.load_target(moe_f32_path)


@pytest.fixture(scope="module")
def moe_q8(moe_ref):
  return dj.load_target(os.path.join(MOE, "model-q8_0.gguf"), weights="quantized")


def test_config_from_gguf(moe_f32):
  c = moe_f32.config
  assert (c.arch, c.n_layer, c.recurrent) == ("qwen35moe", 4, (True, True, True, False))
  assert (c.n_expert, c.n_expert_used, c.d_ff_exp, c.d_ff_shexp) == (8, 2, 32, 64)
  assert c.moe and c.d_ff == 0      # no feed_forward_length in a qwen35moe file


def test_logits_match_transformers_and_llama_cpp(moe_f32, moe_q8, moe_ref):
  for r in range(2):
    lg = np.asarray(dj.forward_logits(moe_f32, moe_ref["tokens"][r]))
    assert np.abs(lg - moe_ref["hf_logits"][r]).max() < 3e-5
    assert np.abs(lg - moe_ref["llamacpp_logits_f32_kvf32"][r]).max() < 3e-5
    # packed q8_0 rows dequantized inside the forward vs transformers on gguf-py's dequantized
    # matrices: the same weights, so the same routing and logits up to float rounding
    lq = np.asarray(dj.forward_logits(moe_q8, moe_ref["tokens"][r]))
    assert np.abs(lq - moe_ref["hf_dequant_logits_q8_0"][r]).max() < 3e-5


@pytest.mark.parametrize("q", ["f32", "q8_0"])
def test_greedy_matches_transformers(moe_f32, moe_q8, moe_ref, q):
  target, ref = ((moe_f32, moe_ref["hf_greedy"]) if q == "f32"
                 else (moe_q8, moe_ref["hf_dequant_greedy_q8_0"]))
  if q == "f32":
    assert (moe_ref["llamacpp_greedy_f32_kvf32"] == ref).all()
  for r in range(2):
    res = dj.generate(target, None, moe_ref["tokens"][r, :12], max_new_tokens=24, mode="ar",
                      max_ctx=128, eog_ids=())
    assert res.tokens == ref[r].tolist()


def _moe_float64(y, f: gguf.GGUFReader, layer: int, n_used: int):
  """Float64 numpy reference of one qwen35moe FFN (transformers' Qwen3_5MoeSparseMoeBlock) on
  the file's tensors dequantized by gguf-py. y: [T, D]."""
  t = {x.name: x for x in f.tensors}

  def w(name):
    x = t[f"blk.{layer}.{name}.weight"]
    return np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), np.float64)

  y = np.asarray(y, np.float64)
  logits = y @ w("ffn_gate_inp").T
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  gate, up, down = w("ffn_gate_exps"), w("ffn_up_exps"), w("ffn_down_exps")   # [E, F, D] / [E, D, F]
  silu = lambda x: x / (1 + np.exp(-x))    # noqa: E731
  out = np.zeros_like(y)
  for i in range(y.shape[0]):
    top = np.argsort(-probs[i])[:n_used]
    wt = probs[i, top] / probs[i, top].sum()
    for e, we in zip(top, wt):
      out[i] += we * (down[e] @ (silu(gate[e] @ y[i]) * (up[e] @ y[i])))
  shared = w("ffn_down_shexp") @ (silu(w("ffn_gate_shexp") @ y.T) * (w("ffn_up_shexp") @ y.T))
  g = 1 / (1 + np.exp(-(y @ w("ffn_gate_inp_shexp").reshape(-1))))
  return out + g[:, None] * shared.T


@pytest.mark.parametrize("t", [1, 3, 4, 9])
def test_moe_ffn_against_float64(moe_q8, t):
  """Both expert paths (gathered: T * n_used < n_expert, here T = 1 and 3; every expert over all
  tokens: T = 4, 9) on packed q8_0 expert rows, against float64 numpy on gguf-py's dequantized
  3-D tensors. Norm: max relative L2 error per row < 1e-5 (float32 math, measured ~1e-7)."""
  c = moe_q8.config
  f = gguf.GGUFReader(os.path.join(MOE, "model-q8_0.gguf"))
  y = np.random.default_rng(t).normal(size=(t, c.d_model)).astype(np.float32)
  for layer in (0, 3):
    p = moe_q8.params.layers[layer].ffn
    out = np.asarray(jax.jit(lambda y, p: layers.moe_ffn(
        y, p, n_used=c.n_expert_used, weights_scale=0.0, rt=Runtime()))(y, p), np.float64)
    ref = _moe_float64(y, f, layer, c.n_expert_used)
    err = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 1e-5, err


def test_speculative_modes_lossless(moe_f32, moe_ref):
  """Chain and DDTree verifies (16 / 9+ rows: every expert over all rows) against
  autoregressive steps (one row: gathered experts) with a random draft, alone and batched, and
  an oracle draft
  accepting 1..16 tokens per step (the hybrid layers' rollback after each)."""
  draft = _random_draft(moe_f32)
  for r in range(2):
    prompt = moe_ref["tokens"][r, :12]
    for mode in ("chain", "ddtree"):
      res = dj.generate(moe_f32, draft, prompt, max_new_tokens=24, mode=mode, max_ctx=128,
                        eog_ids=())
      assert res.tokens == moe_ref["hf_greedy"][r].tolist(), (mode, r)
  # two rows in one batched loop (vmapped rows: each row's expert path from its own rows)
  rows = dj.generate_batch(moe_f32, draft, [moe_ref["tokens"][r, :12] for r in range(2)],
                           max_new_tokens=24, mode="chain", max_ctx=128, eog_ids=(), batch_size=2)
  assert [x.tokens for x in rows] == moe_ref["hf_greedy"].tolist()
  prompt = moe_ref["tokens"][1, :12]
  truth = dj.generate(moe_f32, None, prompt, max_new_tokens=150, mode="ar", max_ctx=256,
                      eog_ids=()).tokens
  pattern = list(range(15)) + [99]
  res = _oracle_run(moe_f32, prompt, np.asarray(truth, np.int32), pattern, 256)
  assert res.tokens == truth
  assert res.accept_lens[:16] == [(p + 1 if p < 15 else 16) for p in pattern]


def test_metadata_errors_name_the_key(moe_f32_path):
  from dflash_jax.gguf_io import read_gguf
  meta = dict(read_gguf(moe_f32_path).meta)
  bad = dict(meta, **{"qwen35moe.expert_used_count": 9})
  with pytest.raises(ValueError, match=r"qwen35moe\.expert_used_count=9"):
    TargetConfig.from_gguf(bad, n_vocab=384, path="x.gguf")
  bad = {k: v for k, v in meta.items() if k != "qwen35moe.expert_feed_forward_length"}
  with pytest.raises(ValueError, match=r"x\.gguf: missing .*qwen35moe\.expert_feed_forward_length"):
    TargetConfig.from_gguf(bad, n_vocab=384, path="x.gguf")
  ok = TargetConfig.from_gguf(dict(meta, **{"qwen35moe.feed_forward_length": 96}), n_vocab=384)
  assert dataclasses.astuple(ok)[:5] == ("qwen35moe", 4, 128, 96, 384)
  assert ok.d_ff_exp == 32        # the explicit key wins over llama.cpp's d_ff / n_used default


def test_tensor_errors_name_the_tensor(moe_f32_path):
  from dflash_jax.gguf_io import read_gguf
  from dflash_jax.target_params import load_params
  f = read_gguf(moe_f32_path)
  cfg = TargetConfig.from_gguf(f.meta, n_vocab=384, path=f.path)
  with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight' has shape \(8, 32, 128\), "
                                       r"expected \(8, 16, 128\)"):
    load_params(f, dataclasses.replace(cfg, d_ff_exp=16))
  f = read_gguf(moe_f32_path)
  f.tensors["blk.0.ffn_gate_up_exps.weight"] = f.tensors["blk.0.ffn_gate_exps.weight"]
  with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_up_exps\.weight \(merged expert"):
    load_params(f, cfg)
