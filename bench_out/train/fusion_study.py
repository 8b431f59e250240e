"""Draft + n-gram table, fused per block offset (issue 24, session 35): how many tokens a greedy
chain step would accept if each drafted offset could take the static n-gram table's next token
(`dflash_jax.ngram`, built from the committed training shards) instead of the draft's argmax.

Teacher-forced and exact for a greedy chain decode: a DFlash draft proposes all block offsets in
one forward from [bonus, MASK x 15], so its logits at offset k do not depend on the tokens chosen
at offsets < k, and the chain only goes on past offset k when the chosen token equals the target's
greedy token there; the table's context at offset k is then the target's own tokens. So per anchor
a and offset k: the draft's top token and probabilities (one `train_hidden` pass, as
`train.heldout`), the table's top token t and share s for the context ending at a + k - 1, and a
fusion rule picking one of the two; `heldout.walk_chain` replays the decode's anchors.

Rules (each chooses the table's token where the table holds the context and):
  draft            never (the shipped chain)
  table_first      always
  share>=tau       s >= tau
  blend:beta       s + beta * p_draft(t) > p_draft(draft top)
  mix:w            p_draft(t) + w * s > p_draft(draft top): the argmax of the mixture
                   (p_draft + w s delta_t) / (1 + w s) that `DecodeConfig.table_mix` = w decodes
                   with (mix:1 = blend:1)
  oracle           whichever of the two is right (an upper bound no rule reaches)

    python bench_out/train/fusion_study.py --json_out bench_out/train/fusion_s35.json
"""

import json
import os
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

_DRAFT = flags.DEFINE_string("draft", os.path.join(ROOT, "checkpoints",
                                                   "smollm2-135m-instruct-dflash"), "Draft.")
_TABLE = flags.DEFINE_string("table", os.path.join(ROOT, "checkpoints", "train_data",
                                                   "smollm2-135m-instruct"),
                             "n-gram table: an .npz or a token-shard directory.")
_EVAL_CACHE = flags.DEFINE_string("eval_cache", "/tmp/depth_study_evalsets.npz",
                                  "Cached greedy continuations (shared with depth_study.py; made when missing).")
_N_HE = flags.DEFINE_integer("n_he", 50, "HumanEval prompts 0..n-1 (64 greedy tokens each).")
_N_CHAT = flags.DEFINE_integer("n_chat", 16, "Benchmark chat prompts (128 greedy tokens each).")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here.")

TAUS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
BETAS = (0.0, 0.5, 1.0, 2.0)
WEIGHTS = (0.25, 0.5, 2.0, 4.0)


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np
  import dflash_jax as dj
  from dflash_jax import cli, draft_io, ngram
  from dflash_jax import draft as draft_lib
  from dflash_jax.train import heldout, objective

  target = dj.load_target(cli.default_target_path(), weights="f32")
  cfg, p = draft_io.load(_DRAFT.value, target.config)
  p = draft_io.params_from_arrays(draft_io.params_to_arrays(p), cfg, weight_fmt="f32")
  t0 = time.time()
  table = ngram.load(_TABLE.value, target.config.n_vocab)
  print(f"table: {table.size} contexts in {time.time() - t0:.1f} s")
  lm = objective.frozen_target_tensors(target)[1]
  L = cfg.block_size

  @jax.jit
  def draft_probs(p, tparams, lm, tokens, length, anchors, ttok):
    feats, _ = objective.target_pass(tparams, target.config, tokens, length,
                                     cfg.target_layer_ids, dj.Runtime())
    bids = jnp.full((anchors.shape[0], L), cfg.mask_token_id, jnp.int32).at[:, 0].set(tokens[anchors])
    h = draft_lib.train_hidden(p, cfg, feats, bids, anchors, tparams.embed)
    logits = jnp.einsum("ald,vd->alv", h[:, 1:], lm, precision=jax.lax.Precision.HIGHEST)
    pr = jax.nn.softmax(logits, -1)
    top = jnp.argmax(logits, -1)
    p_top = jnp.max(pr, -1)
    p_t = jnp.take_along_axis(pr, jnp.maximum(ttok, 0)[..., None], -1)[..., 0]
    return top, p_top, jnp.where(ttok >= 0, p_t, 0.0)

  sets = {}
  for kind, ps in heldout.eval_prompts(target, _N_HE.value, _N_CHAT.value).items():
    name = {"humaneval": "he"}.get(kind, kind)
    sets[name] = heldout.greedy_continuations(target, ps, heldout.EVAL_NEW_TOKENS[kind],
                                              cache_path=_EVAL_CACHE.value, cache_prefix=name)
  rules = ["draft", "table_first"] + [f"share>={t}" for t in TAUS] + [f"blend:{b}" for b in BETAS] + [f"mix:{w}" for w in WEIGHTS] + ["oracle"]
  res = {"draft": _DRAFT.value, "table": _TABLE.value, "table_contexts": table.size, "sets": {}}
  for name, seqs in sets.items():
    per_rule = {r: [] for r in rules}
    held, n_pos, d_ok1, t_ok1 = 0, 0, 0, 0
    for s in seqs:
      seq = np.asarray(s.tokens, np.int32)
      plen, T = int(s.prompt_len), seq.size
      a = np.arange(plen, T - 1)
      q = a[:, None] + np.arange(1, L)                       # [A, L-1] predicted positions
      valid = q < T
      qc = np.minimum(q, T - 1)
      ttok, tshare = ngram.next_tokens(table, seq, qc.reshape(-1))
      ttok, tshare = ttok.reshape(q.shape), tshare.reshape(q.shape)
      Tp = -(-T // 64) * 64
      tp = np.zeros(Tp, np.int32)
      tp[:T] = seq
      top, p_top, p_t = (np.asarray(x) for x in draft_probs(
          p, target.params, lm, jnp.asarray(tp), jnp.int32(T), jnp.asarray(a.astype(np.int32)),
          jnp.asarray(ttok.astype(np.int32))))
      gold = seq[qc]
      d_ok = (top == gold) & valid
      t_ok = (ttok == gold) & valid
      has = ttok >= 0
      held += int(has[:, 0].sum())
      n_pos += a.size
      d_ok1 += int(d_ok[:, 0].sum())
      t_ok1 += int(t_ok[:, 0].sum())
      for r in rules:
        if r == "draft":
          use_t = np.zeros_like(has)
        elif r == "table_first":
          use_t = has
        elif r.startswith("share>="):
          use_t = has & (tshare >= float(r[7:]))
        elif r.startswith("blend:"):
          use_t = has & (tshare + float(r[6:]) * p_t > p_top)
        elif r.startswith("mix:"):
          use_t = has & (p_t + float(r[4:]) * tshare > p_top)
        if r == "oracle":
          ok = d_ok | t_ok
        else:
          ok = np.where(use_t, t_ok, d_ok)
        m = np.cumprod(ok, axis=1).sum(1)
        per_rule[r].append(float(np.mean(heldout.walk_chain(m, T - plen))))
    rows = {r: float(np.mean(v)) for r, v in per_rule.items()}
    res["sets"][name] = {"chain_al": rows, "offset1_draft": d_ok1 / n_pos,
                         "offset1_table": t_ok1 / n_pos, "offset1_table_held": held / n_pos,
                         "n_seqs": len(seqs)}
  print("| rule | " + " | ".join(f"{n} chain AL" for n in res["sets"]) + " |")
  print("|---|" + "---|" * len(res["sets"]))
  for r in rules:
    print(f"| {r} | " + " | ".join(f"{res['sets'][n]['chain_al'][r]:.3f}" for n in res["sets"]) + " |")
  for n, v in res["sets"].items():
    print(f"{n}: offset-1 right: draft {v['offset1_draft']:.3f}, table {v['offset1_table']:.3f} "
          f"(held {v['offset1_table_held']:.3f})")
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


if __name__ == "__main__":
  app.run(main)
