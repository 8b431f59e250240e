"""The Mosaic GPU Q4_K / Q6_K matmul (pallas_kernels.mgpu_matmul) on the CPU: each tile layout is
an exact permutation of the repacked planes; in GPU interpret mode the kernel equals a float64
product of the same bfloat16 operands (relative Frobenius error <= 1e-5: float32 accumulation
only); and the GPU configuration (register operand, two compute warpgroups) lowers for CUDA
without a GPU at Qwen3.5-27B shapes (Mosaic GPU layout inference and dialect lowering run in
`jax.export`)."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import gguf
import pytest
from jax import export

from dflash_jax import quants
from pallas_kernels import mgpu_matmul as mm
from pallas_kernels import repack
from test_quants import _random_blocks

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


def _weight(rng, n, k, fmt="q4_k"):
  raw = _random_blocks(rng, fmt, n, k // 256)
  return repack.repack(raw, fmt, (n, k))


@pytest.mark.parametrize("fmt,block_bytes", [("q4_k", 148), ("q5_k", 180), ("q6_k", 210)])
def test_tiles_are_an_exact_permutation_of_the_planes(fmt, block_bytes):
  rng = np.random.default_rng(0)
  p = _weight(rng, 8, 512, fmt)
  t = mm.to_tiles(p)
  assert isinstance(t, mm.TILES) and t.fmt == fmt
  back = mm.to_planes(t)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(p)))
  assert t.nbytes == p.nbytes == 8 * 2 * block_bytes
  codes = np.asarray(p.codes).reshape(8, 8, 32)             # [N, K/64, 32]
  assert np.array_equal(t.codes[3, 5], codes[5, 3])         # tile g = 3 of row 5
  if fmt != "q4_k":               # high parts: [N, K/128, 32] (Q6_K), [N, K/256, 32] (Q5_K)
    per = 128 if fmt == "q6_k" else 256
    assert np.array_equal(t.high[1, 6], np.asarray(p.high).reshape(8, 512 // per, 32)[6, 1])
  raw = repack.to_gguf(p)                                     # the weight's GGUF bytes
  ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt.upper()])
  got = np.asarray(quants.dequantize(jax.tree.map(jnp.asarray, t)))
  assert np.array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32))
  spec = mm.tile_specs(8, 512, fmt)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), spec) == \
      jax.tree.map(lambda a: (a.shape, a.dtype), t)
  tj = mm.to_tiles(jax.tree.map(jnp.asarray, p))            # jax arrays in, jax arrays out
  assert isinstance(tj.codes, jax.Array) and np.array_equal(tj.codes, t.codes)
  with pytest.raises(ValueError, match="Q4_K, Q5_K or Q6_K"):
    mm.to_tiles(dataclasses.replace(p, fmt="q3_k"))


def _bf16_reference(x, p):
  """float64 x_bf16 @ w_bf16^T with w = repack.dequantize_planes (bit-identical to gguf-py),
  each operand rounded to bfloat16 as the kernel rounds it."""
  w = np.asarray(repack.dequantize_planes(jax.tree.map(jnp.asarray, p)).astype(jnp.bfloat16),
                 np.float64)
  xb = np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
  return xb @ w.T


# (M, N, K, kb, splits, n_sm, fmt): padded token widths 16 / 32 / 64 and a second call (M > 64);
# several work items per persistent program; K splits; two 256-blocks a pipeline step.
CASES = [(3, 128, 512, 1, 2, 1, "q4_k"), (17, 64, 512, 2, 1, 1, "q4_k"),
         (40, 64, 768, 1, 3, 2, "q4_k"), (70, 64, 256, 1, 1, 1, "q4_k"),
         (3, 128, 512, 1, 2, 1, "q6_k"), (17, 64, 1024, 2, 1, 2, "q6_k"),
         (70, 64, 256, 1, 1, 1, "q6_k"), (3, 128, 512, 1, 2, 1, "q5_k"),
         (40, 64, 768, 1, 3, 2, "q5_k")]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="GPU interpret mode runs its 2 simulated "
                    "warpgroups' blocking callbacks on XLA's CPU pool: needs >= 2 cores")
@pytest.mark.parametrize("m,n,k,kb,splits,n_sm,fmt", CASES)
def test_interpret_matches_bf16_operand_reference(m, n, k, kb, splits, n_sm, fmt):
  rng = np.random.default_rng(m)
  p = _weight(rng, n, k, fmt)
  x = rng.standard_normal((m, k)).astype(np.float32)
  cfg = mm.MgpuConfig(kb=kb, splits=splits, stages=2, n_sm=n_sm, a_operand="smem",
                      compute_wgs=1)
  t = jax.tree.map(jnp.asarray, mm.to_tiles(p))
  with plgpu.force_gpu_interpret_mode():
    got = np.asarray(mm.kquant_matmul(jnp.asarray(x), t, cfg), np.float64)
  ref = _bf16_reference(x, p)
  assert got.shape == (m, n)
  err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  assert err <= 1e-5, err
  if fmt == "q6_k":     # one scale for both halves of a 32-weight group would fail the bound
    p1 = dataclasses.replace(p, scales=np.repeat(np.asarray(p.scales)[:, ::2], 2, axis=1))
    assert np.linalg.norm(got - _bf16_reference(x, p1)) / np.linalg.norm(ref) > 1e-2
  full = np.asarray(repack.planes_matmul_reference(jnp.asarray(x),
                                                   jax.tree.map(jnp.asarray, p)), np.float64)
  assert np.linalg.norm(got - full) / np.linalg.norm(full) <= 1e-2   # bf16 operand rounding


def test_vmapped_rows_fold_into_one_mosaic_call():
  """`layers.linear` on a tiled Q4_K weight under nested `jax.vmap` (the batched decode loop)
  traces one Mosaic GPU kernel over the folded rows [B1*B2*M, K], whose grid is that of a plain
  call (a vmapped kernel would get a batch grid axis and read the weight once per row)."""
  import re
  from dflash_jax import layers
  from dflash_jax.runtime import Runtime
  # the grids printed in the trace (the Mosaic GPU kernel is not a `pallas_call` equation in
  # GPU interpret mode; its grid and its pipeline's grid are printed with it)
  printed_grids = lambda fn, a: re.findall(r"grid=\(([^)]*)\)", str(jax.make_jaxpr(fn)(a)))  # noqa: E731
  rng = np.random.default_rng(1)
  n, k = 128, 512
  t = jax.tree.map(jnp.asarray, mm.to_tiles(_weight(rng, n, k)))
  rt = Runtime(kernels="mosaic_interpret", compute_dtype="bfloat16")
  x = jnp.asarray(rng.standard_normal((2, 3, 1, k)), jnp.float32)
  f = lambda xr: layers.linear(xr, t, rt)                        # noqa: E731
  plain = printed_grids(f, x.reshape(6, k))
  assert len(plain) == 1
  assert printed_grids(jax.vmap(jax.vmap(f)), x) == plain
  assert jax.eval_shape(jax.vmap(jax.vmap(f)), x).shape == (2, 3, 1, n)


_spec = functools.partial(mm.tile_specs, fmt="q4_k")


# Qwen3.5-27B: FFN gate/up [17408, 5120], down [5120, 17408], attention / DeltaNet projections
# [6144, 5120], output [248320, 5120] (Q6_K in a Q4_K_M file, as are some layers' ffn_down and
# attn_v), Gated DeltaNet attn_qkv [10240, 5120] (Q5_K in older llama.cpp and unsloth Q4_K_M
# files); M = 1 (decode), 16, 23 (DDTree budget 22 + root), 32, 64 (batched decode).
LOWER_CASES = [(17408, 5120, 1, "q4_k"), (17408, 5120, 23, "q4_k"), (5120, 17408, 16, "q4_k"),
               (5120, 17408, 32, "q4_k"), (6144, 5120, 64, "q4_k"), (5120, 17408, 1, "q6_k"),
               (17408, 5120, 23, "q6_k"), (248320, 5120, 64, "q6_k"), (10240, 5120, 1, "q5_k"),
               (10240, 5120, 23, "q5_k")]


@pytest.mark.parametrize("n,k,m,fmt", LOWER_CASES)
def test_gpu_configuration_lowers_for_cuda(n, k, m, fmt):
  cfg = mm.default_config(m, n, k, n_sm=132, fmt=fmt)
  assert cfg.a_operand == "registers" and cfg.compute_wgs == 2 and cfg.stages >= 2
  assert mm.smem_bytes(cfg, m, fmt) <= mm.SMEM_LIMIT
  exp = export.export(jax.jit(lambda x, t: mm.kquant_matmul(x, t, cfg)), platforms=["cuda"])(
      jax.ShapeDtypeStruct((m, k), jnp.float32), mm.tile_specs(n, k, fmt))
  assert "mosaic_gpu" in exp.mlir_module()


def test_shape_errors_name_the_problem():
  t = _spec(192, 512)
  x = jnp.zeros((1, 512), jnp.float32)
  with pytest.raises(ValueError, match="multiple of 128"):
    mm.kquant_matmul(x, t, mm.MgpuConfig(n_sm=1))
  with pytest.raises(ValueError, match="K=512 is not a multiple"):
    mm.kquant_matmul(x, _spec(128, 512), mm.MgpuConfig(n_sm=1, splits=4))
  with pytest.raises(ValueError, match="x has K=256"):
    mm.kquant_matmul(jnp.zeros((1, 256)), t, mm.MgpuConfig(n_sm=1))
  with pytest.raises(ValueError, match="shared memory"):
    mm.kquant_matmul(jnp.zeros((64, 512)), _spec(128, 512), mm.MgpuConfig(n_sm=1, kb=2, stages=8))
  with pytest.raises(ValueError, match="a_operand"):
    mm.MgpuConfig(a_operand="tmem")
  with pytest.raises(ValueError, match="Q4KTiles, Q5KTiles or Q6KTiles"):
    mm.kquant_matmul(x, repack.repack(_random_blocks(np.random.default_rng(0), "q6_k", 2, 2),
                                      "q6_k", (2, 512)))


def _on_hopper():
  d = jax.devices()[0]
  return d.platform == "gpu" and ("H100" in d.device_kind or "H200" in d.device_kind)


@pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU (H100 / H200)")
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("a_operand", ["registers", "smem"])
@pytest.mark.parametrize("m,n,k", [(1, 512, 1024), (23, 1024, 512), (64, 256, 2048),
                                   (70, 256, 512), (23, 17408, 5120)])
def test_on_gpu_matches_bf16_operand_reference(m, n, k, a_operand, fmt):
  """The GPU configuration itself (both WGMMA operand placements), on the device."""
  from pallas_kernels.dequant_matmul import device_sm_count
  rng = np.random.default_rng(n + m)
  p = _weight(rng, n, k, fmt)
  x = rng.standard_normal((m, k)).astype(np.float32)
  cfg = mm.default_config(min(m, mm.MAX_TOKENS), n, k, device_sm_count(), fmt,
                          a_operand=a_operand)
  got = np.asarray(jax.jit(lambda x, t: mm.kquant_matmul(x, t, cfg))(
      jnp.asarray(x), jax.tree.map(jnp.asarray, mm.to_tiles(p))), np.float64)
  ref = _bf16_reference(x, p)
  err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
  assert err <= 1e-5, (err, cfg)


def test_model_wiring_of_the_mosaic_kernel(monkeypatch):
  """kernels="mosaic*" on the tiny Qwen3.5 hybrid (Q4_K_M): the Q4_K and Q6_K weights are tiled at
  load (`target_params.tile_kquants`: the fused gate|up and qkv groups, the GDN and FFN projections
  whose N and K tile, the Q6_K attn_qkv / attn_v / ffn_down and lm_head; the embedding, an lm_head
  tied to it and other formats untouched; the file has no Q5_K) and `layers.linear` sends exactly
  those to the Mosaic GPU kernel. Checked three ways, since a whole model in GPU interpret mode
  deadlocks XLA's CPU pool (concurrent kernels, each needing its simulated warpgroups' threads):
  (1) with the kernel call replaced by the float32 planes reference, the logits of a 9-token
  forward equal the reference target's (relative L2 <= 1e-5: tiling, group splitting and dispatch
  are exact); (2) one real interpret-mode call of `linear` on a tiled model weight of each format
  against the bf16-operand float64 product (<= 1e-5); (3) the whole prefill and the logits with
  kernels="mosaic" lower for an H100 without a GPU. Float weights are refused."""
  import dflash_jax as dj
  from dflash_jax import layers, target as target_lib, target_params
  from dflash_jax.gguf_io import read_gguf
  from dflash_jax.quants import QuantWeight
  from dflash_jax.runtime import Runtime
  from conftest import QWEN
  path = os.path.join(QWEN, "model-q4_k_m.gguf")
  ref = dj.load_target(path, kernels="reference")
  mos = dj.load_target(path, kernels="mosaic_interpret")
  is_w = lambda x: isinstance(x, (*mm.TILES, QuantWeight))
  leaves = [x for x in jax.tree.leaves(mos.params.layers, is_leaf=is_w) if is_w(x)]
  tiles = [x for x in leaves if isinstance(x, mm.TILES)]
  q6 = [x for x in tiles if isinstance(x, mm.Q6KTiles)]
  assert len(tiles) >= 8 and len(q6) >= 3 and not any(
      x.fmt in ("q4_k", "q6_k") and x.shape[0] % 64 == 0
      for x in leaves if isinstance(x, QuantWeight))
  assert isinstance(mos.params.embed, QuantWeight) and isinstance(mos.params.lm_head, mm.Q6KTiles)
  ids = [1, 5, 9, 33, 100, 7, 2, 64, 80]
  calls = []

  def planes_ref(x2, w, rt):
    calls.append(type(w))
    return repack.planes_matmul_reference(x2, mm.to_planes(w))

  with monkeypatch.context() as mp:
    mp.setattr(layers, "_mosaic_matmul", planes_ref)
    lm = np.asarray(dj.forward_logits(mos, ids), np.float64)
  lr = np.asarray(dj.forward_logits(ref, ids), np.float64)
  assert set(calls) == {mm.Q4KTiles, mm.Q6KTiles}
  assert np.linalg.norm(lm - lr) / np.linalg.norm(lr) <= 1e-5
  for t in (next(x for x in tiles if isinstance(x, mm.Q4KTiles)), q6[0]):
    x = np.random.default_rng(0).standard_normal((5, t.shape[1])).astype(np.float32)
    got = np.asarray(layers.linear(jnp.asarray(x), t, mos.runtime), np.float64)
    want = _bf16_reference(x, mm.to_planes(jax.tree.map(np.asarray, t)))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5
  # (3) the GPU configuration of the whole prefill, lowered for an H100
  rt = Runtime(kernels="mosaic", compute_dtype="bfloat16")
  host = target_params.load_params(read_gguf(path), mos.config, weights="quantized")
  tiled = target_params.tile_kquants(host, rows_multiple=layers.mosaic_rows_multiple(rt))
  spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tiled)
  cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                       target_lib.init_cache(mos.config, 64, rt))
  fn = lambda p, c, toks: target_lib.logits(      # the Q6_K lm_head too
      p, mos.config, target_lib.prefill(p, mos.config, toks, jnp.int32(0), jnp.int32(9), c,
                                        rt).hidden, rt)
  from test_kernels import H100
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,),
                                   abstract_device=jax.sharding.AbstractDevice(H100, 1, "cuda"))
  with jax.sharding.use_abstract_mesh(mesh):      # Triton's lowering asks for a GPU model
    txt = jax.jit(fn).trace(spec, cache, jax.ShapeDtypeStruct((9,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in txt
  # an lm_head tied to the embedding (read by row gathers) stays GGUF rows
  tied = target_params.tile_kquants(dataclasses.replace(host, lm_head=host.embed),
                                    rows_multiple=64)
  assert tied.lm_head is tied.embed and isinstance(tied.lm_head, QuantWeight)
  with pytest.raises(ValueError, match="weights='quantized'"):
    dj.load_target(path, kernels="mosaic_interpret", weights="f32")


@pytest.mark.skipif(not _on_hopper(), reason="needs a Hopper GPU (H100 / H200)")
def test_model_with_mosaic_kernels_on_gpu(monkeypatch):
  """The tiny Qwen3.5 hybrid (Q4_K_M) with kernels="mosaic" on the device, the real kernel in the
  model's own shapes (prefill M = 9, AR M = 1, chain / DDTree verifies, two batched rows):
  (1) logits of a 9-token forward vs the same tiled model with the kernel call replaced by XLA's
  dot of the same bf16-rounded operands (f32 accumulation), relative L2 <= 2e-3 (a misplaced tile
  or scale gives O(1); bf16 rounding flips of x between the two paths give ~1e-4), and vs the
  float32 reference model <= 3e-2 (the bf16 operands' own error); (2) chain and DDTree output
  token-identical to AR with the same kernels; (3) two rows in one batched loop (the rows folded
  into each kernel call) give each row's tokens alone."""
  import dflash_jax as dj
  from dflash_jax import layers, quants
  from conftest import QWEN, DRAFT
  path = os.path.join(QWEN, "model-q4_k_m.gguf")
  ref = dj.load_target(path, kernels="reference")
  mos = dj.load_target(path, kernels="mosaic")
  ids = [1, 5, 9, 33, 100, 7, 2, 64, 80]
  lm = np.asarray(dj.forward_logits(mos, ids), np.float64)
  calls = []

  def xla_bf16(x2, w, rt):
    calls.append(type(w))
    wb = quants.dequantize(w, jnp.bfloat16)      # tiles -> planes -> gguf-py's values, rounded
    return jnp.dot(x2.astype(jnp.bfloat16), wb.T, preferred_element_type=jnp.float32)

  jax.clear_caches()                   # the forward's compiled program holds the kernel call
  with monkeypatch.context() as mp:
    mp.setattr(layers, "_mosaic_matmul", xla_bf16)
    lx = np.asarray(dj.forward_logits(mos, ids), np.float64)
  jax.clear_caches()
  assert set(calls) == {mm.Q4KTiles, mm.Q6KTiles}
  lr = np.asarray(dj.forward_logits(ref, ids), np.float64)
  assert np.linalg.norm(lm - lx) / np.linalg.norm(lx) <= 2e-3
  assert np.linalg.norm(lm - lr) / np.linalg.norm(lr) <= 3e-2
  draft = dj.load_draft(DRAFT, mos)
  ar = dj.generate(mos, None, ids, max_new_tokens=12, mode="ar", max_ctx=64).tokens
  for mode in ("chain", "ddtree"):
    got = dj.generate(mos, draft, ids, max_new_tokens=12, mode=mode, budget=6, max_ctx=64)
    assert got.tokens == ar, mode
  prompts = [ids, [3, 14, 15, 92, 65]]
  rows = dj.generate_batch(mos, draft, prompts, max_new_tokens=8, mode="chain", max_ctx=64,
                           batch_size=2)
  for p, r in zip(prompts, rows):
    assert r.tokens == dj.generate(mos, None, p, max_new_tokens=8, mode="ar", max_ctx=64).tokens
