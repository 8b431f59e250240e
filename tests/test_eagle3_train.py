"""EAGLE-3 training (eagle3.ttt_hidden, train/eagle3_objective.py) on the tiny Qwen3.5 target:

- the training-time-test forward equals the decode path: step j of the chain started at every
  position q is `eagle3.propose` at start = q with the true tokens forced, for the speculators
  fixture drafts (llama3 rope over a 512-id draft vocabulary; qwen3 with its own embedding and
  the norm flags), to float32 rounding (relative max-abs < 1e-4);
- the loss (labels shifted per step, response / row-0 / vocabulary masks, step weights, the KL
  over the draft vocabulary) equals a float64 numpy computation from the same logits;
- the recipe: batched generation -> shards -> online-feature TTT training (loss goes down) ->
  a speculators-format checkpoint that `load_draft` reads back bit for bit -> chain / DDTree
  output identical to autoregressive decoding; resume equals an uninterrupted run.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import eagle3
from dflash_jax import target as target_lib
from dflash_jax import train
from dflash_jax.train import eagle3_objective as e3o
from conftest import eagle3_dir
from test_eagle3 import _one_prefill


def _feats(target, cfg, tokens):
  n = len(tokens)
  rt = target.runtime
  pre = target_lib.prefill(target.params, target.config, jnp.asarray(tokens, jnp.int32),
                           jnp.int32(0), jnp.int32(n), target_lib.init_cache(target.config, n, rt),
                           rt, feature_layers=cfg.target_layer_ids)
  return pre.feats, pre.hidden


@pytest.fixture(scope="module")
def tiny_data(qwen_f32, qwen_ref):
  """Greedy responses of the tiny target (the data pipeline's batched generation)."""
  from dflash_jax.train import datagen
  prompts = [(r, qwen_ref["tokens"][r, :12].tolist()) for r in range(3)]
  return datagen.generate_token_seqs(qwen_f32, prompts, max_new_tokens=40, temperature=0.0,
                                     seed=0, batch_size=4, max_ctx=64)


@pytest.mark.parametrize("variant", ["llama3", "qwen3"])
def test_ttt_equals_forced_decode_chain(variant, qwen_f32, qwen_ref, tmp_path_factory):
  d = dj.load_draft(eagle3_dir(variant, tmp_path_factory), qwen_f32)
  cfg, ep, rt = d.config, d.params, qwen_f32.runtime
  n = 4
  tokens = np.asarray(qwen_ref["tokens"][0, :28], np.int32)
  t = 24
  feats, _ = _feats(qwen_f32, cfg, tokens[:t])
  hs = eagle3.ttt_hidden(ep, qwen_f32.params, cfg, jnp.asarray(tokens), feats, n, rt)
  assert hs.shape == (n, t, cfg.d_model)
  ttt = np.asarray(eagle3.to_target_vocab(ep, jnp.einsum("ntd,vd->ntv", hs,
                                                         ep.lm_head.data.astype(jnp.float32)),
                                          cfg.n_vocab))
  for s in (1, 7, 15, 20):
    cache, g = _one_prefill(qwen_f32, d, tokens[:s], 64)
    forced = lambda logits, j, s=s: (jnp.asarray(tokens, jnp.int32)[s + 1 + j], logits)
    _, ref = eagle3.propose(ep, qwen_f32.params, cfg, jnp.int32(tokens[s]), jnp.int32(s), g,
                            cache, rt, n=n, draw=forced)
    ref = np.asarray(ref)
    fin = np.isfinite(ref)
    assert np.array_equal(fin, np.isfinite(ttt[:, s]))
    err = np.max(np.abs(ttt[:, s][fin] - ref[fin])) / np.max(np.abs(ref[fin]))
    assert err < 1e-4, (s, err)


def _fresh(target, seqs, vd=200, steps=3, seed=0):
  raw = eagle3.config_json(target.config, d_ff=96, draft_tokens=steps, draft_vocab_size=vd)
  cfg = eagle3.config_from_json(raw, target.config)
  vocab = e3o.draft_vocab(seqs, target.config.n_vocab, vd)
  ep = eagle3.init_params(jax.random.key(seed), cfg, target.params, vocab)
  return raw, cfg, vocab, ep


def test_loss_against_float64(qwen_f32, tiny_data):
  """ttt_loss = CE + w * KL, recomputed in float64 numpy from the same draft logits and the
  target's logits (`target.logits`, renormalised over the draft vocabulary), with every mask."""
  raw, cfg, vocab, ep = _fresh(qwen_f32, tiny_data, vd=150)
  n = cfg.block_size - 1
  batch = e3o.make_seq_batch(np.random.default_rng(1), tiny_data, seq_len=48, n_steps=n)
  assert batch.tokens.shape == (3, 48 + n)
  w = train.loss_weights(cfg.block_size, 2.0)
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  rt = qwen_f32.runtime
  vocab_j = jnp.asarray(vocab)
  loss, m = e3o.ttt_loss(ep, cfg, batch, tparams, qwen_f32.config, lm, jnp.asarray(w), vocab_j,
                         0.7, rt)
  num = den = kl_num = 0.0
  pos = {int(v): i for i, v in enumerate(vocab)}
  for b in range(3):
    tok = batch.tokens[b]
    length, plen = int(batch.lengths[b]), int(batch.prompt_lens[b])
    feats, hidden = _feats(qwen_f32, cfg, tok[:48])
    hs = np.asarray(eagle3.ttt_hidden(ep, tparams, cfg, jnp.asarray(tok), feats, n, rt),
                    np.float64)
    d = hs @ np.asarray(ep.lm_head.data, np.float64).T                       # [n, T, Vd]
    tl = np.asarray(target_lib.logits(tparams, qwen_f32.config, hidden, rt), np.float64)[:, vocab]
    for j in range(n):
      for q in range(1, 48):
        lab = q + j + 1
        if not (plen <= lab < length) or int(tok[lab]) not in pos:
          continue
        z = d[j, q] - d[j, q].max()
        lq = z - np.log(np.exp(z).sum())
        zt = tl[q + j] - tl[q + j].max()
        lp = zt - np.log(np.exp(zt).sum())
        num += w[j] * -lq[pos[int(tok[lab])]]
        kl_num += w[j] * np.sum(np.exp(lp) * (lp - lq))
        den += w[j]
  assert den > 0
  ce, kl = num / den, kl_num / den
  assert abs(float(m["ce"]) - ce) < 1e-4 * abs(ce), (float(m["ce"]), ce)
  assert abs(float(m["kl"]) - kl) < 1e-4 * abs(kl) + 1e-6, (float(m["kl"]), kl)
  assert abs(float(loss) - (ce + 0.7 * kl)) < 1e-4 * abs(ce + 0.7 * kl)


def test_draft_vocab_by_response_frequency():
  S = dataclasses.make_dataclass("S", ["tokens", "prompt_len"])
  seqs = [S(np.array([9, 9, 9, 5, 5, 3, 1]), 3), S(np.array([8, 5, 3, 7]), 1)]
  # responses: 5 x3, 3 x2, 1 x1, 7 x1; then prompt ids: 9 x3, 8 x1
  assert e3o.draft_vocab(seqs, 10, 3).tolist() == [1, 3, 5]
  assert e3o.draft_vocab(seqs, 10, 5).tolist() == [1, 3, 5, 7, 9]
  assert e3o.draft_vocab(seqs, 10, 7).tolist() == [0, 1, 3, 5, 7, 8, 9]
  with pytest.raises(ValueError, match="outside"):
    e3o.draft_vocab([S(np.array([10]), 0)], 10, 3)


def test_recipe_save_load_lossless_and_resume(tmp_path, qwen_f32, qwen_ref):
  """Batched generation -> shards -> EAGLE-3 TTT training with online features (the loss goes
  down) -> a speculators-format checkpoint read back by `load_draft` with the same logits as the
  in-memory draft (bf16-rounded) -> chain / DDTree output identical to AR. Then 6 steps in one
  run equal 3 + save + load + 3."""
  from dflash_jax.train import datagen
  d = str(tmp_path / "data")
  prompts = [(r, qwen_ref["tokens"][r % 2, r:r + 10].tolist()) for r in range(6)]
  datagen.generate_shards(qwen_f32, prompts, d, max_new_tokens=24, temperature=0.0, seed=0,
                          batch_size=4, max_ctx=64, shard_prompts=3, meta={"command": "t"},
                          log=lambda _: None)
  seqs = train.read_shards(d, qwen_f32.config.n_vocab)
  raw, cfg, vocab, ep = _fresh(qwen_f32, seqs)
  tc = train.TrainConfig(steps=10, batch=3, seq_len=48, lr=1e-2, warmup=2, kl_weight=0.5)
  st = train.init_state(ep, train.make_optimizer(tc))
  seen = []
  st = train.train(qwen_f32, cfg, seqs, tc, st, vocab_ids=vocab,
                   on_metrics=lambda i, m: seen.append(m["loss"]))
  assert len(seen) == 10 and seen[-1] < 0.9 * seen[0], seen
  with pytest.raises(ValueError, match="vocab"):
    train.train(qwen_f32, cfg, seqs, dataclasses.replace(tc, steps=11), st)
  with pytest.raises(ValueError, match="EAGLE-3"):
    train.make_step(qwen_f32, cfg, dataclasses.replace(tc, restrict_vocab=True))
  out = str(tmp_path / "ck")
  eagle3.save(out, st.params, raw, vocab, qwen_f32.config.n_vocab, extra={"steps": 10})
  conf = json.loads(open(out + "/config.json").read())
  assert conf["speculators_model_type"] == "eagle3" and conf["draft_vocab_size"] == 200
  loaded = dj.load_draft(out, qwen_f32)
  assert loaded.config == cfg and np.array_equal(np.asarray(loaded.params.vocab), vocab)
  import ml_dtypes
  rounded = jax.tree.map(lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)
                         .astype(np.float32), st.params)
  mem = dj.Draft(cfg, dataclasses.replace(rounded, vocab=jnp.asarray(vocab)), "mem")
  prompt = qwen_ref["tokens"][1, :15]
  a = dj.first_draft_logits(qwen_f32, loaded, prompt, max_ctx=64)
  b = dj.first_draft_logits(qwen_f32, mem, prompt, max_ctx=64)
  np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.max(np.abs(b[np.isfinite(b)])))
  ar = dj.generate(qwen_f32, None, prompt, max_new_tokens=20, mode="ar", max_ctx=64, eog_ids=())
  for mode in ("chain", "ddtree"):
    r = dj.generate(qwen_f32, loaded, prompt, max_new_tokens=20, mode=mode, max_ctx=64,
                    eog_ids=(), budget=5)
    assert r.tokens == ar.tokens, mode
  tc = dataclasses.replace(tc, steps=6, seed=4)
  fresh = lambda: train.init_state(_fresh(qwen_f32, seqs)[3], train.make_optimizer(tc))
  full = train.train(qwen_f32, cfg, seqs, tc, fresh(), vocab_ids=vocab)
  half = train.train(qwen_f32, cfg, seqs, tc, fresh(), until=3, vocab_ids=vocab)
  half.save(str(tmp_path / "state.npz"))
  resumed = train.TrainState.load(str(tmp_path / "state.npz"), fresh())
  resumed = train.train(qwen_f32, cfg, seqs, tc, resumed, vocab_ids=vocab)
  for x, y in zip(jax.tree.leaves((full.params, full.opt_state)),
                  jax.tree.leaves((resumed.params, resumed.opt_state))):
    assert np.array_equal(np.asarray(x), np.asarray(y))
