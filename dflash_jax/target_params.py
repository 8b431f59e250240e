"""Target parameters read from GGUF: the params pytree (packed GGUF weights, f32 norms) and the
load-time projection fusion. Tensor names and layouts exactly as llama.cpp stores them
(src/models/{llama,qwen2,qwen3,qwen3moe,qwen35,qwen35moe,qwen3next}.cpp).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np

from dflash_jax import layers
from dflash_jax.config import HYBRID_ARCHS, TargetConfig
from dflash_jax.gguf_io import GGUFFile
from dflash_jax.quants import QuantWeight, from_numpy, to_dtype
from pallas_kernels.dequant_matmul import n_tile


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FFNParams:
  norm: jax.Array          # [D] f32 (pre-FFN RMSNorm weight)
  gate_up: layers.Projections  # ffn_gate [F, D], ffn_up [F, D]
  down: QuantWeight        # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEParams:
  """A routed-expert FFN, with a gated shared expert for qwen35moe (math: `layers.moe_ffn`). The
  expert tensors are the GGUF 3-D tensors with their expert axis folded into the rows, so one
  expert is a contiguous run of rows (GGUF blocks never cross rows)."""

  norm: jax.Array          # [D] f32 (pre-FFN RMSNorm weight)
  router: QuantWeight      # ffn_gate_inp [E, D]
  gate_up_exps: QuantWeight  # [E*2Fe, D]: expert e's ffn_gate rows then its ffn_up rows (llama.cpp's
                             # ffn_gate_up_exps; separate ffn_gate_exps / ffn_up_exps of one format
                             # are merged at load), or ffn_gate_exps [E*Fe, D] alone when up_exps is set
  up_exps: Optional[QuantWeight]  # ffn_up_exps [E*Fe, D] when kept separate (formats differ, or fuse off)
  down_exps: QuantWeight   # ffn_down_exps [E*D, Fe]
  shared_gate_up: Optional[layers.Projections]  # ffn_gate_shexp [Fs, D], ffn_up_shexp [Fs, D]
  shared_down: Optional[QuantWeight]  # ffn_down_shexp [D, Fs]
  shared_gate: Optional[jax.Array]    # ffn_gate_inp_shexp [D] f32 (the shared expert's sigmoid
                                      # gate); the three None without a shared expert (qwen3moe)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttnParams:
  norm: jax.Array          # [D] f32
  qkv: layers.Projections  # attn_q [H*Dh, D] (or [H*2*Dh, D] per-head [query | gate] when
                           # attn_gate), attn_k [Hkv*Dh, D], attn_v [Hkv*Dv, D]
  wo: QuantWeight          # [D, H*Dv]
  q_norm: Optional[jax.Array]  # [Dh] f32 or None
  k_norm: Optional[jax.Array]
  ffn: FFNParams | MoEParams
  qkv_bias: Optional[tuple] = None  # (attn_q.bias [H*Dh], attn_k.bias [Hkv*Dh], attn_v.bias
                                    # [Hkv*Dv]) f32 when the file has them (qwen2; a missing one
                                    # of the three is zeros), else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNParams:
  """One Gated DeltaNet layer (math: gdn.mixer_prefill / gdn.mixer_verify)."""

  norm: jax.Array          # [D] f32
  in_proj: layers.Projections  # attn_qkv [C, D] (C = 2*Hk*Dk + Hv*Dv, V rows in llama.cpp's
                               # tiled head order), attn_gate (z) [Hv*Dv, D], ssm_beta [Hv, D],
                               # ssm_alpha [Hv, D]
  conv: jax.Array          # [C, K] f32 (ssm_conv1d)
  dt_bias: jax.Array       # [Hv] f32 (ssm_dt.bias)
  ssm_a: jax.Array         # [Hv] f32 (= -exp(A_log))
  ssm_norm: jax.Array      # [Dv] f32 (plain weight, no +1)
  w_out: QuantWeight       # [D, Hv*Dv]
  ffn: FFNParams | MoEParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetParams:
  embed: QuantWeight                                  # [V, D] token_embd
  out_norm: jax.Array                                 # [D] f32
  lm_head: QuantWeight                                # [V, D] output (token_embd when tied)
  layers: tuple                                       # [n_layer] AttnParams | GDNParams
  rope_freqs: Optional[jax.Array] = None              # [rope_dim/2] f32 or None


def fuse_projections(ws: Sequence[QuantWeight], fuse: bool = True) -> layers.Projections:
  """Group projections of one input for a fused matmul (host side, at load).

  ws: member weights, logical [N_i, K] each, host (numpy) data. Members with the same format,
  K and storage dtype are concatenated when `fuse`, except that a member is left out of a group
  when adding it would shrink the group's power-of-2 N tile (e.g. 48-row ssm_alpha/ssm_beta
  next to a 16384-row block: they form their own group instead). With fuse=False every member
  is its own group. Returns a layers.Projections; `layers.project` undoes the grouping.
  """
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
  return layers.Projections(tuple(out), tuple(members))



def _expect(f: GGUFFile, name: str, shape: tuple[int, ...]):
  t = f.tensor(name)
  if tuple(t.shape) != tuple(shape):
    raise ValueError(f"{f.path}: tensor {name!r} has shape {t.shape}, expected {shape}")
  return t


def _dense(f: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
  """A small tensor (norm weights, biases, the conv kernel) as float32 on the host, whatever
  its GGUF type."""
  t = _expect(f, name, shape)
  if t.fmt == "f32":
    return np.asarray(t.data, np.float32).reshape(shape)
  rows = int(np.prod(shape[:-1]))
  w = from_numpy(t.data, t.fmt, (rows, shape[-1]), name=f"{f.path}:{name}")
  return np.asarray(to_dtype(w, "f32").data, np.float32).reshape(shape)


def vector(f: GGUFFile, name: str, n: int) -> np.ndarray:
  """A 1-D tensor (norm weights, biases) as [n] float32 on the host."""
  return _dense(f, name, (n,))


def matrix(f: GGUFFile, name: str, shape: tuple[int, int], weights: str) -> QuantWeight:
  """The weight matrix `name` [N, K] (numpy order: GGUF [out, in]) as a QuantWeight: its GGUF
  blocks packed (weights "quantized") or dequantized to weights ("f32" / "bf16"). Raises
  ValueError naming the file and tensor when it is missing or of another shape."""
  t = _expect(f, name, shape)
  w = from_numpy(t.data, t.fmt, shape, name=f"{f.path}:{name}")
  return w if weights == "quantized" else to_dtype(w, weights)


def _experts(f: GGUFFile, name: str, shape: tuple[int, int, int], weights: str) -> QuantWeight:
  """A GGUF expert tensor [E, N, K] as one [E*N, K] weight (expert e = rows e*N .. e*N+N-1)."""
  t = _expect(f, name, shape)
  e, n, k = shape
  w = from_numpy(t.data, t.fmt, (e * n, k), name=f"{f.path}:{name}")
  return w if weights == "quantized" else to_dtype(w, weights)


def _gate_up_experts(f: GGUFFile, p: str, shape: tuple[int, int, int], weights: str,
                     fuse: bool) -> tuple[QuantWeight, Optional[QuantWeight]]:
  """(gate_up_exps, up_exps) of `MoEParams`: a file's merged `ffn_gate_up_exps` [E, 2Fe, D] as it
  is (llama.cpp's `--fuse-gate-up-exps` conversion: torch.cat([gate, up], dim=1)); separate gate /
  up tensors merged the same way per expert when fuse and their formats agree, else kept apart."""
  e, fe, d = shape
  merged = p + "ffn_gate_up_exps.weight"
  if merged in f.tensors:
    return _experts(f, merged, (e, 2 * fe, d), weights), None
  gate = _experts(f, p + "ffn_gate_exps.weight", shape, weights)
  up = _experts(f, p + "ffn_up_exps.weight", shape, weights)
  if not fuse or gate.fmt != up.fmt:
    return gate, up
  data = np.concatenate([np.asarray(w.data).reshape(e, fe, -1) for w in (gate, up)], axis=1)
  return QuantWeight(data.reshape(e * 2 * fe, -1), gate.fmt, (e * 2 * fe, d)), None


def _moe(f: GGUFFile, cfg: TargetConfig, p: str, weights: str, fuse: bool, norm: str) -> MoEParams:
  """A MoE FFN (llama.cpp src/models/qwen35moe.cpp `build_layer_ffn`, qwen3moe.cpp)."""
  d, e, fe, fs = cfg.d_model, cfg.n_expert, cfg.d_ff_exp, cfg.d_ff_shexp
  gate_up, up = _gate_up_experts(f, p, (e, fe, d), weights, fuse)
  shared = dict(shared_gate_up=None, shared_down=None, shared_gate=None)
  if fs:
    shexp_gate = p + "ffn_gate_inp_shexp.weight"
    gate_shape = (1, d) if tuple(f.tensor(shexp_gate).shape) == (1, d) else (d,)
    shared = dict(
        shared_gate_up=fuse_projections([matrix(f, p + "ffn_gate_shexp.weight", (fs, d), weights),
                                         matrix(f, p + "ffn_up_shexp.weight", (fs, d), weights)],
                                        fuse),
        shared_down=matrix(f, p + "ffn_down_shexp.weight", (d, fs), weights),
        shared_gate=_dense(f, shexp_gate, gate_shape).reshape(d))
  return MoEParams(
      norm=vector(f, norm, d),
      # the router stays float32 when weights are dequantized at load (a bf16 router would choose
      # other experts than the file's F32 one near ties)
      router=matrix(f, p + "ffn_gate_inp.weight", (e, d),
                  "quantized" if weights == "quantized" else "f32"),
      gate_up_exps=gate_up, up_exps=up,
      down_exps=_experts(f, p + "ffn_down_exps.weight", (e, d, fe), weights), **shared)


def _ffn(f: GGUFFile, cfg: TargetConfig, p: str, weights: str, fuse: bool) -> FFNParams | MoEParams:
  d = cfg.d_model
  norm = p + ("post_attention_norm" if cfg.arch in HYBRID_ARCHS else "ffn_norm") + ".weight"
  if cfg.moe:
    return _moe(f, cfg, p, weights, fuse, norm)
  return FFNParams(norm=vector(f, norm, d),
                   gate_up=fuse_projections([matrix(f, p + "ffn_gate.weight", (cfg.d_ff, d), weights),
                                             matrix(f, p + "ffn_up.weight", (cfg.d_ff, d), weights)],
                                            fuse),
                   down=matrix(f, p + "ffn_down.weight", (d, cfg.d_ff), weights))


def _rows(w: QuantWeight, idx: np.ndarray) -> QuantWeight:
  """Rows `idx` of a weight (packed GGUF rows of any format: a block never crosses a row)."""
  return QuantWeight(np.asarray(w.data)[idx], w.fmt, (len(idx), w.shape[1]))


def _qwen3next_inputs(f: GGUFFile, cfg: TargetConfig, p: str, weights: str):
  """Qwen3-Next's Gated DeltaNet input projections as qwen35's four: (attn_qkv [C, D], attn_gate
  [Hv*Dv, D], ssm_beta [Hv, D], ssm_alpha [Hv, D]), V heads in the checkpoint's grouped order
  (cfg.gdn_grouped). `ssm_ba` [2*Hv, D] holds per K head g its r = Hv/Hk beta rows then its r
  alpha rows (transformers Qwen3NextGatedDeltaNet.fix_query_key_value_ordering); a legacy file's
  fused `ssm_in` [C + Hv*Dv, D] holds per K head [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] rows, which
  current converters write as attn_qkv = [all q; all k; all v] and attn_gate = all z (llama.cpp
  src/models/qwen3next.cpp build_qkvz, conversion/qwen.py Qwen3NextModel)."""
  d, hk, hv, dk, dv = cfg.d_model, cfg.gdn_n_k_head, cfg.gdn_n_v_head, cfg.gdn_d_k, cfg.gdn_d_v
  r, c = hv // hk, cfg.conv_dim
  ba = matrix(f, p + "ssm_ba.weight", (2 * hv, d), weights)
  g, j = np.arange(hk)[:, None], np.arange(r)[None, :]
  beta, alpha = _rows(ba, (g * 2 * r + j).ravel()), _rows(ba, (g * 2 * r + r + j).ravel())
  if p + "ssm_in.weight" in f.tensors and p + "attn_qkv.weight" not in f.tensors:
    fused = matrix(f, p + "ssm_in.weight", (c + hv * dv, d), weights)
    w = 2 * dk + 2 * r * dv                       # rows per K head
    base = np.arange(hk)[:, None] * w
    q = (base + np.arange(dk)).ravel()
    k = (base + dk + np.arange(dk)).ravel()
    v = (base + 2 * dk + np.arange(r * dv)).ravel()
    z = (base + 2 * dk + r * dv + np.arange(r * dv)).ravel()
    return _rows(fused, np.concatenate([q, k, v])), _rows(fused, z), beta, alpha
  return (matrix(f, p + "attn_qkv.weight", (c, d), weights),
          matrix(f, p + "attn_gate.weight", (hv * dv, d), weights), beta, alpha)


def _gdn_layer(f: GGUFFile, cfg: TargetConfig, p: str, weights: str, fuse: bool) -> GDNParams:
  d, hv, dv, c = cfg.d_model, cfg.gdn_n_v_head, cfg.gdn_d_v, cfg.conv_dim
  if cfg.arch == "qwen3next":
    ins = _qwen3next_inputs(f, cfg, p, weights)
  else:
    ins = (matrix(f, p + "attn_qkv.weight", (c, d), weights),
           matrix(f, p + "attn_gate.weight", (hv * dv, d), weights),
           matrix(f, p + "ssm_beta.weight", (hv, d), weights),
           matrix(f, p + "ssm_alpha.weight", (hv, d), weights))
  return GDNParams(
      norm=vector(f, p + "attn_norm.weight", d),
      in_proj=fuse_projections(list(ins), fuse),
      conv=_dense(f, p + "ssm_conv1d.weight", (c, cfg.conv_kernel)),
      dt_bias=vector(f, p + "ssm_dt.bias", hv), ssm_a=vector(f, p + "ssm_a", hv),
      ssm_norm=vector(f, p + "ssm_norm.weight", dv),
      w_out=matrix(f, p + "ssm_out.weight", (d, hv * dv), weights),
      ffn=_ffn(f, cfg, p, weights, fuse))


def attn_layer_params(f: GGUFFile, cfg: TargetConfig, p: str, weights: str, fuse: bool) -> AttnParams:
  """The softmax-attention and FFN weights of the block whose tensor names start with `p`
  ("blk.3."), in the file's formats (see `matrix`; fuse: q/k/v and gate/up stacked)."""
  d, h, hkv, dh, dvh = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.v_head_dim
  q_rows = h * dh * (2 if cfg.attn_gate else 1)
  sizes = (q_rows, hkv * dh, hkv * dvh)
  names = [p + f"attn_{x}.bias" for x in "qkv"]
  bias = None
  if any(n in f.tensors for n in names):    # llama.cpp create_tensor_qkv: each one optional
    bias = tuple(vector(f, n, m) if n in f.tensors else np.zeros((m,), np.float32)
                 for n, m in zip(names, sizes))
  return AttnParams(
      qkv_bias=bias,
      norm=vector(f, p + "attn_norm.weight", d),
      qkv=fuse_projections([matrix(f, p + "attn_q.weight", (q_rows, d), weights),
                            matrix(f, p + "attn_k.weight", (hkv * dh, d), weights),
                            matrix(f, p + "attn_v.weight", (hkv * dvh, d), weights)], fuse),
      wo=matrix(f, p + "attn_output.weight", (d, h * dvh), weights),
      q_norm=vector(f, p + "attn_q_norm.weight", dh) if cfg.qk_norm else None,
      k_norm=vector(f, p + "attn_k_norm.weight", dh) if cfg.qk_norm else None,
      ffn=_ffn(f, cfg, p, weights, fuse))


def _check_all_used(f: GGUFFile, cfg: TargetConfig):
  """Every tensor of the file must be one the forward reads, as llama.cpp requires ("wrong number
  of tensors"), except blocks past the trunk (multi-token-prediction layers). A renamed tensor
  would otherwise be ignored silently (e.g. a missing `output.weight` falls back to tied
  embeddings). Raises ValueError naming the tensors."""
  def trunk(name):
    parts = name.split(".")
    return not (parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit()
                and int(parts[1]) >= cfg.n_layer)
  extra = sorted(n for n in set(f.tensors) - f.used if trunk(n))
  if extra:
    raise ValueError(f"{f.path}: tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} are not "
                     f"used by the {cfg.arch} architecture (renamed or corrupt tensor names?)")


def load_params(f: GGUFFile, cfg: TargetConfig, *, weights: str = "quantized",
                fuse: bool = True) -> TargetParams:
  """Read every tensor the forward needs, check its shape against cfg.

  weights: "quantized" keeps GGUF blocks packed (dequantized inside the jitted forward);
    "f32" / "bf16" dequantize at load.
  fuse: concatenate same-format projections of one input at load (q/k/v, ffn gate/up, the Gated
    DeltaNet qkv/z/beta/alpha; see `fuse_projections`) so each runs as one matmul.
  Returns host (numpy) arrays; device_put the result. Raises ValueError naming the tensor.
  """
  if weights not in ("quantized", "f32", "bf16"):
    raise ValueError(f"weights={weights!r}: expected 'quantized', 'f32' or 'bf16'")
  d, v = cfg.d_model, cfg.n_vocab
  embed = matrix(f, "token_embd.weight", (v, d), weights)
  lm_head = (matrix(f, "output.weight", (v, d), weights) if "output.weight" in f.tensors else embed)
  out = [(_gdn_layer if cfg.recurrent[i] else attn_layer_params)(f, cfg, f"blk.{i}.", weights, fuse)
         for i in range(cfg.n_layer)]
  rope_freqs = vector(f, "rope_freqs.weight", cfg.rope_dim // 2) if cfg.has_rope_freqs else None
  params = TargetParams(embed=embed, out_norm=vector(f, "output_norm.weight", d), lm_head=lm_head,
                        layers=tuple(out), rope_freqs=rope_freqs)
  _check_all_used(f, cfg)
  return params


def tile_kquants(params: TargetParams, *, rows_multiple: int) -> TargetParams:
  """Q4_K, Q5_K and Q6_K weights (every projection of every layer, fused groups included, and the
  lm_head) in the Mosaic GPU kernel's layouts (`pallas_kernels.mgpu_matmul.Q4KTiles` /
  `Q5KTiles` / `Q6KTiles`: `repack.repack`, then `to_tiles`; a permutation of the same bytes, plus 4 per 256
  weights for Q4_K and Q5_K), for rt.kernels "mosaic*"; weights of other formats, a MoE FFN's routed
  experts (gathered per token), or weights whose N is not a multiple of rows_multiple
  (`layers.mosaic_rows_multiple`: 64 x the kernel's compute warpgroups) or K of 256, stay packed
  GGUF rows. The token embedding stays GGUF rows (read by row gathers), and so does an lm_head
  tied to it. Whatever reads the lm_head whole (the EAGLE-3 draft-vocabulary head, the training
  loss) goes through `quants.dequantize`, which reads tiles too. Host (numpy) work at load:
  params as `load_params` returns them (weights="quantized")."""
  from pallas_kernels import mgpu_matmul, repack

  def tile(w):
    if isinstance(w, MoEParams):     # the experts stay packed rows (gathered per token)
      if w.shared_down is None:
        return w
      return dataclasses.replace(w, shared_gate_up=jax.tree.map(tile, w.shared_gate_up, is_leaf=leaf),
                                 shared_down=tile(w.shared_down))
    if (not isinstance(w, QuantWeight) or w.fmt not in mgpu_matmul.TILE_FORMATS
        or w.shape[0] % rows_multiple or w.shape[1] % repack.QK_K):
      return w
    return mgpu_matmul.to_tiles(repack.repack(np.asarray(w.data), w.fmt, w.shape))

  def leaf(x):
    return isinstance(x, (QuantWeight, MoEParams))

  layers_ = jax.tree.map(tile, params.layers, is_leaf=leaf)
  lm_head = params.lm_head if params.lm_head is params.embed else tile(params.lm_head)
  return dataclasses.replace(params, layers=layers_, lm_head=lm_head)

