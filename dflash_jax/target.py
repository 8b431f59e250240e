"""Target model: params pytree from GGUF, KV / SSM / conv cache, and one forward that serves
prefill (chunked gated delta rule) and decode/verify (recurrent, per-token states kept).

Covers `llama`, `qwen3` (dense) and `qwen35` (Qwen3.5 hybrid: Gated DeltaNet + gated attention),
with tensors exactly as llama.cpp stores them (src/models/{llama,qwen3,qwen35}.cpp).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import layers
from dflash_jax.config import TargetConfig
from dflash_jax.gguf_io import GGUFFile
from dflash_jax.quants import QuantWeight, from_numpy, take_rows, to_dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FFNParams:
  norm: jax.Array          # [D] f32 (pre-FFN RMSNorm weight)
  gate_up: layers.Projections  # ffn_gate [F, D], ffn_up [F, D]
  down: QuantWeight        # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttnParams:
  norm: jax.Array          # [D] f32
  qkv: layers.Projections  # attn_q [H*Dh, D] (or [H*2*Dh, D] per-head [query | gate] when
                           # attn_gate), attn_k [Hkv*Dh, D], attn_v [Hkv*Dv, D]
  wo: QuantWeight          # [D, H*Dv]
  q_norm: Optional[jax.Array]  # [Dh] f32 or None
  k_norm: Optional[jax.Array]
  ffn: FFNParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNParams:
  norm: jax.Array          # [D] f32
  in_proj: layers.Projections  # attn_qkv [C, D] (C = 2*Hk*Dk + Hv*Dv, V rows in llama.cpp's
                               # tiled head order), attn_gate (z) [Hv*Dv, D], ssm_beta [Hv, D],
                               # ssm_alpha [Hv, D]
  conv: jax.Array          # [C, K] f32 (ssm_conv1d)
  dt_bias: jax.Array       # [Hv] f32 (ssm_dt.bias)
  ssm_a: jax.Array         # [Hv] f32 (= -exp(A_log))
  ssm_norm: jax.Array      # [Dv] f32 (plain weight, no +1)
  w_out: QuantWeight       # [D, Hv*Dv]
  ffn: FFNParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetParams:
  embed: QuantWeight                                  # [V, D] token_embd
  out_norm: jax.Array                                 # [D] f32
  lm_head: QuantWeight                                # [V, D] output (token_embd when tied)
  layers: tuple                                       # [n_layer] AttnParams | GDNParams
  rope_freqs: Optional[jax.Array] = None              # [rope_dim/2] f32 or None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetCache:
  """Decode state of the target for positions < the committed length (held by the caller).

  Attributes:
    k: [n_attn, S, Hkv, Dh] KV cache keys (post-RoPE); rows past the length are stale.
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
  """Per-token GDN states captured during a verify, for commit without replay.

  Attributes:
    ssm: [n_gdn, T, Hv, Dk, Dv] float32 state after each verified token.
    xin: [n_gdn, T, C] float32 pre-conv inputs of the verified tokens.
  """

  ssm: jax.Array
  xin: jax.Array


def init_cache(cfg: TargetConfig, capacity: int, kv_dtype=jnp.float32) -> TargetCache:
  """Zeroed cache with `capacity` KV rows."""
  n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
  return TargetCache(
      k=jnp.zeros((n_attn, capacity, cfg.n_kv_head, cfg.head_dim), kv_dtype),
      v=jnp.zeros((n_attn, capacity, cfg.n_kv_head, cfg.v_head_dim), kv_dtype),
      ssm=jnp.zeros((n_gdn, cfg.gdn_n_v_head, cfg.gdn_d_k, cfg.gdn_d_v), jnp.float32),
      conv=jnp.zeros((n_gdn, max(cfg.conv_kernel - 1, 0), cfg.conv_dim), jnp.float32))


def commit(cache: TargetCache, steps: GDNSteps, n_keep: jax.Array) -> TargetCache:
  """Keep the first n_keep (>= 1, traced) verified tokens: the KV cache needs nothing (rows past
  the length are masked by position); SSM state = state after token n_keep-1; conv state =
  last K-1 rows of [old conv state ; inputs of the kept tokens]."""
  if cache.ssm.shape[0] == 0:
    return cache
  ssm = jax.lax.dynamic_index_in_dim(steps.ssm, n_keep - 1, axis=1, keepdims=False)
  xc = jnp.concatenate([cache.conv, steps.xin], axis=1)
  conv = jax.lax.dynamic_slice_in_dim(xc, n_keep, cache.conv.shape[1], axis=1)
  return dataclasses.replace(cache, ssm=ssm, conv=conv)


def _gather_rows(c: jax.Array, start: jax.Array, path: jax.Array) -> jax.Array:
  """c: [n, S, ...]; rows start+m <- rows start+path[m] for m < len(path)."""
  if c.shape[0] == 0:
    return c
  rows = jnp.take(c, start + path, axis=1)
  return jax.lax.dynamic_update_slice_in_dim(c, rows, start, axis=1)


def commit_path(cache: TargetCache, steps: GDNSteps, start: jax.Array, path: jax.Array,
                n_keep: jax.Array) -> TargetCache:
  """Commit the accepted root path of a tree verify (no replay).

  path: [P] int32 node ids of the accepted path (root first; entries past n_keep are ignored);
  n_keep: [] nodes kept (>= 1). KV rows start+path[m] move to start+m; SSM state = the state
  after node path[n_keep-1]; conv state = last K-1 inputs of [old conv state ; path inputs].
  """
  cache = dataclasses.replace(cache, k=_gather_rows(cache.k, start, path),
                              v=_gather_rows(cache.v, start, path))
  if cache.ssm.shape[0] == 0:
    return cache
  ssm = jnp.take(steps.ssm, path[n_keep - 1], axis=1)
  xc = jnp.concatenate([cache.conv, jnp.take(steps.xin, path, axis=1)], axis=1)
  conv = jax.lax.dynamic_slice_in_dim(xc, n_keep, cache.conv.shape[1], axis=1)
  return dataclasses.replace(cache, ssm=ssm, conv=conv)


# ----------------------------------------------------------------------------- loading

def _expect(f: GGUFFile, name: str, shape: tuple[int, ...]):
  t = f.tensors.get(name)
  if t is None:
    raise ValueError(f"{f.path}: missing tensor {name!r}")
  if tuple(t.shape) != tuple(shape):
    raise ValueError(f"{f.path}: tensor {name!r} has shape {t.shape}, expected {shape}")
  return t


def _vec(f: GGUFFile, name: str, n: int) -> np.ndarray:
  """A 1-D tensor (norm weights, biases) as [n] float32 on the host."""
  t = _expect(f, name, (n,))
  if t.fmt == "f32":
    return np.asarray(t.data, np.float32).reshape(n)
  w = from_numpy(t.data, t.fmt, (1, n), name=f"{f.path}:{name}")
  return np.asarray(to_dtype(w, "f32").data, np.float32).reshape(n)


def _mat(f: GGUFFile, name: str, shape: tuple[int, int], weights: str) -> QuantWeight:
  t = _expect(f, name, shape)
  w = from_numpy(t.data, t.fmt, shape, name=f"{f.path}:{name}")
  return w if weights == "quantized" else to_dtype(w, weights)


def load_params(f: GGUFFile, cfg: TargetConfig, *, weights: str = "quantized",
                fuse: bool = True) -> TargetParams:
  """Read every tensor the forward needs, check its shape against cfg.

  weights: "quantized" keeps GGUF blocks packed (dequantized inside the jitted forward);
    "f32" / "bf16" dequantize at load.
  fuse: concatenate same-format projections of one input at load (q/k/v, ffn gate/up, the Gated
    DeltaNet qkv/z/beta/alpha; see layers.fuse_projections) so each runs as one matmul.
  Returns host (numpy) arrays; device_put the result. Raises ValueError naming the tensor.
  """
  if weights not in ("quantized", "f32", "bf16"):
    raise ValueError(f"weights={weights!r}: expected 'quantized', 'f32' or 'bf16'")
  d, v = cfg.d_model, cfg.n_vocab
  embed = _mat(f, "token_embd.weight", (v, d), weights)
  lm_head = (_mat(f, "output.weight", (v, d), weights) if "output.weight" in f.tensors else embed)
  ffn_norm_name = "post_attention_norm" if cfg.arch == "qwen35" else "ffn_norm"
  out = []
  for i in range(cfg.n_layer):
    p = f"blk.{i}."
    ffn = FFNParams(norm=_vec(f, p + ffn_norm_name + ".weight", d),
                    gate_up=layers.fuse_projections(
                        [_mat(f, p + "ffn_gate.weight", (cfg.d_ff, d), weights),
                         _mat(f, p + "ffn_up.weight", (cfg.d_ff, d), weights)], fuse),
                    down=_mat(f, p + "ffn_down.weight", (d, cfg.d_ff), weights))
    norm = _vec(f, p + "attn_norm.weight", d)
    if cfg.recurrent[i]:
      hv, dv, c = cfg.gdn_n_v_head, cfg.gdn_d_v, cfg.conv_dim
      out.append(GDNParams(
          norm=norm, in_proj=layers.fuse_projections(
              [_mat(f, p + "attn_qkv.weight", (c, d), weights),
               _mat(f, p + "attn_gate.weight", (hv * dv, d), weights),
               _mat(f, p + "ssm_beta.weight", (hv, d), weights),
               _mat(f, p + "ssm_alpha.weight", (hv, d), weights)], fuse),
          conv=np.asarray(_expect(f, p + "ssm_conv1d.weight", (c, cfg.conv_kernel)).data, np.float32),
          dt_bias=_vec(f, p + "ssm_dt.bias", hv), ssm_a=_vec(f, p + "ssm_a", hv),
          ssm_norm=_vec(f, p + "ssm_norm.weight", dv),
          w_out=_mat(f, p + "ssm_out.weight", (d, hv * dv), weights), ffn=ffn))
    else:
      h, hkv, dh, dvh = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.v_head_dim
      q_rows = h * dh * (2 if cfg.attn_gate else 1)
      out.append(AttnParams(
          norm=norm, qkv=layers.fuse_projections(
              [_mat(f, p + "attn_q.weight", (q_rows, d), weights),
               _mat(f, p + "attn_k.weight", (hkv * dh, d), weights),
               _mat(f, p + "attn_v.weight", (hkv * dvh, d), weights)], fuse),
          wo=_mat(f, p + "attn_output.weight", (d, h * dvh), weights),
          q_norm=_vec(f, p + "attn_q_norm.weight", dh) if cfg.qk_norm else None,
          k_norm=_vec(f, p + "attn_k_norm.weight", dh) if cfg.qk_norm else None, ffn=ffn))
  rope_freqs = _vec(f, "rope_freqs.weight", cfg.rope_dim // 2) if cfg.has_rope_freqs else None
  return TargetParams(embed=embed, out_norm=_vec(f, "output_norm.weight", d), lm_head=lm_head,
                      layers=tuple(out), rope_freqs=rope_freqs)


# ----------------------------------------------------------------------------- forward

def _ffn(x, p: FFNParams, cfg: TargetConfig, cdt):
  y = layers.rms_norm(x, p.norm, cfg.rms_eps)
  gate, up = layers.project(y, p.gate_up, cdt, cfg.kernels)
  h = jax.nn.silu(gate) * up
  return layers.linear(h, p.down, cdt, cfg.kernels)


def _attn_layer(x, p: AttnParams, cfg: TargetConfig, k_all, v_all, li: int, start, pos, cdt,
                rope_freqs, tree_anc=None):
  """x: [T, D]; k_all/v_all: [n_attn, S, Hkv, Dh] the whole KV cache; li: this layer's row in it;
  start: [] first cache row written; pos: [T] int32 RoPE positions. Writes this call's K/V at
  rows start..start+T-1 of layer li (in place) and returns (out [T, D], k_all, v_all).
  Mask: chain/prefill -> keys at rows <= pos (causal); tree -> rows < start (committed past)
  plus the node's ancestors (tree_anc: [T, T] bool)."""
  t = x.shape[0]
  h, hkv, dh, dv = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.v_head_dim
  y = layers.rms_norm(x, p.norm, cfg.rms_eps)
  q, k, v = layers.project(y, p.qkv, cdt, cfg.kernels)
  gate = None
  if cfg.attn_gate:  # per head [query Dh | gate Dh] (llama.cpp qwen35.cpp)
    q = q.reshape(t, h, 2 * dh)
    q, gate = q[..., :dh], q[..., dh:].reshape(t, h * dh)
  q = q.reshape(t, h, dh)
  k = k.reshape(t, hkv, dh)
  v = v.reshape(t, hkv, dv)
  if cfg.qk_norm:
    q = layers.rms_norm(q, p.q_norm, cfg.rms_eps)
    k = layers.rms_norm(k, p.k_norm, cfg.rms_eps)
  rope = functools.partial(layers.rope, pos=pos, rot_dim=cfg.rope_dim, theta=cfg.rope_theta,
                           style=cfg.rope_style, freq_factors=rope_freqs)
  q, k = rope(q), rope(k)
  k_all = layers.write_rows(k_all, li, start, k)
  v_all = layers.write_rows(v_all, li, start, v)
  k_cache, v_cache = k_all[li], v_all[li]
  key_pos = jnp.arange(k_cache.shape[0], dtype=jnp.int32)
  if tree_anc is None:
    mask = key_pos[None, :] <= pos[:, None]
  else:
    slot = key_pos - start
    in_tree = (slot >= 0) & (slot < t)
    mask = (key_pos[None, :] < start) | (in_tree[None, :] & tree_anc[:, jnp.clip(slot, 0, t - 1)])
  o = layers.attention(q, k_cache.astype(jnp.float32), v_cache.astype(jnp.float32), mask)
  o = o.reshape(t, h * dv)
  if gate is not None:
    o = o * jax.nn.sigmoid(gate)
  return layers.linear(o, p.wo, cdt, cfg.kernels), k_all, v_all


def _gdn_layer(x, p: GDNParams, cfg: TargetConfig, ssm, conv, n_valid, mode, cdt, tree=None):
  """Gated DeltaNet mixer (llama.cpp qwen35.cpp build_layer_attn_linear; HF Qwen3_5GatedDeltaNet).

  x: [T, D]; ssm: [Hv, Dk, Dv]; conv: [K-1, C]; n_valid: [] tokens of x that are real.
  mode "prefill": chunked rule, returns the state after n_valid tokens.
  mode "verify": recurrent rule, returns per-token states (GDNSteps rows) and leaves conv alone.
  mode "tree": like verify, over tree nodes (tree = (parents, depths, ancestors [T, K])): each node
    continues its parent's SSM state and conv window (tree_deltanet reference).
  """
  t = x.shape[0]
  hk, hv, dk, dv = cfg.gdn_n_k_head, cfg.gdn_n_v_head, cfg.gdn_d_k, cfg.gdn_d_v
  y = layers.rms_norm(x, p.norm, cfg.rms_eps)
  xin, z, beta, alpha = layers.project(y, p.in_proj, cdt, cfg.kernels)  # xin: [T, C] pre-conv
  z = z.reshape(t, hv, dv)
  beta = jax.nn.sigmoid(beta)                                            # [T, Hv]
  g = p.ssm_a * jax.nn.softplus(alpha + p.dt_bias)                       # [T, Hv] log decay
  if mode == "tree":
    parents, depths, anc = tree
    mixed = jax.nn.silu(layers.causal_conv_tree(xin, conv, p.conv, anc, depths))
  else:
    mixed = jax.nn.silu(layers.causal_conv(xin, conv, p.conv))
  q = mixed[:, :hk * dk].reshape(t, hk, dk)
  k = mixed[:, hk * dk:2 * hk * dk].reshape(t, hk, dk)
  v = mixed[:, 2 * hk * dk:].reshape(t, hv, dv)
  # GGUF tiled V-head order: V head h reads K head h % Hk.
  q = jnp.tile(layers.l2_norm(q, cfg.rms_eps), (1, hv // hk, 1)) * (dk ** -0.5)
  k = jnp.tile(layers.l2_norm(k, cfg.rms_eps), (1, hv // hk, 1))
  if mode == "prefill":
    valid = (jnp.arange(t) < n_valid)[:, None]
    o, new_ssm = layers.gated_delta_rule_chunked(q, k, v, jnp.where(valid, g, 0.0),
                                                 jnp.where(valid, beta, 0.0), ssm)
    xc = jnp.concatenate([conv, xin], axis=0)
    new_conv = jax.lax.dynamic_slice_in_dim(xc, n_valid, conv.shape[0], axis=0)
    step_states = None
  elif mode == "tree":
    o, step_states = layers.gated_delta_rule_tree(q, k, v, g, beta, ssm, tree[0], cfg.kernels)
    new_ssm, new_conv = ssm, conv
  else:
    o, step_states = layers.gated_delta_rule_recurrent(q, k, v, g, beta, ssm)
    new_ssm, new_conv = ssm, conv
  o = layers.rms_norm(o, p.ssm_norm, cfg.rms_eps) * jax.nn.silu(z)
  out = layers.linear(o.reshape(t, hv * dv), p.w_out, cdt, cfg.kernels)
  return out, new_ssm, new_conv, step_states, xin


def forward(params: TargetParams, cfg: TargetConfig, tokens: jax.Array, start: jax.Array,
            cache: TargetCache, *, n_valid: jax.Array | None = None, mode: str = "verify",
            feature_layers: tuple[int, ...] = (), logits_rows: str = "all",
            compute_dtype: str = "float32", tree_parents: jax.Array | None = None,
            tree_depths: jax.Array | None = None):
  """Target forward of T new tokens at positions start..start+T-1 against `cache`.

  tokens: [T] int32; start: [] int32; n_valid: [] int32 real tokens (prefill padding), default T.
  mode: "prefill" (chunked GDN, cache fully updated for n_valid tokens), "verify" (recurrent
    GDN; KV written for all T, SSM/conv untouched, per-token states returned for `commit`) or
    "tree" (DDTree verify of T tree nodes: tree_parents/tree_depths [T] int32, node i at RoPE
    position start + depth, attending to the committed past and its ancestors; commit with
    `commit_path`).
  feature_layers: target layer ids whose residual-stream outputs are returned, concatenated
    (the DFlash hidden_states[lid+1] convention).
  logits_rows: "all" -> logits [T, V]; "last" -> [1, V] for row n_valid-1; "none" -> None.
  Returns (logits float32, feats [T, F*D] float32 or None, cache, GDNSteps or None).
  """
  cdt = jnp.dtype(compute_dtype)
  t = tokens.shape[0]
  if n_valid is None:
    n_valid = jnp.int32(t)
  tree = tree_anc = None
  if mode == "tree":
    from dflash_jax import tree as tree_lib
    max_depth = t - 1
    tree_anc = tree_lib.ancestor_matrix(tree_parents, max_depth)
    pos = start + tree_depths
    if cfg.gdn_layers:
      tree = (tree_parents, tree_depths, tree_lib.ancestors(tree_parents, cfg.conv_kernel - 1))
  else:
    pos = start + jnp.arange(t, dtype=jnp.int32)
  x = take_rows(params.embed, tokens)
  feats = {}
  # The cache arrays are updated in place layer by layer (no per-layer slices re-stacked: that
  # copies the whole KV / SSM cache every step). verify/tree leave SSM and conv state alone.
  k_all, v_all, ssm_all, conv_all = cache.k, cache.v, cache.ssm, cache.conv
  st_ssm, st_x = [], []
  ia = ig = 0
  for i, p in enumerate(params.layers):
    if cfg.recurrent[i]:
      o, s_new, c_new, st, xin = _gdn_layer(x, p, cfg, ssm_all[ig], conv_all[ig], n_valid,
                                            mode, cdt, tree)
      if mode == "prefill":
        ssm_all, conv_all = ssm_all.at[ig].set(s_new), conv_all.at[ig].set(c_new)
      if st is not None:
        st_ssm.append(st), st_x.append(xin)
      ig += 1
    else:
      o, k_all, v_all = _attn_layer(x, p, cfg, k_all, v_all, ia, start, pos, cdt,
                                    params.rope_freqs, tree_anc)
      ia += 1
    x = x + o
    x = x + _ffn(x, p.ffn, cfg, cdt)
    if i in feature_layers:
      feats[i] = x
  new_cache = TargetCache(k=k_all, v=v_all, ssm=ssm_all, conv=conv_all)
  steps = None
  if mode in ("verify", "tree") and st_ssm:
    steps = GDNSteps(ssm=jnp.stack(st_ssm), xin=jnp.stack(st_x))
  elif mode in ("verify", "tree"):
    steps = GDNSteps(ssm=jnp.zeros((0, t) + cache.ssm.shape[1:], jnp.float32),
                     xin=jnp.zeros((0, t, cache.conv.shape[-1]), jnp.float32))
  feat = jnp.concatenate([feats[l] for l in feature_layers], axis=-1) if feature_layers else None
  if logits_rows == "none":
    logits = None
  else:
    if logits_rows == "last":
      x = jax.lax.dynamic_slice_in_dim(x, n_valid - 1, 1, axis=0)
    logits = layers.linear(layers.rms_norm(x, params.out_norm, cfg.rms_eps), params.lm_head, cdt, cfg.kernels)
  return logits, feat, new_cache, steps
