"""Q4_K dequantizing matmul for Hopper in Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`).

Contract: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T, float32 out, for M tokens (decode, chain /
tree verify, batched decode; one kernel call per 64 tokens) and W a Q4_K weight in `Q4KTiles`
layout (made at load from `repack.Planes`, same bytes: 148 per 256 weights, GGUF's 144 + 2.8 %).

Design (issue 30; ideas taken from JAX's `ops/gpu/hopper_mixed_type_matmul_mgpu.py`: a
warp-specialized TMA pipeline (`plgpu.emit_pipeline_warp_specialized`, one memory warpgroup,
two compute warpgroups), the quantized operand loaded from SMEM into registers, converted there
and fed to WGMMA as the register operand, a persistent grid walking the work items with
`plgpu.nd_loop`):
  * swap-AB: the weight rows sit on WGMMA's M side (64 rows a compute warpgroup, 128 a CTA) and
    the tokens on its N side (M padded to 16, 32 or 64: `padded_tokens`), so one WGMMA serves
    1..64 tokens with no extra weight traffic; the kernel computes y^T [N, M] tiles.
  * the 4-bit codes travel as a [K/64, N, 32] uint8 plane: plane g holds the 32 code bytes of
    weights 64g .. 64g+63 of every row (weight 64g+i in the low nibble of byte i, 64g+32+i in
    the high nibble: GGUF's in-block order), so each TMA box is [tile_k/64, 128, 32] and one
    sub-block (32 weights, one 6-bit scale and min) is one [64, 32] SMEM slice.
  * scales folded before the MMA: per sub-block j the register tile is
    (d * sc_j) * q - (dmin * m_j) in float32, rounded once to bfloat16 (gguf-py's operation
    order, `k_quant_values`), then one K = 32 WGMMA against the matching 32 rows of x^T in
    SMEM. The 6-bit scales / mins and the f16 block scales travel transposed ([K/32, N] uint8,
    [K/256, N] float16) so each sub-block's 64 row scales are one contiguous SMEM row.
  * split-K: a work item is (CTA row tile, K split); splits write float32 partials
    [S, N, Mp] summed outside (for narrow matrices whose row tiles alone cannot fill the GPU).

Numerics: each weight rounded once to bfloat16 and x rounded to bfloat16, float32 accumulation
(the contract of `dequant_matmul(..., compute_dtype=bfloat16)`). Tested on the CPU
(tests/test_mgpu.py) in GPU interpret mode (`plgpu.force_gpu_interpret_mode`; a_operand="smem",
compute_wgs=1: what the interpreter can run) against a float64 product of the same bfloat16
operands, and lowered for CUDA without a GPU (`jax.export`: the Mosaic GPU module is built, its
layouts inferred and its dialect lowered) at Qwen3.5-27B shapes for the GPU configuration.
Timing needs an H100 (scripts/bench_kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.dequant_matmul import device_sm_count
from pallas_kernels.gguf_blocks import QK_K
from pallas_kernels.repack import Planes, arrays_nbytes

_WG_ROWS = 64            # weight rows per compute warpgroup (WGMMA's M)
_SUB = 32                # weights per Q4_K sub-block (one 6-bit scale and min)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4KTiles:
  """A Q4_K weight laid out for `q4k_matmul` (module docstring). Exact: a permutation of
  `repack.Planes`' bytes (`to_planes` inverts it).

  codes: [K/64, N, 32] uint8; scales, mins: [K/32, N] uint8 (6-bit values); d, dmin:
  [K/256, N] float16; shape: logical (N, K) (static)."""

  codes: jax.Array
  scales: jax.Array
  mins: jax.Array
  d: jax.Array
  dmin: jax.Array
  shape: tuple = dataclasses.field(default=(0, 0), metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes of all planes (what the device holds)."""
    return arrays_nbytes(self.codes, self.scales, self.mins, self.d, self.dmin)


def to_tiles(p: Planes) -> Q4KTiles:
  """repack.Planes (Q4_K) -> Q4KTiles (transposes only; numpy or jax arrays in, same kind out).
  Raises ValueError for another format."""
  if p.fmt != "q4_k":
    raise ValueError(f"q4k_matmul: Q4_K planes only, got {p.fmt!r}")
  n, k = p.shape
  xp = jnp if isinstance(p.codes, jax.Array) else np
  return Q4KTiles(codes=xp.transpose(p.codes.reshape(n, k // 64, 32), (1, 0, 2)),
                  scales=p.scales.T, mins=p.mins.T, d=p.d.T, dmin=p.dmin.T, shape=(n, k))


def to_planes(t: Q4KTiles) -> Planes:
  """Inverse of `to_tiles`."""
  n, k = t.shape
  xp = jnp if isinstance(t.codes, jax.Array) else np
  return Planes(codes=xp.transpose(t.codes, (1, 0, 2)).reshape(n, k // 2), scales=t.scales.T,
                mins=t.mins.T, d=t.d.T, dmin=t.dmin.T, fmt="q4_k", shape=(n, k))


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """Tiling of `q4k_matmul`. kb: 256-weight blocks per pipeline step (tile_k = 256 kb);
  splits: K splits (partials summed outside); stages: pipeline depth (max_concurrent_steps);
  n_sm: persistent programs (the GPU's SM count; 0 = the default device's);
  a_operand: where the dequantized weight tile meets WGMMA: "registers" (WGMMA's register
  operand, no SMEM round trip: the GPU default) or "smem" (stored to an SMEM tile first: the
  form GPU interpret mode can run, as it models WGMMA operands in SMEM only); compute_wgs:
  compute warpgroups a CTA (64 weight rows each; 2 on the GPU; 1 lets GPU interpret mode run on
  a 2-core CPU, whose XLA callback pool of 2 threads deadlocks when 3 simulated warpgroups
  block in barrier waits)."""
  kb: int = 1
  splits: int = 1
  stages: int = 4
  n_sm: int = 0
  a_operand: str = "registers"
  compute_wgs: int = 2

  def __post_init__(self):
    if self.compute_wgs not in (1, 2):
      raise ValueError(f"MgpuConfig.compute_wgs: 1 or 2, got {self.compute_wgs}")
    if self.a_operand not in ("registers", "smem"):
      raise ValueError(f"MgpuConfig.a_operand: 'registers' or 'smem', got {self.a_operand!r}")


MAX_TOKENS = 64          # tokens one kernel call serves (WGMMA N <= 64: SMEM for 3+ stages)
SMEM_LIMIT = 232448      # bytes of shared memory a Hopper CTA may use (H100: 227 KiB)


def padded_tokens(m: int) -> int:
  """WGMMA's N for M tokens: 16, 32 or a multiple of 64, so a bf16 row of x^T spans one 32 /
  64 / 128-byte swizzle (Mosaic GPU's swizzles)."""
  return 16 if m <= 16 else 32 if m <= 32 else -(-m // 64) * 64


def smem_bytes(cfg: MgpuConfig, m: int) -> int:
  """Shared memory `q4k_matmul` allocates for M tokens under cfg: `stages` copies of one
  pipeline step's tiles (codes, scales, mins, d, dmin, x^T) plus the output (and, for
  a_operand="smem", dequantized weight) tiles; barriers not counted (< 1 KiB)."""
  mp, rows, tile_k = padded_tokens(m), cfg.compute_wgs * _WG_ROWS, QK_K * cfg.kb
  step = tile_k * rows // 2 + 2 * (tile_k // _SUB) * rows + 2 * 2 * cfg.kb * rows + tile_k * mp * 2
  fixed = cfg.compute_wgs * _WG_ROWS * mp * 4
  if cfg.a_operand == "smem":
    fixed += cfg.compute_wgs * tile_k * _WG_ROWS * 2
  return cfg.stages * step + fixed


def default_config(m: int, n: int, k: int, n_sm: int, **kw) -> MgpuConfig:
  """Split K while the CTA row tiles number fewer than the SMs and each split keeps >= 4
  pipeline steps of one 256-weight block; as many pipeline stages (<= 4) as fit SMEM_LIMIT
  with 1 KiB to spare. kw: other MgpuConfig fields (a_operand, compute_wgs)."""
  base = MgpuConfig(kb=1, n_sm=n_sm, **kw)
  steps = k // QK_K
  splits = 1
  while (n // (base.compute_wgs * _WG_ROWS)) * splits < n_sm and steps % (splits * 2) == 0 \
      and steps // (splits * 2) >= 4:
    splits *= 2
  stages = 4
  while stages > 2 and smem_bytes(dataclasses.replace(base, stages=stages), m) > SMEM_LIMIT - 1024:
    stages -= 1
  return dataclasses.replace(base, splits=splits, stages=stages)


def rows_multiple(cfg: MgpuConfig) -> int:
  """The multiple of N a weight needs under cfg: 64 rows per compute warpgroup."""
  return cfg.compute_wgs * _WG_ROWS


def check_shapes(m: int, t: Q4KTiles, cfg: MgpuConfig) -> None:
  """ValueError naming what does not fit: N a multiple of 64 * compute_wgs, K of
  256 * kb * splits, 1 <= M <= MAX_TOKENS (`q4k_matmul` calls the kernel per MAX_TOKENS rows),
  `smem_bytes` <= SMEM_LIMIT."""
  n, k = t.shape
  if n % rows_multiple(cfg):
    raise ValueError(f"q4k_matmul: N={n} is not a multiple of {rows_multiple(cfg)}")
  if k % (QK_K * cfg.kb * cfg.splits):
    raise ValueError(f"q4k_matmul: K={k} is not a multiple of 256 * kb ({cfg.kb}) * splits "
                     f"({cfg.splits})")
  if not 1 <= m <= MAX_TOKENS:
    raise ValueError(f"q4k_matmul: M={m} tokens outside 1..{MAX_TOKENS}")
  if smem_bytes(cfg, m) > SMEM_LIMIT:
    raise ValueError(f"q4k_matmul: {cfg} needs {smem_bytes(cfg, m)} bytes of shared memory for "
                     f"M={m}, more than {SMEM_LIMIT}: fewer stages or a smaller kb")


def q4k_matmul(x: jax.Array, t: Q4KTiles, cfg: MgpuConfig | None = None) -> jax.Array:
  """x: [M, K] float -> [M, N] float32 = x @ dequantize(W)^T (module docstring). Runs on a
  Hopper GPU, or on the CPU under `plgpu.force_gpu_interpret_mode()`. Raises ValueError for
  shapes `check_shapes` refuses."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  m, k = x.shape
  n = t.shape[0]
  if k != t.shape[1]:
    raise ValueError(f"q4k_matmul: x has K={k}, the weight {t.shape}")
  if m > MAX_TOKENS:
    return jnp.concatenate([q4k_matmul(x[i:i + MAX_TOKENS], t, cfg)
                            for i in range(0, m, MAX_TOKENS)], axis=0)
  if cfg is None:
    cfg = default_config(m, n, k, device_sm_count())
  check_shapes(m, t, cfg)
  n_sm = cfg.n_sm or device_sm_count()
  mp = padded_tokens(m)
  tile_k = QK_K * cfg.kb
  cta_rows = cfg.compute_wgs * _WG_ROWS
  row_tiles = n // cta_rows
  k_steps = k // tile_k // cfg.splits               # pipeline steps per work item
  items = row_tiles * cfg.splits
  xt = jnp.zeros((k, mp), jnp.bfloat16).at[:, :m].set(x.T.astype(jnp.bfloat16))

  def tiled(swizzle, itemsize):      # 8-row tiles, one swizzle wide
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

  x_swz = min(64, plgpu.find_swizzle(mp * 16, "rhs"))   # 64: one K = 32 sub-block per WGMMA
  code_tf = tiled(plgpu.find_swizzle(_SUB * 8, "lhs"), 1)
  x_tf = tiled(x_swz, 2)
  out_tf = tiled(plgpu.find_swizzle(mp * 32, "out"), 4)
  a_tf = tiled(min(x_swz, plgpu.find_swizzle(_SUB * 16, "lhs")), 2)   # WGMMA: A's swizzle <= B's
  n_sub = tile_k // _SUB
  scratch = dict(out_smem=plgpu.SMEM((cfg.compute_wgs, _WG_ROWS, mp), jnp.float32, transforms=out_tf))
  if cfg.a_operand == "smem":
    scratch["a_smem"] = plgpu.SMEM((cfg.compute_wgs, n_sub, _WG_ROWS, _SUB), jnp.bfloat16, transforms=a_tf)

  def kernel(codes_g, sc_g, mn_g, d_g, dm_g, x_g, out_g, out_smem, a_smem=None):
    def get_pipeline(body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_steps,), memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((tile_k // 64, cta_rows, _SUB), lambda s: (s, 0, 0),
                              transforms=code_tf, memory_space=plgpu.SMEM),
              plgpu.BlockSpec((tile_k // _SUB, cta_rows), lambda s: (s, 0),
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((tile_k // _SUB, cta_rows), lambda s: (s, 0),
                              memory_space=plgpu.SMEM),
              plgpu.BlockSpec((cfg.kb, cta_rows), lambda s: (s, 0), memory_space=plgpu.SMEM),
              plgpu.BlockSpec((cfg.kb, cta_rows), lambda s: (s, 0), memory_space=plgpu.SMEM),
              plgpu.BlockSpec((tile_k, mp), lambda s: (s, 0), transforms=x_tf,
                              memory_space=plgpu.SMEM),
          ],
          wg_axis="wg", num_compute_wgs=cfg.compute_wgs, max_concurrent_steps=cfg.stages,
          compute_context=compute_context)

    ignore = lambda *_, **__: None  # noqa: E731 (allocations do not depend on the body)

    @functools.partial(pl.run_scoped, allocs=get_pipeline(ignore, ignore).get_allocations(
        codes_g, sc_g, mn_g, d_g, dm_g, x_g), collective_axes="wg")
    def _scope(allocs):
      wg = lax.axis_index("wg")
      rows = pl.ds(wg * _WG_ROWS, _WG_ROWS)

      @plgpu.nd_loop((items,), collective_axes="sm")
      def _items(info: plgpu.NDLoopInfo):
        (item,) = info.index
        tile, split = item // cfg.splits, item % cfg.splits
        cta = pl.ds(tile * cta_rows, cta_rows)
        ks = split * k_steps                        # first pipeline step of this split

        def compute_context(run_pipeline):
          @functools.partial(pl.run_scoped, acc=plgpu.ACC((_WG_ROWS, mp), jnp.float32))
          def _acc(acc):
            run_pipeline(acc)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_smem[wg] = acc[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg], out_g.at[split].at[cta].at[rows])

        def body(_, codes_s, sc_s, mn_s, d_s, dm_s, x_s, acc):
          for j in range(n_sub):
            b = j // (QK_K // _SUB)
            q = codes_s[j // 2, rows, :].astype(jnp.int32)   # no 8-bit shifts in registers
            q = (q & 15) if j % 2 == 0 else (q >> 4)
            scale = d_s[b, rows].astype(jnp.float32) * sc_s[j, rows].astype(jnp.float32)
            mins = dm_s[b, rows].astype(jnp.float32) * mn_s[j, rows].astype(jnp.float32)
            w = (scale[:, None] * q.astype(jnp.float32) - mins[:, None]).astype(jnp.bfloat16)
            if a_smem is None:
              plgpu.wgmma(acc, w, x_s.at[pl.ds(j * _SUB, _SUB)])
            else:
              a_smem[wg, j] = w
          if a_smem is not None:             # every tile stored: one fence, then the WGMMAs
            plgpu.commit_smem()
            for j in range(n_sub):
              plgpu.wgmma(acc, a_smem.at[wg, j], x_s.at[pl.ds(j * _SUB, _SUB)])
          plgpu.wgmma_wait(0)
          return acc

        get_pipeline(body, compute_context)(
            codes_g.at[pl.ds(ks * (tile_k // 64), k_steps * (tile_k // 64)), cta],
            sc_g.at[pl.ds(ks * (tile_k // _SUB), k_steps * (tile_k // _SUB)), cta],
            mn_g.at[pl.ds(ks * (tile_k // _SUB), k_steps * (tile_k // _SUB)), cta],
            d_g.at[pl.ds(ks * cfg.kb, k_steps * cfg.kb), cta],
            dm_g.at[pl.ds(ks * cfg.kb, k_steps * cfg.kb), cta],
            x_g.at[pl.ds(ks * tile_k, k_steps * tile_k)],
            allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  f = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((cfg.splits, n, mp), jnp.float32),
      grid=(min(n_sm, items),), grid_names=("sm",), num_threads=cfg.compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=scratch)
  part = f(t.codes, t.scales, t.mins, t.d, t.dmin, xt)
  return part.sum(0)[:, :m].T
