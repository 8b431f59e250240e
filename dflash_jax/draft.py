"""z-lab DFlash block-diffusion draft (arXiv:2602.06036; z-lab/dflash dflash/model.py).

The draft sees `[bonus, MASK x (L-1)]` embedded with the target's embedding table, plus context
K/V computed from target features: c = hidden_norm(fc(features)), per layer k = k_norm(k_proj(c)),
v = v_proj(c), RoPE at the context positions. Block queries attend over all context and the
whole block with no mask (sliding layers: causal + window). Logits = target lm_head(norm(h))[1:].

Context K/V are cached across steps (`DraftCache`) and written by `ingest`; `propose` runs the block.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import layers
from dflash_jax.config import DraftConfig, TargetConfig
from dflash_jax.quants import QuantWeight, take_rows


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
  gate: QuantWeight        # [F, D]
  up: QuantWeight          # [F, D]
  down: QuantWeight        # [D, F]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftParams:
  fc: QuantWeight          # [D, n_features*D_target]
  hidden_norm: jax.Array   # [D] f32
  norm: jax.Array          # [D] f32
  layers: tuple            # [n_layer] DraftLayer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
  """Draft context K/V: k, v [n_layer, S, Hkv, Dh] float32 (post k_norm and RoPE)."""

  k: jax.Array
  v: jax.Array


def init_cache(cfg: DraftConfig, capacity: int) -> DraftCache:
  shape = (cfg.n_layer, capacity, cfg.n_kv_head, cfg.head_dim)
  return DraftCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


# ----------------------------------------------------------------------------- z-lab key names

def _layer_keys(i: int) -> dict[str, str]:
  p = f"layers.{i}."
  return dict(in_norm=p + "input_layernorm.weight", post_norm=p + "post_attention_layernorm.weight",
              wq=p + "self_attn.q_proj.weight", wk=p + "self_attn.k_proj.weight",
              wv=p + "self_attn.v_proj.weight", wo=p + "self_attn.o_proj.weight",
              q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight",
              gate=p + "mlp.gate_proj.weight", up=p + "mlp.up_proj.weight",
              down=p + "mlp.down_proj.weight")


def expected_shapes(cfg: DraftConfig, d_target: int) -> dict[str, tuple[int, ...]]:
  """z-lab safetensors key -> HF shape [out, in] for this config."""
  d, h, hkv, dh, f = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
  shapes = {"fc.weight": (d, cfg.n_features * d_target), "hidden_norm.weight": (d,),
            "norm.weight": (d,)}
  for i in range(cfg.n_layer):
    k = _layer_keys(i)
    shapes.update({k["in_norm"]: (d,), k["post_norm"]: (d,), k["wq"]: (h * dh, d),
                   k["wk"]: (hkv * dh, d), k["wv"]: (hkv * dh, d), k["wo"]: (d, h * dh),
                   k["q_norm"]: (dh,), k["k_norm"]: (dh,), k["gate"]: (f, d), k["up"]: (f, d),
                   k["down"]: (d, f)})
  return shapes


def params_from_arrays(arrays: dict[str, np.ndarray], cfg: DraftConfig, *, weight_fmt="bf16",
                       path: str = "?") -> DraftParams:
  """Build DraftParams from z-lab-named arrays (host). Matrices keep `weight_fmt` ("bf16"/"f32")."""
  import ml_dtypes
  dt = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[weight_fmt]

  def mat(key):
    a = np.asarray(arrays[key])
    return QuantWeight(a.astype(dt), weight_fmt, tuple(int(x) for x in a.shape))

  def vec(key):
    return np.asarray(arrays[key]).astype(np.float32)

  lay = []
  for i in range(cfg.n_layer):
    k = _layer_keys(i)
    lay.append(DraftLayer(**{n: (vec(key) if "norm" in n else mat(key)) for n, key in k.items()}))
  return DraftParams(fc=mat("fc.weight"), hidden_norm=vec("hidden_norm.weight"),
                     norm=vec("norm.weight"), layers=tuple(lay))


def params_to_arrays(params: DraftParams, cfg: DraftConfig) -> dict[str, np.ndarray]:
  """Inverse of params_from_arrays: z-lab key -> host array (matrices in their stored dtype)."""
  out = {"fc.weight": np.asarray(params.fc.data), "hidden_norm.weight": np.asarray(params.hidden_norm),
         "norm.weight": np.asarray(params.norm)}
  for i, lay in enumerate(params.layers):
    for n, key in _layer_keys(i).items():
      x = getattr(lay, n)
      out[key] = np.asarray(x.data if isinstance(x, QuantWeight) else x)
  return out


def validate(cfg: DraftConfig, tcfg: TargetConfig, *, path: str = "?"):
  """Check the draft against its target. Raises ValueError naming the draft and the field."""
  if cfg.d_model != tcfg.d_model:
    raise ValueError(f"{path}: draft hidden_size={cfg.d_model} does not match the target "
                     f"embedding_length={tcfg.d_model}")
  if cfg.n_vocab != tcfg.n_vocab:
    raise ValueError(f"{path}: draft vocab_size={cfg.n_vocab} does not match the target vocab "
                     f"({tcfg.n_vocab} rows in token_embd)")
  bad = [i for i in cfg.target_layer_ids if not 0 <= i < tcfg.n_layer]
  if bad:
    raise ValueError(f"{path}: target_layer_ids {list(cfg.target_layer_ids)} has ids {bad} outside "
                     f"the target's {tcfg.n_layer} layers")
  if not 0 <= cfg.mask_token_id < tcfg.n_vocab:
    raise ValueError(f"{path}: mask_token_id={cfg.mask_token_id} is outside the target vocab")
  if cfg.block_size < 2:
    raise ValueError(f"{path}: block_size={cfg.block_size} must be >= 2")


def load(draft_dir: str, tcfg: TargetConfig) -> tuple[DraftConfig, DraftParams]:
  """Read a z-lab draft directory (config.json + model.safetensors) and validate it against tcfg.

  Raises FileNotFoundError for missing files, ValueError for a mismatch or a bad tensor.
  """
  from safetensors.numpy import load_file

  cfg_path = os.path.join(draft_dir, "config.json")
  st_path = os.path.join(draft_dir, "model.safetensors")
  for p in (cfg_path, st_path):
    if not os.path.isfile(p):
      raise FileNotFoundError(f"draft file not found: {p}")
  with open(cfg_path) as fh:
    cfg = DraftConfig.from_json(json.load(fh), path=cfg_path)
  validate(cfg, tcfg, path=draft_dir)
  try:
    arrays = _load_safetensors(st_path)
  except Exception as e:
    raise ValueError(f"{st_path}: cannot read safetensors (truncated or corrupt?): {e}") from e
  for key, shape in expected_shapes(cfg, tcfg.d_model).items():
    if key not in arrays:
      raise ValueError(f"{st_path}: missing tensor {key!r}")
    if tuple(arrays[key].shape) != shape:
      raise ValueError(f"{st_path}: tensor {key!r} has shape {tuple(arrays[key].shape)}, "
                       f"expected {shape}")
  return cfg, params_from_arrays(arrays, cfg, path=st_path)


def _load_safetensors(path: str) -> dict[str, np.ndarray]:
  """Load with safetensors' numpy API; bf16 tensors come back as ml_dtypes.bfloat16."""
  from safetensors import safe_open
  out = {}
  with safe_open(path, framework="flax") as f:
    for k in f.keys():
      out[k] = np.asarray(f.get_tensor(k))
  return out


# ----------------------------------------------------------------------------- forward

def _rope(x, pos, cfg: DraftConfig):
  return layers.rope(x, pos, rot_dim=cfg.head_dim, theta=cfg.rope_theta, style="neox")


def ingest(params: DraftParams, cfg: DraftConfig, feats: jax.Array, start: jax.Array,
           cache: DraftCache, compute_dtype: str = "float32") -> DraftCache:
  """Write context K/V for target features of positions start..start+W-1 into the cache.

  feats: [W, F*D_target] (rows past the real count are written too; they lie at positions that
  the next `propose` overwrites or masks). Context gets fc + hidden_norm only, then per layer
  k = k_norm(k_proj(c)) with RoPE, v = v_proj(c).
  """
  cdt = jnp.dtype(compute_dtype)
  w = feats.shape[0]
  pos = start + jnp.arange(w, dtype=jnp.int32)
  c = layers.rms_norm(layers.linear(feats, params.fc, cdt), params.hidden_norm, cfg.rms_eps)
  k_all, v_all = cache.k, cache.v
  for i, lay in enumerate(params.layers):
    k = layers.rms_norm(layers.linear(c, lay.wk, cdt).reshape(w, cfg.n_kv_head, cfg.head_dim),
                        lay.k_norm, cfg.rms_eps)
    v = layers.linear(c, lay.wv, cdt).reshape(w, cfg.n_kv_head, cfg.head_dim)
    k_all = layers.write_rows(k_all, i, start, _rope(k, pos, cfg))
    v_all = layers.write_rows(v_all, i, start, v)
  return DraftCache(k_all, v_all)


def propose(params: DraftParams, cfg: DraftConfig, embed: QuantWeight, lm_head: QuantWeight,
            bonus: jax.Array, start: jax.Array, cache: DraftCache,
            compute_dtype: str = "float32", n_logits: int | None = None
            ) -> tuple[jax.Array, DraftCache]:
  """One draft block at positions start..start+L-1 (context = cache rows < start).

  bonus: [] int32 the last committed token (at position `start`); embed/lm_head: the target's.
  n_logits: static, 1..L-1 (default L-1): logits only for the first n_logits block offsets (the
  block itself is still the full L positions, so those rows are unchanged; a small DDTree budget
  needs only that many depths and skips the rest of the vocabulary-sized lm_head matmul).
  Returns (logits [n_logits, V] float32, row j predicting position start+1+j; cache with the
  block's K/V written at start.., which later `ingest` calls overwrite).
  Raises ValueError for n_logits outside 1..L-1.
  """
  cdt = jnp.dtype(compute_dtype)
  L = cfg.block_size
  n_logits = L - 1 if n_logits is None else n_logits
  if not 1 <= n_logits <= L - 1:
    raise ValueError(f"n_logits={n_logits} must be in [1, block_size-1={L - 1}]")
  ids = jnp.concatenate([bonus[None].astype(jnp.int32),
                         jnp.full((L - 1,), cfg.mask_token_id, jnp.int32)])
  pos = start + jnp.arange(L, dtype=jnp.int32)
  h = take_rows(embed, ids)
  key_pos = jnp.arange(cache.k.shape[1], dtype=jnp.int32)
  full_mask = jnp.broadcast_to(key_pos[None, :] < start + L, (L, key_pos.shape[0]))
  k_all, v_all = cache.k, cache.v
  for i, lay in enumerate(params.layers):
    x = layers.rms_norm(h, lay.in_norm, cfg.rms_eps)
    q = layers.rms_norm(layers.linear(x, lay.wq, cdt).reshape(L, cfg.n_head, cfg.head_dim),
                        lay.q_norm, cfg.rms_eps)
    k = layers.rms_norm(layers.linear(x, lay.wk, cdt).reshape(L, cfg.n_kv_head, cfg.head_dim),
                        lay.k_norm, cfg.rms_eps)
    v = layers.linear(x, lay.wv, cdt).reshape(L, cfg.n_kv_head, cfg.head_dim)
    q, k = _rope(q, pos, cfg), _rope(k, pos, cfg)
    k_all = layers.write_rows(k_all, i, start, k)
    v_all = layers.write_rows(v_all, i, start, v)
    kc, vc = k_all[i], v_all[i]
    if cfg.sliding[i]:
      mask = ((key_pos[None, :] <= pos[:, None])
              & (pos[:, None] - key_pos[None, :] < cfg.sliding_window))
    else:
      mask = full_mask
    o = layers.attention(q, kc, vc, mask).reshape(L, cfg.n_head * cfg.head_dim)
    h = h + layers.linear(o, lay.wo, cdt)
    y = layers.rms_norm(h, lay.post_norm, cfg.rms_eps)
    h = h + layers.linear(jax.nn.silu(layers.linear(y, lay.gate, cdt)) * layers.linear(y, lay.up, cdt),
                          lay.down, cdt)
  h = layers.rms_norm(h, params.norm, cfg.rms_eps)
  logits = layers.linear(h[1:1 + n_logits], lm_head, cdt)
  return logits, DraftCache(k_all, v_all)


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


def train_hidden(params: DraftParams, cfg: DraftConfig, feats: jax.Array, block_ids: jax.Array,
                 anchors: jax.Array, embed: QuantWeight, compute_dtype: str = "float32"):
  """Draft forward for many blocks of one sequence at once (training; same math as ingest +
  propose, checked by tests).

  feats: [T, F*D] target features of positions 0..T-1; block_ids: [A, L] int32 rows
  [x_anchor, MASK x (L-1)]; anchors: [A] int32 positions of the first rows.
  Returns h: [A, L, D] float32 after the final norm (apply the target lm_head to rows 1..L-1).
  """
  cdt = jnp.dtype(compute_dtype)
  n_ctx = feats.shape[0]
  A, L = block_ids.shape
  H, Hkv, Dh = cfg.n_head, cfg.n_kv_head, cfg.head_dim
  G = H // Hkv
  cpos = jnp.arange(n_ctx, dtype=jnp.int32)
  qpos = (anchors[:, None] + jnp.arange(L, dtype=jnp.int32)).reshape(-1)  # [A*L]
  c = layers.rms_norm(layers.linear(feats, params.fc, cdt), params.hidden_norm, cfg.rms_eps)
  h = take_rows(embed, block_ids.reshape(-1)).reshape(A, L, -1)
  hp = jax.lax.Precision.HIGHEST
  for i, lay in enumerate(params.layers):
    kc = layers.rms_norm(layers.linear(c, lay.wk, cdt).reshape(n_ctx, Hkv, Dh), lay.k_norm, cfg.rms_eps)
    kc = _rope(kc, cpos, cfg)
    vc = layers.linear(c, lay.wv, cdt).reshape(n_ctx, Hkv, Dh)
    x = layers.rms_norm(h, lay.in_norm, cfg.rms_eps).reshape(A * L, -1)
    q = layers.rms_norm(layers.linear(x, lay.wq, cdt).reshape(A * L, H, Dh), lay.q_norm, cfg.rms_eps)
    kb = layers.rms_norm(layers.linear(x, lay.wk, cdt).reshape(A * L, Hkv, Dh), lay.k_norm, cfg.rms_eps)
    vb = layers.linear(x, lay.wv, cdt).reshape(A, L, Hkv, Dh)
    q = _rope(q, qpos, cfg).reshape(A, L, Hkv, G, Dh)
    kb = _rope(kb, qpos, cfg).reshape(A, L, Hkv, Dh)
    ctx_mask, blk_mask = block_masks(anchors, n_ctx, cfg, cfg.sliding[i])
    scale = Dh ** -0.5
    s_ctx = jnp.einsum("alkgd,tkd->akglt", q, kc, precision=hp) * scale
    s_blk = jnp.einsum("alkgd,amkd->akglm", q, kb, precision=hp) * scale
    s = jnp.concatenate([jnp.where(ctx_mask[:, None, None], s_ctx, -jnp.inf),
                         jnp.where(blk_mask[:, None, None], s_blk, -jnp.inf)], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    o = (jnp.einsum("akglt,tkd->alkgd", p[..., :n_ctx], vc, precision=hp)
         + jnp.einsum("akglm,amkd->alkgd", p[..., n_ctx:], vb, precision=hp))
    h = h + layers.linear(o.reshape(A, L, H * Dh), lay.wo, cdt)
    y = layers.rms_norm(h, lay.post_norm, cfg.rms_eps)
    h = h + layers.linear(jax.nn.silu(layers.linear(y, lay.gate, cdt)) * layers.linear(y, lay.up, cdt),
                          lay.down, cdt)
  return layers.rms_norm(h, params.norm, cfg.rms_eps)


def config_for_target(tcfg: TargetConfig, *, n_layer: int = 1, n_features: int = 3,
                      block_size: int = 16, mask_token_id: int = 0) -> DraftConfig:
  """A draft config shaped after the target (its attention/FFN sizes, z-lab default layer ids):
  the starting point for training a new draft, and for tests."""
  from dflash_jax.config import default_target_layer_ids
  return DraftConfig(
      d_model=tcfg.d_model, n_layer=n_layer, n_head=tcfg.n_head, n_kv_head=tcfg.n_kv_head,
      head_dim=tcfg.head_dim, d_ff=tcfg.d_ff, n_vocab=tcfg.n_vocab, rms_eps=tcfg.rms_eps,
      rope_theta=tcfg.rope_theta, block_size=block_size, mask_token_id=mask_token_id,
      target_layer_ids=tuple(default_target_layer_ids(tcfg.n_layer, n_features)),
      sliding=(False,) * n_layer)


def init_params(key: jax.Array, cfg: DraftConfig, d_target: int, *, std: float = 0.02,
                weight_fmt: str = "bf16", out_norm: Optional[np.ndarray] = None) -> DraftParams:
  """Random draft (matrices N(0, std^2), norms 1): a starting point for training and for tests.

  out_norm: optional [D] float32 initial final-norm weight; training passes the target's
  `output_norm` so the draft's logits through the shared lm_head start at the target's scale
  (with all-ones the initial cross-entropy is ~60 nats on SmolLM2 and the first hundreds of
  steps only shrink the logits).
  """
  arrays = {}
  for name, shape in expected_shapes(cfg, d_target).items():
    key, sub = jax.random.split(key)
    arrays[name] = (np.ones(shape, np.float32) if len(shape) == 1
                    else np.asarray(std * jax.random.normal(sub, shape, jnp.float32)))
  if out_norm is not None:
    out_norm = np.asarray(out_norm, np.float32)
    if out_norm.shape != (cfg.d_model,):
      raise ValueError(f"init_params: out_norm shape {out_norm.shape} != ({cfg.d_model},)")
    arrays["norm.weight"] = out_norm
  return params_from_arrays(arrays, cfg, weight_fmt=weight_fmt)
