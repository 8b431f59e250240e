"""Make tests/data/dspark_tiny: a tiny random DeepSeek DSpark draft (DeepSpec's `Qwen3DSparkModel`,
deepspec/modeling/dspark/qwen3/modeling.py + markov_head.py + common.py) for the tiny Qwen3.5
target, saved by the package's own `save_pretrained` (DeepSpec's checkpoint format: config.json +
model.safetensors), and the package's outputs for two draft blocks.

The draft: one decoder layer (hidden 256 as the target, 4 heads / 2 KV heads of 64, MLP 128), block
size 8, target features from layers [2, 6] (columns of `target_hidden` in
tests/data/dflash2_tiny/reference.npz, which holds layers 0, 2, 4, 6 of the same target), a
Markov head of rank 16 and a confidence head. Weights are DeepSpec's init, rounded to bfloat16 as
stored; the Markov, gate, RNN and confidence projections are redrawn larger (DeepSpec's 0.02 init
leaves the Markov bias ~1e-3, so the tests could not tell it from none). embed_tokens / lm_head are
the target's f32 token_embd / output (what DeepSpec's `initialize_embeddings_and_head` copies in),
kept in f32 for the reference and dropped from the stored file (the loader uses the target's own;
a checkpoint that ships them is accepted, tests/test_dspark.py).

Variants over the same backbone (the heads of the others stored as heads_<name>.safetensors, their
config fields in heads.json): "vanilla" (model.safetensors.xz: VanillaMarkov + a confidence head that
reads the Markov embedding), "gated" (GatedMarkovHead + a confidence head on the hidden state
only), "rnn" (RNNHead, no confidence head), "none" (markov_rank 0, no heads: DeepSpec's own DFlash
configuration, anchor-first).

Reference (reference.npz), for block b in 0, 1 (block_start[b], anchor[b]; the context = target
features of positions 0..block_start-1, as DeepSpec's `forward_dspark_draft_block` passes them):
  block_hidden_b [8, 256] (after the final norm), base_logits_b [8, V] (lm_head), and per variant
  v: tokens_v_b [8] int32 (the greedy Markov chain, `sample_draft_tokens` at temperature 0),
  logits_v_b [8, V] (the chain's corrected logits), confidence_v_b [8] (the confidence logits of
  `predict_confidence_step` on the chain's predecessors; vanilla and gated only).

Not run by the tests (they read its output). Needs Python 3.11 with torch, transformers >= 5.2,
gguf, and a DeepSpec checkout (github.com/deepseek-ai/DeepSpec at afdfa7c):

    python tests/data/make_dspark_tiny.py --deepspec /path/to/DeepSpec --target_gguf model-f32.gguf
"""

import argparse
import json
import lzma
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20261129
BLOCK = 8
RANK = 16
LAYER_IDS = [2, 6]                 # of the 4 layers (0, 2, 4, 6) in dflash2_tiny's target_hidden
FEATURE_COLS = [1, 3]              # their column blocks there
BLOCKS = [(20, None), (24, 5)]     # (block start, anchor; None: the prompt's token there)
VARIANTS = {
    "vanilla": dict(markov_rank=RANK, markov_head_type="vanilla", enable_confidence_head=True,
                    confidence_head_with_markov=True),
    "gated": dict(markov_rank=RANK, markov_head_type="gated", enable_confidence_head=True,
                  confidence_head_with_markov=False),
    "rnn": dict(markov_rank=RANK, markov_head_type="rnn", enable_confidence_head=False),
    "none": dict(markov_rank=0, enable_confidence_head=False),
}


def draft_config(Qwen3Config, fields):
  cfg = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=128, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                    rope_theta=1e7, max_position_embeddings=4096, tie_word_embeddings=False,
                    initializer_range=0.02)
  # as deepspec/modeling/dspark/qwen3/config.py build_draft_config sets them
  cfg.architectures = ["Qwen3DSparkModel"]
  cfg.num_target_layers = 8
  cfg.block_size = BLOCK
  cfg.layer_types = ["full_attention"]
  cfg._attn_implementation = "eager"
  cfg.mask_token_id = 1021
  cfg.target_layer_ids = LAYER_IDS
  cfg.num_anchors = 64
  for k, v in fields.items():
    setattr(cfg, k, v)
  return cfg


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--deepspec", required=True, help="DeepSpec checkout (the deepspec package)")
  ap.add_argument("--target_gguf", required=True, help="the tiny Qwen3.5 target, f32 GGUF")
  args = ap.parse_args()
  sys.path.insert(0, args.deepspec)
  import gguf
  from safetensors.torch import load_file, save_file
  from transformers import Qwen3Config
  from deepspec.modeling.dspark.qwen3.modeling import Qwen3DSparkModel

  ref2 = np.load(os.path.join(HERE, "dflash2_tiny", "reference.npz"))
  prompt = ref2["prompt_ids"].astype(np.int64)
  th = ref2["target_hidden"].reshape(len(prompt), 4, 256)[:, FEATURE_COLS].reshape(len(prompt), -1)
  reader = gguf.GGUFReader(args.target_gguf)
  tens = {t.name: np.asarray(t.data, np.float32) for t in reader.tensors
          if t.name in ("token_embd.weight", "output.weight")}

  out_dir = os.path.join(HERE, "dspark_tiny")
  os.makedirs(out_dir, exist_ok=True)
  torch.manual_seed(SEED)
  models = {}
  base_state = None
  for name, fields in VARIANTS.items():
    m = Qwen3DSparkModel(draft_config(Qwen3Config, fields)).float().eval()
    if base_state is None:
      with torch.no_grad():
        for n, p in m.named_parameters():
          if not n.startswith(("markov_head.", "confidence_head.")):
            p.copy_(p.to(torch.bfloat16).float())
      base_state = {n: p.detach().clone() for n, p in m.named_parameters()
                    if not n.startswith(("markov_head.", "confidence_head."))}
    with torch.no_grad():
      for n, p in m.named_parameters():
        if n in base_state:
          p.copy_(base_state[n])
        elif n.endswith("markov_w1.weight"):
          p.copy_(torch.randn_like(p).bfloat16().float())
        elif n.endswith("markov_w2.weight"):
          p.copy_((0.5 * torch.randn_like(p)).bfloat16().float())
        elif n.startswith(("markov_head.", "confidence_head.")):
          std = 0.3 if p.ndim == 2 else 0.1
          p.copy_((std * torch.randn_like(p)).bfloat16().float())
      m.embed_tokens.weight.copy_(torch.from_numpy(tens["token_embd.weight"]))
      m.lm_head.weight.copy_(torch.from_numpy(tens["output.weight"]))
    models[name] = m

  ref = {"prompt_ids": prompt.astype(np.int32), "layer_cols": np.array(FEATURE_COLS, np.int32),
         "block_start": np.array([s for s, _ in BLOCKS], np.int32)}
  anchors = []
  min_gap = np.inf
  for b, (start, anchor) in enumerate(BLOCKS):
    anchor = int(prompt[start]) if anchor is None else anchor
    anchors.append(anchor)
    ids = torch.full((1, BLOCK), 1021, dtype=torch.long)
    ids[0, 0] = anchor
    pos = torch.arange(start + BLOCK)[None]          # context 0..start-1, then the block
    ctx = torch.from_numpy(th[:start][None])
    for name, m in models.items():
      with torch.no_grad():
        hid = m._forward_backbone(target_hidden_states=ctx, noise_embedding=m.embed_tokens(ids),
                                  position_ids=pos, attention_mask=None, past_key_values=None,
                                  use_cache=False, is_causal=False)
        base = m.compute_logits(hid)
        toks, logits = m.sample_draft_tokens(base, first_prev_token_ids=ids[:, 0],
                                             temperature=0.0, hidden_states=hid)
        prev = torch.cat([ids[:, :1], toks[:, :-1]], dim=1)
        conf = m.predict_confidence_step(hid, prev_token_ids=prev)
      if name == "vanilla":
        ref[f"block_hidden_{b}"] = hid[0].numpy()
        ref[f"base_logits_{b}"] = base[0].numpy()
      ref[f"tokens_{name}_{b}"] = toks[0].numpy().astype(np.int32)
      ref[f"logits_{name}_{b}"] = logits[0].numpy()
      if conf is not None:
        ref[f"confidence_{name}_{b}"] = conf[0].numpy()
      top2 = np.sort(logits[0].numpy(), axis=-1)[:, -2:]
      min_gap = min(min_gap, float((top2[:, 1] - top2[:, 0]).min()))
  ref["anchor"] = np.array(anchors, np.int32)
  np.savez_compressed(os.path.join(out_dir, "reference.npz"), **ref)
  print(f"smallest top-2 margin on a greedy chain: {min_gap:.4f}")

  # Checkpoints as DeepSpec writes them (save_pretrained in bfloat16); the vanilla one stored
  # whole minus embed_tokens / lm_head, the others' heads only.
  heads = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, m in models.items():
      d = os.path.join(tmp, name)
      m.to(torch.bfloat16).save_pretrained(d)
      sd = load_file(os.path.join(d, "model.safetensors"))
      conf = json.load(open(os.path.join(d, "config.json")))
      if name == "vanilla":
        sd = {k: v for k, v in sd.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "model.safetensors"), "rb") as fin, \
            lzma.open(os.path.join(out_dir, "model.safetensors.xz"), "wb", preset=9) as fout:
          shutil.copyfileobj(fin, fout)          # 0.92 -> 0.66 MB
        shutil.copy(os.path.join(d, "config.json"), os.path.join(out_dir, "config.json"))
      else:
        hd = {k: v for k, v in sd.items() if k.startswith(("markov_head.", "confidence_head."))}
        if hd:
          save_file(hd, os.path.join(out_dir, f"heads_{name}.safetensors"),
                    metadata={"format": "pt"})
        heads[name] = {k: conf.get(k) for k in ("markov_rank", "markov_head_type",
                                                "enable_confidence_head",
                                                "confidence_head_with_markov")}
  with open(os.path.join(out_dir, "heads.json"), "w") as fh:
    json.dump(heads, fh, indent=1, sort_keys=True)
  print("wrote", sorted(os.listdir(out_dir)))


if __name__ == "__main__":
  main()
