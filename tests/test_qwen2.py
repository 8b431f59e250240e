"""Qwen2 / Qwen2.5 targets (`qwen2`: softmax attention with q/k/v biases, tied embeddings; also the
architecture of DeepSeek-R1-Distill-Qwen files) on a tiny random model converted by llama.cpp's
own converter (tests/data/make_converted_tiny.py): logits against transformers and llama.cpp,
greedy decoding, lossless speculative decoding.

Norms: logits by max abs difference (|logits| <= 2.4 here); measured ours vs transformers
1.3e-6 / 1.6e-6, llama.cpp f32 vs transformers 1.5e-6.
"""


import numpy as np
import pytest

import dflash_jax as dj
from conftest import check_logits_and_greedy, tiny_gguf, tiny_ref
from test_draft_and_decode import _random_draft



@pytest.fixture(scope="module")
def ref():
  return tiny_ref("qwen2_tiny")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
  return tiny_gguf("qwen2_tiny", tmp_path_factory)


@pytest.fixture(scope="module")
def target(path):
  return dj.load_target(path)     # the tokenizer too: pre-tokenizer `deepseek-r1-qwen`


def test_config_biases_and_tied_output(target):
  c = target.config
  assert (c.arch, c.rope_style, c.qk_norm, c.attn_gate) == ("qwen2", "neox", False, False)
  lay = target.params.layers[0]
  assert [b.shape for b in lay.qkv_bias] == [(128,), (64,), (64,)]
  assert "output.weight" not in dj.gguf_io.read_gguf(target.path).tensors   # tied: token_embd
  assert target.params.lm_head.shape == target.params.embed.shape
  # the file's 8 merges (Ġ t, h e, i n, ..., Ġt he) under the qwen2 pre-tokenizer regex
  assert target.tokenizer.encode(" the in") == [263, 32, 258]


def test_logits_and_greedy_match_transformers_and_llama_cpp(target, ref):
  assert (ref["llamacpp_greedy_f32_kvf32"] == ref["hf_greedy"]).all()
  check_logits_and_greedy(target, ref, _random_draft(target))


def test_missing_bias_is_zero_and_unknown_tensor_refused(path):
  """llama.cpp's create_tensor_qkv takes each of attn_{q,k,v}.bias as optional; a tensor the
  architecture does not read (here `output.bias`, which we do not support) is refused by name."""
  from dflash_jax.config import TargetConfig
  from dflash_jax.gguf_io import read_gguf
  from dflash_jax.target_params import load_params
  f = read_gguf(path)
  cfg = TargetConfig.from_gguf(f.meta, n_vocab=384, path=f.path)
  del f.tensors["blk.1.attn_k.bias"]
  p = load_params(f, cfg)
  assert not np.asarray(p.layers[1].qkv_bias[1]).any() and np.asarray(p.layers[1].qkv_bias[0]).any()
  f = read_gguf(path)
  f.tensors["output.bias"] = f.tensors["output_norm.weight"]
  with pytest.raises(ValueError, match=r"\['output\.bias'\] are not used by the qwen2"):
    load_params(f, cfg)
