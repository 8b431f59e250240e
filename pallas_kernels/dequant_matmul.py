"""Dequantizing matmul over packed GGUF rows: a Pallas (Triton lowering) kernel and its reference.

Contract: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T with float32 accumulation, W a packed
weight (gguf_blocks: `data`, `fmt`, `shape`; e.g. dflash_jax's QuantWeight) holding the raw GGUF
blocks `[N, K // block * type_size] uint8` exactly as the loader keeps them on device (no repacking: device bytes = file bytes).

Kernel design (`dequant_matmul`):
  * grid (M tiles, N tiles, K splits). Each program owns a [bm, bn] output tile and a contiguous
    range of GGUF blocks of its bn weight rows; the weight rows are viewed as
    [N, n_blocks, type_size] so every field of a block (f16 scales, packed 6-bit scales, nibbles,
    high bits) is a strided ref slice, loaded and decoded in registers. Nothing dequantized is
    written to memory.
  * per sub-block (32 elements; 16 for Q4_0/Q4_1/Q5_x halves and for Q6_K whose scales are per
    16) the integer codes q are exact in bf16/f16, so one small dot `x_sub @ q_sub^T` with
    float32 accumulation is followed by the block scale (and for the affine formats the min term
    `rowsum(x_sub) * min`), applied in float32 after the dot. This is exact up to the rounding
    of x to the operand dtype (llama.cpp's q8_1-sum trick; tokamax's post-scale path).
  * split-K (`k_splits` > 1) writes float32 partials [S, M, N] that are summed outside, for
    shapes whose N alone cannot fill the GPU.
  * M is padded to a multiple of bm (>= 16: tensor-core dots need M >= 16).

Block layouts: ggml/src/ggml-common.h; decoding mirrors gguf_blocks.dequantize_blocks
(bit-identical to gguf-py's gguf.quants.dequantize), which is what the tests compare against.

Uses `jax.experimental.pallas.triton` (deprecated since JAX 0.11 but shipped in 0.12; the only
GPU Pallas style that also runs with interpret=True on CPU). The kernel body only uses ref
slicing, jnp ops and fori_loop, so a Mosaic GPU port is mechanical.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gguf_blocks import BLOCK_FORMATS, dequantize

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

# Formats with a Pallas kernel (the list plus Q5_0/Q5_1/Q5_K, same machinery).
KERNEL_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k")
# Formats with the folded-scale path (TileConfig.fold_scales): the bulk of a Q4_K_M file.
FOLD_FORMATS = ("q4_k", "q6_k")


def dequant_matmul_reference(x: jax.Array, w, compute_dtype=jnp.float32) -> jax.Array:
  """Pure-JAX reference. x: [M, K] float; w: logical [N, K] packed; returns [M, N] float32.

  Dequantizes W to `compute_dtype` (exact for float32), then one matmul with float32 accumulation
  (HIGHEST precision for float32 operands). Works for every gguf_blocks format.
  """
  wd = dequantize(w, compute_dtype)
  prec = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
  return jnp.dot(wd, x.astype(compute_dtype).T, precision=prec, preferred_element_type=jnp.float32).T


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Static tiling of one kernel call. bm: rows of x per program (>= 16, power of 2);
  bn: weight rows per program (power of 2); k_splits: programs along K (divides n_blocks);
  num_warps / num_stages: Triton launch parameters. fold_scales: for FOLD_FORMATS, dequantize
  64 weights at a time (scales folded in, in float32, then rounded to the operand dtype) and run
  one K=64 dot per piece instead of one K=16/32 dot per sub-block with the scale applied after
  it (exact in bf16, but ~4x the dots, each with its own register-layout conversion).
  words (default on): read Q4_K blocks as 36 little-endian 32-bit words (one [bn, 8] word load
  per 64 weights instead of byte loads; on an H100 1.7-1.85x faster than the byte path); other
  formats ignore it (Q6_K's 210-byte blocks are not word-aligned). (A no-tensor-core GEMV variant
  for bm = 1 measured 2-5x slower on an H100 and was removed.)"""
  bm: int = 16
  bn: int = 64
  k_splits: int = 1
  num_warps: int = 4
  num_stages: int = 3
  fold_scales: bool = True
  words: bool = True


def _pow2_divisor(n: int, cap: int) -> int:
  b = 1
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def n_tile(n: int) -> int:
  """The N tile `default_tiles` uses for N = n rows: the largest power of 2 <= 128 dividing n."""
  return _pow2_divisor(n, 128)


def device_sm_count(device=None) -> int:
  """Streaming multiprocessors of `device` (default: the first JAX device), from the device's
  `core_count`; 1 for devices that report none (CPU, interpret mode)."""
  device = device or jax.devices()[0]
  return int(getattr(device, "core_count", 0) or 1)


def default_tiles(m: int, n: int, k: int, fmt: str, *, n_sm: int | None = None) -> TileConfig:
  """Tile choice used by the model: bm = M rounded up to a power of 2 in [16, 64]; bn the largest
  power of 2 <= 64 dividing N (>= 16); split K while the programs number fewer than 8 per SM
  (`n_sm` SMs; default `device_sm_count()`) and each split keeps >= 4 blocks. From the H100 tile
  sweep (scripts/bench_kernels.py --tables=tiles; docs/gpu-kernels.md). Raises ValueError when N has no
  power-of-2 divisor >= 16."""
  n_sm = device_sm_count() if n_sm is None else n_sm
  bm = 16
  while bm < min(m, 64):
    bm *= 2
  bn = min(64, n_tile(n))
  if bn < 16:
    raise ValueError(f"dequant_matmul: N={n} has no power-of-2 tile >= 16")
  blk = BLOCK_FORMATS[fmt][0]
  n_blocks = k // blk
  splits = 1
  while ((n // bn) * splits < 8 * n_sm and n_blocks % (splits * 2) == 0
         and n_blocks // (splits * 2) >= 4):
    splits *= 2
  return TileConfig(bm=bm, bn=bn, k_splits=splits)


def supports(w) -> bool:
  """True when `dequant_matmul` has a kernel for this weight (format and N tileable)."""
  return w.fmt in KERNEL_FORMATS and n_tile(w.shape[0]) >= 16


# ----------------------------------------------------------------------------- block decoding

def _half(bits):
  """[bn] unsigned integers holding IEEE half bits in their low 16 -> [bn] float32."""
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _f16(lo, hi):
  """Two [bn] uint8 vectors (little endian) -> [bn] float32 via IEEE half."""
  return _half(lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8))


def _i8(b):
  return jax.lax.bitcast_convert_type(b, jnp.int8)


def _sub_blocks(fmt: str, w_ref, blk):
  """Sub-blocks of GGUF block `blk` (traced index into w_ref's block axis) as a static list of
  (x offset within the block, width, q [bn, width] integer codes (int32), scale [bn] f32,
  bias [bn] f32 or None) with  w[:, off:off+width] = scale * q + bias."""
  def byte(i):
    return w_ref[:, blk, i]

  def bytes_(start, n):
    return w_ref[:, blk, pl.ds(start, n)]

  def iota(n):
    return jax.lax.broadcasted_iota(jnp.uint32, (1, n), 1)

  def u32(start):
    b = [byte(start + i).astype(jnp.uint32) for i in range(4)]
    return b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)

  out = []
  if fmt == "q8_0":
    d = _f16(byte(0), byte(1))
    out.append((0, 32, _i8(bytes_(2, 32)).astype(jnp.int32), d, None))
  elif fmt in ("q4_0", "q4_1"):
    d = _f16(byte(0), byte(1))
    off = 2 if fmt == "q4_0" else 4
    bias = None if fmt == "q4_0" else _f16(byte(2), byte(3))
    qs = bytes_(off, 16).astype(jnp.int32)
    shift = 8 if fmt == "q4_0" else 0
    out.append((0, 16, (qs & 15) - shift, d, bias))
    out.append((16, 16, (qs >> 4) - shift, d, bias))
  elif fmt in ("q5_0", "q5_1"):
    d = _f16(byte(0), byte(1))
    off = 2 if fmt == "q5_0" else 4
    bias = None if fmt == "q5_0" else _f16(byte(2), byte(3))
    qh = u32(off)[:, None]
    qs = bytes_(off + 4, 16).astype(jnp.int32)
    shift = 16 if fmt == "q5_0" else 0
    hb_lo = ((qh >> iota(16)) & 1).astype(jnp.int32)
    hb_hi = ((qh >> (iota(16) + 16)) & 1).astype(jnp.int32)
    out.append((0, 16, ((qs & 15) | (hb_lo << 4)) - shift, d, bias))
    out.append((16, 16, ((qs >> 4) | (hb_hi << 4)) - shift, d, bias))
  elif fmt in ("q4_k", "q5_k"):
    d = _f16(byte(0), byte(1))
    dmin = _f16(byte(2), byte(3))
    s = [byte(4 + i).astype(jnp.int32) for i in range(12)]
    qs_off = 16 if fmt == "q4_k" else 48
    qh = bytes_(16, 32).astype(jnp.int32) if fmt == "q5_k" else None
    for j in range(8):
      if j < 4:
        sc, mn = s[j] & 63, s[j + 4] & 63
      else:
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
      qb = bytes_(qs_off + 32 * (j // 2), 32).astype(jnp.int32)
      q = (qb & 15) if j % 2 == 0 else (qb >> 4)
      if qh is not None:
        q = q | (((qh >> j) & 1) << 4)
      out.append((32 * j, 32, q, d * sc.astype(jnp.float32), -(dmin * mn.astype(jnp.float32))))
  elif fmt == "q6_k":
    d = _f16(byte(208), byte(209))
    for s16 in range(16):
      n, r, p = s16 // 8, (s16 % 8) // 2, s16 % 2
      ql = bytes_(64 * n + 32 * (r % 2) + 16 * p, 16).astype(jnp.int32)
      nib = (ql & 15) if r < 2 else (ql >> 4)
      qh = bytes_(128 + 32 * n + 16 * p, 16).astype(jnp.int32)
      q = (nib | (((qh >> (2 * r)) & 3) << 4)) - 32
      sc = _i8(byte(192 + s16)).astype(jnp.float32)
      out.append((128 * n + 32 * r + 16 * p, 16, q, d * sc, None))
  else:
    raise ValueError(f"dequant_matmul: no kernel for format {fmt!r}; kernels: {KERNEL_FORMATS}")
  return out


def _mm(a, b):
  """[bm, K] x [bn, K] -> [bm, bn] float32: a tensor-core dot (operands as given)."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _q4_k_word_pieces(w_ref, blk, wdt):
  """Q4_K block `blk` read as 36 uint32 words (w_ref [bn, n_blocks, 36] uint32): word 0 = d | dmin
  << 16, words 1-3 = the 12 packed scale bytes, words 4-35 = qs. Same pieces as `_folded_pieces`
  (64 weights each, scales folded in float32, then cast to `wdt`)."""
  h0 = w_ref[:, blk, 0]
  d, dmin = _half(h0 & 0xFFFF), _half(h0 >> 16)
  sw = [w_ref[:, blk, 1 + i] for i in range(3)]
  s = [((sw[j // 4] >> (8 * (j % 4))) & 255).astype(jnp.int32) for j in range(12)]
  sc, mn = _q4_k_scales(s)
  h = jax.lax.broadcasted_iota(jnp.uint32, (1, 2, 1, 1), 1)
  bi = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, 1, 4), 3)
  shift = bi * 8 + h * 4                                                       # [1, 2, 1, 4]
  pieces = []
  for c in range(4):
    qw = w_ref[:, blk, pl.ds(4 + 8 * c, 8)]                                    # [bn, 8] words
    q = ((qw[:, None, :, None] >> shift) & 15).astype(jnp.float32)              # [bn, 2, 8, 4]
    pieces.append((64 * c, 64, _q4_k_piece(q, h, c, d, dmin, sc, mn, wdt)))
  return pieces


def _q4_k_piece(q, h, c, d, dmin, sc, mn, wdt):
  """Weights 64c..64c+63 of a Q4_K block: q [bn, 2, ...] float32 codes whose axis 1 is h, the
  nibble (sub-block 2c + h); h an iota over that axis; d, dmin [bn] float32; sc, mn the 8 [bn]
  6-bit scales / mins. Returns [bn, 64] `wdt` = d * sc * q - dmin * mn, in float32 then cast."""
  col = (slice(None),) + (None,) * (q.ndim - 1)      # [bn] -> [bn, 1, ...]
  scale = jnp.where(h == 0, sc[2 * c][col], sc[2 * c + 1][col]).astype(jnp.float32)
  mins = jnp.where(h == 0, mn[2 * c][col], mn[2 * c + 1][col]).astype(jnp.float32)
  w = q * (d[col] * scale) - dmin[col] * mins
  return w.reshape(q.shape[0], 64).astype(wdt)


def _q4_k_scales(s):
  """The 8 (scale, min) 6-bit pairs of a Q4_K/Q5_K block from its 12 packed bytes s (int32)."""
  sc, mn = [], []
  for j in range(8):
    if j < 4:
      sc.append(s[j] & 63)
      mn.append(s[j + 4] & 63)
    else:
      sc.append((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4))
      mn.append((s[j + 4] >> 4) | ((s[j] >> 6) << 4))
  return sc, mn


def _folded_pieces(fmt: str, w_ref, blk, cdt):
  """GGUF block `blk` as 4 pieces (x offset within the block, 64, w [bn, 64] in `cdt`) with the
  scales folded in: each piece is 64 consecutive weights of the block, decoded as a
  [bn, 2, 32] / [bn, 2, 2, 16] tile so each sub-block's scale broadcasts over its codes."""
  def byte(i):
    return w_ref[:, blk, i]

  def bytes_(start, n):
    return w_ref[:, blk, pl.ds(start, n)]

  pieces = []
  if fmt == "q4_k":
    # weights 64c + 32h + i (c < 4, h < 2, i < 32) = nibble h of qs[32c + i], sub-block j = 2c + h
    d = _f16(byte(0), byte(1))
    dmin = _f16(byte(2), byte(3))
    s = [byte(4 + i).astype(jnp.int32) for i in range(12)]
    sc, mn = _q4_k_scales(s)
    h = jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1)
    for c in range(4):
      qs = bytes_(16 + 32 * c, 32).astype(jnp.int32)[:, None, :]            # [bn, 1, 32]
      q = ((qs >> (4 * h)) & 15).astype(jnp.float32)                         # [bn, 2, 32]
      pieces.append((64 * c, 64, _q4_k_piece(q, h, c, d, dmin, sc, mn, cdt)))
  elif fmt == "q6_k":
    # weights 128n + 32r + l: ql[64n + 32(r%2) + l] nibble r//2, qh[32n + l] bits 2r, scale
    # 8n + 2r + l//16. For fixed (n, h = r//2) the 64 weights r%2 = a, l are consecutive.
    d = _f16(byte(208), byte(209))
    a = jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1, 1), 1)
    for n in range(2):
      qh = bytes_(128 + 32 * n, 32).astype(jnp.int32).reshape(-1, 1, 2, 16)  # [bn, 1, 2, 16]
      for hh in range(2):
        ql = bytes_(64 * n, 64).astype(jnp.int32).reshape(-1, 2, 2, 16)     # [bn, a, l16, 16]
        nib = (ql >> (4 * hh)) & 15
        hi = (qh >> (2 * (2 * hh + a))) & 3                                   # [bn, 2, 2, 16]
        q = ((nib | (hi << 4)) - 32).astype(jnp.float32)
        scb = _i8(bytes_(192 + 8 * n + 4 * hh, 4)).astype(jnp.float32).reshape(-1, 2, 2, 1)
        w = q * (d[:, None, None, None] * scb)
        pieces.append((128 * n + 64 * hh, 64, w.reshape(w.shape[0], 64).astype(cdt)))
  else:
    raise ValueError(f"dequant_matmul: no folded path for format {fmt!r}; {FOLD_FORMATS}")
  return pieces


def _kernel(x_ref, w_ref, o_ref, *, fmt: str, blk_elems: int, blocks_per_split: int,
            group: int, cdt, fold: bool, words: bool):
  """One [bm, bn] output tile over `blocks_per_split` GGUF blocks (a K split)."""
  bm = x_ref.shape[0]
  bn = w_ref.shape[0]

  def body(g, acc):
    for b in range(group):
      blk = g * group + b
      if fold:
        pieces = (_q4_k_word_pieces(w_ref, blk, cdt) if words
                  else _folded_pieces(fmt, w_ref, blk, cdt))
        for off, width, w in pieces:
          xs = x_ref[:, pl.ds(blk * blk_elems + off, width)].astype(cdt)    # [bm, 64]
          acc = acc + _mm(xs, w)
        continue
      for off, width, q, scale, bias in _sub_blocks(fmt, w_ref, blk):
        xs = x_ref[:, pl.ds(blk * blk_elems + off, width)].astype(cdt)      # [bm, width]
        y = _mm(xs, q.astype(cdt))                                    # [bm, bn]
        acc = acc + y * scale[None, :]
        if bias is not None:
          acc = acc + jnp.sum(xs.astype(jnp.float32), axis=1)[:, None] * bias[None, :]
    return acc

  acc = jax.lax.fori_loop(0, blocks_per_split // group, body, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("fmt_shape", "tiles", "compute_dtype", "interpret"))
def _dequant_matmul(x, data, *, fmt_shape, tiles: TileConfig, compute_dtype, interpret):
  fmt, (n, k) = fmt_shape
  blk_elems, type_size = BLOCK_FORMATS[fmt]
  n_blocks = k // blk_elems
  m = x.shape[0]
  bm, bn, s = tiles.bm, tiles.bn, tiles.k_splits
  mp = -(-m // bm) * bm
  if mp != m:
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
  bps = n_blocks // s
  group = _pow2_divisor(bps, 8) if blk_elems == 32 else 1
  fold = tiles.fold_scales and fmt in FOLD_FORMATS
  words = tiles.words and fold and fmt == "q4_k"
  if words:   # the same bytes as little-endian 32-bit words: [N, n_blocks, 36] uint32
    w3 = jax.lax.bitcast_convert_type(data.reshape(n, n_blocks, type_size // 4, 4), jnp.uint32)
  else:
    w3 = data.reshape(n, n_blocks, type_size)
  from jax.experimental.pallas import triton as plgpu_triton
  kernel = functools.partial(_kernel, fmt=fmt, blk_elems=blk_elems, blocks_per_split=bps,
                             group=group, cdt=jnp.dtype(compute_dtype), fold=fold, words=words)
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((s, mp, n), jnp.float32),
      grid=(mp // bm, n // bn, s),
      in_specs=[pl.BlockSpec((bm, bps * blk_elems), lambda i, j, t: (i, t)),
                pl.BlockSpec((bn, bps, w3.shape[-1]), lambda i, j, t: (j, t, 0))],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, t: (t, i, j)),
      compiler_params=plgpu_triton.CompilerParams(num_warps=tiles.num_warps,
                                                  num_stages=tiles.num_stages),
      interpret=interpret,
      name=f"dequant_matmul_{fmt}",
  )(x, w3)
  y = out[0] if s == 1 else jnp.sum(out, axis=0)
  return y[:m]


def dequant_matmul(x: jax.Array, w, *, compute_dtype=jnp.bfloat16,
                   tiles: TileConfig | None = None, interpret: bool = False) -> jax.Array:
  """Pallas dequantizing matmul. x: [M, K] float; w: packed weight, logical [N, K], fmt in
  KERNEL_FORMATS; returns y [M, N] float32 = x @ dequantize(w)^T.

  compute_dtype: dot operand dtype (bfloat16 default; float16; float32 = TF32 on GPU tensor
    cores). Codes q are exact in all three; x is rounded to it. Scales apply in float32 after
    each sub-block dot, except on the folded path (FOLD_FORMATS with tiles.fold_scales, the
    default), where each weight is dequantized in float32 and rounded to compute_dtype, the
    same rounding as dequant_matmul_reference(x, w, compute_dtype).
  tiles: TileConfig (default `default_tiles`). interpret: run the kernel with the Pallas
    interpreter (CPU tests; the interpreter starts outputs as NaN, so an
    element the kernel never writes shows up in the result).
  Raises ValueError for a format without a kernel, a K/N that does not tile, or a shape mismatch.
  """
  if w.fmt not in KERNEL_FORMATS:
    raise ValueError(f"dequant_matmul: no kernel for format {w.fmt!r}; kernels: {KERNEL_FORMATS}")
  n, k = w.shape
  if x.ndim != 2 or x.shape[1] != k:
    raise ValueError(f"dequant_matmul: x shape {x.shape} does not match weight [N={n}, K={k}]")
  tiles = tiles or default_tiles(x.shape[0], n, k, w.fmt)
  blk = BLOCK_FORMATS[w.fmt][0]
  if (k // blk) % tiles.k_splits or n % tiles.bn or tiles.bm < 16:
    raise ValueError(f"dequant_matmul: tiles {tiles} do not fit N={n}, K={k} ({w.fmt})")
  return _dequant_matmul(x, w.data, fmt_shape=(w.fmt, (n, k)), tiles=tiles,
                         compute_dtype=jnp.dtype(compute_dtype).name, interpret=interpret)
