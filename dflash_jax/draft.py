"""z-lab DFlash block-diffusion draft forward (arXiv:2602.06036; z-lab/dflash dflash/model.py).

The draft sees `[bonus, MASK x (L-1)]` embedded with the target's embedding table, plus context
K/V computed from target features: c = hidden_norm(fc(features)), per layer k = k_norm(k_proj(c)),
v = v_proj(c), RoPE at the context positions. Block queries attend over all context and the
whole block with no mask (sliding layers: causal + window). Logits = target lm_head(norm(h))[1:].

Context K/V are cached across steps (`DraftCache`) and written by `ingest`; `propose` runs the
block; `train_hidden` is the many-blocks training form of the same math. Checkpoint I/O (z-lab
key names, safetensors, config.json) is in `draft_io`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax import kv_cache, layers
from dflash_jax.config import DraftConfig
from dflash_jax.quants import QuantWeight, take_rows
from dflash_jax.runtime import Runtime


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftLayer:
  in_norm: jax.Array       # [D] f32 input_layernorm
  post_norm: jax.Array     # [D] f32 post_attention_layernorm
  wq: QuantWeight          # [H*Dh, D]
  wk: QuantWeight          # [Hkv*Dh, D]
  wv: QuantWeight          # [Hkv*Dh, D]
  wo: QuantWeight          # [D, H*Dh]
  q_norm: jax.Array        # [Dh] f32
  k_norm: jax.Array        # [Dh] f32
  gate_up: layers.Projections  # mlp.gate_proj [F, D], mlp.up_proj [F, D] (unfused)
  down: QuantWeight        # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ConvParams:
  """A DFlash-2 grouped dynamic causal convolution (`GroupedDynamicCausalConv`): static taps
  base [2, K, D] f32 (side 0 "prepare", side 1 "finish") plus per-row dynamic taps
  proj(h) [2*K*D/G] (column s*K*(D/G) + o*(D/G) + g: side s, tap o, group g)."""
  base: jax.Array          # [2, K, D] f32
  proj: QuantWeight        # [2*K*D/G, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlash2Params:
  """What a DFlash-2 draft adds to DraftParams: per layer the attention and MLP convolutions,
  and the candidate selector (hidden_projection [R, D], predecessor / successor codebooks
  [V, R] f32)."""
  attn_conv: tuple         # [n_layer] ConvParams
  mlp_conv: tuple          # [n_layer] ConvParams
  sel_proj: QuantWeight    # [R, D]
  pred: jax.Array          # [V, R] f32
  succ: jax.Array          # [V, R] f32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DSparkParams:
  """What a DSpark draft adds to DraftParams (DeepSpec markov_head.py / common.py): the Markov
  head's predecessor embedding w1 [V, r] f32 (`markov_w1`) and bias projection w2 [V, r]
  (`markov_w2`); gated heads: gate [r, D+r] + gate_b [r] (`gate_proj`); RNN heads: joint
  [3r, 2r+D] + joint_b [3r] (`joint_proj`); a confidence head: conf [D(+r)] f32 + conf_b []
  (`confidence_head.proj`). Absent parts are None."""
  w1: "jax.Array | None" = None
  w2: "QuantWeight | None" = None
  gate: "QuantWeight | None" = None
  gate_b: "jax.Array | None" = None
  joint: "QuantWeight | None" = None
  joint_b: "jax.Array | None" = None
  conf: "jax.Array | None" = None
  conf_b: "jax.Array | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftParams:
  fc: QuantWeight          # [D, n_features*D_target]
  hidden_norm: jax.Array   # [D] f32
  norm: jax.Array          # [D] f32
  layers: tuple            # [n_layer] DraftLayer
  dflash2: "DFlash2Params | None" = None   # DFlash-2 drafts only (draft2.py)
  dspark: "DSparkParams | None" = None     # DSpark drafts only (dspark.py)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
  """Draft context K/V: k, v [n_layer, Hkv, R, Dh] kv_cache.KVBuffer (Runtime.k_format /
  v_format, as the target's cache), head-major (post k_norm and RoPE at the absolute position).

  window: static; 0 = row p holds position p (R = the decode capacity); else a ring buffer:
  position p lives in row p % R and `propose` attends to positions start-window..start-1 only
  (R >= window + the most rows one write puts past the committed length, DecodeConfig.draft_rows,
  so such rows never land on a row the window still reads).
  relative: static; with a ring buffer, window-relative RoPE positions
  (DecodeConfig.draft_positions "window"): k holds keys before RoPE, rotated as they are read
  at their position minus `base(start)`.
  """

  k: kv_cache.KVBuffer
  v: kv_cache.KVBuffer
  window: int = dataclasses.field(default=0, metadata=dict(static=True))
  relative: bool = dataclasses.field(default=False, metadata=dict(static=True))

  def base(self, start: jax.Array) -> jax.Array:
    """[] int32 the position RoPE counts from for a block at `start`: max(0, start - window)
    with window-relative positions, else 0."""
    if not self.relative:
      return jnp.int32(0)
    return jnp.maximum(jnp.asarray(start, jnp.int32) - self.window, 0)

  def write(self, start: jax.Array, k: jax.Array, v: jax.Array, lead: tuple = ()) -> "DraftCache":
    """Context rows k, v [(1,) n_layer, T, Hkv, Dh] float (token-major; T <= R) for positions
    start..start+T-1 written at their rows: one dynamic-update-slice per plane at row `start`,
    or, in a ring buffer, a scatter to rows (start + j) % R (in place either way). lead: the
    indices of the leading (batch) axes of a batched cache, with a leading 1 on k / v."""
    kr, vr = jnp.swapaxes(k, -3, -2), jnp.swapaxes(v, -3, -2)     # head-major, as stored
    z = jnp.int32(0)
    if not self.window:
      at = tuple(lead) + (z, z, jnp.asarray(start, jnp.int32), z)
      return dataclasses.replace(self, k=self.k.write(kr, at), v=self.v.write(vr, at))
    rows = (start + jnp.arange(kr.shape[-2], dtype=jnp.int32)) % self.k.shape[-2]
    return dataclasses.replace(self, k=self.k.scatter(kr, tuple(lead), rows),
                               v=self.v.scatter(vr, tuple(lead), rows))

  def context(self, start: jax.Array, n_queries: int):
    """What a block at `start` reads: (pos [R] int32 the position each row holds, n_live []
    int32 the rows to read, visible [n_queries, R] bool or None). Without a window: rows <
    start, all visible (None). A ring buffer: every row once it wrapped, visible when it holds
    a position in start-window..start-1."""
    r = self.k.shape[-2]
    rows = jnp.arange(r, dtype=jnp.int32)
    if not self.window:
      return rows, start, None
    pos = start - 1 - jnp.mod(start - 1 - rows, r)
    visible = (pos >= 0) & (pos >= start - self.window)
    return pos, jnp.minimum(start, r), jnp.broadcast_to(visible[None], (n_queries, r))


def init_cache(cfg: DraftConfig, capacity: int, rt: Runtime = Runtime(),
               window: int = 0, relative: bool = False) -> DraftCache:
  """Zeroed context cache of `capacity` rows in rt's K / V formats (ValueError from
  kv_cache.check_format); window > 0: a ring buffer; relative: window-relative positions (only
  with a ring buffer; see DraftCache)."""
  lead = (cfg.n_layer, cfg.n_kv_head, capacity)
  return DraftCache(kv_cache.KVBuffer.zeros(rt.k_format, lead, cfg.head_dim),
                    kv_cache.KVBuffer.zeros(rt.v_format, lead, cfg.head_dim), window,
                    relative and window > 0)


def kv_rows(x, lay: DraftLayer, pos, cfg: DraftConfig, rt: Runtime):
  """Context / block K, V [T, Hkv, Dh] of normed rows x [T, D]; pos None: k before RoPE."""
  return layers.context_kv(x, lay.wk, lay.wv, lay.k_norm, pos, n_kv_head=cfg.n_kv_head,
                           head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_eps=cfg.rms_eps,
                           rt=rt)


def queries(x, lay: DraftLayer, pos, cfg: DraftConfig, rt: Runtime):
  """x: [T, D] normed block rows -> q [T, H, Dh] (q_norm, RoPE)."""
  q = layers.linear(x, lay.wq, rt).reshape(x.shape[0], cfg.n_head, cfg.head_dim)
  return layers.rope(layers.rms_norm(q, lay.q_norm, cfg.rms_eps), pos, rot_dim=cfg.head_dim,
                     theta=cfg.rope_theta, style="neox")


def context_rows(params: DraftParams, feats, cfg: DraftConfig, rt: Runtime):
  """Target features [T, F*D_target] -> draft context rows c [T, D] (fc, then hidden_norm)."""
  return layers.rms_norm(layers.linear(feats, params.fc, rt), params.hidden_norm, cfg.rms_eps)


def _mlp_residual(h, o, lay: DraftLayer, cfg: DraftConfig, rt: Runtime):
  """h + wo(o), then + SwiGLU MLP of its post-attention norm."""
  h = h + layers.linear(o, lay.wo, rt)
  return h + layers.swiglu_mlp(layers.rms_norm(h, lay.post_norm, cfg.rms_eps), lay.gate_up,
                               lay.down, rt)


def ingest_rows(params: DraftParams, cfg: DraftConfig, feats: jax.Array, start: jax.Array,
                rt: Runtime, rope_keys: bool = True) -> tuple[jax.Array, jax.Array]:
  """Context K/V of target features at positions start..start+W-1, not yet written.

  feats: [W, F*D_target]. Context gets fc + hidden_norm only, then per layer
  k = k_norm(k_proj(c)) with RoPE (none when rope_keys is False, static: a window-relative
  cache, DraftCache.relative, rotates keys as it reads them), v = v_proj(c).
  Returns (k, v): [n_layer, W, Hkv, Dh] float32.
  """
  pos = start + jnp.arange(feats.shape[0], dtype=jnp.int32) if rope_keys else None
  c = context_rows(params, feats, cfg, rt)
  kv = [kv_rows(c, lay, pos, cfg, rt) for lay in params.layers]
  return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])


def ingest(params: DraftParams, cfg: DraftConfig, feats: jax.Array, start: jax.Array,
           cache: DraftCache, rt: Runtime) -> DraftCache:
  """Write context K/V for target features of positions start..start+W-1 into the cache
  (`ingest_rows`, then one dynamic-update-slice per buffer).

  feats: [W, F*D_target] (rows past the real count are written too; they lie at positions that
  later ingests overwrite and `propose` never reads).
  """
  k, v = ingest_rows(params, cfg, feats, start, rt, rope_keys=not cache.relative)
  return cache.write(start, k, v)


def propose(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
            bonus: jax.Array, start: jax.Array, cache: DraftCache, rt: Runtime,
            n_logits: int | None = None) -> tuple[jax.Array, DraftCache]:
  """One draft block at positions start..start+L-1 (context = cache rows < start).

  bonus: [] int32 the last committed token (at position `start`); embed/lm_head: the target's.
  n_logits: static, 1..L-1 (default L-1): logits only for the first n_logits block offsets (the
  block itself is still the full L positions, so those rows are unchanged; a small DDTree budget
  needs only that many depths and skips the rest of the vocabulary-sized lm_head matmul).
  The block's own K/V are attended to directly (bidirectionally; sliding layers causally within
  the window) and not written: the cache is only read.
  Returns (logits [n_logits, V] float32, row j predicting position start+1+j; the cache,
  unchanged).
  Raises ValueError for n_logits outside 1..L-1.
  """
  n_logits = check_n_logits(cfg, n_logits, cfg.block_size - 1)
  h = block_hidden(params, cfg, embed, bonus, start, cache, rt)
  return layers.linear(h[1:1 + n_logits], lm_head, rt), cache


def check_n_logits(cfg: DraftConfig, n_logits: int | None, most: int) -> int:
  """n_logits (static) or its default `most` (the rows one block gives: L-1 for z-lab's layout,
  L for DSpark's anchor-first one), checked: ValueError outside 1..most."""
  n_logits = most if n_logits is None else n_logits
  if not 1 <= n_logits <= most:
    what = "block_size-1" if most == cfg.block_size - 1 else "block_size"
    raise ValueError(f"n_logits={n_logits} must be in [1, {what}={most}]")
  return n_logits


def block_hidden(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, bonus: jax.Array,
                 start: jax.Array, cache: DraftCache, rt: Runtime) -> jax.Array:
  """The block [bonus, MASK x (L-1)] at positions start..start+L-1 through the draft layers and
  the final norm (context = cache rows < start; the block's own K/V attended to directly, not
  written). Returns h: [L, D] float32."""
  L = cfg.block_size
  ids = jnp.concatenate([bonus[None].astype(jnp.int32),
                         jnp.full((L - 1,), cfg.mask_token_id, jnp.int32)])
  pos = start + jnp.arange(L, dtype=jnp.int32)
  h = take_rows(embed, ids)
  key_pos, n_live, in_window = cache.context(start, L)
  rpos, key_fn = context_rope(cache, cfg, start, pos, key_pos)
  full_local = jnp.ones((L, L), bool)
  for i, lay in enumerate(params.layers):
    x = layers.rms_norm(h, lay.in_norm, cfg.rms_eps)
    k, v = kv_rows(x, lay, rpos, cfg, rt)
    past = in_window
    if cfg.sliding[i]:
      past = pos[:, None] - key_pos[None, :] < cfg.sliding_window
      past = past if in_window is None else past & in_window
      local = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < cfg.sliding_window)
    else:
      local = full_local
    o = layers.attention_live(queries(x, lay, rpos, cfg, rt), cache.k, cache.v, i, past, n_live,
                              local=(k, v, local), key_fn=key_fn,
                              dense=rt.dense)
    h = _mlp_residual(h, o.reshape(L, cfg.n_head * cfg.head_dim), lay, cfg, rt)
  return layers.rms_norm(h, params.norm, cfg.rms_eps)


def context_rope(cache: DraftCache, cfg: DraftConfig, start: jax.Array, pos: jax.Array,
                 key_pos: jax.Array):
  """RoPE positions of a block at `start` and how its context keys are read.

  pos: [L] int32 the block's absolute positions; key_pos: [R] int32 the position each cache row
  holds (DraftCache.context). Returns (rope positions [L] int32 for the block's queries and
  keys, key_fn for layers.attention_live): absolute positions and None (keys are stored
  rotated), or, for a window-relative cache, pos - base and a function rotating each decoded
  chunk of stored pre-RoPE keys to its row's position - base (DraftCache.base).
  """
  if not cache.relative:
    return pos, None
  base = cache.base(start)

  def key_fn(kc, rows):                              # kc: [Hkv, c, Dh]
    k = layers.rope(jnp.swapaxes(kc, 0, 1), jnp.take(key_pos, rows) - base, rot_dim=cfg.head_dim,
                    theta=cfg.rope_theta, style="neox")
    return jnp.swapaxes(k, 0, 1)

  return pos - base, key_fn


def block_masks(anchors: jax.Array, n_ctx: int, cfg: DraftConfig, sliding: bool):
  """Attention masks of the training forward (True = visible).

  anchors: [A] int32 absolute positions of the blocks' first rows. Context rows are positions
  0..n_ctx-1. Block a's queries see context positions < anchors[a] (target features strictly
  before the anchor) and the L rows of their own block only (bidirectional; other blocks never);
  sliding layers add causality and the window, measured in absolute positions.
  Returns (ctx_mask [A, L, n_ctx], blk_mask [A, L, L]).
  """
  L = cfg.block_size
  qpos = anchors[:, None] + jnp.arange(L)                        # [A, L]
  cpos = jnp.arange(n_ctx)
  ctx = jnp.broadcast_to(cpos[None, None, :] < anchors[:, None, None], (anchors.shape[0], L, n_ctx))
  blk = jnp.ones((anchors.shape[0], L, L), bool)
  if sliding:
    w = cfg.sliding_window
    ctx = ctx & (qpos[:, :, None] - cpos[None, None, :] < w)
    blk = blk & (qpos[:, None, :] <= qpos[:, :, None]) & (qpos[:, :, None] - qpos[:, None, :] < w)
  return ctx, blk


def block_attention(q, kc, vc, kb, vb, ctx_mask, blk_mask, head_dim: int,
                     compute_dtype=jnp.float32):
  """Training attention of A blocks: q [A, L, Hkv, G, Dh] over the shared context kc/vc
  [n_ctx, Hkv, Dh] and the block's own kb/vb [A, L, Hkv, Dh]. Returns [A, L, Hkv, G, Dh]
  float32. compute_dtype (static): float32 runs the products at HIGHEST precision; bfloat16
  takes bf16 operands (q, k, v and the probabilities) with float32 accumulation, as the draft's
  projections do under it (and flash attention in bf16 training); the softmax is float32."""
  def mm(spec, a, b):
    return layers.attn_matmul(spec, a, b, compute_dtype)

  n_ctx = kc.shape[0]
  scale = head_dim ** -0.5
  s_ctx = mm("alkgd,tkd->akglt", q, kc) * scale
  s_blk = mm("alkgd,amkd->akglm", q, kb) * scale
  s = jnp.concatenate([jnp.where(ctx_mask[:, None, None], s_ctx, -jnp.inf),
                       jnp.where(blk_mask[:, None, None], s_blk, -jnp.inf)], axis=-1)
  p = jax.nn.softmax(s, axis=-1)
  return mm("akglt,tkd->alkgd", p[..., :n_ctx], vc) + mm("akglm,amkd->alkgd", p[..., n_ctx:], vb)


# `block_attention` rematerialized: the backward pass recomputes the scores and probabilities
# instead of keeping them ([A, Hkv, G, L, n_ctx + L] float32 a layer, 147 MB for a packed row of
# 1024 with 245 blocks of 16: kept, they are most of a training step's memory once the loss is
# fused, `objective.fused_head_loss`), for one more forward of the attention.
block_attention_remat = jax.checkpoint(block_attention, static_argnums=(7, 8))


def packed_positions(anchors: jax.Array, n_ctx: int, block_size: int, positions, segments):
  """RoPE positions and the same-sequence mask of a training forward over T context rows.

  anchors: [A] int32 row indices of the blocks' first rows. positions / segments: None (one
  sequence: row index = position) or [T] int32 each row's position inside its own sequence and
  which sequence it is (several sequences packed in the row). Returns (context positions [T],
  block positions [A, L] int32, same [A, T] bool or None: context rows of the anchor's own
  sequence)."""
  offs = jnp.arange(block_size, dtype=jnp.int32)
  if positions is None:
    return jnp.arange(n_ctx, dtype=jnp.int32), anchors[:, None] + offs, None
  same = segments[None, :] == jnp.take(segments, anchors)[:, None]
  return positions, jnp.take(positions, anchors)[:, None] + offs, same


def train_hidden(params: DraftParams, cfg: DraftConfig, feats: jax.Array, block_ids: jax.Array,
                 anchors: jax.Array, embed: QuantWeight, rt: Runtime = Runtime(),
                 positions=None, segments=None, remat_attention: bool = False):
  """Draft forward for many blocks of one sequence at once (training; same math as ingest +
  propose, checked by tests).

  feats: [T, F*D] target features of positions 0..T-1; block_ids: [A, L] int32 rows
  [x_anchor, MASK x (L-1)]; anchors: [A] int32 positions of the first rows.
  positions, segments: None, or [T] int32 for a packed row (several sequences back to back;
  `packed_positions`): a block then sees only its own sequence's rows before its anchor, at
  RoPE positions inside that sequence, so each block computes what it would alone.
  remat_attention: static; recompute each layer's attention scores in the backward pass instead
  of keeping them (less memory, the same gradients; `TrainConfig.remat_attention`).
  Returns h: [A, L, D] float32 after the final norm (apply the target lm_head to rows 1..L-1).
  """
  n_ctx = feats.shape[0]
  A, L = block_ids.shape
  H, Hkv, Dh = cfg.n_head, cfg.n_kv_head, cfg.head_dim
  cpos, qpos, same = packed_positions(anchors, n_ctx, L, positions, segments)
  qpos = qpos.reshape(-1)                                                 # [A*L]
  c = context_rows(params, feats, cfg, rt)
  h = take_rows(embed, block_ids.reshape(-1)).reshape(A, L, -1)
  for i, lay in enumerate(params.layers):
    kc, vc = kv_rows(c, lay, cpos, cfg, rt)
    x = layers.rms_norm(h, lay.in_norm, cfg.rms_eps).reshape(A * L, -1)
    q = queries(x, lay, qpos, cfg, rt).reshape(A, L, Hkv, H // Hkv, Dh)
    kb, vb = kv_rows(x, lay, qpos, cfg, rt)
    ctx_mask, blk_mask = block_masks(anchors, n_ctx, cfg, cfg.sliding[i])
    if same is not None:
      ctx_mask = ctx_mask & same[:, None, :]
    attend = block_attention_remat if remat_attention else block_attention
    o = attend(q, kc, vc, kb.reshape(A, L, Hkv, Dh), vb.reshape(A, L, Hkv, Dh),
               ctx_mask, blk_mask, Dh, rt.cdt)
    h = _mlp_residual(h, o.reshape(A, L, H * Dh), lay, cfg, rt)
  return layers.rms_norm(h, params.norm, cfg.rms_eps)
