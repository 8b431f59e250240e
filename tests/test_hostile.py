"""Regression tests for hostile and broken input (one per failure the issue lists): corrupt GGUF
counts and offsets, bad metadata values, broken tokenizers and chat templates, bad draft configs.
Each must be a ValueError / NotImplementedError naming the file and key or tensor, fast."""

import dataclasses
import json
import os
import time

import numpy as np
import pytest

import dflash_jax as dj
from conftest import DRAFT, QWEN, draft_copy
from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.gguf_io import GGUFFormatError, read_gguf
from dflash_jax.runtime import Runtime
from gguf_mutations import header_slots, write_slot

SRC = os.path.join(QWEN, "model-q8_0.gguf")


def _patched(tmp_path, edits, name="bad.gguf"):
  """A copy of the tiny Q8_0 file with header slots (by their gguf_mutations name) overwritten:
  edits = {slot name: value}."""
  slots = {s.what: s for s in header_slots(SRC)[0]}
  buf = bytearray(open(SRC, "rb").read())
  for what, value in edits.items():
    write_slot(buf, slots[what], value)
  p = tmp_path / name
  p.write_bytes(bytes(buf))
  return str(p)


# 1. counts past the end of the file: fail fast, bounded memory, naming the key.
@pytest.mark.parametrize("slot", ["tokenizer.ggml.token_type:count", "tokenizer.ggml.tokens:count",
                                  "tokenizer.ggml.tokens:str_len[0]", "GGUF.kv_count",
                                  "GGUF.tensor_count"])
def test_huge_counts_fail_fast(tmp_path, slot):
  t0 = time.perf_counter()
  with pytest.raises(GGUFFormatError, match=r"bad\.gguf: .*(bytes|corrupt)"):
    read_gguf(_patched(tmp_path, {slot: 1 << 40}))
  assert time.perf_counter() - t0 < 5.0


def test_nested_array_refused(tmp_path):
  with pytest.raises(GGUFFormatError, match=r"bad\.gguf: metadata key 'tokenizer\.ggml\.token_type': nested"):
    read_gguf(_patched(tmp_path, {"tokenizer.ggml.token_type:item_type": 9}))


# 2. tensor offsets / types that used to load as garbage.
@pytest.mark.parametrize("edit,match", [
    ({"blk.0.ffn_down.weight:offset": (1 << 64) - 1}, r"'blk\.0\.ffn_down\.weight': data offset"),
    ({"blk.0.ffn_down.weight:offset": 0}, r"'blk\.0\.ffn_down\.weight': data offset 0"),
    ({"blk.0.ffn_down.weight:offset": 1}, r"'blk\.0\.ffn_down\.weight': data offset 1"),
    ({"blk.0.ffn_down.weight:type": 2}, r"(ffn_down|offset|padding)"),        # Q8_0 -> Q4_0
    ({"blk.6.ssm_dt.bias:type": 1}, r"'blk\.6\.ssm_dt\.bias': the padding"),   # F32 -> F16 fits the slot
    ({"output_norm.weight:type": 13}, r"(data ends|output_norm)"),
    ({"token_embd.weight:ne0": 255}, r"token_embd"),
])
def test_bad_tensor_infos(tmp_path, edit, match):
  with pytest.raises(GGUFFormatError, match=r"bad\.gguf: .*" + match):
    read_gguf(_patched(tmp_path, edit))


def test_renamed_tensor_refused(tmp_path):
  raw = open(SRC, "rb").read()
  p = tmp_path / "renamed.gguf"
  p.write_bytes(raw.replace(b"output.weight", b"outpux.weight", 1))
  with pytest.raises(ValueError, match=r"renamed\.gguf: tensor\(s\) \['outpux\.weight'\] are not used"):
    dj.load_target(str(p), tokenizer=False)


def test_nonfinite_logits_after_prefill(tmp_path):
  from gguf import GGUFReader
  t = next(t for t in GGUFReader(SRC).tensors if t.name == "output_norm.weight")
  raw = bytearray(open(SRC, "rb").read())
  raw[t.data_offset:t.data_offset + 4] = np.float32(np.nan).tobytes()
  p = tmp_path / "nan.gguf"
  p.write_bytes(bytes(raw))
  tgt = dj.load_target(str(p), tokenizer=False)
  with pytest.raises(ValueError, match=r"nan\.gguf: .*logits after prefill are not finite"):
    dj.generate(tgt, None, [1, 2, 3], max_new_tokens=2, mode="ar", max_ctx=16, prefill_chunk=8)


# 4. / 6. metadata values that used to raise ZeroDivisionError, IndexError or JAX errors.
@pytest.mark.parametrize("edit,match", [
    ({"qwen35.attention.head_count:value": 0}, r"attention\.head_count=0: must be in \[1, "),
    ({"qwen35.ssm.group_count:value": 0}, r"ssm\.group_count=0"),
    ({"qwen35.ssm.time_step_rank:value": 0}, r"ssm\.time_step_rank=0"),
    ({"qwen35.rope.dimension_count:value": 15}, r"rope\.dimension_count=15: must be even"),
    ({"qwen35.block_count:value": 0}, r"block_count=0"),
    ({"qwen35.block_count:value": 13}, r"recurrent_layers.*one entry per layer"),
    ({"qwen35.attention.layer_norm_rms_epsilon:value": -1.0}, r"layer_norm_rms_epsilon=-1\.0"),
    ({"qwen35.rope.freq_base:value": 0.0}, r"rope\.freq_base=0\.0"),
    ({"qwen35.embedding_length:value": 257}, r"token_embd\.weight.*shape"),
])
def test_bad_metadata_values(tmp_path, edit, match):
  with pytest.raises(ValueError, match=r"bad\.gguf: .*" + match):
    dj.load_target(_patched(tmp_path, edit), tokenizer=False)


def test_metadata_of_wrong_type():
  meta = {"general.architecture": "llama", "llama.block_count": "12", "llama.embedding_length": 64}
  with pytest.raises(ValueError, match=r"m\.gguf: GGUF metadata key llama\.block_count='12': expected an integer"):
    TargetConfig.from_gguf(meta, n_vocab=8, path="m.gguf")


@pytest.mark.parametrize("edit,match", [
    ({"tokenizer.ggml.tokens": []}, r"'tokenizer\.ggml\.tokens' is missing"),
    ({"tokenizer.ggml.tokens": None}, r"'tokenizer\.ggml\.tokens' is missing"),
    ({"tokenizer.ggml.merges": ["abc"]}, r"merges\[0\]='abc'"),
    ({"tokenizer.ggml.merges": ["zzz qqq"]}, r"merges\[0\]='zzz qqq'"),
    ({"tokenizer.ggml.merges": [5]}, r"merges\[0\]=5"),
    ({"tokenizer.ggml.token_type": [1, 1]}, r"token_type' must be 1024 integers"),
    ({"tokenizer.ggml.eos_token_id": 5000}, r"eos_token_id'=5000 is not a token id"),
])
def test_broken_tokenizer_metadata(edit, match):
  from dflash_jax.tokenizer import GGUFTokenizer
  meta = dict(read_gguf(SRC).meta, **edit)
  with pytest.raises(ValueError, match=r"m\.gguf: .*" + match):
    GGUFTokenizer(meta, path="m.gguf")


def test_vocabulary_missing_characters_is_an_error():
  from dflash_jax.tokenizer import GGUFTokenizer
  meta = dict(read_gguf(SRC).meta, **{"tokenizer.ggml.tokens": ["a", "b"],
                                      "tokenizer.ggml.token_type": [1, 1],
                                      "tokenizer.ggml.merges": []})
  tok = GGUFTokenizer(meta, path="m.gguf")
  assert tok.encode("ab") == [0, 1]
  with pytest.raises(ValueError, match=r"m\.gguf: the vocabulary cannot encode"):
    tok.encode("abc")


@pytest.mark.parametrize("template,match", [
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ 'a' * 10**10 }}", "exceeds the limit"),
    ("{{ 10 ** 100000 }}", "exponent"),
    ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "exceeds the limit"),
    ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('a') }}", "exceeds the limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "range"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{% if %}", "TemplateSyntaxError"),
    ("{{ raise_exception('no system role') }}", "no system role"),
])
def test_hostile_chat_templates(template, match):
  from dflash_jax.tokenizer import GGUFTokenizer
  tok = GGUFTokenizer(dict(read_gguf(SRC).meta, **{"tokenizer.chat_template": template}),
                      path="m.gguf")
  t0 = time.perf_counter()
  with pytest.raises(ValueError, match=r"m\.gguf: tokenizer\.chat_template failed: .*" + match):
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert time.perf_counter() - t0 < 10.0


@pytest.mark.parametrize("edit,match", [
    (lambda c: [], r"expected a JSON object, got list"),
    (lambda c: None, r"expected a JSON object, got NoneType"),
    (lambda c: {**c, "hidden_size": None}, r"missing draft config field 'hidden_size'"),
    (lambda c: {**c, "num_attention_heads": 0}, r"num_attention_heads=0"),
    (lambda c: {**c, "rope_theta": 0}, r"rope_theta=0"),
    (lambda c: {**c, "rms_norm_eps": -1e-6}, r"rms_norm_eps=-1e-06"),
    (lambda c: {**c, "block_size": 2.5, "dflash_config": {**c["dflash_config"], "block_size": 2.5}},
     r"block_size=2\.5: expected an integer"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "block_size": 100000}},
     r"block_size=100000: must be in \[2, 64\]"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "target_layer_ids": "1,3,5"}},
     r"target_layer_ids='1,3,5': expected a list"),
    (lambda c: {**c, "num_hidden_layers": 0}, r"num_hidden_layers=0"),
    (lambda c: {**c, "layer_types": ["x", "y"]}, r"layer_types"),
])
def test_bad_draft_configs(tmp_path, qwen_f32, edit, match):
  with pytest.raises(ValueError, match=r"config\.json: .*" + match):
    dj.load_draft(draft_copy(tmp_path, edit), qwen_f32)


def test_draft_config_not_json(tmp_path, qwen_f32):
  d = draft_copy(tmp_path, lambda c: c)
  with open(os.path.join(d, "config.json"), "wb") as fh:
    fh.write(b"\xff\xfe{not json")
  with pytest.raises(ValueError, match=r"config\.json: not a readable JSON file"):
    dj.load_draft(d, qwen_f32)


def test_draft_config_parse_unit():
  with pytest.raises(ValueError, match=r"x: draft config field mask_token_id=-1"):
    DraftConfig.from_json({**json.load(open(os.path.join(DRAFT, "config.json"))),
                           "mask_token_id": -1, "dflash_config": {}}, path="x")


def test_max_ctx_checks_before_compiling(qwen_f32, monkeypatch):
  from dflash_jax import api
  dec = api.resolve_config(None, mode="ar", max_ctx=1 << 20)
  need = api.state_bytes(qwen_f32, None, dec)
  # 2 attention layers x (K + V) x 2 KV heads x 64 dims x 4 bytes per token, plus the rest.
  assert 2 * 2 * 2 * 64 * 4 * (1 << 20) < need < 2 * 2 * 2 * 64 * 4 * (1 << 20) * 1.2
  monkeypatch.setattr(api, "available_bytes", lambda: need - 1)
  with pytest.raises(ValueError, match=r"max_ctx=1048576: the decode cache with a float32 KV "
                                       r"cache needs 2\.\d\d GiB \(\d+ bytes\) but only"):
    api.check_config(qwen_f32, None, dec)
  # The format counts: q4_0 K and V store 18 bytes per 32 values (0.14 of float32's bytes).
  q4 = dataclasses.replace(qwen_f32, runtime=Runtime(kv_dtype="q4_0"))
  need_q4 = api.state_bytes(q4, None, dec)
  values = 2 * 2 * 2 * 64 * dec.capacity        # layers x (K, V) x heads x dims x cache rows
  assert need - need_q4 == values * 4 - values * 18 // 32
  monkeypatch.setattr(api, "available_bytes", lambda: need_q4 - 1)
  with pytest.raises(ValueError, match=r"a q4_0 KV cache needs 0\.\d\d GiB \(\d+ bytes\)"):
    api.check_config(q4, None, dec)
  monkeypatch.undo()
  with pytest.raises(ValueError, match=r"DecodeConfig\.max_ctx=100000000: must be in"):
    api.resolve_config(None, mode="ar", max_ctx=100_000_000)
  with pytest.raises(ValueError, match=r"tree_top_k=5000 exceeds the vocabulary \(1024\)"):
    api.check_config(qwen_f32, None, api.resolve_config(None, has_proposer=True, mode="ddtree",
                                                        block_size=16, tree_top_k=5000))
  assert qwen_f32.config.n_ctx_train == 4096
  with pytest.warns(UserWarning, match=r"max_ctx=8192 exceeds the model's context_length=4096"):
    api.check_config(qwen_f32, None, api.resolve_config(None, mode="ar", max_ctx=8192))


def test_string_arrays_equal_gguf_reader():
  """The bounded reader parses string arrays (the tokenizer's vocabulary and merges) in its own
  lean loop; every field equals what gguf's GGUFReader reads (SmolLM2 and the tiny file)."""
  from gguf import GGUFReader, GGUFValueType
  from dflash_jax import cli, gguf_io
  ours = gguf_io._bounded_reader_class()
  for path in (cli.default_target_path(), SRC):
    a, b = GGUFReader(path), ours(path)
    assert list(a.fields) == list(b.fields)
    n_str = 0
    for k, fa in a.fields.items():
      fb = b.fields[k]
      assert fa.types == fb.types and fa.offset == fb.offset and fa.contents() == fb.contents(), k
      if fa.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        n_str += 1
        assert fa.data == fb.data and len(fa.parts) == len(fb.parts), k
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(fa.parts, fb.parts))
    assert n_str >= 2
