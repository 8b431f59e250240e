"""A decode round without host round trips (the step's overheads on a GPU): `Runtime.attention`
"dense" and `Runtime.rounds`, counted by `host_syncs`, and lossless under both."""

import dataclasses

import jax.numpy as jnp
import pytest

import dflash_jax as dj
from dflash_jax import api, batching, host_syncs
from dflash_jax.config import DecodeConfig
from dflash_jax.runtime import Runtime

_MODES = (("ar", {}), ("chain", {}), ("ddtree", dict(budget=8, tree_top_k=4)),
          ("lookup", dict(lookup=4)))


def _with(target, **rt):
  return dataclasses.replace(target, runtime=dataclasses.replace(target.runtime, **rt))


def test_count_sees_while_cond_and_static_loops():
  """host_syncs.count: a traced-bound fori_loop is a data-dependent loop, a static one is not;
  a cond inside a static loop of n trips counts n times; constructs inside a while count as
  nested."""
  import jax

  def f(x, n):
    x = jax.lax.fori_loop(0, n, lambda i, y: y + 1.0, x)                  # while
    x = jax.lax.fori_loop(0, 3, lambda i, y: jax.lax.cond(y > 0, lambda: y, lambda: -y), x)
    return jax.lax.while_loop(lambda y: y < 10.0,
                              lambda y: jax.lax.cond(y > 5, lambda: y * 2, lambda: y + 1), x)

  s = host_syncs.count(f, jnp.float32(1), jnp.int32(4))
  assert s == host_syncs.Syncs(loops=2, conds=3, nested_loops=0, nested_conds=1)


def test_decode_round_host_syncs(qwen_f32, qwen_draft):
  """Per decode round on the tiny Qwen3.5 hybrid: with the defaults, the loop's own predicate
  plus one data-dependent chunk loop per attention layer (target, and draft in chain / ddtree)
  and the logit-rule switch; with attention "dense" no chunk loop; with rounds > 0 as well, no
  data-dependent control flow at all in any mode, greedy or sampled."""
  n_attn = len(qwen_f32.config.attn_layers)
  n_draft = qwen_draft.config.n_layer
  for mode, kw in _MODES:
    dec = api.resolve_config(qwen_draft, DecodeConfig(mode=mode, max_ctx=256, **kw))
    counts = {}
    for name, t in (("live", qwen_f32), ("dense", _with(qwen_f32, attention="dense")),
                    ("free", _with(qwen_f32, attention="dense", rounds=3))):
      b = batching.SlotBatch(t, qwen_draft, dec, 2, jnp.asarray([0], jnp.int32))
      counts[name] = host_syncs.decode_round(b)
      if name == "free":       # the sampled variant too (its per-row conds are vmapped: selects)
        counts["free_sampled"] = host_syncs.decode_round(b, sampled=True)
    branches = 2 if mode == "lookup" else 1           # the lookup round's AR fallback branch
    assert counts["live"].loops == 1 and counts["live"].conds == 0, mode
    assert counts["live"].nested_loops == branches * n_attn + (n_draft if dec.uses_draft else 0)
    assert counts["live"].nested_conds == 2 * branches - 1, mode
    assert counts["dense"] == host_syncs.Syncs(1, 0, 0, 2 * branches - 1), mode
    assert counts["free"] == counts["free_sampled"] == host_syncs.Syncs(0, 0, 0, 0), mode


# attention "dense" with a while loop (no static rounds) is the same attention and the same loop
# body as the case below minus the fixed trip count; that variant was dropped from CI for time.
@pytest.mark.parametrize("attention,rounds", [("dense", 3)])
def test_dense_attention_and_fixed_rounds_lossless(qwen_f32, qwen_draft, draft_ref, attention,
                                                   rounds):
  """Greedy output of every mode under attention "dense" and / or a static loop of `rounds`
  rounds per call equals the default runtime's autoregressive output token for token (one row,
  and a batch of two rows whose length budgets end in different calls), and the acceptance
  lengths equal the default runtime's for the same mode."""
  t = _with(qwen_f32, attention=attention, rounds=rounds)
  p = draft_ref["prompt_ids"]
  truth = dj.generate(qwen_f32, None, p, max_new_tokens=30, mode="ar", max_ctx=256).tokens
  for mode, kw in _MODES:
    d = qwen_draft if mode in ("chain", "ddtree") else None
    base = dj.generate(qwen_f32, d, p, max_new_tokens=30, mode=mode, max_ctx=256, **kw)
    got = dj.generate(t, d, p, max_new_tokens=30, mode=mode, max_ctx=256, **kw)
    assert got.tokens == truth, (mode, attention, rounds)
    assert got.accept_lens == base.accept_lens, (mode, attention, rounds)
    rows = dj.generate_batch(t, d, [p, p[:-3]], max_new_tokens=[30, 11], mode=mode,
                             max_ctx=256, **kw)
    short = dj.generate(qwen_f32, None, p[:-3], max_new_tokens=11, mode="ar", max_ctx=256)
    assert rows[0].tokens == truth and rows[1].tokens == short.tokens, (mode, attention, rounds)


def test_runtime_rejects_bad_attention_and_rounds():
  with pytest.raises(ValueError, match="Runtime.attention"):
    Runtime(attention="sparse")
  for bad in (-1, 1000, 2.0, True):
    with pytest.raises(ValueError, match="Runtime.rounds"):
      Runtime(rounds=bad)


def test_static_round_lowers_for_a_gpu(qwen_draft):
  """The GPU configuration of a sync-free decode loop (Pallas kernels, bf16, attention "dense",
  rounds 4; DDTree with the draft, two rows) on the tiny Qwen3.5 hybrid's Q4_K_M file lowers for
  an H100 without a GPU (the Triton matmul and tree-GDN kernels inside the static loop), its
  traced form holds no data-dependent loop or branch, and each matmul kernel runs once for both
  rows (no batch grid axis)."""
  import os

  import jax
  import numpy as np

  from conftest import QWEN
  from dflash_jax import decode as decode_lib
  from dflash_jax import target_params
  from dflash_jax.gguf_io import read_gguf
  from test_kernels import H100, kernel_calls
  path = os.path.join(QWEN, "model-q4_k_m.gguf")
  cfg = dj.load_target(path, kernels="reference").config
  rt = Runtime(kernels="pallas", compute_dtype="bfloat16", attention="dense", rounds=4)
  spec = lambda tree: jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else
                                     np.asarray(a).dtype), tree)
  params = spec(target_params.load_params(read_gguf(path), cfg, weights="quantized"))
  dec = api.resolve_config(qwen_draft, DecodeConfig(mode="ddtree", budget=8, tree_top_k=4,
                                                    max_ctx=256))
  plan = decode_lib.Plan(cfg, qwen_draft.config, dec, rt)
  state = spec(decode_lib.init_state(plan, 2))
  dparams = spec(qwen_draft.params)
  fn = lambda p, dp, s: decode_lib.decode_loop(p, dp, s, jnp.int32(4), jnp.asarray([0], jnp.int32),
                                               plan=plan)
  assert host_syncs.count(fn, params, dparams, state) == host_syncs.Syncs(0, 0, 0, 0)
  # the two rows run each matmul kernel once on both rows' tokens: grid (M tiles, N tiles, K
  # splits), no batch axis (layers.linear folds the loop's vmap into M)
  mats = [g for name, g in kernel_calls(fn, params, dparams, state) if "dequant_matmul" in name]
  assert mats and all(len(g) == 3 for g in mats), mats
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,),
                                   abstract_device=jax.sharding.AbstractDevice(H100, 1, "cuda"))
  with jax.sharding.use_abstract_mesh(mesh):      # Triton's lowering asks for a GPU model
    txt = jax.jit(fn).trace(params, dparams, state).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in txt
