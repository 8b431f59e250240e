"""Pallas kernels (Triton lowering): numerics in interpret mode on CPU (the compiled kernels
where a GPU is the default backend), and deviceless lowering for an H100 at the tile
configurations the model uses.

Tolerance norm: relative Frobenius error ||y - ref||_F / ||ref||_F against a float64 numpy
reference (gguf-py's `gguf.quants.dequantize` for the weights).
  * float32 operands: < 1e-5 in interpret mode (exact f32 products); on a GPU the same call
    runs TF32 tensor cores (x rounded to a 10-bit mantissa): < 3e-3.
  * bfloat16 operands: the codes q are exact in bf16 and scales apply in f32 after each
    sub-block dot, so the only rounding is x -> bf16: compared against the float64 product of
    bf16-rounded x, < 1e-5 (< 1e-4 on a GPU: tensor-core f32 accumulation order); against
    unrounded x the error is the bf16 rounding (< 1e-2).
Inputs are fresh random bytes every run (the seed is printed on failure); the Pallas interpreter
starts outputs as NaN (jax/_src/pallas/hlo_interpreter.py, `uninitialized_value`), so an
element the kernel never writes fails the finiteness checks.
"""


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from dflash_jax.quants import BLOCK_FORMATS, QuantWeight
from pallas_kernels import dequant_matmul as dm
from pallas_kernels import tree_gdn as tg
from kernel_inputs import root_path, tree_gdn_inputs
from test_quants import _random_blocks

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")

# Where a GPU is the default backend the same tests run the compiled kernels.
ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
F32_TOL = 3e-3 if ON_GPU else 1e-5     # TF32 tensor cores on GPU
EXACT_TOL = 1e-4 if ON_GPU else 1e-5   # bf16 operands vs the f64 product of bf16-rounded x

H100 = "NVIDIA H100 80GB HBM3"
H100_SMS = 132   # default_tiles reads the SM count from the device; lowering has no device
# Qwen3.5-27B matrix shapes [N, K] (GGUF [out, in]): ffn_gate/up, ffn_down, GDN attn_qkv,
# ssm_out / attn_output, attn_q (+gate), output, then the fused projections the loader builds
# (layers.fuse_projections): gate|up, attn_qkv|attn_gate, ssm_beta|ssm_alpha, q|k, q|k|v, k/v;
# and SmolLM2-135M's (q|k|v 960, gate|up 3072 fused).
QWEN27B_SHAPES = [(17408, 5120), (5120, 17408), (10240, 5120), (5120, 6144), (12288, 5120),
                  (248320, 5120), (34816, 5120), (16384, 5120), (96, 5120), (13312, 5120),
                  (14336, 5120), (1024, 5120)]
SMOL_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (960, 576),
               (3072, 576)]


def _fresh_rng():
  seed = int(np.random.SeedSequence().entropy % (2**32))
  return np.random.default_rng(seed), seed


def _rel(y, ref):
  y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _lower_for_h100(fn, *specs) -> str:
  dev = jax.sharding.AbstractDevice(H100, 1, "cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                   abstract_device=dev)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------- dequant matmul

@pytest.mark.parametrize("fmt", dm.KERNEL_FORMATS)
@pytest.mark.parametrize("m,tiles", [
    (1, None), (23, dm.TileConfig(bm=16, bn=32, k_splits=2, words=False)),
    (5, dm.TileConfig(bm=16, bn=32, fold_scales=False)),
    (23, dm.TileConfig(bm=32, bn=32, words=True))])
def test_dequant_matmul_interpret_vs_gguf(fmt, m, tiles):
  """Every kernel path: scales after each sub-block dot (exact in bf16 up to x's rounding); the
  folded path (FOLD_FORMATS by default, Q4_K also from 32-bit words), whose weights are rounded
  to the operand dtype exactly as the XLA reference path dequantize(w, bf16) rounds them."""
  rng, seed = _fresh_rng()
  n, k = 64, 512
  blk = BLOCK_FORMATS[fmt][0]
  raw = _random_blocks(rng, fmt, n, k // blk)
  w64 = gq.dequantize(raw, QT[fmt.upper()]).astype(np.float64)          # [N, K]
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = QuantWeight(jnp.asarray(raw), fmt, (n, k))
  y32 = dm.dequant_matmul(jnp.asarray(x), w, compute_dtype=jnp.float32, tiles=tiles,
                          interpret=INTERPRET)
  ybf = dm.dequant_matmul(jnp.asarray(x), w, compute_dtype=jnp.bfloat16, tiles=tiles,
                          interpret=INTERPRET)
  ref = x.astype(np.float64) @ w64.T
  xbf = x.astype(ml_dtypes.bfloat16).astype(np.float64)
  assert y32.shape == ybf.shape == (m, n)
  assert np.isfinite(np.asarray(y32)).all() and np.isfinite(np.asarray(ybf)).all(), f"seed {seed}"
  assert _rel(y32, ref) < F32_TOL, f"seed {seed}"
  assert _rel(ybf, ref) < 1e-2, f"seed {seed}"
  t = tiles or dm.TileConfig()
  rounds_w = fmt in dm.FOLD_FORMATS and t.fold_scales
  if rounds_w:
    ybf_ref = dm.dequant_matmul_reference(jnp.asarray(x), w, jnp.bfloat16)
    assert _rel(ybf, ybf_ref) < 1e-4, f"seed {seed}"
  else:
    assert _rel(ybf, xbf @ w64.T) < EXACT_TOL, f"seed {seed}"
  # and against the model's pure-JAX reference path
  yr = dm.dequant_matmul_reference(jnp.asarray(x), w, jnp.float32)
  assert _rel(y32, yr) < F32_TOL, f"seed {seed}"


def test_dequant_matmul_smollm2_q4_1_tensor(smol_path):
  """A real GGUF tensor (SmolLM2 Q4_1 ffn_down: K = 1536, 48 blocks per row) through the
  kernel's default tiles, vs gguf-py's dequantize."""
  from dflash_jax.gguf_io import read_gguf
  from dflash_jax.quants import from_numpy
  t = read_gguf(smol_path).tensors["blk.0.ffn_down.weight"]
  w = jax.tree.map(jnp.asarray, from_numpy(t.data, t.fmt, t.shape, name=t.name))
  assert w.fmt == "q4_1" and w.fmt in dm.KERNEL_FORMATS
  rng, seed = _fresh_rng()
  x = rng.standard_normal((3, w.shape[1])).astype(np.float32)
  w64 = gq.dequantize(np.asarray(w.data), QT[w.fmt.upper()]).astype(np.float64)
  y = dm.dequant_matmul(jnp.asarray(x), w, compute_dtype=jnp.float32, interpret=INTERPRET)
  assert _rel(y, x.astype(np.float64) @ w64.T) < F32_TOL, f"seed {seed}"


def test_dequant_matmul_rejects_bad_input():
  w16 = QuantWeight(jnp.zeros((64, 64), jnp.float16), "f16", (64, 64))
  with pytest.raises(ValueError, match="no kernel for format 'f16'"):
    dm.dequant_matmul(jnp.zeros((1, 64)), w16)
  w = QuantWeight(jnp.zeros((64, 2 * 34), jnp.uint8), "q8_0", (64, 64))
  with pytest.raises(ValueError, match="does not match"):
    dm.dequant_matmul(jnp.zeros((1, 32)), w)
  with pytest.raises(ValueError, match="do not fit"):
    dm.dequant_matmul(jnp.zeros((1, 64)), w, tiles=dm.TileConfig(bn=128))
  with pytest.raises(ValueError, match="no power-of-2 tile"):
    dm.default_tiles(1, 24, 64, "q8_0")
  assert not dm.supports(QuantWeight(jnp.zeros((4, 34), jnp.uint8), "q8_0", (4, 32)))


def kernel_calls(fn, *args) -> list[tuple[str, tuple[int, ...]]]:
  """(kernel name, grid) of every pallas_call in fn's traced program, nested jaxprs (jit, loops,
  branches, custom rules) included. args: arrays or ShapeDtypeStructs."""
  out = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        name = e.params.get("name", e.params.get("name_and_src_info"))
        out.append((str(getattr(name, "name", name)), tuple(e.params["grid_mapping"].grid)))
      for v in e.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def _kernel_grids(fn, *args) -> list[tuple[int, ...]]:
  return [g for _, g in kernel_calls(fn, *args)]


def test_linear_folds_vmapped_rows_into_one_kernel_call():
  """`layers.linear` under `jax.vmap` (the batched decode loop vmaps one row's step over the
  rows): the rows of every vmap level fold into the kernel's M, one pallas_call whose grid is
  that of a plain call on [B*M, K] (a vmapped pallas_call would get a batch grid axis and read
  every weight tile once per row), bit-identical to row-by-row calls and within the f32
  tolerance of gguf-py's float64 product; a batched weight (the MoE experts' form) keeps one
  kernel per batch element, equal to expert-by-expert calls; and a batch of 64 one-token rows at
  Qwen3.5-27B's ffn_gate/up shape lowers for an H100 as one Triton call."""
  from dflash_jax import layers
  from dflash_jax.runtime import Runtime
  rng, seed = _fresh_rng()
  rt = Runtime(kernels="pallas" if ON_GPU else "pallas_interpret", compute_dtype="float32")
  n, k = 64, 512
  raw = _random_blocks(rng, "q4_k", n, k // 256)
  w = QuantWeight(jnp.asarray(raw), "q4_k", (n, k))
  x = jnp.asarray(rng.standard_normal((2, 3, 5, k)), jnp.float32)
  f = lambda xr: layers.linear(xr, w, rt)                          # noqa: E731
  y = jax.jit(jax.vmap(jax.vmap(f)))(x)
  rows = np.stack([np.stack([np.asarray(f(x[i, j])) for j in range(3)]) for i in range(2)])
  assert np.array_equal(np.asarray(y), rows), f"seed {seed}"
  w64 = gq.dequantize(raw, QT.Q4_K).astype(np.float64)
  assert _rel(y, np.asarray(x, np.float64) @ w64.T) < F32_TOL, f"seed {seed}"
  assert _kernel_grids(jax.vmap(jax.vmap(f)), x) == _kernel_grids(f, x.reshape(30, k))
  assert _kernel_grids(jax.vmap(f), x[0]) == _kernel_grids(f, x[0].reshape(15, k))
  assert len(_kernel_grids(jax.vmap(f), x[0])) == 1
  # batched weights: one kernel per expert, as expert-by-expert calls
  experts = jnp.stack([jnp.asarray(_random_blocks(rng, "q4_k", n, k // 256)) for _ in range(3)])
  one = lambda xs, d: layers.linear(xs, QuantWeight(d, "q4_k", (n, k)), rt)   # noqa: E731
  ye = jax.vmap(one)(x[0], experts)
  assert np.array_equal(np.asarray(ye), np.stack([np.asarray(one(x[0, e], experts[e]))
                                                  for e in range(3)])), f"seed {seed}"
  (grid,) = _kernel_grids(jax.vmap(one), x[0], experts)
  assert grid[0] == 3 and grid[1:] == _kernel_grids(f, x[0, 0])[0]
  # a batch of 64 decode rows at a 27B shape: one kernel call in the CUDA lowering
  n, k = 17408, 5120
  g = lambda xb, data: jax.vmap(lambda xr: layers.linear(             # noqa: E731
      xr, QuantWeight(data, "q4_k", (n, k)), Runtime(kernels="pallas", compute_dtype="bfloat16")))(xb)
  txt = _lower_for_h100(g, jax.ShapeDtypeStruct((64, 1, k), jnp.bfloat16),
                        jax.ShapeDtypeStruct((n, k // 256 * 144), jnp.uint8))
  assert txt.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("fmt", dm.KERNEL_FORMATS)
def test_dequant_matmul_lowers_for_h100(fmt):
  """Every format at the model's default tiles for the Qwen3.5-27B shapes (decode M=1, chain
  verify M=16, tree verify M=23 and 32, prefill tile M=64), and for SmolLM2's shapes where the
  format tiles them; the real Pallas -> Triton IR lowering, on a CPU-only jaxlib."""
  blk, size = BLOCK_FORMATS[fmt]
  shapes = list(QWEN27B_SHAPES) + [s for s in SMOL_SHAPES if s[1] % blk == 0]
  seen = set()
  for n, k in shapes:
    for m in (1, 16, 23, 32, 64):
      tiles = dm.default_tiles(m, n, k, fmt, n_sm=H100_SMS)
      key = (tiles, k // blk // tiles.k_splits, m)
      if key in seen:
        continue
      seen.add(key)

      def f(x, data, n=n, k=k, tiles=tiles):
        return dm.dequant_matmul(x, QuantWeight(data, fmt, (n, k)), tiles=tiles)

      txt = _lower_for_h100(f, jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                            jax.ShapeDtypeStruct((n, k // blk * size), jnp.uint8))
      assert "__gpu$xla.gpu.triton" in txt, (fmt, n, k, m, tiles)


@pytest.mark.parametrize("fmt,n,k,m,tiles", [
    ("q4_k", 17408, 5120, 23, dm.TileConfig(bm=32, bn=64, k_splits=4, words=True)),
    ("q4_k", 5120, 17408, 1, dm.TileConfig(bm=16, bn=32, k_splits=4, words=False)),
    ("q6_k", 5120, 17408, 1, dm.TileConfig(bm=16, bn=32, k_splits=4, fold_scales=False))])
def test_dequant_matmul_variants_lower_for_h100(fmt, n, k, m, tiles):
  """The 32-bit-word, byte and unfolded variants at Qwen3.5-27B shapes lower for an H100."""
  blk, size = BLOCK_FORMATS[fmt]

  def f(x, data):
    return dm.dequant_matmul(x, QuantWeight(data, fmt, (n, k)), tiles=tiles)

  txt = _lower_for_h100(f, jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                        jax.ShapeDtypeStruct((n, k // blk * size), jnp.uint8))
  assert "__gpu$xla.gpu.triton" in txt


def test_lowering_check_catches_non_power_of_two_tiles():
  """The lowering test can fail: a 48-row tile is rejected by the Triton lowering."""
  def f(x, data):
    return dm.dequant_matmul(x, QuantWeight(data, "q8_0", (96, 64)),
                             tiles=dm.TileConfig(bm=16, bn=48))
  with pytest.raises(ValueError, match="power of 2"):
    _lower_for_h100(f, jax.ShapeDtypeStruct((16, 64), jnp.bfloat16),
                    jax.ShapeDtypeStruct((96, 68), jnp.uint8))


# ----------------------------------------------------------------------------- tree GDN

def _chain_np(q, k, v, g, beta, s0, path):
  """float64 numpy recurrence along `path` (node ids, root first): states after each node."""
  s = s0.astype(np.float64)
  outs, states = [], []
  for i in path:
    s = s * np.exp(g[i])[:, None, None]
    kv = np.einsum("hk,hkv->hv", k[i], s)
    s = s + k[i][:, :, None] * ((v[i] - kv) * beta[i][:, None])[:, None, :]
    outs.append(np.einsum("hk,hkv->hv", q[i], s))
    states.append(s)
  return outs, states


@pytest.mark.parametrize("n,hv,dk,dv,bv", [(16, 3, 32, 32, None), (23, 2, 64, 64, 32)])
def test_tree_gdn_interpret_vs_reference(n, hv, dk, dv, bv):
  rng, seed = _fresh_rng()
  parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)
  args = tree_gdn_inputs(rng, n, hv, dk, dv)
  o, st = tg.tree_gdn(*map(jnp.asarray, args), jnp.asarray(parents), bv=bv, interpret=INTERPRET)
  o_ref, st_ref = tg.tree_gdn_reference(*map(jnp.asarray, args), jnp.asarray(parents))
  assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(st)).all(), f"seed {seed}"
  assert _rel(o, o_ref) < 1e-5 and _rel(st, st_ref) < 1e-5, f"seed {seed}"
  # every node == the float64 chain recurrence along its root path
  for i in range(n):
    outs, states = _chain_np(*args, root_path(parents, i))
    assert _rel(o[i], outs[-1]) < 1e-5 and _rel(st[i], states[-1]) < 1e-5, f"seed {seed} node {i}"


@pytest.mark.parametrize("n,hv,dk,dv,bv,max_depth", [(16, 3, 32, 32, None, None),
                                                     (23, 2, 64, 64, 32, "tree")])
def test_tree_gdn_without_states_and_replay(n, hv, dk, dv, bv, max_depth):
  """`Runtime.gdn_commit="replay"`: the outputs-only kernel (each node's state rebuilt in
  registers from its root path) against the reference's outputs and the float64 chain along
  every root path (and the one-walk chain kernel against the reference); the reference without
  states gives the same outputs bit for bit; and
  `replay_path` over a node's root path (what the commit runs) rebuilds the state the
  states-writing reference stored for it, to float32 rounding (<= 1e-6 relative)."""
  rng, seed = _fresh_rng()
  parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)
  depths = np.array([len(root_path(parents, i)) - 1 for i in range(n)])
  md = int(depths.max()) if max_depth == "tree" else None
  args = tree_gdn_inputs(rng, n, hv, dk, dv)
  ja = list(map(jnp.asarray, args))
  o, none = tg.tree_gdn(*ja, jnp.asarray(parents), bv=bv, interpret=INTERPRET, states=False,
                        max_depth=md)
  assert none is None
  o_ref, st_ref = tg.tree_gdn_reference(*ja, jnp.asarray(parents))
  o_ref2, none = tg.tree_gdn_reference(*ja, jnp.asarray(parents), states=False)
  assert none is None and np.array_equal(np.asarray(o_ref2), np.asarray(o_ref))
  assert np.isfinite(np.asarray(o)).all() and _rel(o, o_ref) < 1e-5, f"seed {seed}"
  q, k, v, g, beta, s0 = args
  for i in range(n):
    path = root_path(parents, i)
    outs, _ = _chain_np(*args, path)
    assert _rel(o[i], outs[-1]) < 1e-5, f"seed {seed} node {i}"
    pad = path + [path[-1]] * (n - len(path))             # fixed trip count, masked past the path
    s = tg.replay_path(jnp.asarray(s0), *(jnp.asarray(a[pad]) for a in (k, v, g, beta)),
                       jnp.int32(len(path)))
    assert _rel(s, st_ref[i]) < 1e-6, f"seed {seed} node {i}"
  chain = np.arange(n, dtype=np.int32) - 1          # a path tree: the one-walk kernel
  oc, _ = tg.tree_gdn(*ja, jnp.asarray(chain), bv=bv, interpret=INTERPRET, states=False,
                      is_path=True)
  oc_ref, _ = tg.tree_gdn_reference(*ja, jnp.asarray(chain))
  assert _rel(oc, oc_ref) < 1e-5, f"seed {seed}"
  anc = np.asarray(tg.ancestor_path(jnp.asarray(parents), n))
  for i in range(n):                         # right-aligned root path, -1 before the root
    row = anc[i][anc[i] >= 0].tolist()
    assert row[-1] == i and row[0] == 0 and len(row) == depths[i] + 1
    assert all(parents[b] == a for a, b in zip(row, row[1:]))


def test_tree_gdn_rejects_untileable_heads():
  z = jnp.zeros
  with pytest.raises(ValueError, match="do not tile"):
    tg.tree_gdn(z((4, 2, 24)), z((4, 2, 24)), z((4, 2, 32)), z((4, 2)), z((4, 2)),
                z((2, 24, 32)), jnp.array([-1, 0, 1, 2], jnp.int32))


@pytest.mark.parametrize("n", [16, 23])
def test_tree_gdn_lowers_for_h100(n):
  """Qwen3.5-27B GDN shapes: 48 V heads, Dk = Dv = 128, trees of 16 and 23 nodes."""
  S = jax.ShapeDtypeStruct
  f32 = jnp.float32
  txt = _lower_for_h100(lambda *a: tg.tree_gdn(*a), S((n, 48, 128), f32), S((n, 48, 128), f32),
                        S((n, 48, 128), f32), S((n, 48), f32), S((n, 48), f32),
                        S((48, 128, 128), f32), S((n,), jnp.int32))
  assert "__gpu$xla.gpu.triton" in txt
  txt = _lower_for_h100(lambda *a: tg.tree_gdn(*a, states=False, max_depth=15, is_path=n == 16),
                        S((n, 48, 128), f32), S((n, 48, 128), f32), S((n, 48, 128), f32),
                        S((n, 48), f32), S((n, 48), f32), S((48, 128, 128), f32),
                        S((n,), jnp.int32))
  assert "__gpu$xla.gpu.triton" in txt


# ----------------------------------------------------------------------------- in the model

def test_model_with_pallas_kernels_matches_reference():
  """The tiny Qwen3.5 hybrid (Q4_K_M: Q4_K, Q6_K and Q8_0... tensors) through forward with
  kernels="pallas_interpret" vs "reference": logits to 1e-5, and DDTree decoding (tree GDN
  kernel, with per-node states and with the outputs-only kernel + replayed commit) and a
  two-row batched chain token-identical."""
  import os
  import dflash_jax as dj
  from conftest import QWEN, DRAFT
  path = os.path.join(QWEN, "model-q4_k_m.gguf")
  ref = dj.load_target(path, kernels="reference")
  kind = "pallas" if ON_GPU else "pallas_interpret"
  ker = dj.load_target(path, kernels=kind)
  assert ker.runtime.kernels == kind
  ids = [1, 5, 9, 33, 100, 7, 2, 64, 80]
  lr = np.asarray(dj.forward_logits(ref, ids))
  lk = np.asarray(dj.forward_logits(ker, ids))
  assert _rel(lk, lr) < F32_TOL
  draft = dj.load_draft(DRAFT, ref)
  a = dj.generate(ref, draft, ids, max_new_tokens=6, mode="ddtree", budget=6, max_ctx=64)
  b = dj.generate(ker, dj.load_draft(DRAFT, ker), ids, max_new_tokens=6, mode="ddtree", budget=6,
                  max_ctx=64)
  assert a.tokens == b.tokens
  # the outputs-only tree kernel with the commit's replay (Runtime.gdn_commit "replay")
  rep = dj.load_target(path, kernels=kind, gdn_commit="replay")
  c = dj.generate(rep, dj.load_draft(DRAFT, rep), ids, max_new_tokens=6, mode="ddtree", budget=6,
                  max_ctx=64)
  assert c.tokens == a.tokens and c.accept_lens == b.accept_lens
  # two rows in one batched loop (layers.linear folds the rows into each kernel call): each
  # row's tokens are the reference kernels' for that prompt alone
  prompts = [ids, [3, 14, 15, 92, 65]]
  rows = dj.generate_batch(ker, dj.load_draft(DRAFT, ker), prompts, max_new_tokens=5,
                           mode="chain", max_ctx=64, batch_size=2)
  for p, r in zip(prompts, rows):
    assert r.tokens == dj.generate(ref, draft, p, max_new_tokens=5, mode="chain",
                                   max_ctx=64).tokens
