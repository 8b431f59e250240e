"""Q4_K / Q5_K / Q6_K dequantizing matmul for Hopper in Mosaic GPU (`pallas.mosaic_gpu`).

Contract: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T, float32 out, for M tokens (decode, chain /
tree verify, batched decode; one kernel call per 64 tokens) and W a K-quant weight in a tile
layout made at load from `repack.Planes` (same bytes): `Q4KTiles` (148 bytes per 256 weights,
GGUF's 144 + 2.8 %), `Q5KTiles` (180, GGUF 176: Q4_K's planes plus the fifth bits, which older
llama.cpp and unsloth Q4_K_M files use for Qwen3.5's attn_qkv) or `Q6KTiles` (210, as GGUF). The
formats share the kernel; only the planes a pipeline step loads and the dequantization of one
32-weight group differ.

Design (ideas taken from JAX's `ops/gpu/hopper_mixed_type_matmul_mgpu.py`: a
warp-specialized TMA pipeline (`plgpu.emit_pipeline_warp_specialized`, one memory warpgroup,
two compute warpgroups), the quantized operand loaded from SMEM into registers, converted there
and fed to WGMMA as the register operand, a persistent grid walking the work items with
`plgpu.nd_loop`):
  * swap-AB: the weight rows sit on WGMMA's M side (64 rows a compute warpgroup, 128 a CTA) and
    the tokens on its N side (M padded to 16, 32 or 64: `padded_tokens`), so one WGMMA serves
    1..64 tokens with no extra weight traffic; the kernel computes y^T [N, M] tiles.
  * the 4-bit codes travel as a [K/64, N, 32] uint8 plane: plane g holds bytes 32g .. 32g+31 of
    the planes' code row, so each TMA box is [tile_k/64, 128, 32] and one 32-weight group (one
    nibble of one plane) is one [64, 32] SMEM slice. Q4_K: plane g holds weights 64g .. 64g+63 of
    every row (weight 64g+i in the low nibble of byte i, 64g+32+i in the high nibble: GGUF's
    in-block order). Q6_K: the low 4 bits, plane 2h + t of 128-weight half h holding weights
    128h+32t+i (low nibble) and 128h+64+32t+i (high nibble); its 2-bit high parts travel as a
    [K/128, N, 32] plane (byte i of plane h, bits 2s..2s+1: weight 128h+32s+i), GGUF's qh order.
    Q5_K: Q4_K's code plane, and its fifth bits as a [K/256, N, 32] plane (byte i of block b, bit
    g: weight 256b+32g+i).
  * scales folded before the MMA: per 32-weight group the register tile is, in float32,
    (d * sc) * q - (dmin * m) for Q4_K / Q5_K (one 6-bit scale and min a group) and
    (d * sc) * (q - 32) for Q6_K (two int8 scales a group, one per 16 weights: selected per
    column), rounded once to bfloat16 (gguf-py's operation order: `k_quant_values`, `q6_k_values`), then one K = 32 WGMMA
    against the matching 32 rows of x^T in SMEM. The scale planes (6-bit scales / mins [K/32, N]
    uint8, Q6_K scales [K/16, N] int8, block scales [K/256, N] float16) travel transposed so
    each group's 64 row scales are one contiguous SMEM row.
  * split-K: a work item is (CTA row tile, K split); splits write float32 partials
    [S, N, Mp] summed outside (for narrow matrices whose row tiles alone cannot fill the GPU).

Numerics: each weight rounded once to bfloat16 and x rounded to bfloat16, float32 accumulation
(the contract of `dequant_matmul(..., compute_dtype=bfloat16)`). Tested on the CPU
(tests/test_mgpu.py) in GPU interpret mode (`plgpu.force_gpu_interpret_mode`; a_operand="smem",
compute_wgs=1: what the interpreter can run) against a float64 product of the same bfloat16
operands, and lowered for CUDA without a GPU (`jax.export`: the Mosaic GPU module is built, its
layouts inferred and its dialect lowered) at Qwen3.5-27B shapes for the GPU configuration.
Timing needs an H100 (scripts/bench_kernels.py --tables=mgpu).
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
_GROUP = 32              # weights per WGMMA (K = 32): one Q4_K sub-block, two Q6_K ones


class _Tiles:
  """What both tile layouts share: `fmt` (class attribute) and the bytes of their planes."""

  fmt = ""

  @property
  def nbytes(self) -> int:
    """Bytes of all planes (what the device holds)."""
    return arrays_nbytes(*(getattr(self, f.name) for f in dataclasses.fields(self)
                           if f.name != "shape"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4KTiles(_Tiles):
  """A Q4_K weight laid out for `kquant_matmul` (module docstring). Exact: a permutation of
  `repack.Planes`' bytes (`to_planes` inverts it).

  codes: [K/64, N, 32] uint8; scales, mins: [K/32, N] uint8 (6-bit values); d, dmin:
  [K/256, N] float16; shape: logical (N, K) (static)."""

  codes: jax.Array
  scales: jax.Array
  mins: jax.Array
  d: jax.Array
  dmin: jax.Array
  shape: tuple = dataclasses.field(default=(0, 0), metadata=dict(static=True))
  fmt = "q4_k"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q5KTiles(_Tiles):
  """A Q5_K weight laid out for `kquant_matmul`: Q4_K's planes for the low 4 bits, scales and
  mins, plus the fifth bits (module docstring). A permutation of `repack.Planes`' bytes, 180 per
  256 weights (GGUF: 176).

  codes: [K/64, N, 32] uint8; high: [K/256, N, 32] uint8; scales, mins: [K/32, N] uint8; d, dmin:
  [K/256, N] float16; shape: logical (N, K) (static)."""

  codes: jax.Array
  high: jax.Array
  scales: jax.Array
  mins: jax.Array
  d: jax.Array
  dmin: jax.Array
  shape: tuple = dataclasses.field(default=(0, 0), metadata=dict(static=True))
  fmt = "q5_k"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q6KTiles(_Tiles):
  """A Q6_K weight laid out for `kquant_matmul` (module docstring). Exact: a permutation of
  `repack.Planes`' bytes (`to_planes` inverts it), 210 bytes per 256 weights as in GGUF.

  codes: [K/64, N, 32] uint8 (low 4 bits); high: [K/128, N, 32] uint8 (2-bit high parts);
  scales: [K/16, N] int8; d: [K/256, N] float16; shape: logical (N, K) (static)."""

  codes: jax.Array
  high: jax.Array
  scales: jax.Array
  d: jax.Array
  shape: tuple = dataclasses.field(default=(0, 0), metadata=dict(static=True))
  fmt = "q6_k"


TILES = (Q4KTiles, Q5KTiles, Q6KTiles)   # the weight types `kquant_matmul` takes
TILE_FORMATS = tuple(c.fmt for c in TILES)
_TILE_CLASS = dict(zip(TILE_FORMATS, TILES))


def _planes_3d(a, xp):
  """A byte plane [N, B] -> [B/32, N, 32]: byte 32g + i of a row to [g, row, i]."""
  return xp.transpose(a.reshape(a.shape[0], a.shape[1] // 32, 32), (1, 0, 2))


def _fields(fmt: str):
  """The planes of a format as (attribute, weights per leading index, trailing shape, dtype), in
  the order the kernel takes them."""
  if fmt == "q4_k":
    return (("codes", 64, (32,), jnp.uint8), ("scales", 32, (), jnp.uint8),
            ("mins", 32, (), jnp.uint8), ("d", QK_K, (), jnp.float16),
            ("dmin", QK_K, (), jnp.float16))
  if fmt == "q5_k":
    return (("codes", 64, (32,), jnp.uint8), ("high", QK_K, (32,), jnp.uint8),
            ("scales", 32, (), jnp.uint8), ("mins", 32, (), jnp.uint8),
            ("d", QK_K, (), jnp.float16), ("dmin", QK_K, (), jnp.float16))
  if fmt == "q6_k":
    return (("codes", 64, (32,), jnp.uint8), ("high", 128, (32,), jnp.uint8),
            ("scales", 16, (), jnp.int8), ("d", QK_K, (), jnp.float16))
  raise ValueError(f"kquant_matmul: Q4_K, Q5_K or Q6_K only, got {fmt!r}")


def to_tiles(p: Planes):
  """repack.Planes (Q4_K, Q5_K or Q6_K) -> Q4KTiles / Q5KTiles / Q6KTiles (transposes only;
  numpy or jax arrays in, same kind out). Raises ValueError for another format."""
  if p.fmt not in TILE_FORMATS:
    raise ValueError(f"kquant_matmul: Q4_K, Q5_K or Q6_K planes only, got {p.fmt!r}")
  xp = jnp if isinstance(p.codes, jax.Array) else np
  arrays = {name: _planes_3d(getattr(p, name), xp) if rest else getattr(p, name).T
            for name, _, rest, _ in _fields(p.fmt)}
  return _TILE_CLASS[p.fmt](**arrays, shape=tuple(p.shape))


def to_planes(t) -> Planes:
  """Inverse of `to_tiles`."""
  n = t.shape[0]
  xp = jnp if isinstance(t.codes, jax.Array) else np
  flat = lambda a: xp.transpose(a, (1, 0, 2)).reshape(n, -1)   # noqa: E731
  arrays = {name: flat(getattr(t, name)) if rest else getattr(t, name).T
            for name, _, rest, _ in _fields(t.fmt)}
  return Planes(**arrays, fmt=t.fmt, shape=t.shape)


def tile_specs(n: int, k: int, fmt: str):
  """ShapeDtypeStructs of a weight of logical shape (N, K) in fmt's tile layout (for lowering
  without data)."""
  s = jax.ShapeDtypeStruct
  arrays = {name: s((k // per, n, *rest), dtype) for name, per, rest, dtype in _fields(fmt)}
  return _TILE_CLASS[fmt](**arrays, shape=(n, k))


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """Tiling of `kquant_matmul`. kb: 256-weight blocks per pipeline step (tile_k = 256 kb);
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


def smem_bytes(cfg: MgpuConfig, m: int, fmt: str = "q4_k") -> int:
  """Shared memory `kquant_matmul` allocates for M tokens of an fmt weight under cfg: `stages`
  copies of one pipeline step's tiles (the format's planes and x^T) plus the output (and, for
  a_operand="smem", dequantized weight) tiles; barriers not counted (< 1 KiB)."""
  mp, rows, tile_k = padded_tokens(m), cfg.compute_wgs * _WG_ROWS, QK_K * cfg.kb
  step = tile_k * mp * 2 + sum(tile_k // per * rows * int(np.prod(rest)) * np.dtype(dt).itemsize
                               for _, per, rest, dt in _fields(fmt))
  fixed = cfg.compute_wgs * _WG_ROWS * mp * 4
  if cfg.a_operand == "smem":
    fixed += cfg.compute_wgs * tile_k * _WG_ROWS * 2
  return cfg.stages * step + fixed


def default_config(m: int, n: int, k: int, n_sm: int, fmt: str = "q4_k", **kw) -> MgpuConfig:
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
  while stages > 2 and smem_bytes(dataclasses.replace(base, stages=stages), m, fmt) > \
      SMEM_LIMIT - 1024:
    stages -= 1
  return dataclasses.replace(base, splits=splits, stages=stages)


def rows_multiple(cfg: MgpuConfig) -> int:
  """The multiple of N a weight needs under cfg: 64 rows per compute warpgroup."""
  return cfg.compute_wgs * _WG_ROWS


def check_shapes(m: int, t, cfg: MgpuConfig) -> None:
  """ValueError naming what does not fit: N a multiple of 64 * compute_wgs, K of
  256 * kb * splits, 1 <= M <= MAX_TOKENS (`kquant_matmul` calls the kernel per MAX_TOKENS
  rows), `smem_bytes` <= SMEM_LIMIT."""
  n, k = t.shape
  if n % rows_multiple(cfg):
    raise ValueError(f"kquant_matmul: N={n} is not a multiple of {rows_multiple(cfg)}")
  if k % (QK_K * cfg.kb * cfg.splits):
    raise ValueError(f"kquant_matmul: K={k} is not a multiple of 256 * kb ({cfg.kb}) * splits "
                     f"({cfg.splits})")
  if not 1 <= m <= MAX_TOKENS:
    raise ValueError(f"kquant_matmul: M={m} tokens outside 1..{MAX_TOKENS}")
  if smem_bytes(cfg, m, t.fmt) > SMEM_LIMIT:
    raise ValueError(f"kquant_matmul: {cfg} needs {smem_bytes(cfg, m, t.fmt)} bytes of shared "
                     f"memory for M={m} ({t.fmt}), more than {SMEM_LIMIT}: fewer stages or a "
                     f"smaller kb")


def _q4k_group(j: int, planes: dict, rows):
  """Q4_K (and Q5_K, whose planes add "high"): the [64, 32] float32 weights of 32-weight group j
  of a pipeline step, rows `rows` of the CTA tile: (d * sc) * q - dmin * m (gguf-py's order)."""
  b, g = divmod(j, QK_K // _GROUP)
  q = planes["codes"][j // 2, rows, :].astype(jnp.int32)   # no 8-bit shifts in registers
  q = (q & 15) if j % 2 == 0 else (q >> 4)
  if "high" in planes:               # Q5_K: bit g of the block's high byte i is weight 32g + i's
    hi = planes["high"][b, rows, :].astype(jnp.int32)
    q = q | ((((hi >> g) if g else hi) & 1) << 4)
  scale = planes["d"][b, rows].astype(jnp.float32) * planes["scales"][j, rows].astype(jnp.float32)
  mins = planes["dmin"][b, rows].astype(jnp.float32) * planes["mins"][j, rows].astype(jnp.float32)
  return scale[:, None] * q.astype(jnp.float32) - mins[:, None]


def _q6k_group(j: int, planes: dict, rows):
  """Q6_K: the [64, 32] float32 weights of 32-weight group j (weights 128h + 32s + i of the
  step's half h = j // 4, s = j % 4): q = low nibble | high 2 bits << 4, then (d * sc) * (q - 32)
  with the scale of weights 0-15 and of 16-31 picked per column (gguf-py's order)."""
  h, s = divmod(j, 4)
  lo = planes["codes"][2 * h + s % 2, rows, :].astype(jnp.int32)
  lo = (lo & 15) if s < 2 else (lo >> 4)
  hi = planes["high"][h, rows, :].astype(jnp.int32)
  hi = ((hi >> (2 * s)) if s else hi) & 3
  q = ((lo | (hi << 4)) - 32).astype(jnp.float32)
  d = planes["d"][j // (QK_K // _GROUP), rows].astype(jnp.float32)
  shape = (_WG_ROWS, _GROUP)
  s0 = jnp.broadcast_to((d * planes["scales"][2 * j, rows].astype(jnp.float32))[:, None], shape)
  s1 = jnp.broadcast_to((d * planes["scales"][2 * j + 1, rows].astype(jnp.float32))[:, None], shape)
  first_half = lax.broadcasted_iota(jnp.int32, shape, 1) < _GROUP // 2
  return jnp.where(first_half, s0, s1) * q


_GROUP_WEIGHTS = {"q4_k": _q4k_group, "q5_k": _q4k_group, "q6_k": _q6k_group}


def kquant_matmul(x: jax.Array, t, cfg: MgpuConfig | None = None) -> jax.Array:
  """x: [M, K] float, t: Q4KTiles | Q5KTiles | Q6KTiles of logical shape (N, K) -> [M, N]
  float32 = x @ dequantize(W)^T (module docstring). Runs on a Hopper GPU, or on the CPU under
  `plgpu.force_gpu_interpret_mode()`. Raises ValueError for shapes `check_shapes` refuses or
  another weight type."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  if not isinstance(t, TILES):
    raise ValueError(f"kquant_matmul: a Q4KTiles, Q5KTiles or Q6KTiles weight, got "
                     f"{type(t).__name__}")
  m, k = x.shape
  n = t.shape[0]
  if k != t.shape[1]:
    raise ValueError(f"kquant_matmul: x has K={k}, the weight {t.shape}")
  if m > MAX_TOKENS:
    return jnp.concatenate([kquant_matmul(x[i:i + MAX_TOKENS], t, cfg)
                            for i in range(0, m, MAX_TOKENS)], axis=0)
  fmt = t.fmt
  if cfg is None:
    cfg = default_config(m, n, k, device_sm_count(), fmt)
  check_shapes(m, t, cfg)
  n_sm = cfg.n_sm or device_sm_count()
  mp = padded_tokens(m)
  tile_k = QK_K * cfg.kb
  cta_rows = cfg.compute_wgs * _WG_ROWS
  row_tiles = n // cta_rows
  k_steps = k // tile_k // cfg.splits               # pipeline steps per work item
  items = row_tiles * cfg.splits
  xt = jnp.zeros((k, mp), jnp.bfloat16).at[:, :m].set(x.T.astype(jnp.bfloat16))
  fields = _fields(fmt)
  names = [name for name, *_ in fields]
  group_weights = _GROUP_WEIGHTS[fmt]

  def tiled(swizzle, itemsize):      # 8-row tiles, one swizzle wide
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

  x_swz = min(64, plgpu.find_swizzle(mp * 16, "rhs"))   # 64: one K = 32 group per WGMMA
  byte_plane_tf = tiled(plgpu.find_swizzle(_GROUP * 8, "lhs"), 1)
  x_tf = tiled(x_swz, 2)
  out_tf = tiled(plgpu.find_swizzle(mp * 32, "out"), 4)
  a_tf = tiled(min(x_swz, plgpu.find_swizzle(_GROUP * 16, "lhs")), 2)  # WGMMA: A's swizzle <= B's
  n_group = tile_k // _GROUP
  scratch = dict(out_smem=plgpu.SMEM((cfg.compute_wgs, _WG_ROWS, mp), jnp.float32, transforms=out_tf))
  if cfg.a_operand == "smem":
    scratch["a_smem"] = plgpu.SMEM((cfg.compute_wgs, n_group, _WG_ROWS, _GROUP), jnp.bfloat16,
                                   transforms=a_tf)

  def plane_spec(per, rest):
    if rest:                         # a byte plane [groups, rows, 32]
      return plgpu.BlockSpec((tile_k // per, cta_rows, *rest), lambda s: (s, 0, 0),
                             transforms=byte_plane_tf, memory_space=plgpu.SMEM)
    return plgpu.BlockSpec((tile_k // per, cta_rows), lambda s: (s, 0), memory_space=plgpu.SMEM)

  def kernel(*refs, out_smem, a_smem=None):
    *planes_g, x_g, out_g = refs

    def get_pipeline(body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_steps,), memory_registers=40,
          in_specs=[plane_spec(per, rest) for _, per, rest, _ in fields] + [
              plgpu.BlockSpec((tile_k, mp), lambda s: (s, 0), transforms=x_tf,
                              memory_space=plgpu.SMEM)],
          wg_axis="wg", num_compute_wgs=cfg.compute_wgs, max_concurrent_steps=cfg.stages,
          compute_context=compute_context)

    ignore = lambda *_, **__: None  # noqa: E731 (allocations do not depend on the body)

    @functools.partial(pl.run_scoped, allocs=get_pipeline(ignore, ignore).get_allocations(
        *planes_g, x_g), collective_axes="wg")
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

        def body(_, *step_refs):
          *planes_s, x_s, acc = step_refs
          planes = dict(zip(names, planes_s))
          for j in range(n_group):
            w = group_weights(j, planes, rows).astype(jnp.bfloat16)
            if a_smem is None:
              plgpu.wgmma(acc, w, x_s.at[pl.ds(j * _GROUP, _GROUP)])
            else:
              a_smem[wg, j] = w
          if a_smem is not None:             # every tile stored: one fence, then the WGMMAs
            plgpu.commit_smem()
            for j in range(n_group):
              plgpu.wgmma(acc, a_smem.at[wg, j], x_s.at[pl.ds(j * _GROUP, _GROUP)])
          plgpu.wgmma_wait(0)
          return acc

        def window(a, per):                 # this split's pipeline steps of a plane
          return a.at[pl.ds(ks * (tile_k // per), k_steps * (tile_k // per)), cta]

        get_pipeline(body, compute_context)(
            *[window(a, per) for a, (_, per, _, _) in zip(planes_g, fields)],
            x_g.at[pl.ds(ks * tile_k, k_steps * tile_k)],
            allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  f = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((cfg.splits, n, mp), jnp.float32),
      grid=(min(n_sm, items),), grid_names=("sm",), num_threads=cfg.compute_wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=scratch)
  part = f(*[getattr(t, name) for name in names], xt)
  return part.sum(0)[:, :m].T
