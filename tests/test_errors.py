"""Bad input gets a clear error naming the file, tensor or value."""

import os
import shutil

import numpy as np
import pytest

import dflash_jax as dj
from conftest import DATA, DRAFT, QWEN, draft_copy


def _write_gguf(path, arch, tensors, extra_kv=()):
  from gguf import GGUFWriter
  w = GGUFWriter(str(path), arch)
  w.add_block_count(1)
  w.add_embedding_length(256)
  w.add_feed_forward_length(256)
  w.add_head_count(4)
  w.add_layer_norm_rms_eps(1e-5)
  for k, v in extra_kv:
    w.add_string(k, v)
  for name, arr, raw in tensors:
    w.add_tensor(name, arr, raw_dtype=raw)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_unknown_architecture(tmp_path):
  p = tmp_path / "m.gguf"
  _write_gguf(p, "gpt_neox", [("token_embd.weight", np.zeros((8, 256), np.float32), None)])
  with pytest.raises(ValueError, match=r"m\.gguf.*architecture.*'gpt_neox'"):
    dj.load_target(str(p))


def test_unknown_quant_type_names_tensor(tmp_path):
  from gguf import GGMLQuantizationType as QT
  p = tmp_path / "m.gguf"
  _write_gguf(p, "llama", [("token_embd.weight", np.zeros((8, 84), np.uint8), QT.Q2_K)])
  with pytest.raises(ValueError, match=r"token_embd\.weight.*Q2_K.*not supported"):
    dj.load_target(str(p), tokenizer=False)


def test_truncated_gguf(tmp_path):
  src = os.path.join(QWEN, "model-q4_k_m.gguf")
  p = tmp_path / "trunc.gguf"
  with open(src, "rb") as fh:
    p.write_bytes(fh.read()[: os.path.getsize(src) - 1000])
  with pytest.raises(ValueError, match=r"trunc\.gguf.*(truncated|corrupt)"):
    dj.load_target(str(p), tokenizer=False)
  p.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
  with pytest.raises(ValueError, match=r"trunc\.gguf"):
    dj.load_target(str(p), tokenizer=False)


def test_missing_file():
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    dj.load_target("/nonexistent/nope.gguf")


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 512, r"hidden_size=512.*embedding_length=256"),
    ("vocab_size", 2048, r"vocab_size=2048"),
    ("dflash_config", {"mask_token_id": 1023, "target_layer_ids": [1, 3, 9]}, r"target_layer_ids.*\[9\]"),
])
def test_mismatched_draft(tmp_path, qwen_f32, field, value, match):
  d = draft_copy(tmp_path, lambda cfg: {**cfg, field: value})
  with pytest.raises(ValueError, match=match):
    dj.load_draft(d, qwen_f32)


def test_dflash2_and_unknown_draft_variants_are_refused(tmp_path, qwen_f32):
  """A DFlash-2 config.json (z-lab's DFlash2DraftModel, the shared fixture's) over DFlash-1
  weights is refused naming a missing DFlash-2 tensor, and each DFlash-2 field on a DFlash-1
  config is refused naming the file and the field (not silently ignored)."""
  import json
  v2 = json.loads(open(os.path.join(DATA, "dflash2_tiny", "config.json")).read())
  d = draft_copy(tmp_path / "v2", lambda cfg: v2)
  with pytest.raises(ValueError, match=r"model\.safetensors: (missing )?tensor '[\w.]+'"):
    dj.load_draft(d, qwen_f32)
  cases = [({"architectures": ["EagleDraft"]}, r"architectures=\['EagleDraft'\]"),
           ({"is_causal": True}, r"is_causal=True"),
           ({"final_logit_softcapping": 4.0}, r"final_logit_softcapping=4\.0"),
           ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
           ({"dflash_config": {"mask_token_id": 1023, "target_layer_ids": [1, 3, 5],
                               "output_multiplier": 4.0}}, r"dflash_config\.output_multiplier=4\.0"),
           ({"dflash_config": {"mask_token_id": 1023, "target_layer_ids": [1, 3, 5],
                               "selector_rank": 32}}, r"selector_rank=32.*candidate selector")]
  for i, (edit, match) in enumerate(cases):
    d = draft_copy(tmp_path / str(i), lambda cfg: {**cfg, **edit})
    with pytest.raises(ValueError, match=match):
      dj.load_draft(d, qwen_f32)
  ok = draft_copy(tmp_path / "ok", lambda cfg: {**cfg, "is_causal": False, "output_multiplier": 1.0})
  dj.load_draft(ok, qwen_f32)                       # the "off" values load


def test_draft_with_unused_tensor(tmp_path, qwen_f32):
  """A tensor no DFlash-1 layer uses (a DFlash-2 conv kernel) is refused, naming it."""
  from safetensors.numpy import save_file
  from dflash_jax.draft_io import load_safetensors
  d = tmp_path / "draft"
  shutil.copytree(DRAFT, d)
  arrays = load_safetensors(str(d / "model.safetensors"))
  arrays["layers.0.mlp_conv.base_kernel"] = np.zeros((16, 2), np.float32)
  save_file({k: np.asarray(v, np.float32) for k, v in arrays.items()}, str(d / "model.safetensors"))
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'layers\.0\.mlp_conv\.base_kernel' "
                                       r"is used by no layer"):
    dj.load_draft(str(d), qwen_f32)


def test_draft_with_wrong_tensor_shape(tmp_path, qwen_f32):
  from safetensors.numpy import save_file
  from dflash_jax.draft_io import load_safetensors
  d = tmp_path / "draft"
  shutil.copytree(DRAFT, d)
  arrays = load_safetensors(str(d / "model.safetensors"))
  arrays["layers.1.mlp.up_proj.weight"] = np.zeros((100, 256), np.float32)
  save_file(arrays, str(d / "model.safetensors"))
  with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight.*\(100, 256\)"):
    dj.load_draft(str(d), qwen_f32)


def test_prompt_longer_than_context(qwen_f32, qwen_draft):
  with pytest.raises(ValueError, match=r"prompt has 48 tokens.*max_ctx=32"):
    dj.generate(qwen_f32, qwen_draft, list(range(48)), max_new_tokens=4, max_ctx=32)


def test_bad_mode_and_block_size(qwen_f32, qwen_draft):
  with pytest.raises(ValueError, match="mode='tree'"):
    dj.generate(qwen_f32, qwen_draft, [1, 2, 3], max_new_tokens=4, mode="tree")
  with pytest.raises(ValueError, match="block_size=8"):
    dj.generate(qwen_f32, qwen_draft, [1, 2, 3], max_new_tokens=4, block_size=8)


def test_unsupported_tokenizer_kind():
  from dflash_jax.tokenizer import GGUFTokenizer
  with pytest.raises(NotImplementedError, match=r"m\.gguf.*tokenizer\.ggml\.model='bert'.*not supported yet"):
    GGUFTokenizer({"tokenizer.ggml.model": "bert"}, path="m.gguf")
  with pytest.raises(NotImplementedError, match=r"tokenizer\.ggml\.pre='mystery'"):
    GGUFTokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"}, path="m.gguf")


@pytest.mark.parametrize("ids,match", [
    ([5, 1 << 20], r"token_ids\[1\] = 1048576"),
    ([3, -1], r"token_ids\[1\] = -1"),
    ([1.7, 2.0], "must be integers"),
    ([[1, 2], [3, 4]], r"one-dimensional.*\(2, 2\)"),
    ([True, False], "must be integers"),
    ([], "at least one token"),
])
def test_forward_logits_checks_ids(qwen_f32, ids, match):
  """forward_logits refuses what generate refuses (out-of-vocabulary, negative, float, 2-D ids)
  instead of returning non-finite or wrapped logits."""
  with pytest.raises(ValueError, match=match):
    dj.forward_logits(qwen_f32, ids)


def test_generate_argument_types(qwen_f32):
  with pytest.raises(TypeError, match="config must be a DecodeConfig.*mode='chain'"):
    dj.generate(qwen_f32, None, [1, 2], max_new_tokens=2, config="chain")
  with pytest.raises(TypeError, match="sampling must be a SamplingConfig.*keywords"):
    dj.generate(qwen_f32, None, [1, 2], max_new_tokens=2, mode="ar", sampling={"temperature": 1})
  with pytest.raises(TypeError, match="config must be a DecodeConfig"):
    dj.generate_batch(qwen_f32, None, [[1, 2]], max_new_tokens=2, config="ar")
  for eog, match in ((["2"], "'2' is not a token id"), ("2", "must be a sequence"),
                     ([1 << 40], "1099511627776 is not a token id"), ([True], "True is not")):
    with pytest.raises(ValueError, match=match):
      dj.generate(qwen_f32, None, [1, 2], max_new_tokens=2, mode="ar", eog_ids=eog)
  with pytest.raises(ValueError, match=r"one-dimensional.*\(1, 2\)"):
    dj.generate(qwen_f32, None, [[1, 2]], max_new_tokens=2, mode="ar")
  with pytest.raises(ValueError, match=r"prompt list is empty or not a list"):
    dj.generate_batch(qwen_f32, None, "12", max_new_tokens=2, mode="ar")


def test_pallas_kernels_without_gpu_name_the_option():
  from dflash_jax.runtime import Runtime
  with pytest.raises(ValueError, match=r"kernels='pallas' \(--kernels\) needs a GPU"):
    Runtime.for_backend("pallas")


def test_draft_with_integer_weights_or_repeated_layers(tmp_path, qwen_f32):
  from safetensors.numpy import save_file
  from dflash_jax.draft_io import load_safetensors
  d = tmp_path / "draft"
  shutil.copytree(DRAFT, d)
  arrays = load_safetensors(str(d / "model.safetensors"))
  arrays["layers.0.mlp.up_proj.weight"] = arrays["layers.0.mlp.up_proj.weight"].astype(np.int8)
  save_file(arrays, str(d / "model.safetensors"))
  with pytest.raises(ValueError, match=r"up_proj\.weight' has dtype int8.*quantized drafts"):
    dj.load_draft(str(d), qwen_f32)

  def repeat(cfg):
    ids = cfg["dflash_config"]["target_layer_ids"]
    cfg["dflash_config"]["target_layer_ids"] = [ids[0]] * len(ids)
    return cfg
  d2 = draft_copy(tmp_path / "b", repeat)
  with pytest.warns(UserWarning, match=r"target_layer_ids .* repeats layer"):
    dj.load_draft(d2, qwen_f32)


def test_text_that_is_not_unicode():
  from dflash_jax.tokenizer import check_text
  assert check_text("héllo") == "héllo"
  with pytest.raises(ValueError, match=r"lone surrogate '\\ud800' at character 1"):
    check_text("a\ud800b")
  with pytest.raises(ValueError, match="expected a string, got int"):
    check_text(5)
