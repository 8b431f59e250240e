"""Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464) as Qwen3.5 uses it (llama.cpp
src/models/qwen35.cpp `build_layer_attn_linear`; HF `Qwen3_5GatedDeltaNet`): the causal conv
(sequence and tree forms), the gated delta rule (recurrent reference, chunked for prefill, tree
for verify), and the mixer layer's two forms, `mixer_prefill` and `mixer_verify` (their `p` is
a target_params.GDNParams).

Dimension letters: T tokens / N tree nodes, D d_model, Hk/Hv key/value heads, Dk/Dv head dims,
C conv channels = 2*Hk*Dk + Hv*Dv, K conv kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax import layers
from dflash_jax.config import TargetConfig
from dflash_jax.runtime import Runtime
from pallas_kernels import tree_gdn as tk


def causal_conv(x: jax.Array, conv_state: jax.Array, w: jax.Array,
                positions: jax.Array | None = None) -> jax.Array:
  """Depthwise causal conv1d over [conv_state ; x], no bias, no activation.

  x: [T, C]; conv_state: [K-1, C] inputs before x (zeros at the start); w: [C, K] (GGUF ssm_conv1d).
  y[t, c] = sum_j w[c, j] * xc[t + j, c] with xc = [conv_state ; x]. Returns [T, C] float32.
  positions: None, or [T] int32 each row's position inside its own sequence for several
  sequences packed back to back (training; conv_state zeros): a tap that would reach back past
  its row's sequence start reads zero, so each sequence equals its own conv from a zero state.
  """
  kk = w.shape[1]
  t = x.shape[0]
  xc = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)], axis=0)
  y = jnp.zeros_like(x, dtype=jnp.float32)
  for j in range(kk):                                  # tap j reaches kk-1-j rows back
    tap = xc[j:j + t]
    if positions is not None:
      tap = jnp.where((positions >= kk - 1 - j)[:, None], tap, 0.0)
    y = y + tap * w[:, j]
  return y


def gated_delta_rule_recurrent(q, k, v, g, beta, state, *, states: bool = True):
  """Token-by-token gated delta rule (Yang et al. 2024, arXiv:2412.06464), float32.

  q, k: [T, Hv, Dk] (L2-normalized, q pre-scaled by Dk**-0.5); v: [T, Hv, Dv];
  g: [T, Hv] log-space decay (<= 0); beta: [T, Hv] write strength; state: [Hv, Dk, Dv].
  Per token (`tree_gdn.gdn_step`): S = e^g S;  S += k (beta (v - S^T k))^T;  o = S^T q.
  Returns (o: [T, Hv, Dv], states: [T, Hv, Dk, Dv] the state after each token, or None when
  `states` (static) is False).
  """

  def step(s, inp):
    qt, kt, vt, gt, bt = inp
    s = tk.gdn_step(s, kt, vt, gt, bt)
    o = jnp.einsum("hk,hkv->hv", qt, s, precision=jax.lax.Precision.HIGHEST)
    return s, ((o, s) if states else o)

  _, ys = jax.lax.scan(step, state.astype(jnp.float32), (q, k, v, g, beta))
  return ys if states else (ys, None)


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk: int = 64):
  """Chunked (WY) form of the same recurrence, as HF `torch_chunk_gated_delta_rule` and
  llama.cpp `build_delta_net_chunking` (chunk 64). Same I/O as the recurrent form except that
  only the final state is returned: (o: [T, Hv, Dv], state: [Hv, Dk, Dv]).

  Tokens with g = 0 and beta = 0 leave the state unchanged (used to pad prefill chunks).
  """
  t, hv, dk = k.shape
  dv = v.shape[-1]
  n = -(-t // chunk)
  pad = n * chunk - t
  f32 = jnp.float32
  hp = jax.lax.Precision.HIGHEST

  def prep(x):
    x = jnp.pad(x.astype(f32), [(0, pad)] + [(0, 0)] * (x.ndim - 1))
    return jnp.moveaxis(x.reshape(n, chunk, *x.shape[1:]), 2, 1)  # [N, Hv, C, ...]

  qc, kc, vc, gc, bc = prep(q), prep(k), prep(v), prep(g), prep(beta)
  gcum = jnp.cumsum(gc, axis=-1)  # [N, Hv, C]
  tri = jnp.tril(jnp.ones((chunk, chunk), bool))
  decay = jnp.where(tri, jnp.exp(jnp.where(tri, gcum[..., :, None] - gcum[..., None, :], 0.0)), 0.0)
  kb = kc * bc[..., None]
  a = jnp.einsum("nhik,nhjk->nhij", kb, kc, precision=hp) * decay
  a = jnp.where(jnp.tril(jnp.ones((chunk, chunk), bool), -1), a, 0.0)
  eye = jnp.eye(chunk, dtype=f32)
  # T = (I + A)^-1 applied to [beta V | beta e^G K] via unit lower-triangular solve.
  rhs = jnp.concatenate([vc * bc[..., None], kb * jnp.exp(gcum)[..., None]], axis=-1)
  sol = jax.scipy.linalg.solve_triangular(eye + a, rhs, lower=True, unit_diagonal=True)
  u, w = sol[..., :dv], sol[..., dv:]
  aqk = jnp.einsum("nhik,nhjk->nhij", qc, kc, precision=hp) * decay

  def step(s, inp):
    qn, kn, un, wn, gn, aqkn = inp  # [Hv, C, ...]
    vnew = un - jnp.einsum("hck,hkv->hcv", wn, s, precision=hp)
    o = (jnp.einsum("hck,hkv->hcv", qn * jnp.exp(gn)[..., None], s, precision=hp)
         + jnp.einsum("hij,hjv->hiv", aqkn, vnew, precision=hp))
    glast = gn[:, -1]
    s = (s * jnp.exp(glast)[:, None, None]
         + jnp.einsum("hck,hcv->hkv", kn * jnp.exp(glast[:, None] - gn)[..., None], vnew, precision=hp))
    return s, o

  s, o = jax.lax.scan(step, state.astype(f32), (qc, kc, u, w, gcum, aqk))
  o = jnp.moveaxis(o, 2, 1).reshape(n * chunk, hv, dv)[:t]
  return o, s


def gated_delta_rule_tree(q, k, v, g, beta, state, parents, rt: Runtime, *, is_path: bool = False,
                          max_depth: int | None = None):
  """Gated delta rule over a tree (verify): node i starts from its parent's state, the root
  (parents[i] < 0) from `state`; parents[i] < i. The chain is parents = [-1, 0, 1, ...].

  q, k: [N, Hv, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]; state: [Hv, Dk, Dv]; parents: [N] int32.
  Returns (o: [N, Hv, Dv], states: [N, Hv, Dk, Dv] the state after each node, or None with
  rt.gdn_commit "replay"), float32. max_depth: static bound of the nodes' depths (the replay
  kernel's work per node).
  rt.kernels "pallas*" / "mosaic*": the Pallas kernel (pallas_kernels.tree_gdn) where
  the head sizes tile; otherwise the pure-JAX form: for a path (`is_path`, static: parents =
  [-1, 0, 1, ...]) the token recurrence `gated_delta_rule_recurrent`, else
  `tree_gdn_reference` (a scan over nodes with a parent gather).
  """
  keep = rt.gdn_commit == "states"
  if rt.pallas and tk.supports(q.shape[-1], v.shape[-1]):
    return tk.tree_gdn(q, k, v, g, beta, state, parents, interpret=rt.interpret,
                       states=keep, max_depth=max_depth, is_path=is_path)
  if is_path:
    return gated_delta_rule_recurrent(q, k, v, g, beta, state, states=keep)
  return tk.tree_gdn_reference(q, k, v, g, beta, state, parents, states=keep)


def causal_conv_tree(x: jax.Array, conv_state: jax.Array, w: jax.Array, anc: jax.Array,
                     depths: jax.Array) -> jax.Array:
  """Causal depthwise conv along each node's ancestor chain (DDTree verify).

  x: [N, C] node inputs; conv_state: [K-1, C] committed inputs before the root (oldest first);
  w: [C, K]; anc: [N, K] j-th ancestor of each node (column 0 = itself, -1 past the root);
  depths: [N] root = 0. Node i's window reads x[anc[i, j]] for j <= depth and then falls back
  into conv_state (the committed past). Returns [N, C] float32; equals `causal_conv` on a chain.
  """
  kk = w.shape[1]
  x = x.astype(jnp.float32)
  y = jnp.zeros_like(x)
  for j in range(kk):  # j = steps back from the node
    from_tree = x[jnp.maximum(anc[:, j], 0)]
    back = j - depths                                   # > 0: inside the committed conv state
    from_state = conv_state.astype(jnp.float32)[jnp.clip(kk - 1 - back, 0, kk - 2)]
    y = y + jnp.where((j <= depths)[:, None], from_tree, from_state) * w[:, kk - 1 - j]
  return y


def _inputs(x, p, cfg: TargetConfig, rt: Runtime):
  """Shared front of both forms: (xin [T, C] pre-conv inputs, z [T, Hv, Dv], g [T, Hv] log
  decay, beta [T, Hv])."""
  y = layers.rms_norm(x, p.norm, cfg.rms_eps)
  xin, z, beta, alpha = layers.project(y, p.in_proj, rt)
  z = z.reshape(x.shape[0], cfg.gdn_n_v_head, cfg.gdn_d_v)
  g = p.ssm_a * jax.nn.softplus(alpha + p.dt_bias)
  return xin, z, g, jax.nn.sigmoid(beta)


def _qkv(mixed, cfg: TargetConfig):
  """Split the conv output [T, C] into q, k [T, Hv, Dk] (L2-normed, q scaled by Dk**-0.5) and
  v [T, Hv, Dv]; GGUF's tiled V-head order: V head h reads K head h % Hk (qwen35, qwen35moe), or
  the grouped order h // (Hv / Hk) with cfg.gdn_grouped (qwen3next)."""
  t, hk, hv, dk = mixed.shape[0], cfg.gdn_n_k_head, cfg.gdn_n_v_head, cfg.gdn_d_k
  q = mixed[:, :hk * dk].reshape(t, hk, dk)
  k = mixed[:, hk * dk:2 * hk * dk].reshape(t, hk, dk)
  v = mixed[:, 2 * hk * dk:].reshape(t, hv, cfg.gdn_d_v)
  if cfg.gdn_grouped:
    spread = lambda a: jnp.repeat(a, hv // hk, axis=1)
  else:
    spread = lambda a: jnp.tile(a, (1, hv // hk, 1))
  q = spread(layers.l2_norm(q, cfg.rms_eps)) * (dk ** -0.5)
  k = spread(layers.l2_norm(k, cfg.rms_eps))
  return q, k, v


def _output(o, z, p, cfg: TargetConfig, rt: Runtime):
  o = layers.rms_norm(o, p.ssm_norm, cfg.rms_eps) * jax.nn.silu(z)
  return layers.linear(o.reshape(o.shape[0], -1), p.w_out, rt)


def mixer_prefill(x, p, cfg: TargetConfig, ssm, conv, n_valid, rt: Runtime):
  """Prefill form: chunked rule over T tokens of which the first n_valid are real.

  x: [T, D]; ssm: [Hv, Dk, Dv]; conv: [K-1, C]; n_valid: [] int32.
  Returns (out [T, D], ssm after n_valid tokens, conv = the last K-1 real inputs).
  """
  xin, z, g, beta = _inputs(x, p, cfg, rt)
  q, k, v = _qkv(jax.nn.silu(causal_conv(xin, conv, p.conv)), cfg)
  valid = (jnp.arange(x.shape[0]) < n_valid)[:, None]
  o, new_ssm = gated_delta_rule_chunked(q, k, v, jnp.where(valid, g, 0.0),
                                        jnp.where(valid, beta, 0.0), ssm)
  xc = jnp.concatenate([conv, xin], axis=0)
  new_conv = jax.lax.dynamic_slice_in_dim(xc, n_valid, conv.shape[0], axis=0)
  return _output(o, z, p, cfg, rt), new_ssm, new_conv


# Log decay given to a packed sequence's first row (`mixer_packed`): e^-60 ~ 1e-26 of the previous
# sequence's state survives it, below float32 resolution of any state it is added to.
SEQUENCE_RESET_DECAY = -60.0


def mixer_packed(x, p, cfg: TargetConfig, positions, rt: Runtime):
  """Training form over several sequences packed back to back in one row, each from a zero SSM
  and conv state (the target's features of a packed row equal those of each sequence's own
  prefill): the conv taps stop at each sequence's start (`causal_conv` with positions) and a
  sequence's first row decays the carried state by e^SEQUENCE_RESET_DECAY, so the chunked rule
  runs across sequence boundaries without carrying state over them.

  x: [T, D]; positions: [T] int32 each row's position inside its own sequence (0 at its first
  row). Returns out [T, D] float32.
  """
  xin, z, g, beta = _inputs(x, p, cfg, rt)
  conv0 = jnp.zeros((p.conv.shape[1] - 1, xin.shape[1]), jnp.float32)
  q, k, v = _qkv(jax.nn.silu(causal_conv(xin, conv0, p.conv, positions)), cfg)
  g = jnp.where((positions == 0)[:, None], SEQUENCE_RESET_DECAY, g)
  state = jnp.zeros((cfg.gdn_n_v_head, cfg.gdn_d_k, cfg.gdn_d_v), jnp.float32)
  o, _ = gated_delta_rule_chunked(q, k, v, g, beta, state)
  return _output(o, z, p, cfg, rt)


def mixer_verify(x, p, cfg: TargetConfig, ssm, conv, tree, anc, rt: Runtime):
  """Verify form over the N nodes of a draft tree (tree.Tree; a chain is a path tree): each
  node continues its parent's SSM state and conv window; the committed ssm/conv stay as they
  are. x: [N, D]; ssm: [Hv, Dk, Dv]; conv: [K-1, C]; anc: [N, K] the nodes' ancestor columns
  (tree.ancestor_columns(K - 1), shared by all layers; None for a path tree).
  Returns (out [N, D], steps, xin [N, C] pre-conv inputs), steps = the states [N, Hv, Dk, Dv]
  after each node (rt.gdn_commit "states"), or the nodes' recurrence inputs (k [N, Hv, Dk],
  v [N, Hv, Dv], g [N, Hv], beta [N, Hv]) for a replay ("replay"): what `target.path_update`
  needs to commit any root path.
  """
  xin, z, g, beta = _inputs(x, p, cfg, rt)
  if tree.is_path:
    mixed = causal_conv(xin, conv, p.conv)
  else:
    mixed = causal_conv_tree(xin, conv, p.conv, anc, tree.depths)
  q, k, v = _qkv(jax.nn.silu(mixed), cfg)
  o, states = gated_delta_rule_tree(q, k, v, g, beta, ssm, tree.parents, rt, is_path=tree.is_path,
                                    max_depth=tree.max_depth)
  steps = states if states is not None else (k, v, g, beta)
  return _output(o, z, p, cfg, rt), steps, xin
