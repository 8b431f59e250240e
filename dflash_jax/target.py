"""Target forward: the KV / SSM / conv cache, `prefill` (chunked Gated DeltaNet, cache updated)
and `verify` (a draft tree in one forward, per-node states kept), and `commit_path`, the only
commit. The chain is a path tree and autoregressive decoding a root-only tree (tree.path_tree).

Covers `llama`, `qwen2`, `qwen3`, `qwen3moe` and the hybrids `qwen35`, `qwen35moe`, `qwen3next`
(Gated DeltaNet + gated attention),
with tensors exactly as llama.cpp stores them (src/models/{llama,qwen3,qwen35}.cpp); params come
from target_params.load_params.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from dflash_jax import gdn, kv_cache, layers
from dflash_jax import tree as tree_lib
from dflash_jax.config import TargetConfig
from dflash_jax.quants import take_rows
from dflash_jax.runtime import Runtime
from dflash_jax.target_params import AttnParams, TargetParams
from dflash_jax.tree import Tree
from pallas_kernels import tree_gdn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetCache:
  """Decode state of the target for positions < the committed length (held by the caller).

  Attributes:
    k: [n_attn, Hkv, S, Dh] KV cache keys (kv_cache.KVBuffer in Runtime.k_format), head-major
      (layers.write_block; post-RoPE); rows past the length are stale.
    v: [n_attn, Hkv, S, Dv] values (Runtime.v_format).
    ssm: [n_gdn, Hv, Dk, Dv] float32 Gated DeltaNet SSM state.
    conv: [n_gdn, K-1, C] float32 conv state: the last K-1 pre-conv inputs.
  """

  k: jax.Array
  v: jax.Array
  ssm: jax.Array
  conv: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNSteps:
  """What a verify's Gated DeltaNet layers keep so that any root path can be committed
  (`path_update`), per `Runtime.gdn_commit`.

  Attributes:
    ssm: "states": [n_gdn, N, Hv, Dk, Dv] float32 state after each verified node; "replay": None.
    xin: [n_gdn, N, C] float32 pre-conv inputs of the verified nodes.
    k, v, g, beta: "replay": the nodes' recurrence inputs, [n_gdn, N, Hv, Dk], [n_gdn, N, Hv,
      Dv], [n_gdn, N, Hv], [n_gdn, N, Hv] float32 (the commit replays the accepted path);
      "states": None.
  """

  ssm: Optional[jax.Array]
  xin: jax.Array
  k: Optional[jax.Array] = None
  v: Optional[jax.Array] = None
  g: Optional[jax.Array] = None
  beta: Optional[jax.Array] = None

  def nodes(self, rows) -> "GDNSteps":
    """The same fields for node slots `rows` (a slice or index array along axis 1)."""
    return jax.tree.map(lambda a: a[:, rows], self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefilled:
  """Output of `prefill`: hidden [T, D] float32 final residual stream (before the output norm;
  logits of chosen rows: `logits(params, cfg, hidden[rows], rt)`); feats [T, F*D] float32 or
  None; cache with the n_valid real tokens committed."""

  hidden: jax.Array
  feats: Optional[jax.Array]
  cache: TargetCache
  k: Optional[jax.Array] = None      # with kv_row: the new K rows [n_attn, T, Hkv, Dh], unwritten
  v: Optional[jax.Array] = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
  """Output of `verify`: logits [N, V] float32 per tree node; feats [N, F*D] float32 or None;
  k, v [n_attn, N, Hkv, Dh|Dv] float32 the nodes' K/V before the cache's encoding (not written
  to the cache: the commit writes the accepted path's); steps the per-node GDN states for `commit_path`."""

  logits: jax.Array
  feats: Optional[jax.Array]
  k: jax.Array
  v: jax.Array
  steps: GDNSteps


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheUpdate:
  """What committing a verified path writes (`path_update`; applied by `apply_update` for one
  sequence, by the decode loop for a batch): k, v [n_attn, P, Hkv, Dh|Dv] the kept nodes' K/V
  for rows start..start+P-1 (rows past the kept count are written too; they lie past the
  committed length, where nothing reads them); ssm [n_gdn, Hv, Dk, Dv] and conv [n_gdn, K-1, C]
  the new recurrent state."""

  k: jax.Array
  v: jax.Array
  ssm: jax.Array
  conv: jax.Array


def init_cache(cfg: TargetConfig, capacity: int, rt: Runtime = Runtime()) -> TargetCache:
  """Zeroed cache with `capacity` KV rows (K / V in rt.k_format / rt.v_format).
  Raises ValueError (kv_cache.check_format) for a block format that does not tile the head dim."""
  n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
  lead = (n_attn, cfg.n_kv_head, capacity)
  return TargetCache(
      k=kv_cache.KVBuffer.zeros(rt.k_format, lead, cfg.head_dim),
      v=kv_cache.KVBuffer.zeros(rt.v_format, lead, cfg.v_head_dim),
      ssm=jnp.zeros((n_gdn, cfg.gdn_n_v_head, cfg.gdn_d_k, cfg.gdn_d_v), jnp.float32),
      conv=jnp.zeros((n_gdn, max(cfg.conv_kernel - 1, 0), cfg.conv_dim), jnp.float32))


def path_update(cache: TargetCache, ver: Verified, path: jax.Array, n_keep: jax.Array, *,
                rows_in_place: bool = False) -> CacheUpdate:
  """What committing the accepted root path of a verify writes (no replay).

  path: [P] int32 node ids of the accepted path (root first; entries past n_keep are ignored);
  n_keep: [] nodes kept (>= 1). K/V rows: node path[m] goes to row start+m (a path tree's nodes
  already are in that order: `rows_in_place`, static, takes them as they are); SSM state = the
  state after node path[n_keep-1]; conv state = last K-1 inputs of [old conv state ; path
  inputs]. With `Runtime.gdn_commit` "replay" (GDNSteps.ssm None) the SSM state is rebuilt by
  replaying the path's first n_keep nodes from the committed state (`tree_gdn.replay_path`).
  """
  k, v = (ver.k, ver.v) if rows_in_place else (jnp.take(ver.k, path, axis=1),
                                               jnp.take(ver.v, path, axis=1))
  if cache.ssm.shape[0] == 0:
    return CacheUpdate(k, v, cache.ssm, cache.conv)
  steps = ver.steps
  on_path = (lambda a: a) if rows_in_place else (lambda a: jnp.take(a, path, axis=1))
  if steps.ssm is not None:
    ssm = jnp.take(steps.ssm, path[n_keep - 1], axis=1)
  else:                                   # Runtime.gdn_commit "replay": rebuild it, per layer
    ssm = jax.vmap(tree_gdn.replay_path, in_axes=(0, 0, 0, 0, 0, None))(
        cache.ssm, on_path(steps.k), on_path(steps.v), on_path(steps.g), on_path(steps.beta),
        n_keep)
  xin = on_path(steps.xin)
  xc = jnp.concatenate([cache.conv, xin], axis=1)
  conv = jax.lax.dynamic_slice_in_dim(xc, n_keep, cache.conv.shape[1], axis=1)
  return CacheUpdate(k, v, ssm, conv)


def apply_update(cache: TargetCache, upd: CacheUpdate, start: jax.Array) -> TargetCache:
  """One sequence's cache with `upd` committed at rows start.. (one dynamic-update-slice per
  K / V buffer: in place on a donated or loop-carried cache)."""
  return TargetCache(k=layers.write_block(cache.k, start, upd.k),
                     v=layers.write_block(cache.v, start, upd.v), ssm=upd.ssm, conv=upd.conv)


def commit_path(cache: TargetCache, ver: Verified, start: jax.Array, path: jax.Array,
                n_keep: jax.Array, *, rows_in_place: bool = False) -> TargetCache:
  """Commit the accepted root path of a verify at rows start.. of one sequence's cache
  (`path_update` + `apply_update`; no replay). KV rows past the committed length are masked by
  position, so they need no reset."""
  return apply_update(cache, path_update(cache, ver, path, n_keep, rows_in_place=rows_in_place),
                      start)


def logits(params: TargetParams, cfg: TargetConfig, hidden: jax.Array, rt: Runtime) -> jax.Array:
  """LM head: hidden [T, D] -> logits [T, V] float32 (output norm, then `output.weight`)."""
  return layers.linear(layers.rms_norm(hidden, params.out_norm, cfg.rms_eps), params.lm_head, rt)


# ----------------------------------------------------------------------------- layers

def attn_qkv(x, p: AttnParams, cfg: TargetConfig, pos, rope_freqs, rt: Runtime):
  """The attention sublayer's inputs (llama.cpp src/models/{llama,qwen3,qwen35}.cpp): x [T, D]
  the residual stream -> attn_norm -> q [T, H, Dh], k [T, Hkv, Dh] (q/k norms for qk_norm, RoPE at
  pos [T] int32), v [T, Hkv, Dv], gate [T, H*Dv] or None (qwen35's output gate) float32."""
  return attn_heads(layers.rms_norm(x, p.norm, cfg.rms_eps), p, cfg, pos, rope_freqs, rt)


def attn_heads(y, p: AttnParams, cfg: TargetConfig, pos, rope_freqs, rt: Runtime):
  """`attn_qkv` after the attention norm: y [T, K] the normed input (K = D; an EAGLE-3 draft
  layer's [T, 2D], eagle3.py) -> (q, k, v, gate) as attn_qkv (p.norm is not read)."""
  t = y.shape[0]
  h, hkv, dh, dv = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.v_head_dim
  q, k, v = layers.project(y, p.qkv, rt)
  if p.qkv_bias is not None:
    q, k, v = (a + b for a, b in zip((q, k, v), p.qkv_bias))
  gate = None
  if cfg.attn_gate:  # per head [query Dh | gate Dh] (llama.cpp qwen35.cpp)
    q = q.reshape(t, h, 2 * dh)
    q, gate = q[..., :dh], q[..., dh:].reshape(t, h * dh)
  q, k, v = q.reshape(t, h, dh), k.reshape(t, hkv, dh), v.reshape(t, hkv, dv)
  if cfg.qk_norm:
    q = layers.rms_norm(q, p.q_norm, cfg.rms_eps)
    k = layers.rms_norm(k, p.k_norm, cfg.rms_eps)
  rope = functools.partial(layers.rope, pos=pos, rot_dim=cfg.rope_dim, theta=cfg.rope_theta,
                           style=cfg.rope_style, freq_factors=rope_freqs)
  return rope(q), rope(k), v, gate


def attn_out(o, gate, p: AttnParams, rt: Runtime):
  """The attention sublayer's output: o [T, H, Dv] attention -> (times sigmoid(gate) when gated)
  -> attn_output -> [T, D] float32."""
  o = o.reshape(o.shape[0], -1)
  if gate is not None:
    o = o * jax.nn.sigmoid(gate)
  return layers.linear(o, p.wo, rt)


def _attn_layer(x, p: AttnParams, cfg: TargetConfig, k_all, v_all, li: int, start, pos,
                local_mask, rope_freqs, rt: Runtime, live_bound=None, kv_row=None, ordered=None):
  """Softmax attention (gated for qwen35). x: [T, D]; k_all/v_all: [n_attn, Hkv, S, Dh] the
  whole KV cache (read only: rows < start are the committed past, all visible); li: this
  layer's row in it; pos: [T] int32 RoPE positions; local_mask: [T, T] bool which of this
  call's own rows each row sees. Returns (out [T, D], k [T, Hkv, Dh], v [T, Hkv, Dv]) float32
  (what a commit encodes and writes; this call's own rows are attended to as the cache will
  return them, kv_cache.roundtrip, so a verify sees what autoregressive decoding sees)."""
  q, k, v, gate = attn_qkv(x, p, cfg, pos, rope_freqs, rt)
  kr, vr = kv_cache.roundtrip(k_all.fmt, k), kv_cache.roundtrip(v_all.fmt, v)
  if ordered is not None:
    o = layers.attention_ordered(q, k_all, v_all, li, start, kr, vr, *ordered,
                                 live_bound=live_bound, dense=rt.dense)
  else:
    o = layers.attention_live(q, k_all, v_all, li, None, start, local=(kr, vr, local_mask),
                              live_bound=live_bound, row=kv_row, dense=rt.dense)
  return attn_out(o, gate, p, rt), k, v


def ffn(y, p, cfg: TargetConfig, rt: Runtime):
  """A layer's FFN over y [T, D] (normed): SwiGLU, or routed experts (qwen35moe, qwen3moe)."""
  if cfg.moe:
    return layers.moe_ffn(y, p, n_used=cfg.n_expert_used, weights_scale=cfg.expert_weights_scale,
                          rt=rt)
  return layers.swiglu_mlp(y, p.gate_up, p.down, rt)


# A GDN mixer: (x, params, layer index among GDN layers, cache) -> (out, cache, step or None).
GDNMixer = Callable


def _trunk(params: TargetParams, cfg: TargetConfig, x, cache: TargetCache, start, pos,
           local_mask, gdn_mixer: GDNMixer, feature_layers: tuple[int, ...], rt: Runtime,
           live_bound=None, kv_row=None, ordered=None):
  """All layers over x [T, D]: attention reads the cache's committed rows (< start) plus this
  call's own rows (local_mask [T, T]) and returns its K/V rows instead of writing them (the
  caller commits them); each Gated DeltaNet layer runs `gdn_mixer`. Returns (hidden [T, D],
  feats [T, F*D] or None, k [n_attn, T, Hkv, Dh], v [n_attn, T, Hkv, Dv], cache (GDN state as
  the mixer left it), the mixer's per-layer step outputs)."""
  feats, steps, ks, vs = {}, [], [], []
  ia = ig = 0
  for i, p in enumerate(params.layers):
    if cfg.recurrent[i]:
      o, cache, step = gdn_mixer(x, p, ig, cache)
      steps.append(step)
      ig += 1
    else:
      o, k, v = _attn_layer(x, p, cfg, cache.k, cache.v, ia, start, pos, local_mask,
                            params.rope_freqs, rt, live_bound, kv_row, ordered)
      ks.append(k)
      vs.append(v)
      ia += 1
    x = x + o
    x = x + ffn(layers.rms_norm(x, p.ffn.norm, cfg.rms_eps), p.ffn, cfg, rt)
    if i in feature_layers:
      feats[i] = x
  feat = jnp.concatenate([feats[l] for l in feature_layers], axis=-1) if feature_layers else None
  t = x.shape[0]
  k = jnp.stack(ks) if ks else jnp.zeros((0, t, cfg.n_kv_head, cfg.head_dim), jnp.float32)
  v = jnp.stack(vs) if vs else jnp.zeros((0, t, cfg.n_kv_head, cfg.v_head_dim), jnp.float32)
  return x, feat, k, v, cache, steps


# ----------------------------------------------------------------------------- entry points

def prefill(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, start: jax.Array,
            n_valid: jax.Array, cache: TargetCache, rt: Runtime, *,
            feature_layers: tuple[int, ...] = (), kv_row=None) -> Prefilled:
  """Forward of T prompt tokens at positions start..start+T-1 (causal), of which the first
  n_valid are real (the rest is chunk padding), committing them to the cache: KV rows written,
  SSM state advanced by the chunked gated delta rule, conv state = the last K-1 real inputs.

  tokens: [T] int32; start, n_valid: [] int32. feature_layers: static target layer ids whose
  residual-stream outputs are returned, concatenated (DFlash's hidden_states[lid+1]).
  kv_row: None, or [] int32 with cache.k / cache.v a batch's caches [B, n_attn, Hkv, S, Dh]
  (cache.ssm / cache.conv this sequence's own): the sequence is row kv_row of them, read in
  place, and its new K/V rows come back unwritten in Prefilled.k / .v (the caller writes them,
  as `decode.prefill_chunk` does; cache.k / .v come back as given).
  """
  t = tokens.shape[0]
  pos = start + jnp.arange(t, dtype=jnp.int32)
  causal = jnp.tril(jnp.ones((t, t), bool))

  def mixer(x, p, ig, c):
    o, s, cv = gdn.mixer_prefill(x, p, cfg, c.ssm[ig], c.conv[ig], n_valid, rt)
    return o, dataclasses.replace(c, ssm=c.ssm.at[ig].set(s), conv=c.conv.at[ig].set(cv)), None

  x = take_rows(params.embed, tokens)
  h, feats, k, v, cache, _ = _trunk(params, cfg, x, cache, start, pos, causal, mixer,
                                    feature_layers, rt, kv_row=kv_row)
  if kv_row is not None:
    return Prefilled(hidden=h, feats=feats, cache=cache, k=k, v=v)
  cache = dataclasses.replace(cache, k=layers.write_block(cache.k, start, k),
                              v=layers.write_block(cache.v, start, v))
  return Prefilled(hidden=h, feats=feats, cache=cache)


def layer_period(params: TargetParams, cfg: TargetConfig) -> int:
  """The smallest p dividing the layer count such that layer i and layer i + p have the same
  kind (attention / Gated DeltaNet) and the same parameter tree, shapes and dtypes for every i:
  1 for a dense llama / qwen3 target, the full-attention interval (4) for qwen35 with uniform
  weights; the layer count when no shorter period exists (a Q4_K_M target mixing formats
  across layers, weights="native"). The layers then run as a `lax.scan` over n / p groups of p
  (`forward_packed`)."""
  def sig(i):
    p = params.layers[i]
    return (cfg.recurrent[i], jax.tree.structure(p),
            tuple((a.shape, a.dtype) for a in jax.tree.leaves(p)))

  n = len(params.layers)
  sigs = [sig(i) for i in range(n)]
  return next(p for p in range(1, n + 1)
              if n % p == 0 and all(sigs[i] == sigs[i % p] for i in range(n)))


def forward_packed(params: TargetParams, cfg: TargetConfig, tokens: jax.Array,
                   positions: jax.Array, segments: jax.Array, rt: Runtime, *,
                   feature_layers: tuple[int, ...] = ()):
  """Training forward of one packed row: several sequences back to back in T tokens, each
  seeing only itself (attention: causal within its own segment; Gated DeltaNet:
  `gdn.mixer_packed`, conv and SSM state restarted at every sequence start), RoPE at each
  row's position inside its own sequence. Nothing is cached. Each sequence's rows equal its own
  `prefill` from position 0 up to float rounding (tests/test_train.py checks it).

  The layers run as a `lax.scan` over groups of `layer_period` layers with the groups' weights
  stacked (one traced and compiled copy of a group instead of one per layer: the SmolLM2
  training step lowers ~2x faster), the features
  gathered into the loop's carry. The stacking is a copy of the layer weights inside the
  traced step (0.42 GB float32 for SmolLM2, ~0.3 ms of an H100's bandwidth; a target whose
  weights fill the device would want them stacked once at load instead). Decoding keeps the
  unrolled layer loop (`_trunk`): on XLA:CPU a scanned decode step copies each layer's weights
  out of the stack, and a few-row step is bound by reading them (~1.9x slower). Attention is `layers.attention` over the row's own keys with operands in
  rt.compute_dtype (bfloat16 training: bf16 products, float32 accumulation and softmax).

  tokens, positions, segments: [T] int32 (segments: which sequence a row belongs to; rows of one
  sequence are contiguous; padding rows get a segment of their own). feature_layers: static, as
  in `prefill`. Returns (hidden [T, D] float32, feats [T, F*D] float32 or None).
  """
  t = tokens.shape[0]
  mask = jnp.tril(jnp.ones((t, t), bool)) & (segments[:, None] == segments[None, :])
  n, period = len(params.layers), layer_period(params, cfg)

  def layer(x, p, recurrent):
    if recurrent:
      o = gdn.mixer_packed(x, p, cfg, positions, rt)
    else:
      q, k, v, gate = attn_qkv(x, p, cfg, positions, params.rope_freqs, rt)
      o = attn_out(layers.attention(q, k, v, mask, rt.cdt), gate, p, rt)
    x = x + o
    return x + ffn(layers.rms_norm(x, p.ffn.norm, cfg.rms_eps), p.ffn, cfg, rt)

  def group(carry, xs):
    x, feats = carry
    ps, slots = xs
    for j, p in enumerate(ps):
      x = layer(x, p, cfg.recurrent[j])
      if feature_layers:               # slot -1: not a feature layer (the row is written back)
        s = jnp.maximum(slots[j], 0)
        feats = feats.at[s].set(jnp.where(slots[j] >= 0, x, feats[s]))
    return (x, feats), None

  uniq = sorted(set(feature_layers))
  if uniq and not 0 <= uniq[0] <= uniq[-1] < n:
    raise ValueError(f"forward_packed: feature layers {feature_layers} outside the target's "
                     f"{n} layers")
  slot = [uniq.index(i) if i in uniq else -1 for i in range(n)]
  stacked = [jax.tree.map(lambda *a: jnp.stack(a), *params.layers[j::period])
             for j in range(period)]
  x = take_rows(params.embed, tokens)
  feats = jnp.zeros((max(len(uniq), 1),) + x.shape, x.dtype)
  (x, feats), _ = jax.lax.scan(
      group, (x, feats), (stacked, jnp.asarray(slot, jnp.int32).reshape(n // period, period)))
  feat = (jnp.concatenate([feats[uniq.index(i)] for i in feature_layers], axis=-1)
          if feature_layers else None)
  return x, feat


def _verify_mask(tree: Tree):
  """[N, N] bool: which nodes each node sees besides the committed past: path tree -> causal;
  tree -> its ancestors (and itself)."""
  if tree.is_path:
    return jnp.tril(jnp.ones((tree.n, tree.n), bool))
  return tree.ancestor_matrix()


# XLA:CPU reduces a row-wise reduction (an RMS or L2 norm over [T, H, D]) in tiles of 32
# flattened rows with a separate code path for the last partial tile, so with T = 23 a node's
# bits depended on its slot (measured on AVX-512: slots >= 16 of 23 differed from slot 0 in the
# last bit; on the earlier VMs, described as AVX2, they did not). With T a multiple of 32
# every tile is full.
INVARIANT_ROW_TILE = 32


def invariant_slots(rows: int) -> int:
  """The node slots a batch-invariant verify of `rows` rows runs: rows rounded up to a
  multiple of INVARIANT_ROW_TILE (32), so no slot falls in a partial reduction tile."""
  return -(-rows // INVARIANT_ROW_TILE) * INVARIANT_ROW_TILE


def verify(params: TargetParams, cfg: TargetConfig, tree: Tree, start: jax.Array,
           cache: TargetCache, rt: Runtime, *, feature_layers: tuple[int, ...] = (),
           live_bound=None, invariant_rows: int = 0) -> Verified:
  """Verify a draft tree in one forward: node i (token tree.tokens[i]) sits at RoPE position
  start + depth, is written to KV row start + i, and sees the committed past plus its
  ancestors; each Gated DeltaNet node continues its parent's SSM state and conv window
  (tree-aware states, DDTree arXiv:2604.12989). The cache is only read; commit the accepted
  path with `commit_path` (or `path_update` + `apply_update`). A path tree (chain, autoregressive) takes the causal forms.

  tree: tree.Tree of N nodes; start: [] int32 committed length. feature_layers as in `prefill`.
  live_bound: optional [] int32 >= start shared by a vmapped batch (see layers.attention_live).
  invariant_rows: static; 0, or R >= N: batch-invariant verify (`DecodeConfig.invariant_rows`):
  the tree is padded to `invariant_slots(R)` slots (`tree.pad_tree`) and verified with the tree
  forms and `layers.attention_ordered`, so each node's logits, K/V and states are the same bits
  whatever the tree around it (an autoregressive step, a chain, a DDTree) and whichever slot it
  sits in, as long as R is the same; outputs are for the N nodes of `tree`. Raises ValueError
  when R < N.
  """
  if invariant_rows:
    n0 = tree.n
    if invariant_rows < n0:
      raise ValueError(f"verify: invariant_rows={invariant_rows} < the tree's {n0} nodes")
    ptree = tree_lib.pad_tree(tree, invariant_slots(invariant_rows))
    ver = _verify(params, cfg, ptree, start, cache, rt, feature_layers, live_bound,
                  (ptree.ancestors_by_depth(), ptree.depths))
    return Verified(logits=ver.logits[:n0], feats=None if ver.feats is None else ver.feats[:n0],
                    k=ver.k[:, :n0], v=ver.v[:, :n0],
                    steps=ver.steps.nodes(slice(0, n0)))
  return _verify(params, cfg, tree, start, cache, rt, feature_layers, live_bound, None)


def _verify(params, cfg: TargetConfig, tree: Tree, start, cache: TargetCache, rt: Runtime,
            feature_layers, live_bound, ordered) -> Verified:
  n = tree.n
  pos = start + (jnp.arange(n, dtype=jnp.int32) if tree.is_path else tree.depths)
  mask = _verify_mask(tree)
  anc = None if tree.is_path or not cfg.gdn_layers else tree.ancestor_columns(cfg.conv_kernel - 1)

  def mixer(x, p, ig, c):
    o, states, xin = gdn.mixer_verify(x, p, cfg, c.ssm[ig], c.conv[ig], tree, anc, rt)
    return o, c, (states, xin)

  x = take_rows(params.embed, tree.tokens)
  h, feats, k, v, cache, st = _trunk(params, cfg, x, cache, start, pos, mask, mixer,
                                     feature_layers, rt, live_bound, ordered=ordered)
  if st and rt.gdn_commit == "replay":
    k_, v_, g_, b_ = (jnp.stack([s[j] for s, _ in st]) for j in range(4))
    steps = GDNSteps(ssm=None, xin=jnp.stack([xi for _, xi in st]), k=k_, v=v_, g=g_, beta=b_)
  elif st:
    steps = GDNSteps(ssm=jnp.stack([s for s, _ in st]), xin=jnp.stack([xi for _, xi in st]))
  else:
    steps = GDNSteps(ssm=jnp.zeros((0, n) + cache.ssm.shape[1:], jnp.float32),
                     xin=jnp.zeros((0, n, cache.conv.shape[-1]), jnp.float32))
  return Verified(logits=logits(params, cfg, h, rt), feats=feats, k=k, v=v, steps=steps)
