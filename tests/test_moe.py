"""MoE targets on tiny random models converted by llama.cpp's own converter
(tests/data/make_converted_tiny.py): `qwen35moe` (Gated DeltaNet + gated attention with routed experts
and a gated shared expert, as Qwen3.5-35B-A3B) and `qwen3moe` (softmax attention, routed experts,
as Qwen3-30B-A3B). Logits against transformers and llama.cpp, the MoE FFN against a float64
numpy reference on gguf-py-dequantized expert tensors, lossless speculative decoding.

Norms: logits by max abs difference (|logits| <= 2.5 here); measured ours vs transformers
5.7e-6 / 9.4e-6 (qwen35moe f32), 1.2e-6 / 1.7e-6 (qwen3moe f32), 7.7e-6 / 6.7e-6 (qwen35moe q8_0 vs
transformers on the dequantized q8_0 matrices); llama.cpp f32 vs transformers 8.3e-6 (qwen35moe),
1.9e-6 (qwen3moe).
"""

import dataclasses
import os

import gguf
import jax
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import layers
from dflash_jax.config import TargetConfig
from dflash_jax.runtime import Runtime
from conftest import DATA, tiny_gguf, tiny_ref
from test_draft_and_decode import _random_draft, check_every_acceptance_length

ARCHS = ("qwen35moe", "qwen3moe")


def _dir(arch):
  return os.path.join(DATA, f"{arch}_tiny")


@pytest.fixture(scope="module")
def refs():
  return {a: tiny_ref(f"{a}_tiny") for a in ARCHS}


@pytest.fixture(scope="module")
def f32_paths(tmp_path_factory):
  return {a: tiny_gguf(f"{a}_tiny", tmp_path_factory) for a in ARCHS}


@pytest.fixture(scope="module")
def targets(f32_paths):
  """f32 files of both architectures, and qwen35moe's q8_0 file with its experts kept packed."""
  out = {a: dj.load_target(f32_paths[a]) for a in ARCHS}
  out["qwen35moe_q8_0"] = dj.load_target(os.path.join(_dir("qwen35moe"), "model-q8_0.gguf"),
                                         weights="quantized")
  return out


def test_config_from_gguf(targets):
  c = targets["qwen35moe"].config
  assert (c.arch, c.n_layer, c.recurrent) == ("qwen35moe", 4, (True, True, True, False))
  assert (c.n_expert, c.n_expert_used, c.d_ff_exp, c.d_ff_shexp) == (8, 2, 32, 64)
  assert c.moe and c.d_ff == 0      # no feed_forward_length in a qwen35moe file
  c = targets["qwen3moe"].config
  assert (c.arch, c.n_layer, c.recurrent, c.qk_norm, c.attn_gate) == (
      "qwen3moe", 3, (False,) * 3, True, False)
  assert (c.n_expert, c.n_expert_used, c.d_ff_exp, c.d_ff_shexp) == (8, 2, 32, 0)
  assert targets["qwen3moe"].params.layers[0].ffn.shared_down is None


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_and_llama_cpp(targets, refs, arch):
  ref = refs[arch]
  for r in range(2):
    lg = np.asarray(dj.forward_logits(targets[arch], ref["tokens"][r]))
    assert np.abs(lg - ref["hf_logits"][r]).max() < 3e-5
    assert np.abs(lg - ref["llamacpp_logits_f32_kvf32"][r]).max() < 3e-5
    if arch == "qwen35moe":
      # packed q8_0 rows dequantized inside the forward vs transformers on gguf-py's
      # dequantized matrices: the same weights, so the same routing and logits up to rounding
      lq = np.asarray(dj.forward_logits(targets["qwen35moe_q8_0"], ref["tokens"][r]))
      assert np.abs(lq - ref["hf_dequant_logits_q8_0"][r]).max() < 3e-5


@pytest.mark.parametrize("which", ["qwen35moe", "qwen35moe_q8_0", "qwen3moe"])
def test_greedy_matches_transformers_and_llama_cpp(targets, refs, which):
  ref = refs[which.removesuffix("_q8_0")]
  expect = ref["hf_dequant_greedy_q8_0"] if which.endswith("q8_0") else ref["hf_greedy"]
  if not which.endswith("q8_0"):
    assert (ref["llamacpp_greedy_f32_kvf32"] == expect).all()
  for r in range(2):
    res = dj.generate(targets[which], None, ref["tokens"][r, :12], max_new_tokens=24, mode="ar",
                      max_ctx=128, eog_ids=())
    assert res.tokens == expect[r].tolist()


def _moe_float64(y, f: gguf.GGUFReader, layer: int, n_used: int):
  """Float64 numpy reference of one MoE FFN (transformers' Qwen3_5MoeSparseMoeBlock, or
  Qwen3MoeSparseMoeBlock when the file has no shared expert) on the file's tensors dequantized by
  gguf-py. y: [T, D]."""
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
  if f"blk.{layer}.ffn_down_shexp.weight" in t:
    shared = w("ffn_down_shexp") @ (silu(w("ffn_gate_shexp") @ y.T) * (w("ffn_up_shexp") @ y.T))
    out += shared.T / (1 + np.exp(-(y @ w("ffn_gate_inp_shexp").reshape(-1))))[:, None]
  return out


@pytest.mark.parametrize("t", [1, 3, 4, 9])
@pytest.mark.parametrize("which", ["qwen35moe_q8_0", "qwen3moe"])
def test_moe_ffn_against_float64(targets, f32_paths, which, t):
  """Both expert paths (gathered: T * n_used < n_expert, here T = 1 and 3; every expert over all
  tokens: T = 4, 9), on packed q8_0 experts with a shared expert (qwen35moe) and f32 experts
  without one (qwen3moe), against float64 numpy on gguf-py's dequantized 3-D tensors.
  Norm: max relative L2 error per row < 1e-5 (float32 math)."""
  target = targets[which]
  c = target.config
  path = (os.path.join(_dir("qwen35moe"), "model-q8_0.gguf") if which.endswith("q8_0")
          else f32_paths[which])
  f = gguf.GGUFReader(path)
  y = np.random.default_rng(t).normal(size=(t, c.d_model)).astype(np.float32)
  for layer in (0, c.n_layer - 1):
    p = target.params.layers[layer].ffn
    out = np.asarray(jax.jit(lambda y, p: layers.moe_ffn(
        y, p, n_used=c.n_expert_used, weights_scale=0.0, rt=Runtime()))(y, p), np.float64)
    ref = _moe_float64(y, f, layer, c.n_expert_used)
    err = np.linalg.norm(out - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() < 1e-5, err


@pytest.mark.parametrize("kernels", ["pallas_interpret", "pallas"])
@pytest.mark.parametrize("t", [1, 9])
def test_moe_ffn_pallas_kernel_matches_reference(targets, t, kernels):
  """The expert matmuls through the Pallas dequantizing matmul (vmapped over gathered experts,
  T = 1, or over every expert, T = 9; the Pallas interpreter, and the kernel itself on a GPU)
  against the reference kernels, float32 operands. Norm: max abs < 1e-6 interpreted (outputs
  ~0.2; measured 3e-8 / 7e-8), 2e-3 on a GPU (TF32 operands)."""
  if kernels == "pallas" and jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  target = targets["qwen35moe_q8_0"]
  c, p = target.config, target.params.layers[0].ffn
  y = np.random.default_rng(t).normal(size=(t, c.d_model)).astype(np.float32)
  out = [np.asarray(jax.jit(lambda y, p: layers.moe_ffn(
      y, p, n_used=c.n_expert_used, weights_scale=0.0, rt=rt))(y, p))
         for rt in (Runtime(), Runtime(kernels=kernels))]
  assert np.abs(out[0] - out[1]).max() < (1e-6 if kernels == "pallas_interpret" else 2e-3)


def test_speculative_modes_lossless(targets, refs):
  """Chain and DDTree verifies (16 / 9+ rows: every expert over all rows) against
  autoregressive steps (one row: gathered experts) with a random draft, alone and batched
  (qwen35moe), and an oracle draft accepting 1..16 tokens per step (qwen35moe: the hybrid layers'
  rollback after each)."""
  for arch in ARCHS:
    target, ref = targets[arch], refs[arch]
    draft = _random_draft(target)
    for r in range(2):
      for mode in ("chain", "ddtree"):
        res = dj.generate(target, draft, ref["tokens"][r, :12], max_new_tokens=24, mode=mode,
                          max_ctx=128, eog_ids=())
        assert res.tokens == ref["hf_greedy"][r].tolist(), (arch, mode, r)
  target, ref = targets["qwen35moe"], refs["qwen35moe"]
  # two rows in one batched loop (vmapped rows: each row's expert path from its own rows)
  rows = dj.generate_batch(target, _random_draft(target), [ref["tokens"][r, :12] for r in range(2)],
                           max_new_tokens=24, mode="chain", max_ctx=128, eog_ids=(), batch_size=2)
  assert [x.tokens for x in rows] == ref["hf_greedy"].tolist()
  check_every_acceptance_length(target, ref["tokens"][1, :12], 150, 256)


def test_metadata_errors_name_the_key(f32_paths):
  from dflash_jax.gguf_io import read_gguf
  meta = dict(read_gguf(f32_paths["qwen35moe"]).meta)
  bad = dict(meta, **{"qwen35moe.expert_used_count": 9})
  with pytest.raises(ValueError, match=r"qwen35moe\.expert_used_count=9"):
    TargetConfig.from_gguf(bad, n_vocab=384, path="x.gguf")
  bad = {k: v for k, v in meta.items() if k != "qwen35moe.expert_feed_forward_length"}
  with pytest.raises(ValueError, match=r"x\.gguf: missing .*qwen35moe\.expert_feed_forward_length"):
    TargetConfig.from_gguf(bad, n_vocab=384, path="x.gguf")
  ok = TargetConfig.from_gguf(dict(meta, **{"qwen35moe.feed_forward_length": 96}), n_vocab=384)
  assert dataclasses.astuple(ok)[:5] == ("qwen35moe", 4, 128, 96, 384)
  assert ok.d_ff_exp == 32        # the explicit key wins over llama.cpp's d_ff / n_used default


def test_tensor_errors_name_the_tensor(f32_paths):
  from dflash_jax.gguf_io import read_gguf
  from dflash_jax.target_params import load_params
  f = read_gguf(f32_paths["qwen35moe"])
  cfg = TargetConfig.from_gguf(f.meta, n_vocab=384, path=f.path)
  with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_exps\.weight' has shape \(8, 32, 128\), "
                                       r"expected \(8, 16, 128\)"):
    load_params(f, dataclasses.replace(cfg, d_ff_exp=16))
  f = read_gguf(f32_paths["qwen35moe"])
  f.tensors["blk.0.ffn_gate_up_exps.weight"] = f.tensors["blk.0.ffn_gate_exps.weight"]
  with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate_up_exps\.weight' has shape "
                                       r"\(8, 32, 128\), expected \(8, 64, 128\)"):
    load_params(f, cfg)


def test_merged_and_separate_gate_up_experts(targets, f32_paths, refs):
  """Three layouts of the experts' gate / up rows give the same logits: separate tensors merged
  at load (the default), kept separate (fuse_projections=False), and a file holding llama.cpp's
  merged `ffn_gate_up_exps` (what `convert_hf_to_gguf.py --fuse-gate-up-exps` writes for
  qwen35moe: torch.cat([gate, up], dim=1) per expert; built here from the separate tensors. The
  converter's own fused q8_0 file of this model, made once with make_moe_tiny.py's functions, gave
  6.4e-6 max abs against `hf_dequant_logits_q8_0`)."""
  from dflash_jax.gguf_io import GGUFTensor, read_gguf
  from dflash_jax.target_params import load_params
  path, tokens = f32_paths["qwen35moe"], refs["qwen35moe"]["tokens"][0]
  merged = targets["qwen35moe"]
  assert merged.params.layers[0].ffn.up_exps is None
  separate = dj.load_target(path, fuse_projections=False)
  assert separate.params.layers[0].ffn.up_exps is not None
  f = read_gguf(path)
  for i in range(merged.config.n_layer):
    g, u = (f.tensors.pop(f"blk.{i}.ffn_{w}_exps.weight") for w in ("gate", "up"))
    data = np.concatenate([g.data, u.data], axis=1)
    name = f"blk.{i}.ffn_gate_up_exps.weight"
    f.tensors[name] = GGUFTensor(name, g.fmt, data.shape, data, g.n_bytes + u.n_bytes)
  from_file = dataclasses.replace(merged, params=jax.device_put(load_params(f, merged.config)))
  ref = np.asarray(dj.forward_logits(merged, tokens))
  assert np.abs(ref - refs["qwen35moe"]["hf_logits"][0]).max() < 3e-5
  for t in (separate, from_file):
    assert np.abs(np.asarray(dj.forward_logits(t, tokens)) - ref).max() < 1e-5


@pytest.mark.parametrize("t", [1, 23, 64])
def test_moe_ffn_lowers_for_h100_at_35b_a3b_shapes(t):
  """Qwen3.5-35B-A3B's FFN (256 Q4_K experts of 512 x 2048, top 8, a shared expert) through the
  Pallas dequantizing matmul, vmapped over gathered experts (T = 1, 23) or over every expert
  (T = 64): the real Pallas -> Triton lowering for an H100, on a CPU-only jaxlib."""
  from dflash_jax.quants import QuantWeight
  from dflash_jax.target_params import MoEParams
  from test_kernels import _lower_for_h100
  d, e, f = 2048, 256, 512
  spec = lambda n, k: QuantWeight(jax.ShapeDtypeStruct((n, k // 256 * 144), np.uint8),   # noqa: E731
                                  "q4_k", (n, k))
  p = MoEParams(norm=jax.ShapeDtypeStruct((d,), np.float32),
                router=QuantWeight(jax.ShapeDtypeStruct((e, d), np.float32), "f32", (e, d)),
                gate_up_exps=spec(e * 2 * f, d), up_exps=None, down_exps=spec(e * d, f),
                shared_gate_up=layers.Projections.separate([spec(f, d), spec(f, d)]),
                shared_down=spec(d, f), shared_gate=jax.ShapeDtypeStruct((d,), np.float32))
  rt = Runtime(kernels="pallas", compute_dtype="bfloat16")
  txt = _lower_for_h100(lambda y, p: layers.moe_ffn(y, p, n_used=8, weights_scale=0.0, rt=rt),
                        jax.ShapeDtypeStruct((t, d), np.float32), p)
  # one lowered program per distinct call: experts gate|up (merged), experts down, shared gate /
  # up (the same shapes), shared down
  assert txt.count("__gpu$xla.gpu.triton") == 4
