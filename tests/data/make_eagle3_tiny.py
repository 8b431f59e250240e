"""Make tests/data/eagle3_tiny: tiny random EAGLE-3 drafts for the tiny Qwen3.5 target, as the
speculators package (vLLM's EAGLE-3 format, `Eagle3DraftModel`, speculators 0.9.0) defines and
saves them, and the package's outputs for drafted chains.

The weights are not stored: `weights(variant)` draws them from numpy's legacy RandomState (a
stream numpy keeps fixed across versions), rounded to bfloat16 as checkpoints store them, and
conftest.eagle3_dir writes them back as model.safetensors next to the config.json this script
saved with the package's own `save_pretrained` (main() checks that the package's saved tensors
are exactly these arrays). Only config.json files and reference.npz are kept (~0.1 MB instead of
~3 MB of weights).

Variants (hidden 256 as the target, 4 heads / 2 KV heads of 64, MLP 192):
  "llama3": a llama layer with llama3 rope scaling (as Llama-3.1 EAGLE-3 drafts), a draft vocab
    of 512 of the target's 1024 ids (d2t / t2d), aux layers [1, 5, 7], no embed_tokens stored
    (the target's token_embd is used, as vLLM shares it).
  "qwen3": a qwen3 layer (q/k norms), the full vocab, aux layers [3, 5, 7], norm_before_residual,
    fc_norm and norm_output on (EAGLE 3.1), its own embed_tokens stored.
The aux features are columns of `target_hidden` in tests/data/dflash2_tiny/reference.npz (the
outputs of layers 0, 2, 4, 6 of the same target at the 24 prompt positions = HF hidden_states
1, 3, 5, 7).

Reference (reference.npz), per variant v and chain start s in STARTS: the draft's KV rows are the
pairs (x_q, g_{q-1}) for q = 1..s-1 (g = fc of the aux features; vLLM's draft prefill), then 4
chained steps from (x_s, g_{s-1}), each feeding the argmax (mapped to the target vocab by d2t)
and the layer output (normed with norm_output): logits_v_s [4, Vd] (draft vocab), tokens_v_s [4]
(target ids).

Not run by the tests (they read its output). Needs Python 3.11 with torch, transformers, gguf and
speculators==0.9.0 (pip install --no-deps speculators plus its import-time dependencies):

    python tests/data/make_eagle3_tiny.py --target_gguf model-f32.gguf
"""

import argparse
import os
import shutil
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
D, HEADS, KV_HEADS, HEAD_DIM, FF, V = 256, 4, 2, 64, 192, 1024
STARTS = (12, 20)
STEPS = 4
FEATURE_LAYERS = (0, 2, 4, 6)      # dflash2_tiny's target_hidden column blocks (layer outputs)
VARIANTS = {
    "llama3": dict(seed=31, model_type="llama", draft_vocab=512, aux=[1, 5, 7], embed=False,
                   flags={}, rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16, "rope_theta": 5e5}),
    "qwen3": dict(seed=32, model_type="qwen3", draft_vocab=V, aux=[3, 5, 7], embed=True,
                  flags=dict(norm_before_residual=True, fc_norm=True, norm_output=True),
                  rope={"rope_type": "default", "rope_theta": 1e6}),
}


def _bf16(a: np.ndarray) -> np.ndarray:
  """Round float32 values to the nearest bfloat16 (ties to even), kept as float32."""
  u = a.astype(np.float32).view(np.uint32)
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
  return u.astype(np.uint32).view(np.float32)


def weights(variant: str) -> dict:
  """The variant's tensors under speculators' names (float32 arrays holding bfloat16 values; d2t
  int64, t2d bool), drawn from RandomState(seed)."""
  v = VARIANTS[variant]
  rng = np.random.RandomState(v["seed"])
  n_aux, vd = len(v["aux"]), v["draft_vocab"]

  def mat(n, k, gain=1.0):
    return _bf16(rng.standard_normal((n, k)) * gain / np.sqrt(k))

  def norm(n):
    return _bf16(1.0 + 0.2 * rng.standard_normal(n))

  p = "layers.0."
  out = {
      "fc.weight": mat(D, n_aux * D),
      p + "input_layernorm.weight": norm(D), p + "hidden_norm.weight": norm(D),
      p + "post_attention_layernorm.weight": norm(D),
      p + "self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, 2 * D, 2.0),
      p + "self_attn.k_proj.weight": mat(KV_HEADS * HEAD_DIM, 2 * D, 2.0),
      p + "self_attn.v_proj.weight": mat(KV_HEADS * HEAD_DIM, 2 * D),
      p + "self_attn.o_proj.weight": mat(D, HEADS * HEAD_DIM),
      p + "mlp.gate_proj.weight": mat(FF, D), p + "mlp.up_proj.weight": mat(FF, D),
      p + "mlp.down_proj.weight": mat(D, FF),
      "norm.weight": norm(D), "lm_head.weight": mat(vd, D, 4.0),
  }
  if v["model_type"] == "qwen3":
    out[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
    out[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
  if v["flags"].get("fc_norm"):
    for i in range(n_aux):
      out[f"fc_norm.{i}.weight"] = norm(D)
  if v["embed"]:
    out["embed_tokens.weight"] = _bf16(rng.standard_normal((V, D)))
  if vd != V:
    ids = np.sort(rng.choice(V, vd, replace=False))
    out["d2t"] = (ids - np.arange(vd)).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    out["t2d"] = t2d
  return out


def feature_cols(variant: str) -> list:
  """Column blocks of dflash2_tiny's target_hidden holding the variant's aux layers."""
  return [FEATURE_LAYERS.index(i - 1) for i in VARIANTS[variant]["aux"]]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--target_gguf", required=True, help="the tiny Qwen3.5 target, f32 GGUF")
  args = ap.parse_args()
  import gguf
  import torch
  from safetensors.torch import load_file
  from transformers import AutoConfig, DynamicCache
  from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
  from speculators.config import SpeculatorsConfig, VerifierConfig
  from speculators.proposals.greedy import GreedyTokenProposalConfig

  ref2 = np.load(os.path.join(HERE, "dflash2_tiny", "reference.npz"))
  prompt = ref2["prompt_ids"].astype(np.int64)
  th_all = ref2["target_hidden"].reshape(len(prompt), len(FEATURE_LAYERS), D)
  reader = gguf.GGUFReader(args.target_gguf)
  token_embd = next(np.asarray(t.data, np.float32) for t in reader.tensors
                    if t.name == "token_embd.weight")
  out_dir = os.path.join(HERE, "eagle3_tiny")
  os.makedirs(out_dir, exist_ok=True)
  ref = {"prompt_ids": prompt.astype(np.int32), "starts": np.array(STARTS, np.int32)}
  min_gap = np.inf
  for name, v in VARIANTS.items():
    w = weights(name)
    lc = AutoConfig.for_model(
        v["model_type"], vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters=dict(v["rope"]))
    lc._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=lc, draft_vocab_size=v["draft_vocab"],
        eagle_aux_hidden_state_layer_ids=v["aux"], **v["flags"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3_5ForCausalLM"])))
    m = Eagle3DraftModel(cfg).float().eval()
    sd = {k: torch.from_numpy(a) for k, a in w.items()}
    if not v["embed"]:
      sd["embed_tokens.weight"] = torch.from_numpy(token_embd)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"verifier_lm_head.weight", "verifier_norm.weight"}, missing

    with tempfile.TemporaryDirectory() as tmp:
      m.save_pretrained(tmp)
      saved = load_file(os.path.join(tmp, "model.safetensors"))
      for k, a in w.items():               # what the package writes = what weights() draws
        np.testing.assert_array_equal(saved[k].float().numpy() if a.dtype == np.float32
                                      else saved[k].numpy(), a, err_msg=k)
      extra = set(saved) - set(w)
      assert extra <= {"embed_tokens.weight"}, extra
      os.makedirs(os.path.join(out_dir, name), exist_ok=True)
      shutil.copy(os.path.join(tmp, "config.json"), os.path.join(out_dir, name, "config.json"))

    ids_map = (np.arange(v["draft_vocab"]) + w["d2t"]) if "d2t" in w else np.arange(V)
    feats = torch.from_numpy(th_all[:, feature_cols(name)].reshape(len(prompt), -1)[None])
    layer = m.layers[0]
    with torch.no_grad():
      h = feats
      if m.fc_norm is not None:
        h = torch.cat([nm(c) for nm, c in zip(m.fc_norm, h.chunk(len(m.fc_norm), -1))], -1)
      g_all = m.fc(h)                                                   # [1, P, D]
      for s in STARTS:
        cache = DynamicCache()
        # draft prefill: pairs (x_q, g_{q-1}) for q = 1..s-1 at positions q
        n = s - 1
        x = torch.cat([m.embed_tokens(torch.from_numpy(prompt[1:s])[None]), g_all[:, :s - 1]], -1)
        pos = torch.arange(1, s)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        layer(x, attention_mask=mask, position_ids=pos, past_key_values=cache,
              cache_position=torch.arange(n), position_embeddings=m.rotary_emb(x, pos))
        tok, g = int(prompt[s]), g_all[:, s - 1:s]
        logits, toks = [], []
        for j in range(STEPS):
          x = torch.cat([m.embed_tokens(torch.tensor([[tok]])), g], -1)
          pos = torch.tensor([[s + j]])
          out = layer(x, attention_mask=None, position_ids=pos, past_key_values=cache,
                      cache_position=torch.tensor([n + j]),
                      position_embeddings=m.rotary_emb(x, pos))
          normed = m.norm(out)
          lg = m.lm_head(normed)[0, 0].numpy()
          logits.append(lg)
          tok = int(ids_map[int(lg.argmax())])
          toks.append(tok)
          g = normed if cfg.norm_output else out
          top2 = np.sort(lg)[-2:]
          min_gap = min(min_gap, float(top2[1] - top2[0]))
        ref[f"logits_{name}_{s}"] = np.stack(logits).astype(np.float32)
        ref[f"tokens_{name}_{s}"] = np.array(toks, np.int32)
  np.savez_compressed(os.path.join(out_dir, "reference.npz"), **ref)
  print(f"smallest top-2 margin on a drafted chain: {min_gap:.4f}")
  print("wrote", sorted(os.listdir(out_dir)))


if __name__ == "__main__":
  main()
