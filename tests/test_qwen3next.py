"""Qwen3-Next targets (`qwen3next`, as Qwen3-Next-80B-A3B: Gated DeltaNet + gated attention like
Qwen3.5, routed experts + a gated shared expert, plain RoPE, the checkpoint's grouped V-head order
and a fused beta/alpha projection `ssm_ba`) on a tiny random model converted by llama.cpp's own
converter (tests/data/make_converted_tiny.py; 2 K heads with 2 V heads each, so grouped and
tiled head orders differ): logits against transformers and llama.cpp, greedy decoding, lossless
speculative decoding, and the legacy fused `ssm_in` layout of older conversions.

Norms: logits by max abs difference (|logits| <= ~3 here).
"""

import dataclasses

import jax
import numpy as np
import pytest

import dflash_jax as dj
from conftest import check_logits_and_greedy, tiny_gguf, tiny_ref
from dflash_jax import target_params
from dflash_jax.config import TargetConfig
from dflash_jax.gguf_io import GGUFTensor, read_gguf
from test_draft_and_decode import _random_draft


@pytest.fixture(scope="module")
def ref():
  return tiny_ref("qwen3next_tiny")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  return dj.load_target(tiny_gguf("qwen3next_tiny", tmp_path_factory), weights="f32")


def _with_params(target, f, cfg=None):
  cfg = cfg or target.config
  return dataclasses.replace(target, config=cfg, params=jax.device_put(
      target_params.load_params(f, cfg, weights="f32")))


def test_config(target):
  c = target.config
  assert (c.arch, c.gdn_grouped, c.moe, c.recurrent) == ("qwen3next", True, True, (True, False))
  assert (c.gdn_n_k_head, c.gdn_n_v_head, c.n_expert, c.d_ff_shexp) == (2, 4, 4, 32)
  assert "blk.0.ssm_ba.weight" in read_gguf(target.path).tensors


def test_logits_and_greedy_match_transformers_and_llama_cpp(target, ref):
  assert "llamacpp_logits_f32_kvf32" in ref
  check_logits_and_greedy(target, ref, _random_draft(target))


def test_tiled_head_order_would_be_wrong(target, ref):
  """The grouped order matters here (a test that can fail): the same file read with qwen35's
  tiled V-head order is far from transformers."""
  tiled = _with_params(target, read_gguf(target.path), dataclasses.replace(target.config,
                                                                     gdn_grouped=False))
  lg = np.asarray(dj.forward_logits(tiled, ref["tokens"][0]))
  assert np.abs(lg - ref["hf_logits"][0]).max() > 1e-2


def test_legacy_fused_ssm_in(target, ref):
  """A file of an older converter stores each Gated DeltaNet layer's q/k/v/z projections as one
  `ssm_in` tensor, per K head [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] rows (llama.cpp
  qwen3next.cpp's legacy path): rebuilt from this file's attn_qkv / attn_gate, it loads to the
  same projections and the same logits, bit for bit."""
  c = target.config
  hk, dk, dv, r = c.gdn_n_k_head, c.gdn_d_k, c.gdn_d_v, c.gdn_n_v_head // c.gdn_n_k_head
  f = read_gguf(target.path)
  for i in c.gdn_layers:
    p = f"blk.{i}."
    qkv = np.asarray(f.tensors.pop(p + "attn_qkv.weight").data).reshape(-1, c.d_model)
    z = np.asarray(f.tensors.pop(p + "attn_gate.weight").data).reshape(-1, c.d_model)
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
    per_head = [np.concatenate([q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk],
                                v[g * r * dv:(g + 1) * r * dv], z[g * r * dv:(g + 1) * r * dv]])
                for g in range(hk)]
    fused = np.ascontiguousarray(np.concatenate(per_head), np.float32)
    f.tensors[p + "ssm_in.weight"] = GGUFTensor(p + "ssm_in.weight", "f32", fused.shape, fused,
                                                fused.nbytes)
  legacy = _with_params(target, f)
  np.testing.assert_array_equal(np.asarray(dj.forward_logits(legacy, ref["tokens"][1])),
                                np.asarray(dj.forward_logits(target, ref["tokens"][1])))


def test_missing_tensor_named(target):
  f = read_gguf(target.path)
  cfg = TargetConfig.from_gguf(f.meta, n_vocab=320, path=f.path)
  del f.tensors["blk.0.ssm_ba.weight"]
  with pytest.raises(ValueError, match="ssm_ba"):
    target_params.load_params(f, cfg)
