"""Where the draft's first proposed token fails (issue 24, session 28): the shipped draft's acceptance
at block offset 1 binned by the target's own confidence (its top-1 probability) at that position,
on the depth study's held-out sets (HumanEval 0-49 x 64, chat 16 x 128: the target's greedy
continuations, `train.heldout.greedy_continuations`, cached in --eval_cache with depth_study.py).

    python bench_out/train/confidence_study.py --json_out bench_out/train/confidence_s28.json
"""

import json
import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

_DRAFT = flags.DEFINE_string("draft", os.path.join(ROOT, "checkpoints",
                                                   "smollm2-135m-instruct-dflash"), "Draft.")
_EVAL_CACHE = flags.DEFINE_string("eval_cache", "/tmp/depth_study_evalsets.npz",
                                  "Cached greedy continuations (shared with depth_study.py; made when missing).")
_N_HE = flags.DEFINE_integer("n_he", 50, "HumanEval prompts 0..n-1 (64 greedy tokens each).")
_N_CHAT = flags.DEFINE_integer("n_chat", 16, "Benchmark chat prompts (128 greedy tokens each).")
_ABLATE = flags.DEFINE_integer("ablate_n", 20, "HumanEval sequences for the bonus-token ablation "
                               "(offset-1 accuracy with the block's first token true / the mask "
                               "token / a random id); 0: none.")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


def main(argv):
  del argv
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import cli, draft_io
  from dflash_jax.train import heldout
  target = dj.load_target(cli.default_target_path(), weights="f32")
  cfg, p = draft_io.load(_DRAFT.value, target.config)
  p = draft_io.params_from_arrays(draft_io.params_to_arrays(p), cfg, weight_fmt="f32")
  n_he = max(_N_HE.value, _ABLATE.value)
  sets = {}
  for kind, ps in heldout.eval_prompts(target, n_he, _N_CHAT.value).items():
    name = {"humaneval": "he"}.get(kind, kind)       # depth_study.py's set names and cache keys
    sets[name] = heldout.greedy_continuations(target, ps, heldout.EVAL_NEW_TOKENS[kind],
                                              cache_path=_EVAL_CACHE.value, cache_prefix=name)
  res = {"draft": _DRAFT.value, "bins": list(BINS), "sets": {}}
  for name, seqs in sets.items():
    conf, hit = [], []
    for s in seqs[:_N_HE.value] if name == "he" else seqs:
      seq, plen = s.tokens, s.prompt_len
      logits, _ = dj.forward_logits(target, seq.tolist(), feature_layers=cfg.target_layer_ids)
      z = np.asarray(logits, np.float64)
      pr = np.exp(z - z.max(-1, keepdims=True))
      pr /= pr.sum(-1, keepdims=True)
      m, ok = heldout.chain_matches(p, cfg, target, seq, plen)
      # anchor a predicts x_{a+1} at offset 1: the target's distribution for it is row a
      anchors = np.arange(plen, seq.size - 1)
      conf.append(pr[anchors].max(-1))
      hit.append(ok[:, 0])
    conf, hit = np.concatenate(conf), np.concatenate(hit)
    rows = []
    for lo, hi in zip(BINS[:-1], BINS[1:]):
      sel = (conf >= lo) & (conf < hi)
      rows.append({"conf_lo": lo, "conf_hi": min(hi, 1.0), "positions": int(sel.sum()),
                   "share": float(sel.mean()),
                   "offset1_accept": float(hit[sel].mean()) if sel.any() else None})
    res["sets"][name] = {"positions": int(conf.size), "mean_target_top1": float(conf.mean()),
                         "offset1_accept": float(hit.mean()), "bins": rows}
  if _ABLATE.value:
    import jax.numpy as jnp
    from dflash_jax import draft as draft_lib
    from dflash_jax.train import objective
    lm = np.asarray(objective.frozen_target_tensors(target)[1])
    rng = np.random.default_rng(0)
    hits = {"true": [], "mask": [], "random": []}
    for i in range(_ABLATE.value):
      seq, plen = sets["he"][i].tokens, sets["he"][i].prompt_len
      _, feats = dj.forward_logits(target, seq.tolist(), feature_layers=cfg.target_layer_ids)
      a = np.arange(plen, seq.size - 1)
      for kind in hits:
        bids = np.full((a.size, cfg.block_size), cfg.mask_token_id, np.int32)
        bids[:, 0] = {"true": seq[a], "mask": cfg.mask_token_id,
                      "random": rng.integers(0, cfg.n_vocab, a.size)}[kind]
        h = draft_lib.train_hidden(p, cfg, jnp.asarray(feats), jnp.asarray(bids), jnp.asarray(a),
                                   target.params.embed)
        hits[kind].append((np.asarray(h[:, 1]) @ lm.T).argmax(-1) == seq[a + 1])
    res["bonus_token_ablation"] = {"n_seqs": _ABLATE.value, **{
        k: float(np.concatenate(v).mean()) for k, v in hits.items()}}
    print("offset-1 accuracy with the block's first token:", res["bonus_token_ablation"])
  print("| set | target top-1 prob | share of positions | offset-1 acceptance |")
  print("|---|---|---|---|")
  for name, r in res["sets"].items():
    for b in r["bins"]:
      a = "-" if b["offset1_accept"] is None else f"{b['offset1_accept']:.3f}"
      print(f"| {name} | [{b['conf_lo']:.1f}, {b['conf_hi']:.1f}) | {b['share']:.3f} | {a} |")
    print(f"| {name} | all (mean {r['mean_target_top1']:.3f}) | 1 | {r['offset1_accept']:.3f} |")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
