"""Model math shared by the target and the draft: linear over packed weights, RMSNorm, RoPE,
masked attention over a KV cache, the Gated DeltaNet causal conv and gated delta rule.

Dimension letters: T tokens in this call, S cache rows, D d_model, H/Hkv heads, Dh head dim,
Hk/Hv GDN key/value heads, Dk/Dv GDN head dims, C conv channels, K conv kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.quants import QuantWeight

KERNEL_CHOICES = ("reference", "pallas", "pallas_interpret")


def linear(x: jax.Array, w: QuantWeight, compute_dtype=jnp.float32,
           kernels: str = "reference") -> jax.Array:
  """y = x @ W^T.  x: [..., K] float; w: logical [N, K]; returns [..., N] float32.

  kernels: "reference" dequantizes inside the traced function and runs one XLA dot (float32
  uses HIGHEST precision); "pallas" runs pallas_kernels.dequant_matmul on the packed GGUF rows
  (operands in `compute_dtype`: float32 means TF32 tensor cores on GPU) for the block formats
  and N it tiles, the reference otherwise; "pallas_interpret" is the same through the Pallas
  interpreter (CPU tests).
  """
  from pallas_kernels import dequant_matmul as dm
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  if kernels != "reference" and dm.supports(w):
    y = dm.dequant_matmul(x2, w, compute_dtype=compute_dtype,
                          interpret=kernels == "pallas_interpret")
  else:
    y = dm.dequant_matmul_reference(x2, w, compute_dtype)
  return y.reshape(*lead, w.shape[0])


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
  """

  groups: tuple
  members: tuple = dataclasses.field(metadata=dict(static=True))


def fuse_projections(ws: Sequence[QuantWeight], fuse: bool = True) -> Projections:
  """Group projections of one input for a fused matmul (host side, at load).

  ws: member weights, logical [N_i, K] each, host (numpy) data. Members with the same format,
  K and storage dtype are concatenated when `fuse`, except that a member is left out of a group
  when adding it would shrink the group's power-of-2 N tile (e.g. 48-row ssm_alpha/ssm_beta
  next to a 16384-row block: they form their own group instead). With fuse=False every member
  is its own group. Returns a Projections; `project` undoes the grouping.
  """
  from pallas_kernels.dequant_matmul import n_tile
  order = sorted(range(len(ws)), key=lambda i: -ws[i].shape[0])
  groups: list[list[int]] = []
  for i in order:
    w = ws[i]
    for g in groups if fuse else ():
      head = ws[g[0]]
      n = sum(ws[j].shape[0] for j in g) + w.shape[0]
      if ((head.fmt, head.shape[1], np.asarray(head.data).dtype)
          == (w.fmt, w.shape[1], np.asarray(w.data).dtype)
          and n_tile(n) >= min(n_tile(ws[j].shape[0]) for j in g)):
        g.append(i)
        break
    else:
      groups.append([i])
  out, members = [], []
  for g in sorted((sorted(g) for g in groups), key=lambda g: g[0]):
    if len(g) == 1:
      out.append(ws[g[0]])
    else:
      data = np.concatenate([np.asarray(ws[j].data) for j in g], axis=0)
      out.append(QuantWeight(data, ws[g[0]].fmt,
                             (sum(ws[j].shape[0] for j in g), ws[g[0]].shape[1])))
    members.append(tuple((j, ws[j].shape[0]) for j in g))
  return Projections(tuple(out), tuple(members))


def project(x: jax.Array, p: Projections, compute_dtype=jnp.float32,
            kernels: str = "reference") -> tuple[jax.Array, ...]:
  """All member projections of x: x [..., K] -> tuple of [..., N_i] float32, in member order.

  One `linear` per group (see `fuse_projections`), then the group output is split by rows.
  """
  outs = {}
  for w, mem in zip(p.groups, p.members):
    y = linear(x, w, compute_dtype, kernels)
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


def write_rows(cache: jax.Array, layer: int, start: jax.Array, rows: jax.Array) -> jax.Array:
  """cache: [n_layer, S, ...] (KV cache of all layers); rows: [T, ...] -> cache with
  cache[layer, start:start+T] = rows (cast to cache.dtype).

  One dynamic-update-slice on the stacked buffer, which XLA does in place on a donated or
  loop-carried cache; slicing each layer out and re-stacking would copy the whole cache every step.
  """
  idx = (jnp.int32(layer), jnp.asarray(start, jnp.int32)) + (jnp.int32(0),) * (cache.ndim - 2)
  return jax.lax.dynamic_update_slice(cache, rows[None].astype(cache.dtype), idx)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax attention with GQA, float32.

  q: [T, H, Dh]; k: [S, Hkv, Dh]; v: [S, Hkv, Dv]; mask: [T, S] bool (True = visible).
  Query head h reads KV head h // (H / Hkv). Scale Dh**-0.5. Returns [T, H, Dv].
  """
  t, h, dh = q.shape
  hkv = k.shape[1]
  qg = q.reshape(t, hkv, h // hkv, dh)
  s = jnp.einsum("tgrd,sgd->grts", qg, k, precision=jax.lax.Precision.HIGHEST) * (dh ** -0.5)
  s = jnp.where(mask[None, None], s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  o = jnp.einsum("grts,sgd->tgrd", p, v, precision=jax.lax.Precision.HIGHEST)
  return o.reshape(t, h, v.shape[-1])


def causal_conv(x: jax.Array, conv_state: jax.Array, w: jax.Array) -> jax.Array:
  """Depthwise causal conv1d over [conv_state ; x], no bias, no activation.

  x: [T, C]; conv_state: [K-1, C] inputs before x (zeros at the start); w: [C, K] (GGUF ssm_conv1d).
  y[t, c] = sum_j w[c, j] * xc[t + j, c] with xc = [conv_state ; x]. Returns [T, C] float32.
  """
  kk = w.shape[1]
  t = x.shape[0]
  xc = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)], axis=0)
  y = jnp.zeros_like(x, dtype=jnp.float32)
  for j in range(kk):
    y = y + xc[j:j + t] * w[:, j]
  return y


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
  """Token-by-token gated delta rule (Yang et al. 2024, arXiv:2412.06464), float32.

  q, k: [T, Hv, Dk] (L2-normalized, q pre-scaled by Dk**-0.5); v: [T, Hv, Dv];
  g: [T, Hv] log-space decay (<= 0); beta: [T, Hv] write strength; state: [Hv, Dk, Dv].
  Per token: S = e^g S;  S += k (beta (v - S^T k))^T;  o = S^T q.
  Returns (o: [T, Hv, Dv], states: [T, Hv, Dk, Dv] the state after each token).
  """

  def step(s, inp):
    qt, kt, vt, gt, bt = inp
    s = s * jnp.exp(gt)[:, None, None]
    kv = jnp.einsum("hk,hkv->hv", kt, s, precision=jax.lax.Precision.HIGHEST)
    delta = (vt - kv) * bt[:, None]
    s = s + kt[:, :, None] * delta[:, None, :]
    o = jnp.einsum("hk,hkv->hv", qt, s, precision=jax.lax.Precision.HIGHEST)
    return s, (o, s)

  _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), (q, k, v, g, beta))
  return o, states


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


def gated_delta_rule_tree(q, k, v, g, beta, state, parents, kernels: str = "reference"):
  """Gated delta rule over a tree (DDTree verify): node i starts from its parent's state, the
  root (parents[i] < 0) from `state`; parents[i] < i. The chain is parents = [-1, 0, 1, ...].

  q, k: [N, Hv, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]; state: [Hv, Dk, Dv]; parents: [N] int32.
  Returns (o: [N, Hv, Dv], states: [N, Hv, Dk, Dv] the state after each node), float32.
  kernels: "reference" (pallas_kernels.tree_gdn.tree_gdn_reference, a scan over nodes with a
  parent gather), "pallas" / "pallas_interpret" (the Pallas kernel where the head sizes tile).
  """
  from pallas_kernels import tree_gdn as tk
  if kernels != "reference" and tk.supports(q.shape[-1], v.shape[-1]):
    return tk.tree_gdn(q, k, v, g, beta, state, parents, interpret=kernels == "pallas_interpret")
  return tk.tree_gdn_reference(q, k, v, g, beta, state, parents)


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
