"""Make tests/data/{qwen35moe,qwen3next,qwen3moe,qwen2}_tiny: tiny random models converted to GGUF
by llama.cpp's own converter, with transformers and llama.cpp references.

- qwen35moe: Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention, routed experts + a gated shared
  expert, as Qwen3.5-35B-A3B), transformers `Qwen3_5MoeForCausalLM`;
- qwen3next: Qwen3-Next (the same hybrid with routed experts, plain RoPE, grouped V heads and a fused
  beta/alpha projection, as Qwen3-Next-80B-A3B), transformers `Qwen3NextForCausalLM`;
- qwen3moe: Qwen3-MoE (softmax attention with q/k norms, routed experts, as Qwen3-30B-A3B and
  Qwen3-Coder-30B-A3B), transformers `Qwen3MoeForCausalLM` with norm_topk_prob (llama.cpp's
  qwen3moe always renormalises the top-k weights, as the released models' configs ask);
- qwen2: Qwen2 / Qwen2.5 (softmax attention with q/k/v biases, tied embeddings as the small
  Qwen2.5 models; DeepSeek-R1-Distill-Qwen files use this architecture with the
  `deepseek-r1-qwen` pre-tokenizer, which this file names), transformers `Qwen2ForCausalLM`.

Not run by the tests (they read its output). Needs Python 3.11 with torch, transformers >= 5.2,
numpy and llama-cpp-python (0.3.36, built from its sdist), and a llama.cpp source tree (that
sdist's `vendor/llama.cpp`, whose `conversion/qwen.py` registers these classes):

    python tests/data/make_converted_tiny.py --llama_cpp /path/to/llama.cpp [--arch qwen35moe]

Writes, per architecture, model-f32.gguf.xz, model-q8_0.gguf (qwen35moe only: the packed-expert
path is the same code for both, and the test data stay small; tracked as model-q8_0.recipe.npz,
tests/gguf_recipe.py) (`convert_hf_to_gguf.py --outtype
{f32,q8_0}`, plus `--no-mtp` for qwen35moe) and reference.npz:
  tokens [2, 40] int32 random ids; hf_logits [2, 40, V] float32 (transformers, fp32, full forward
  of each row); hf_greedy [2, 24] int32 (greedy continuation of tokens[:, :12], full no-cache
  forwards); hf_dequant_{logits,greedy}_q8_0: the same with the q8_0 file's matrices dequantized
  by gguf-py (the quantized model with float32 activations); llamacpp_{logits,greedy}_f32_kvf32:
  llama.cpp (f32 KV cache, n_ctx 128, one batch per row) on the f32 file (on a q8_0 file llama.cpp
  quantizes activations too: KL 7e-4 / 1.6e-3 nats to both transformers and us on qwen35moe).
Only the converter's vocab step is replaced (the models have no tokenizer): the minimal
byte-level BPE vocabulary of ../shared/fixtures/qwen35_tiny (ids 0-255 GPT-2 byte characters,
8 merges, USER_DEFINED fillers).
"""

import argparse
import json
import lzma
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

SEED = 20261129
N_VOCAB = 384
_COMMON = dict(vocab_size=N_VOCAB, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
               head_dim=64, rms_norm_eps=1e-6, tie_word_embeddings=False, moe_intermediate_size=32,
               num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096)
ARCHS = {
    "qwen35moe": dict(
        hf_class="Qwen3_5MoeForCausalLM", hf_config="Qwen3_5MoeTextConfig",
        converter_class="Qwen3_5MoeTextModel", pre="qwen35", zero_centred_norms=True,
        converter_args=["--no-mtp"], outtypes=("f32", "q8_0"),
        config=dict(_COMMON, num_hidden_layers=4, linear_conv_kernel_dim=4,
                    linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=1,
                    linear_num_value_heads=2, shared_expert_intermediate_size=64,
                    layer_types=["linear_attention"] * 3 + ["full_attention"],
                    rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                         partial_rotary_factor=0.25, mrope_section=[3, 3, 2],
                                         mrope_interleaved=True))),
    # Qwen3-Next (as Qwen3-Next-80B-A3B): hybrid like qwen35moe but plain RoPE, the checkpoint's
    # grouped V-head order, a fused beta/alpha projection (ssm_ba); 2 K heads x 2 V heads each,
    # so the grouped and tiled orders differ
    "qwen3next": dict(
        hf_class="Qwen3NextForCausalLM", hf_config="Qwen3NextConfig",
        converter_class="Qwen3NextModel", pre="qwen2", zero_centred_norms=True,
        converter_args=["--no-mtp"], outtypes=("f32",),
        config=dict(vocab_size=320, hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    max_position_embeddings=4096, num_hidden_layers=2, intermediate_size=64,
                    moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, norm_topk_prob=True, linear_conv_kernel_dim=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
                    rope_parameters=dict(rope_type="default", rope_theta=1e7,
                                         partial_rotary_factor=0.25))),
    "qwen3moe": dict(
        hf_class="Qwen3MoeForCausalLM", hf_config="Qwen3MoeConfig",
        converter_class="Qwen3MoeModel", pre="qwen2", zero_centred_norms=False, converter_args=[],
        outtypes=("f32",),
        config=dict(_COMMON, num_hidden_layers=3, norm_topk_prob=True,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    "qwen2": dict(
        hf_class="Qwen2ForCausalLM", hf_config="Qwen2Config", converter_class="Qwen2Model",
        pre="deepseek-r1-qwen", zero_centred_norms=False, converter_args=[], outtypes=("f32",),
        config=dict(vocab_size=N_VOCAB, hidden_size=128, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=256, num_hidden_layers=2,
                    rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=4096,
                    rope_parameters=dict(rope_type="default", rope_theta=1e6))),
}

# Replaces the converter's set_vocab (run inside its process; see main()).
VOCAB_PATCH = r'''
import sys
sys.path.insert(0, {llama_cpp!r})
import convert_hf_to_gguf as conv
from conversion import qwen
import gguf

def _bytes_to_unicode():
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
       list(range(ord("\xae"), ord("\xff") + 1))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b); cs.append(256 + n); n += 1
  return dict(zip(bs, map(chr, cs)))

def set_vocab(self):
  b2u = _bytes_to_unicode()
  toks = [b2u[b] for b in range(256)]
  merges = ["\u0120 t", "h e", "i n", "e r", "\u0120 a", "o n", "r e", "\u0120t he"]
  toks += ["\u0120t", "he", "in", "er", "\u0120a", "on", "re", "\u0120the"]
  types = [gguf.TokenType.NORMAL] * len(toks)
  n = self.hparams["vocab_size"]
  toks += [f"<t{{i}}>" for i in range(len(toks), n)]
  types += [gguf.TokenType.USER_DEFINED] * (n - len(types))
  self.gguf_writer.add_tokenizer_model("gpt2")
  self.gguf_writer.add_tokenizer_pre({pre!r})
  self.gguf_writer.add_token_list(toks)
  self.gguf_writer.add_token_types(types)
  self.gguf_writer.add_token_merges(merges)

getattr(qwen, {converter_class!r}).set_vocab = set_vocab
conv.main()
'''


def make_model(arch: dict):
  import transformers
  torch.manual_seed(SEED)
  config = getattr(transformers, arch["hf_config"])(**arch["config"])
  model = getattr(transformers, arch["hf_class"])(config).float().eval()
  g = torch.Generator().manual_seed(SEED + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("linear_attn.norm.weight") or (name.endswith("norm.weight")
                                                      and not arch["zero_centred_norms"]):
        p.copy_(1 + 0.15 * torch.randn(p.shape, generator=g))
      elif name.endswith("norm.weight"):                 # Qwen3.5's zero-centred (1 + w) norms
        p.copy_(0.15 * torch.randn(p.shape, generator=g))
      elif name.endswith("A_log"):
        p.copy_(torch.empty(p.shape).uniform_(-4, 1, generator=g))
      elif name.endswith("dt_bias"):
        p.copy_(torch.empty(p.shape).uniform_(-1, 1, generator=g))
      elif "mlp.gate.weight" in name:                    # router: spread the expert choice
        p.copy_(0.3 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(0.05 * torch.randn(p.shape, generator=g))
    for p in model.parameters():                         # the files hold the model exactly
      p.copy_(p.to(torch.bfloat16).float())
  return model


def references(model):
  rng = np.random.default_rng(SEED + 2)
  tokens = rng.integers(0, model.config.vocab_size, size=(2, 40)).astype(np.int32)
  logits = []
  with torch.no_grad():
    for row in tokens:
      logits.append(model(torch.tensor(row[None], dtype=torch.long)).logits[0].numpy())
    greedy = []
    for row in tokens:
      seq = list(row[:12])
      for _ in range(24):
        out = model(torch.tensor([seq], dtype=torch.long)).logits[0, -1]
        seq.append(int(out.argmax()))
      greedy.append(seq[12:])
  return dict(tokens=tokens, hf_logits=np.stack(logits).astype(np.float32),
              hf_greedy=np.asarray(greedy, np.int32))


def _hf_name(gguf_name: str) -> str:
  """HF parameter name of a GGUF matrix of this model (the converter's mapping; with one Gated
  DeltaNet K head its V-head reorder is the identity, so the matrices map one to one)."""
  top = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
  if gguf_name in top:
    return top[gguf_name]
  _, i, rest = gguf_name.split(".", 2)
  sub = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
         "attn_gate.weight": "linear_attn.in_proj_z.weight",
         "ssm_beta.weight": "linear_attn.in_proj_b.weight",
         "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
         "ssm_out.weight": "linear_attn.out_proj.weight",
         "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
         "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
         "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
         "ffn_down_exps.weight": "mlp.experts.down_proj"}[rest]
  return f"model.layers.{i}.{sub}"


def with_gguf_matrices(model, gguf_path: str, llama_cpp: str):
  """A copy of model whose quantized matrices are the GGUF's, dequantized by gguf-py (the
  quantized model with float32 activations, as `hf_dequant_logits` of qwen35_tiny)."""
  import copy
  sys.path.insert(0, os.path.join(llama_cpp, "gguf-py"))
  import gguf
  model = copy.deepcopy(model)
  params = dict(model.named_parameters())
  reader = gguf.GGUFReader(gguf_path)
  tensors = {t.name: t for t in reader.tensors}
  with torch.no_grad():
    for name, t in tensors.items():
      if t.tensor_type == gguf.GGMLQuantizationType.F32 or name.endswith(("_gate_exps.weight",
                                                                          "_up_exps.weight")):
        continue
      w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
      params[_hf_name(name)].copy_(w.reshape(params[_hf_name(name)].shape))
    for i in range(len(model.model.layers)):
      gate, up = (gguf.quants.dequantize(tensors[f"blk.{i}.ffn_{w}_exps.weight"].data,
                                         tensors[f"blk.{i}.ffn_{w}_exps.weight"].tensor_type)
                  for w in ("gate", "up"))
      params[f"model.layers.{i}.mlp.experts.gate_up_proj"].copy_(
          torch.from_numpy(np.concatenate([gate, up], axis=1).astype(np.float32)))
  return model


def llama_cpp_references(gguf_path: str, tokens: np.ndarray) -> dict:
  """llama.cpp (llama-cpp-python) logits of every row (f32 KV cache, one batch per row) and its
  greedy continuation of tokens[:, :12] (24 tokens)."""
  import llama_cpp
  llm = llama_cpp.Llama(gguf_path, logits_all=True, n_ctx=128, n_threads=2, verbose=False,
                        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
  logits, greedy = [], []
  for row in tokens:
    llm.reset()
    llm.eval(row.tolist())
    logits.append(np.array(llm.scores[:len(row)], np.float32))
    llm.reset()
    llm.eval(row[:12].tolist())
    out = []
    for _ in range(24):
      out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
      llm.eval([out[-1]])
    greedy.append(out)
  return dict(logits=np.stack(logits), greedy=np.asarray(greedy, np.int32))


def make(name: str, llama_cpp: str, out: str):
  arch = ARCHS[name]
  os.makedirs(out, exist_ok=True)
  model = make_model(arch)
  with tempfile.TemporaryDirectory() as tmp:
    hf = os.path.join(tmp, "hf")
    model.save_pretrained(hf)
    patch = os.path.join(tmp, "convert.py")
    with open(patch, "w") as fh:
      fh.write(VOCAB_PATCH.format(llama_cpp=os.path.abspath(llama_cpp), pre=arch["pre"],
                                  converter_class=arch["converter_class"]))
    for outtype in arch["outtypes"]:
      gguf_path = os.path.join(tmp if outtype == "f32" else out, f"model-{outtype}.gguf")
      subprocess.run([sys.executable, patch, hf, "--outtype", outtype, *arch["converter_args"],
                      "--outfile", gguf_path], check=True, cwd=llama_cpp)
    with open(os.path.join(tmp, "model-f32.gguf"), "rb") as src, \
         lzma.open(os.path.join(out, "model-f32.gguf.xz"), "wb", preset=9) as dst:
      dst.write(src.read())
    if "q8_0" in arch["outtypes"]:   # kept as a recipe over the f32 file (tests/gguf_recipe.py)
      sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
      import gguf_recipe
      gguf_recipe.write_recipe(os.path.join(out, "model-q8_0.gguf"),
                               os.path.join(tmp, "model-f32.gguf"),
                               os.path.join(out, "model-q8_0.recipe.npz"))
    ref = references(model)
    if "q8_0" in arch["outtypes"]:
      # The mapping is checked on the f32 file: its matrices must give back the model exactly.
      same = with_gguf_matrices(model, os.path.join(tmp, "model-f32.gguf"), llama_cpp)
      for a, b in zip(model.parameters(), same.parameters()):
        assert torch.equal(a, b)
      deq = references(with_gguf_matrices(model, os.path.join(out, "model-q8_0.gguf"),
                                          llama_cpp))
      ref.update(hf_dequant_logits_q8_0=deq["hf_logits"], hf_dequant_greedy_q8_0=deq["hf_greedy"])
    lc = llama_cpp_references(os.path.join(tmp, "model-f32.gguf"), ref["tokens"])
    ref["llamacpp_logits_f32_kvf32"], ref["llamacpp_greedy_f32_kvf32"] = lc["logits"], lc["greedy"]
  np.savez_compressed(os.path.join(out, "reference.npz"), **ref)
  with open(os.path.join(out, "config.json"), "w") as fh:
    json.dump(dict(arch["config"], architectures=[arch["hf_class"]], seed=SEED), fh, indent=1)


def run_main(archs, make_fn, out_name):
  """The makers' command line: --llama_cpp (required), --arch (repeatable; default all of
  `archs`); calls make_fn(name, llama_cpp, tests/data/<out_name(name)>) for each."""
  here = os.path.dirname(os.path.abspath(__file__))
  ap = argparse.ArgumentParser()
  ap.add_argument("--llama_cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
  ap.add_argument("--arch", choices=sorted(archs), action="append",
                  help="architectures to make (default: all)")
  args = ap.parse_args()
  for name in args.arch or sorted(archs):
    make_fn(name, args.llama_cpp, os.path.join(here, out_name(name)))


def main():
  run_main(ARCHS, make, lambda name: f"{name}_tiny")


if __name__ == "__main__":
  main()
