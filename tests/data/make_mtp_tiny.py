"""Make tests/data/qwen35mtp_tiny and qwen35moemtp_tiny: a tiny random Qwen3.5 (dense, hybrid)
and Qwen3.5-MoE (routed experts + shared expert, also in the MTP block) with a multi-token-
prediction block, converted to GGUF by llama.cpp's own converter (which stores the `mtp.*`
tensors as block n_layer, `blk.N.nextn.*`, and writes `qwen35.nextn_predict_layers` = 1), and
transformers references for the trunk and the MTP block.

transformers' Qwen3_5ForCausalLM ignores `mtp.*`, so the block's random weights are added to
the saved checkpoint here, and its reference forward is assembled from transformers modules as
vLLM's `Qwen3_5MultiTokenPredictor` assembles it (vllm/model_executor/models/qwen3_5_mtp.py):
z = fc([pre_fc_norm_embedding(embed(x_q)) ; pre_fc_norm_hidden(h_{q-1})]), one full-attention
`Qwen3_5DecoderLayer` (causal over the block's own rows), then `mtp.norm`, then the shared
lm_head; h = the trunk's last hidden state after its final norm; row q at RoPE position q (the
pair (x_q, h_{q-1}), h_{-1} = 0: llama.cpp's MTP positions; positions only enter through RoPE,
so vLLM's one-earlier convention gives the same logits).

Not run by the tests (they read its output). Needs Python 3.11 with torch, transformers >= 5.2
and llama.cpp's converter (`conversion/qwen.py` with `_QwenMtpMixin`, e.g. the
`vendor/llama.cpp` of the llama-cpp-python 0.3.36 sdist):

    python tests/data/make_mtp_tiny.py --llama_cpp /path/to/llama.cpp [--arch qwen35moe]

The trunk's mixer and FFN output projections are scaled by MIXER_SCALE (a calmer random trunk
whose next token depends mostly on the current one) and the block is distilled on the trunk's
greedy text (`train_mtp`), so its drafts are accepted (1.6-3.1 tokens a step) and multi-token
commits get tested.

Writes tests/data/<name>/{model-f32.gguf.xz, reference.npz, config.json}; reference.npz:
  tokens [2, 40] int32 random ids; hf_greedy [2, 24] int32 (greedy continuation of tokens[:, :12]); mtp_logits [2, 40, V] float32
  (teacher forcing: row q = the block's logits for position q + 1 from (tokens[q], h_{q-1}));
  chain_start [2] int32, chain_tokens [2, 4] int32 and chain_logits [2, 4, V] float32: the block
  drafting 4 tokens after position chain_start (step 0 from (tokens[s], h_{s-1}), step j from
  (argmax of step j-1, the block's normed output of step j-1)), over the rows before s.
"""

import copy
import json
import lzma
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_converted_tiny as mct  # noqa: E402

SEED = 20261130
N_VOCAB = 320
CONFIG = dict(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_conv_kernel_dim=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=1,
              linear_num_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
              max_position_embeddings=4096, mtp_num_hidden_layers=1,
              layer_types=["linear_attention"] * 3 + ["full_attention"],
              rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                   mrope_section=[2, 1, 1], mrope_interleaved=True))
ARCHS = {
    "qwen35": dict(hf_class="Qwen3_5ForCausalLM", hf_config="Qwen3_5TextConfig",
                   converter_class="Qwen3_5TextModel", pre="qwen35", zero_centred_norms=True,
                   config=CONFIG, out="qwen35mtp_tiny"),
    # Qwen3.5-MoE (as Qwen3.5-35B-A3B): the MTP block's FFN is routed experts + the shared expert
    "qwen35moe": dict(hf_class="Qwen3_5MoeForCausalLM", hf_config="Qwen3_5MoeTextConfig",
                      converter_class="Qwen3_5MoeTextModel", pre="qwen35", zero_centred_norms=True,
                      config=dict({k: v for k, v in CONFIG.items() if k != "intermediate_size"},
                                  num_hidden_layers=2, layer_types=["linear_attention",
                                                                    "full_attention"],
                                  moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                  num_experts=4, num_experts_per_tok=2),
                      out="qwen35moemtp_tiny"),
}
N_CHAIN = 4
MIXER_SCALE = 0.25


def mtp_weights(model) -> dict:
  """Random MTP block weights under the checkpoint's `mtp.*` names (bf16-exact float32): fc,
  the three norms, and a full-attention decoder block of the trunk's own class (dense or MoE)."""
  cfg = model.config
  d = cfg.hidden_size
  g = torch.Generator().manual_seed(SEED + 5)
  layer = type(model.model.layers[0])(cfg, cfg.layer_types.index("full_attention"))
  out = {"mtp.fc.weight": 0.1 * torch.randn((d, 2 * d), generator=g)}
  for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    out[f"mtp.{name}.weight"] = 0.15 * torch.randn((d,), generator=g)
  for name, p in layer.state_dict().items():
    scale = 0.15 if name.endswith("norm.weight") else (0.3 if name == "mlp.gate.weight" else 0.08)
    out["mtp.layers.0." + name] = scale * torch.randn(p.shape, generator=g)
  return {k: v.to(torch.bfloat16).float() for k, v in out.items()}


def _rms(x, w, eps):            # Qwen3.5's zero-centred RMSNorm (1 + w)
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class MTPBlock(torch.nn.Module):
  """The MTP block over [B, T] rows (causal among them), from transformers modules; the trunk's
  embedding and lm_head are shared (frozen)."""

  def __init__(self, model, w: dict):
    super().__init__()
    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "eager"
    self.model, self.eps = model, cfg.rms_norm_eps
    self.layer = type(model.model.layers[0])(cfg, cfg.layer_types.index("full_attention"))
    self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in w.items()
                                if k.startswith("mtp.layers.0.")})
    self.top = torch.nn.ParameterDict({k[len("mtp."):-len(".weight")]:   # fc, norm, pre_fc_*
                                       torch.nn.Parameter(v.clone()) for k, v in w.items()
                                       if not k.startswith("mtp.layers.")})

  def weights(self) -> dict:
    out = {f"mtp.{k}.weight": v.detach().clone() for k, v in self.top.items()}
    out.update({"mtp.layers.0." + k: v.detach().clone() for k, v in self.layer.state_dict().items()})
    return out

  def forward(self, tokens, h_prev, pos):
    t = self.top
    e = self.model.model.embed_tokens(tokens)
    x = torch.cat([_rms(e, t["pre_fc_norm_embedding"], self.eps),
                   _rms(h_prev, t["pre_fc_norm_hidden"], self.eps)], -1)
    z = x @ t["fc"].T
    p = pos.view(1, 1, -1).expand(3, z.shape[0], -1)
    pe = self.model.model.rotary_emb(z, p)
    n = z.shape[1]
    mask = torch.triu(torch.full((n, n), float("-inf")), 1)[None, None]
    y = self.layer(z, position_embeddings=pe, attention_mask=mask, position_ids=pos[None])
    out = _rms(y, t["norm"], self.eps)
    return self.model.lm_head(out), out


def _hidden(model, seqs: torch.Tensor) -> torch.Tensor:
  """The trunk's last hidden state after its final norm, [B, T, D]."""
  with torch.no_grad():
    return model.model(seqs).last_hidden_state


def _greedy_text(model, n: int, seed: int) -> torch.Tensor:
  """n random 8-token prompts with 56 greedy tokens of the trunk each, [n, 64]."""
  g = torch.Generator().manual_seed(seed)
  seqs = torch.randint(0, N_VOCAB, (n, 8), generator=g)
  with torch.no_grad():
    for _ in range(56):
      nxt = model(seqs).logits[:, -1].argmax(-1)
      seqs = torch.cat([seqs, nxt[:, None]], 1)
  return seqs


def train_mtp(model, w: dict, steps: int = 600, n_seqs: int = 768, batch: int = 128) -> dict:
  """Self-distil the block on the trunk's own greedy text (random 8-token prompts, 56 greedy
  tokens): cross-entropy of row q against the trunk's token q + 1, so the block drafts what the
  trunk then accepts (random weights would accept nothing and leave multi-token commits
  untested). Prints the top-1 agreement on held-out text. Returns bf16-exact weights."""
  seqs = _greedy_text(model, n_seqs, SEED + 6)
  held = _greedy_text(model, 64, SEED + 7)
  pad = lambda h: torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
  h_prev, h_held = pad(_hidden(model, seqs)), pad(_hidden(model, held))
  block = MTPBlock(model, w)
  for p in model.parameters():
    p.requires_grad_(False)
  opt = torch.optim.Adam([p for p in block.parameters() if p.requires_grad], lr=3e-3)
  pos = torch.arange(seqs.shape[1] - 1)
  g = torch.Generator().manual_seed(SEED + 8)
  for i in range(steps):
    idx = torch.randint(0, n_seqs, (batch,), generator=g)
    logits, _ = block(seqs[idx, :-1], h_prev[idx, :-1], pos)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             seqs[idx, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i % 100 == 0 or i == steps - 1:
      with torch.no_grad():
        lh, _ = block(held[:, :-1], h_held[:, :-1], pos)
      acc = (lh.argmax(-1)[:, 8:] == held[:, 9:]).float().mean()
      print(f"mtp distillation step {i}: loss {loss.item():.3f} held-out top-1 {acc.item():.3f}")
  return {k: v.to(torch.bfloat16).float() for k, v in block.weights().items()}


def mtp_references(model, w: dict, tokens: np.ndarray) -> dict:
  block = MTPBlock(model, w).eval()

  def run(toks, hp, pos):
    with torch.no_grad():
      lg, out = block(torch.as_tensor(np.asarray(toks), dtype=torch.long)[None],
                      torch.as_tensor(np.asarray(hp))[None],
                      torch.as_tensor(np.asarray(pos), dtype=torch.long))
    return lg[0].numpy(), out[0].numpy()

  logits, chain_start, chain_tokens, chain_logits = [], [], [], []
  for r, row in enumerate(tokens):
    h = _hidden(model, torch.tensor(row[None], dtype=torch.long))[0].numpy()
    h_prev = np.concatenate([np.zeros_like(h[:1]), h[:-1]])
    lg, _ = run(row, h_prev, np.arange(len(row)))
    logits.append(lg)
    s = 17 + 5 * r                            # a chain after position s, over rows < s
    toks, hp, pos = list(row[:s + 1]), list(h_prev[:s + 1]), list(range(s + 1))
    ct, cl = [], []
    for j in range(N_CHAIN):
      lg_c, out = run(toks, hp, pos)
      cl.append(lg_c[-1])
      ct.append(int(np.argmax(lg_c[-1])))
      toks.append(ct[-1])
      hp.append(out[-1])
      pos.append(s + 1 + j)
    chain_start.append(s)
    chain_tokens.append(ct)
    chain_logits.append(np.stack(cl))
  return dict(mtp_logits=np.stack(logits).astype(np.float32),
              chain_start=np.asarray(chain_start, np.int32),
              chain_tokens=np.asarray(chain_tokens, np.int32),
              chain_logits=np.stack(chain_logits).astype(np.float32))


def main():
  mct.run_main(ARCHS, make, lambda name: ARCHS[name]["out"])


def make(name: str, llama_cpp: str, out: str):
  arch = ARCHS[name]
  os.makedirs(out, exist_ok=True)
  mct.SEED = SEED
  mct.N_VOCAB = N_VOCAB
  model = mct.make_model(arch)
  with torch.no_grad():     # quieter mixers and FFNs: a trunk whose next token the block can learn
    for name, p in model.named_parameters():
      if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")):
        p.copy_((MIXER_SCALE * p).to(torch.bfloat16).float())
  w = train_mtp(model, mtp_weights(model))
  with tempfile.TemporaryDirectory() as tmp:
    hf = os.path.join(tmp, "hf")
    model.save_pretrained(hf)
    from safetensors.torch import load_file, save_file
    st = os.path.join(hf, "model.safetensors")
    sd = load_file(st)
    sd.update({k: v.contiguous() for k, v in w.items()})
    save_file(sd, st, metadata={"format": "pt"})
    patch = os.path.join(tmp, "convert.py")
    with open(patch, "w") as fh:
      fh.write(mct.VOCAB_PATCH.format(llama_cpp=os.path.abspath(llama_cpp), pre=arch["pre"],
                                      converter_class=arch["converter_class"]))
    gguf_path = os.path.join(tmp, "model-f32.gguf")
    subprocess.run([sys.executable, patch, hf, "--outtype", "f32", "--outfile", gguf_path],
                   check=True, cwd=llama_cpp)
    with open(gguf_path, "rb") as src, \
         lzma.open(os.path.join(out, "model-f32.gguf.xz"), "wb", preset=9) as dst:
      dst.write(src.read())
  ref = mct.references(model)
  del ref["hf_logits"]            # the trunks' logits are checked on the other fixtures
  ref.update(mtp_references(model, w, ref["tokens"]))
  np.savez_compressed(os.path.join(out, "reference.npz"), **ref)
  with open(os.path.join(out, "config.json"), "w") as fh:
    json.dump(dict(arch["config"], architectures=[arch["hf_class"]], seed=SEED), fh, indent=1)


if __name__ == "__main__":
  main()
