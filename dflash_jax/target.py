"""Target forward: the KV / SSM / conv cache, `prefill` (chunked Gated DeltaNet, cache updated)
and `verify` (a draft tree in one forward, per-node states kept), and `commit_path`, the only
commit. The chain is a path tree and autoregressive decoding a root-only tree (tree.path_tree).

Covers `llama`, `qwen3` (dense) and `qwen35` (Qwen3.5 hybrid: Gated DeltaNet + gated attention),
with tensors exactly as llama.cpp stores them (src/models/{llama,qwen3,qwen35}.cpp); params come
from target_params.load_params.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from dflash_jax import gdn, layers
from dflash_jax.config import TargetConfig
from dflash_jax.quants import take_rows
from dflash_jax.runtime import Runtime
from dflash_jax.target_params import AttnParams, TargetParams
from dflash_jax.tree import Tree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetCache:
  """Decode state of the target for positions < the committed length (held by the caller).

  Attributes:
    k: [n_attn, S, Hkv, Dh] KV cache keys (post-RoPE, Runtime.kv_dtype); rows past the length
      are stale.
    v: [n_attn, S, Hkv, Dv].
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
  """Per-node GDN states captured during a verify, for commit without replay.

  Attributes:
    ssm: [n_gdn, N, Hv, Dk, Dv] float32 state after each verified node.
    xin: [n_gdn, N, C] float32 pre-conv inputs of the verified nodes.
  """

  ssm: jax.Array
  xin: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefilled:
  """Output of `prefill`: hidden [T, D] float32 final residual stream (before the output norm;
  logits of chosen rows: `logits(params, cfg, hidden[rows], rt)`); feats [T, F*D] float32 or
  None; cache with the n_valid real tokens committed."""

  hidden: jax.Array
  feats: Optional[jax.Array]
  cache: TargetCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Verified:
  """Output of `verify`: logits [N, V] float32 per tree node; feats [N, F*D] float32 or None;
  cache with the nodes' K/V written at rows start..start+N-1 (SSM/conv untouched); steps the
  per-node GDN states for `commit_path`."""

  logits: jax.Array
  feats: Optional[jax.Array]
  cache: TargetCache
  steps: GDNSteps


def init_cache(cfg: TargetConfig, capacity: int, rt: Runtime = Runtime()) -> TargetCache:
  """Zeroed cache with `capacity` KV rows (KV in rt.kv_dtype)."""
  n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
  return TargetCache(
      k=jnp.zeros((n_attn, capacity, cfg.n_kv_head, cfg.head_dim), rt.kv),
      v=jnp.zeros((n_attn, capacity, cfg.n_kv_head, cfg.v_head_dim), rt.kv),
      ssm=jnp.zeros((n_gdn, cfg.gdn_n_v_head, cfg.gdn_d_k, cfg.gdn_d_v), jnp.float32),
      conv=jnp.zeros((n_gdn, max(cfg.conv_kernel - 1, 0), cfg.conv_dim), jnp.float32))


def _gather_rows(c: jax.Array, start: jax.Array, path: jax.Array) -> jax.Array:
  """c: [n, S, ...]; rows start+m <- rows start+path[m] for m < len(path)."""
  if c.shape[0] == 0:
    return c
  rows = jnp.take(c, start + path, axis=1)
  return jax.lax.dynamic_update_slice_in_dim(c, rows, start, axis=1)


def commit_path(cache: TargetCache, steps: GDNSteps, start: jax.Array, path: jax.Array,
                n_keep: jax.Array, *, rows_in_place: bool = False) -> TargetCache:
  """Commit the accepted root path of a verify (no replay).

  path: [P] int32 node ids of the accepted path (root first; entries past n_keep are ignored);
  n_keep: [] nodes kept (>= 1). KV rows start+path[m] move to start+m (skipped when
  `rows_in_place`, static: a path tree's nodes already sit at their rows); SSM state = the
  state after node path[n_keep-1]; conv state = last K-1 inputs of [old conv state ; path
  inputs]. KV rows past the committed length are masked by position, so they need no reset.
  """
  if not rows_in_place:
    cache = dataclasses.replace(cache, k=_gather_rows(cache.k, start, path),
                                v=_gather_rows(cache.v, start, path))
  if cache.ssm.shape[0] == 0:
    return cache
  ssm = jnp.take(steps.ssm, path[n_keep - 1], axis=1)
  xin = steps.xin if rows_in_place else jnp.take(steps.xin, path, axis=1)
  xc = jnp.concatenate([cache.conv, xin], axis=1)
  conv = jax.lax.dynamic_slice_in_dim(xc, n_keep, cache.conv.shape[1], axis=1)
  return dataclasses.replace(cache, ssm=ssm, conv=conv)


def logits(params: TargetParams, cfg: TargetConfig, hidden: jax.Array, rt: Runtime) -> jax.Array:
  """LM head: hidden [T, D] -> logits [T, V] float32 (output norm, then `output.weight`)."""
  return layers.linear(layers.rms_norm(hidden, params.out_norm, cfg.rms_eps), params.lm_head, rt)


# ----------------------------------------------------------------------------- layers

def _attn_layer(x, p: AttnParams, cfg: TargetConfig, k_all, v_all, li: int, start, pos, mask,
                rope_freqs, rt: Runtime):
  """Softmax attention (gated for qwen35). x: [T, D]; k_all/v_all: [n_attn, S, Hkv, Dh] the
  whole KV cache; li: this layer's row in it; start: [] first cache row written; pos: [T] int32
  RoPE positions; mask: [T, S] bool visible keys. Writes this call's K/V at rows
  start..start+T-1 of layer li (in place) and returns (out [T, D], k_all, v_all)."""
  t = x.shape[0]
  h, hkv, dh, dv = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.v_head_dim
  y = layers.rms_norm(x, p.norm, cfg.rms_eps)
  q, k, v = layers.project(y, p.qkv, rt)
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
  q, k = rope(q), rope(k)
  k_all = layers.write_rows(k_all, li, start, k)
  v_all = layers.write_rows(v_all, li, start, v)
  o = layers.attention_live(q, k_all, v_all, li, mask, start + t)
  o = o.reshape(t, h * dv)
  if gate is not None:
    o = o * jax.nn.sigmoid(gate)
  return layers.linear(o, p.wo, rt), k_all, v_all


# A GDN mixer: (x, params, layer index among GDN layers, cache) -> (out, cache, step or None).
GDNMixer = Callable


def _trunk(params: TargetParams, cfg: TargetConfig, x, cache: TargetCache, start, pos, mask,
           gdn_mixer: GDNMixer, feature_layers: tuple[int, ...], rt: Runtime):
  """All layers over x [T, D]: attention writes K/V at rows start.. of the cache in place (no
  per-layer slices re-stacked: that copies the whole cache every step); each Gated DeltaNet
  layer runs `gdn_mixer`. Returns (hidden [T, D], feats [T, F*D] or None, cache, the mixer's
  per-layer step outputs)."""
  k_all, v_all = cache.k, cache.v
  feats, steps = {}, []
  ia = ig = 0
  for i, p in enumerate(params.layers):
    if cfg.recurrent[i]:
      o, cache, step = gdn_mixer(x, p, ig, cache)
      steps.append(step)
      ig += 1
    else:
      o, k_all, v_all = _attn_layer(x, p, cfg, k_all, v_all, ia, start, pos, mask,
                                    params.rope_freqs, rt)
      ia += 1
    x = x + o
    x = x + layers.swiglu_mlp(layers.rms_norm(x, p.ffn.norm, cfg.rms_eps), p.ffn.gate_up,
                              p.ffn.down, rt)
    if i in feature_layers:
      feats[i] = x
  feat = jnp.concatenate([feats[l] for l in feature_layers], axis=-1) if feature_layers else None
  return x, feat, dataclasses.replace(cache, k=k_all, v=v_all), steps


# ----------------------------------------------------------------------------- entry points

def prefill(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, start: jax.Array,
            n_valid: jax.Array, cache: TargetCache, rt: Runtime, *,
            feature_layers: tuple[int, ...] = ()) -> Prefilled:
  """Forward of T prompt tokens at positions start..start+T-1 (causal), of which the first
  n_valid are real (the rest is chunk padding), committing them to the cache: KV rows written,
  SSM state advanced by the chunked gated delta rule, conv state = the last K-1 real inputs.

  tokens: [T] int32; start, n_valid: [] int32. feature_layers: static target layer ids whose
  residual-stream outputs are returned, concatenated (DFlash's hidden_states[lid+1]).
  """
  t = tokens.shape[0]
  pos = start + jnp.arange(t, dtype=jnp.int32)
  mask = jnp.arange(cache.k.shape[1], dtype=jnp.int32)[None, :] <= pos[:, None]

  def mixer(x, p, ig, c):
    o, s, cv = gdn.mixer_prefill(x, p, cfg, c.ssm[ig], c.conv[ig], n_valid, rt)
    return o, dataclasses.replace(c, ssm=c.ssm.at[ig].set(s), conv=c.conv.at[ig].set(cv)), None

  x = take_rows(params.embed, tokens)
  h, feats, cache, _ = _trunk(params, cfg, x, cache, start, pos, mask, mixer, feature_layers, rt)
  return Prefilled(hidden=h, feats=feats, cache=cache)


def _verify_mask(tree: Tree, start, n_rows: int):
  """[N, S] bool visible keys of each node: path tree -> causal (rows <= its position); tree ->
  the committed past (rows < start) plus the node's ancestors (rows start + ancestor id)."""
  key = jnp.arange(n_rows, dtype=jnp.int32)
  if tree.is_path:
    return key[None, :] <= (start + tree.depths)[:, None]
  n = tree.n
  slot = key - start
  in_tree = (slot >= 0) & (slot < n)
  return (key[None, :] < start) | (in_tree[None, :] & tree.ancestor_matrix()[:, jnp.clip(slot, 0, n - 1)])


def verify(params: TargetParams, cfg: TargetConfig, tree: Tree, start: jax.Array,
           cache: TargetCache, rt: Runtime, *, feature_layers: tuple[int, ...] = ()) -> Verified:
  """Verify a draft tree in one forward: node i (token tree.tokens[i]) sits at RoPE position
  start + depth, is written to KV row start + i, and sees the committed past plus its
  ancestors; each Gated DeltaNet node continues its parent's SSM state and conv window
  (tree-aware states, DDTree arXiv:2604.12989). SSM/conv state stay as committed; commit the
  accepted path with `commit_path`. A path tree (chain, autoregressive) takes the causal forms.

  tree: tree.Tree of N nodes; start: [] int32 committed length. feature_layers as in `prefill`.
  """
  n = tree.n
  pos = start + (jnp.arange(n, dtype=jnp.int32) if tree.is_path else tree.depths)
  mask = _verify_mask(tree, start, cache.k.shape[1])
  anc = None if tree.is_path or not cfg.gdn_layers else tree.ancestor_columns(cfg.conv_kernel - 1)

  def mixer(x, p, ig, c):
    o, states, xin = gdn.mixer_verify(x, p, cfg, c.ssm[ig], c.conv[ig], tree, anc, rt)
    return o, c, (states, xin)

  x = take_rows(params.embed, tree.tokens)
  h, feats, cache, st = _trunk(params, cfg, x, cache, start, pos, mask, mixer, feature_layers, rt)
  if st:
    steps = GDNSteps(ssm=jnp.stack([s for s, _ in st]), xin=jnp.stack([xi for _, xi in st]))
  else:
    steps = GDNSteps(ssm=jnp.zeros((0, n) + cache.ssm.shape[1:], jnp.float32),
                     xin=jnp.zeros((0, n, cache.conv.shape[-1]), jnp.float32))
  return Verified(logits=logits(params, cfg, h, rt), feats=feats, cache=cache, steps=steps)
