"""Model math shared by the target, the draft and the training forward: linear over packed
weights, grouped projections, RMSNorm, RoPE, masked attention over a KV cache, the SwiGLU MLP,
the DFlash context K/V. The Gated DeltaNet family is in `gdn`.

Dimension letters: T tokens in this call, S cache rows, D d_model, H/Hkv heads, Dh head dim,
Hk/Hv GDN key/value heads, Dk/Dv GDN head dims, C conv channels, K conv kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from dflash_jax.kv_cache import KVBuffer
from dflash_jax.quants import QuantWeight
from dflash_jax.runtime import Runtime
from pallas_kernels import dequant_matmul as dm
from pallas_kernels import mgpu_matmul as mgpu


def linear(x: jax.Array, w: QuantWeight, rt: Runtime) -> jax.Array:
  """y = x @ W^T.  x: [..., K] float; w: logical [N, K]; returns [..., N] float32.

  rt.kernels "reference" dequantizes inside the traced function and runs one XLA dot (float32
  uses HIGHEST precision); "pallas" runs pallas_kernels.dequant_matmul on the packed GGUF rows
  (operands in rt.compute_dtype: float32 means TF32 tensor cores on GPU) for the block formats
  and N it tiles, the reference otherwise; "pallas_interpret" is the same through the Pallas
  interpreter (CPU tests). A `Q4KTiles` / `Q5KTiles` / `Q6KTiles` weight (rt.kernels "mosaic" /
  "mosaic_interpret", tiled at load) runs `pallas_kernels.mgpu_matmul.kquant_matmul` (bf16
  operands, float32 accumulation).
  Under `jax.vmap` (the batched decode loop) a kernel call runs once on the rows of the whole
  batch, not once per row (`_rows_folded`).
  """
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  if isinstance(w, mgpu.TILES) or (rt.pallas and dm.supports(w)):
    y = _rows_folded(rt)(x2, w)
  else:
    y = dm.dequant_matmul_reference(x2, w, rt.cdt)
  return y.reshape(*lead, w.shape[0])


def _kernel_matmul(x2: jax.Array, w, rt: Runtime) -> jax.Array:
  """x2 [M, K] through the Pallas kernel that `linear` picks for w -> [M, N] float32."""
  if isinstance(w, mgpu.TILES):                  # tiled at load for rt.kernels "mosaic*"
    return _mosaic_matmul(x2, w, rt)
  return dm.dequant_matmul(x2, w, compute_dtype=rt.cdt, interpret=rt.interpret)


def _rows_folded(rt: Runtime):
  """`_kernel_matmul` with a vmap rule that folds the batch into the kernel's rows: under
  `jax.vmap` with x batched and the weight not (the batched decode loop vmaps a row's step
  over the rows; `jax.vmap` of a `pallas_call` would instead add a grid axis over the batch, a
  copy of the whole grid per row that reads every weight tile again), x [B, M, K] runs as one
  call on [B*M, K], so a step of B rows streams each weight once per M-tile, as XLA's batched
  dot does. Nested vmaps fold level by level. A batched weight (the MoE experts, vmapped with
  their own packed rows) keeps one kernel per batch element (`jax.vmap` of the kernel)."""

  @jax.custom_batching.custom_vmap
  def mm(x2, w):
    return _kernel_matmul(x2, w, rt)

  @mm.def_vmap
  def _(axis_size, in_batched, x2, w):
    x_b, w_b = in_batched
    if any(jax.tree.leaves(w_b)):
      w_axes = jax.tree.map(lambda b: 0 if b else None, w_b)
      y = jax.vmap(functools.partial(_kernel_matmul, rt=rt),
                   in_axes=(0 if x_b else None, w_axes))(x2, w)
      return y, True
    if not x_b:                                   # nothing batched: the same rows for all
      return mm(x2, w), False
    b, m, k = x2.shape
    return mm(x2.reshape(b * m, k), w).reshape(b, m, -1), True

  return mm


# The configuration the Mosaic GPU kernel runs in GPU interpret mode (CPU tests): what the
# interpreter can run (WGMMA operand in SMEM, one compute warpgroup), one persistent program.
MOSAIC_INTERPRET_CONFIG = dict(kb=1, splits=1, stages=2, n_sm=1, a_operand="smem", compute_wgs=1)


def mosaic_rows_multiple(rt: Runtime) -> int:
  """The multiple of N a K-quant weight needs to run the Mosaic GPU kernel as rt runs it (the
  interpret configuration, or the GPU default `MgpuConfig`); `target_params.tile_kquants` tiles
  only those."""
  return mgpu.rows_multiple(mgpu.MgpuConfig(**MOSAIC_INTERPRET_CONFIG) if rt.interpret
                            else mgpu.MgpuConfig())


def _mosaic_matmul(x2: jax.Array, w, rt: Runtime) -> jax.Array:
  """x2 [M, K] @ dequantize(w)^T through the Mosaic GPU K-quant kernel -> [M, N] float32."""
  if not rt.interpret:
    return mgpu.kquant_matmul(x2, w)
  import jax.experimental.pallas.mosaic_gpu as plgpu
  with plgpu.force_gpu_interpret_mode():
    return mgpu.kquant_matmul(x2, w, mgpu.MgpuConfig(**MOSAIC_INTERPRET_CONFIG))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Projections:
  """Several projections of the same input (q/k/v, ffn gate/up, the Gated DeltaNet inputs), with
  the members of equal quant format concatenated along N at load so one matmul reads x once and
  one kernel launch covers them (the "fused QKV / gate-up" variant: the packed GGUF rows of the
  members are simply stacked, so every kernel and the reference run unchanged).

  Attributes:
    groups: QuantWeights, each the row-concatenation of one or more members ([sum N_i, K]).
    members: static; per group, the (member index, rows) of its members in row order.
  Built at load by `target_params.fuse_projections`, or unfused by `Projections.separate`.
  """

  groups: tuple
  members: tuple = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def separate(cls, ws: Sequence[QuantWeight]) -> "Projections":
    """Every member its own group (no fusion)."""
    return cls(tuple(ws), tuple(((i, w.shape[0]),) for i, w in enumerate(ws)))

  def member_weights(self) -> tuple:
    """The members' weights, in member order (requires one member per group)."""
    if any(len(m) != 1 for m in self.members):
      raise ValueError("member_weights: projections are fused")
    order = sorted(range(len(self.groups)), key=lambda g: self.members[g][0][0])
    return tuple(self.groups[g] for g in order)


def project(x: jax.Array, p: Projections, rt: Runtime) -> tuple[jax.Array, ...]:
  """All member projections of x: x [..., K] -> tuple of [..., N_i] float32, in member order.

  One `linear` per group, then the group output is split by rows.
  """
  outs = {}
  for w, mem in zip(p.groups, p.members):
    y = linear(x, w, rt)
    off = 0
    for j, n in mem:
      outs[j] = y[..., off:off + n]
      off += n
  return tuple(outs[j] for j in range(len(outs)))


def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) * w over the last axis, float32.

  GGUF stores Qwen3.5's zero-centred norms already as (1 + w), so one form serves all models.
  """
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return y if w is None else y * w


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis (HF `l2norm`, llama.cpp `build_gdn_l2_norm`)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def rope(x: jax.Array, pos: jax.Array, *, rot_dim: int, theta: float, style: str,
         freq_factors: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding on the first rot_dim dims of each head.

  x: [T, H, Dh] float32; pos: [T] int32 absolute positions.
  style "neox": rotate pairs (i, i + rot_dim/2) (HF rotate_half; llama.cpp NEOX / IMROPE for text);
  style "norm": rotate adjacent pairs (2i, 2i+1) (llama.cpp LLAMA_ROPE_TYPE_NORM).
  freq_factors: optional [rot_dim/2] divisors of the frequencies (GGUF `rope_freqs.weight`).
  """
  half = rot_dim // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rot_dim)
  if freq_factors is not None:
    inv_freq = inv_freq / freq_factors
  ang = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, half]
  cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
  xr, rest = x[..., :rot_dim], x[..., rot_dim:]
  if style == "neox":
    x1, x2 = xr[..., :half], xr[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  elif style == "norm":
    x1, x2 = xr[..., 0::2], xr[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xr.shape)
  else:
    raise ValueError(f"unknown rope {style=}")
  return jnp.concatenate([out, rest], axis=-1)


def write_block(cache: KVBuffer, start: jax.Array, rows: jax.Array) -> KVBuffer:
  """cache: [n_layer, Hkv, S, Dh] (one sequence's K or V cache of all layers, head-major: a
  layer's head is one contiguous [S, Dh] slab, so attention reads chunks with no transpose; any
  kv_cache format); rows: [n_layer, T, Hkv, Dh] float (token-major, as the forwards produce
  them) -> cache with rows start..start+T-1 = rows, encoded in the cache's format: one
  dynamic-update-slice per plane, in place on a donated or loop-carried cache."""
  z = jnp.int32(0)
  return cache.write(kv_rows(rows), (z, z, jnp.asarray(start, jnp.int32), z))


def kv_rows(rows: jax.Array) -> jax.Array:
  """Token-major K/V rows [n_layer, T, Hkv, Dh] -> the cache's head-major [n_layer, Hkv, T, Dh]."""
  return rows.transpose(0, 2, 1, 3)


def write_block_rows(cache: KVBuffer, start: jax.Array, rows: jax.Array) -> KVBuffer:
  """The batched form: cache [B, n_layer, Hkv, S, Dh], start [B] int32, rows [B, n_layer, T,
  Hkv, Dh] -> row b's block written at start[b]. One dynamic-update-slice per row and plane,
  unrolled (in place; no scatter, and no nested loop whose carry XLA would copy)."""
  z = jnp.int32(0)
  for b in range(cache.shape[0]):
    cache = cache.write(kv_rows(rows[b])[None], (jnp.int32(b), z, z, start[b], z))
  return cache


def attn_matmul(spec: str, a: jax.Array, b: jax.Array, compute_dtype=jnp.float32) -> jax.Array:
  """One product of a training attention (`jnp.einsum(spec, a, b)`), float32 out. compute_dtype
  (static): float32 runs it at HIGHEST precision (what decoding and the references run);
  bfloat16 takes bf16 operands with float32 accumulation (flash attention's bf16 training form,
  as the projections under `Runtime.compute_dtype` bfloat16)."""
  if jnp.dtype(compute_dtype) == jnp.float32:
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
  return jnp.einsum(spec, a.astype(compute_dtype), b.astype(compute_dtype),
                    preferred_element_type=jnp.float32)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              compute_dtype=jnp.float32) -> jax.Array:
  """Softmax attention with GQA, float32 softmax.

  q: [T, H, Dh]; k: [S, Hkv, Dh]; v: [S, Hkv, Dv]; mask: [T, S] bool (True = visible; a query
  must see at least one key). Query head h reads KV head h // (H / Hkv). Scale Dh**-0.5.
  compute_dtype (static): the two products' operands (`attn_matmul`: float32 at HIGHEST, or
  bfloat16 with float32 accumulation for bf16 training). Returns [T, H, Dv] float32.
  """
  t, h, dh = q.shape
  hkv = k.shape[1]
  qg = q.reshape(t, hkv, h // hkv, dh)
  s = attn_matmul("tgrd,sgd->grts", qg, k, compute_dtype) * (dh ** -0.5)
  s = jnp.where(mask[None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = attn_matmul("grts,sgd->tgrd", p, v, compute_dtype)
  return o.reshape(t, h, v.shape[-1])


def live_chunk(capacity: int, n_queries: int = 1) -> int:
  """Rows per chunk of `attention_live` for a cache of `capacity` rows read by `n_queries`
  queries: for a decode step (<= 32 queries: AR, chain and DDTree verifies) capacity / 32
  rounded down to a power of two, within 128..2048; 128 for more queries (prefill chunks).
  Each chunk is a loop iteration with a fixed cost, so long caches want fewer, larger chunks
  when the step is small: on the 2-core CPU, SmolLM2 at 64K live rows, 2048-row chunks take an
  AR step from 569 to 337 ms (float32 cache) and a 16-token verify from 1697 to 1150 ms; a
  512-query prefill chunk at 16K live rows is slower with them (11.2 s at 128 rows, 15.3 s at
  512)."""
  if n_queries > 32:
    return 128
  return int(min(2048, max(128, 1 << max(capacity // 32, 1).bit_length() - 1)))


def attention_live(q: jax.Array, k_all: KVBuffer, v_all: KVBuffer, layer: int,
                   mask, n_live: jax.Array, chunk: int | None = None, local=None,
                   live_bound=None, row=None, key_fn=None, dense: bool = False) -> jax.Array:
  """Softmax attention over the live rows of a stacked KV cache only, chunk by chunk with an
  online softmax (FlashAttention's running max / sum, arXiv:2205.14135): the work is
  proportional to n_live, not to the cache capacity S; optionally plus `local` keys that are not
  in the cache (this call's own rows), in the same softmax.

  q: [T, H, Dh] float32; k_all / v_all: [n_layer, Hkv, S, Dh|Dv] head-major caches
  (kv_cache.KVBuffer in any format; each chunk is decoded to float32 as it is read, never the
  whole cache; see `write_block`); layer: static row of k_all; mask: [T, S] bool
  visible cache keys, or None (all rows below n_live visible); n_live: [] int32 cache rows that
  may be visible (rows >= n_live never are). local: None or (k [T2, Hkv, Dh], v [T2, Hkv, Dv],
  mask [T, T2] bool; float32, already as the cache would return them: kv_cache.roundtrip).
  live_bound: optional [] int32 >= n_live that sets the number of chunks visited; the batched decode loop
  passes the largest n_live of its rows, unbatched, so that under `vmap` every row reads the
  same chunk offsets (plain slices instead of per-row gathers). row: None, or [] int32 with
  k_all / v_all a batch's caches [B, n_layer, Hkv, S, Dh]: this sequence's cache is row `row`,
  read in place (a prefill never copies its row out of the batch). key_fn: None, or a function
  (k [Hkv, c, Dh] float32 a decoded chunk, rows [c] int32 its cache rows) -> the keys to attend
  to (the draft's window-relative positions rotate stored pre-RoPE keys here, chunk by chunk).
  dense: static; True reads the whole capacity as one chunk (rows >= n_live masked): a loop of
  one static trip instead of a data-dependent one, so a GPU runs no host round trip per layer
  (XLA:GPU copies a while loop's predicate to the host each iteration) at the price of reading
  S rows (`Runtime.attention` "dense").
  Returns [T, H, Dv] float32,
  equal to `attention` over the visible keys up to float rounding (a different summation
  order). Chunks are `chunk` rows (default `live_chunk(S, T)`; S if smaller); the last one is slid
  back to end at S and its already-seen rows masked, so any S works. A query must see at least
  one key.
  """
  t, h, dh = q.shape
  hkv, s_cap, dv = v_all.shape[-3:]
  c = s_cap if dense else min(chunk or live_chunk(s_cap, t), s_cap)
  r = h // hkv
  hp = jax.lax.Precision.HIGHEST
  qg = q.reshape(t, hkv, r, dh) * (dh ** -0.5)
  n_chunks = 1 if dense else ((n_live if live_bound is None else live_bound) + c - 1) // c

  def update(carry, sc, vc):                          # vc: [Hkv, s, Dv]
    m, l, acc = carry
    m_new = jnp.maximum(m, sc.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(sc - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    return (m_new, l * corr + p.sum(-1),
            acc * corr[..., None] + jnp.einsum("grts,gsd->grtd", p, vc, precision=hp))

  def body(i, carry):
    c0 = jnp.minimum(i * c, s_cap - c)                 # slid back for the last partial chunk
    z = jnp.int32(0)
    if row is None:
      at, sizes = (jnp.int32(layer), z, c0, z), (1, hkv, c)
    else:
      at, sizes = (row, jnp.int32(layer), z, c0, z), (1, 1, hkv, c)
    kc = k_all.read(at, sizes).reshape(hkv, c, dh)
    vc = v_all.read(at, sizes).reshape(hkv, c, dv)
    cols = c0 + jnp.arange(c, dtype=jnp.int32)
    if key_fn is not None:
      kc = key_fn(kc, cols)
    vis = ((cols >= i * c) & (cols < n_live))[None, :]
    if mask is not None:
      vis = vis & jax.lax.dynamic_slice_in_dim(mask, c0, c, axis=1)
    sc = jnp.einsum("tgrd,gsd->grts", qg, kc, precision=hp)
    return update(carry, jnp.where(vis[None, None], sc, -jnp.inf), vc)

  init = (jnp.full((hkv, r, t), -jnp.inf, jnp.float32), jnp.zeros((hkv, r, t), jnp.float32),
          jnp.zeros((hkv, r, t, dv), jnp.float32))
  if local is not None:
    lk, lv, lmask = local
    sc = jnp.einsum("tgrd,sgd->grts", qg, lk.astype(jnp.float32), precision=hp)
    init = update(init, jnp.where(lmask[None, None], sc, -jnp.inf),
                  lv.astype(jnp.float32).transpose(1, 0, 2))
  _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
  o = acc / l[..., None]                                # [Hkv, R, T, Dv]
  return o.transpose(2, 0, 1, 3).reshape(t, h, dv)


def ordered_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """Sum over `axis` in a fixed pairwise order (halve, add, repeat; an odd length is padded with
  one zero), written as elementwise adds: every output is the same sequence of float32 adds
  whatever the other axes' sizes or the element's index, unlike a reduce or a dot, whose order
  XLA picks per shape. x: any float32 array. Returns x.sum(axis) up to rounding."""
  x = jnp.moveaxis(x, axis, -1)
  while x.shape[-1] > 1:
    n = x.shape[-1]
    if n % 2:
      x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (1,), x.dtype)], axis=-1)
      n += 1
    x = x[..., :n // 2] + x[..., n // 2:]
  return x[..., 0]


def attention_ordered(q: jax.Array, k_all: KVBuffer, v_all: KVBuffer, layer: int,
                      start: jax.Array, block_k: jax.Array, block_v: jax.Array,
                      anc_at_depth: jax.Array, depths: jax.Array, chunk: int | None = None,
                      live_bound=None, dense: bool = False) -> jax.Array:
  """Batch-invariant attention of a verify block (`DecodeConfig.invariant_rows`): each query
  row reads its keys at their sequence positions, the committed cache rows < start and then its
  own root path (ancestors in depth order, then itself) at positions start, start + 1, ...,
  exactly where an autoregressive step would find them in the cache; chunks are aligned at
  absolute positions and every score, softmax sum and value sum is an `ordered_sum`. So a
  row's output depends only on its own path and the cache, bit for bit, not on the block's
  size, its other nodes, or the row's index: a token verified in a chain or a DDTree gets the
  same float32 bits as in a padded autoregressive step of the same number of rows.

  q: [T, H, Dh] float32 (RoPE at start + depth); k_all / v_all: [n_layer, Hkv, S, Dh|Dv]
  caches (any format), rows < start committed; layer: static; start: [] int32;
  block_k / block_v: [T, Hkv, Dh|Dv] float32 this block's rows as the cache will return them
  (kv_cache.roundtrip); anc_at_depth: [T, T] int32, [t, d] = node t's ancestor at depth d
  (d <= depths[t]); depths: [T] int32. chunk, live_bound, dense as in `attention_live` (dense
  still aligns its one chunk at position 0, so the sums keep their order).
  Returns [T, H, Dv] float32, equal to `attention` over the same keys up to rounding.
  """
  t, h, dh = q.shape
  hkv, s_cap, dv = v_all.shape[-3:]
  c = s_cap if dense else min(chunk or live_chunk(s_cap, t), s_cap)
  r = h // hkv
  qg = q.reshape(t, hkv, r, dh) * (dh ** -0.5)
  n_chunks = 1 if dense else ((start if live_bound is None else live_bound) + t + c - 1) // c

  def body(i, carry):
    m, l, acc = carry
    c0 = jnp.minimum(i * c, s_cap - c)
    z = jnp.int32(0)
    at, sizes = (jnp.int32(layer), z, c0, z), (1, hkv, c)
    kc = k_all.read(at, sizes).reshape(hkv, c, dh).transpose(1, 0, 2)     # [c, Hkv, Dh]
    vc = v_all.read(at, sizes).reshape(hkv, c, dv).transpose(1, 0, 2)
    cols = c0 + jnp.arange(c, dtype=jnp.int32)
    fresh = cols >= i * c                                  # the slid-back last chunk's new rows
    rel = cols - start
    in_path = fresh[None] & (rel[None] >= 0) & (rel[None] <= depths[:, None])   # [T, c]
    node = jnp.take_along_axis(anc_at_depth, jnp.broadcast_to(jnp.clip(rel, 0, t - 1), (t, c)),
                               axis=1)
    krow = jnp.where(in_path[..., None, None], block_k[node], kc[None])   # [T, c, Hkv, Dh]
    vrow = jnp.where(in_path[..., None, None], block_v[node], vc[None])
    vis = in_path | (fresh & (cols < start))[None]
    sc = ordered_sum(qg[:, :, :, None, :] * krow.transpose(0, 2, 1, 3)[:, :, None], -1)
    sc = jnp.where(vis[:, None, None, :], sc, -jnp.inf)                  # [T, Hkv, R, c]
    m_new = jnp.maximum(m, sc.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(sc - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    pv = ordered_sum(p[..., None] * vrow.transpose(0, 2, 1, 3)[:, :, None], -2)
    return m_new, l * corr + ordered_sum(p, -1), acc * corr[..., None] + pv

  init = (jnp.full((t, hkv, r), -jnp.inf, jnp.float32), jnp.zeros((t, hkv, r), jnp.float32),
          jnp.zeros((t, hkv, r, dv), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, n_chunks, body, init)
  return (acc / l[..., None]).reshape(t, h, dv)


def swiglu_mlp(y: jax.Array, gate_up: Projections, down: QuantWeight, rt: Runtime) -> jax.Array:
  """SwiGLU feed-forward (target FFN, draft MLP): down(silu(gate(y)) * up(y)).

  y: [..., D] (already normed); gate_up: the gate [F, D] and up [F, D] projections; down:
  [D, F]. Returns [..., D] float32.
  """
  gate, up = project(y, gate_up, rt)
  return linear(jax.nn.silu(gate) * up, down, rt)


def _experts(w: QuantWeight, n_expert: int) -> tuple[jax.Array, tuple[int, int]]:
  """A folded [E*N, K] expert weight as its per-expert packed rows [E, N, row_bytes | K] and the
  logical shape (N, K) of one expert."""
  n, k = w.shape[0] // n_expert, w.shape[1]
  return w.data.reshape(n_expert, n, w.data.shape[-1]), (n, k)


def _expert_rows(x: jax.Array, w: QuantWeight, n_expert: int, ids: jax.Array,
                 rt: Runtime) -> jax.Array:
  """Row s of x through expert ids[s]: x [S, K], ids [S] int32 -> [S, N] float32. Only the
  chosen experts' packed rows are gathered; each row is one `linear` (the Pallas dequantizing
  matmul under rt.pallas, vmapped over the rows)."""
  data, shape = _experts(w, n_expert)
  one = lambda xs, d: linear(xs[None], QuantWeight(d, w.fmt, shape), rt)[0]   # noqa: E731
  return jax.vmap(one)(x, jnp.take(data, ids, axis=0))


def _every_expert(x: jax.Array, w: QuantWeight, n_expert: int, rt: Runtime) -> jax.Array:
  """Every expert over its own rows: x [E, T, K] (or [T, K], the same rows for all) -> [E, T, N]
  float32, one `linear` per expert (vmapped)."""
  data, shape = _experts(w, n_expert)
  one = lambda xs, d: linear(xs, QuantWeight(d, w.fmt, shape), rt)   # noqa: E731
  return jax.vmap(one, in_axes=(0 if x.ndim == 3 else None, 0))(x, data)


MOE_PATHS = ("auto", "gather", "all")


def moe_ffn(y: jax.Array, p, *, n_used: int, weights_scale: float, rt: Runtime,
            path: str = "auto") -> jax.Array:
  """Routed-expert FFN plus, when p has one, a gated shared expert (Qwen3.5-MoE, Qwen3-MoE;
  llama.cpp src/models/qwen35moe.cpp `build_layer_ffn` / qwen3moe.cpp with llama-graph.cpp
  `build_moe_ffn`, as transformers' Qwen3_5MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock):

    probs = softmax(y @ router^T); (w, e) = top n_used of probs; w /= max(sum(w), 2^-14)
    (times weights_scale when that is neither 0 nor 1);
    out = sum_j w_j * down_e_j(silu(gate_e_j(y)) * up_e_j(y)) [+ sigmoid(y . shared_gate) * shared(y)]

  y: [..., D] (already normed); p: `target_params.MoEParams`. Returns [..., D] float32.
  The routed experts run one of two ways, chosen by the static shape: with fewer (token, expert)
  pairs than experts (decode steps and small verifies), each pair's expert is gathered from the
  packed rows (only the chosen experts' bytes are read); otherwise every expert runs over all T
  tokens with a zero weight where it was not chosen (prefill chunks, batched verifies: E /
  n_used x the FFN FLOPs, each expert read once). Every expert matmul is a `linear` on packed
  rows (rt's kernels). The two agree up to float rounding (tests/test_moe.py). path: static;
  "auto" (the rule above), or "gather" / "all" to force one (benchmarks).
  Raises ValueError for another path.
  """
  if path not in MOE_PATHS:
    raise ValueError(f"moe_ffn: path={path!r}; expected one of {MOE_PATHS}")
  lead, d = y.shape[:-1], y.shape[-1]
  y2 = y.reshape(-1, d)
  t = y2.shape[0]
  n_expert = p.router.shape[0]
  probs = jax.nn.softmax(linear(y2, p.router, rt), axis=-1)             # [T, E]
  w, ids = jax.lax.top_k(probs, n_used)                                  # [T, k]
  w = w / jnp.maximum(jnp.sum(w, -1, keepdims=True), 6.103515625e-5)
  if weights_scale not in (0.0, 1.0):
    w = w * weights_scale

  def swiglu(run):          # run(w) -> an expert matmul's output [..., N]
    if p.up_exps is None:   # merged rows: [gate | up] per expert
      gu = run(p.gate_up_exps)
      gate, up = jnp.split(gu, 2, axis=-1)
    else:
      gate, up = run(p.gate_up_exps), run(p.up_exps)
    return jax.nn.silu(gate) * up

  if path == "gather" or (path == "auto" and t * n_used < n_expert):
    xs, ids = jnp.repeat(y2, n_used, axis=0), ids.reshape(-1)            # [T*k, D], [T*k]
    h = swiglu(lambda m: _expert_rows(xs, m, n_expert, ids, rt)) * w.reshape(-1, 1)
    out = _expert_rows(h, p.down_exps, n_expert, ids, rt).reshape(t, n_used, d).sum(1)
  else:
    comb = jnp.zeros((t, n_expert), jnp.float32).at[jnp.arange(t)[:, None], ids].set(w)
    h = swiglu(lambda m: _every_expert(y2, m, n_expert, rt)) * comb.T[..., None]   # [E, T, F]
    out = _every_expert(h, p.down_exps, n_expert, rt).sum(0)
  if p.shared_down is not None:
    shared = swiglu_mlp(y2, p.shared_gate_up, p.shared_down, rt)
    g = jax.nn.sigmoid(jnp.dot(y2, p.shared_gate, precision=jax.lax.Precision.HIGHEST))
    out = out + g[:, None] * shared
  return out.reshape(*lead, d)


def context_kv(c: jax.Array, wk: QuantWeight, wv: QuantWeight, k_norm: jax.Array,
               pos: jax.Array, *, n_kv_head: int, head_dim: int, rope_theta: float,
               rms_eps: float, rt: Runtime) -> tuple[jax.Array, jax.Array]:
  """K/V of a Qwen3-style attention layer (the DFlash draft's context and block keys, z-lab
  dflash/model.py): k = RoPE(k_norm(wk c)), v = wv c, RoPE "neox" over the whole head.

  c: [T, D] inputs; pos: [T] int32 positions, or None: k without RoPE (rotated later, at
  read: the draft's window-relative positions). Returns (k, v): [T, Hkv, Dh] float32.
  """
  t = c.shape[0]
  k = rms_norm(linear(c, wk, rt).reshape(t, n_kv_head, head_dim), k_norm, rms_eps)
  v = linear(c, wv, rt).reshape(t, n_kv_head, head_dim)
  if pos is None:
    return k, v
  return rope(k, pos, rot_dim=head_dim, theta=rope_theta, style="neox"), v
