"""z-lab DFlash draft checkpoints: config.json + model.safetensors with z-lab key names
(z-lab/dflash dflash/model.py, a transformers Qwen3 layout plus `fc` and `hidden_norm`); reading
with validation against the target, writing, and fresh (random) drafts shaped after a target.
The forward is in `draft`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import draft as draft_lib
from dflash_jax import layers
from dflash_jax.config import (DRAFT_ARCHITECTURES, DraftConfig, TargetConfig,
                               default_target_layer_ids)
from dflash_jax.quants import QuantWeight


def _layer_keys(i: int) -> dict[str, str]:
  p = f"layers.{i}."
  return dict(in_norm=p + "input_layernorm.weight", post_norm=p + "post_attention_layernorm.weight",
              wq=p + "self_attn.q_proj.weight", wk=p + "self_attn.k_proj.weight",
              wv=p + "self_attn.v_proj.weight", wo=p + "self_attn.o_proj.weight",
              q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight",
              gate=p + "mlp.gate_proj.weight", up=p + "mlp.up_proj.weight",
              down=p + "mlp.down_proj.weight")


def _dflash2_keys(i: int) -> dict[str, str]:
  p = f"layers.{i}."
  return dict(attn_base=p + "attention_conv.base_kernel",
              attn_proj=p + "attention_conv.kernel_projection.weight",
              mlp_base=p + "mlp_conv.base_kernel", mlp_proj=p + "mlp_conv.kernel_projection.weight")


DSPARK_KEYS = dict(w1="markov_head.markov_w1.weight", w2="markov_head.markov_w2.weight",
                   gate="markov_head.gate_proj.weight", gate_b="markov_head.gate_proj.bias",
                   joint="markov_head.joint_proj.weight", joint_b="markov_head.joint_proj.bias",
                   conf="confidence_head.proj.weight", conf_b="confidence_head.proj.bias")
# Tensors a DeepSpec checkpoint ships that the forward takes from the target instead (DeepSpec
# trains with frozen copies of the target's): checked for shape, not used.
DSPARK_SHIPPED = ("embed_tokens.weight", "lm_head.weight")


def _dspark_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
  f, d, v = cfg.dspark, cfg.d_model, cfg.n_vocab
  r = f.markov_rank
  k = DSPARK_KEYS
  out = {}
  if r:
    out.update({k["w1"]: (v, r), k["w2"]: (v, r)})
  if f.markov_head == "gated":
    out.update({k["gate"]: (r, d + r), k["gate_b"]: (r,)})
  if f.markov_head == "rnn":
    out.update({k["joint"]: (3 * r, 2 * r + d), k["joint_b"]: (3 * r,)})
  if f.confidence:
    out.update({k["conf"]: (1, d + (r if f.confidence_with_markov else 0)), k["conf_b"]: (1,)})
  return out


SELECTOR_KEYS = dict(sel_proj="candidate_selector.hidden_projection.weight",
                     pred="candidate_selector.predecessor_codebook",
                     succ="candidate_selector.successor_codebook")


def expected_shapes(cfg: DraftConfig, d_target: int) -> dict[str, tuple[int, ...]]:
  """z-lab safetensors key -> HF shape [out, in] for this config (DFlash-2: plus the convs'
  base_kernel [2, K, D] / kernel_projection [2*K*D/G, D] and the selector's tensors; the
  codebooks under z-lab's names, without `.weight`)."""
  d, h, hkv, dh, f = cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.d_ff
  shapes = {"fc.weight": (d, cfg.n_features * d_target), "hidden_norm.weight": (d,),
            "norm.weight": (d,)}
  for i in range(cfg.n_layer):
    k = _layer_keys(i)
    shapes.update({k["in_norm"]: (d,), k["post_norm"]: (d,), k["wq"]: (h * dh, d),
                   k["wk"]: (hkv * dh, d), k["wv"]: (hkv * dh, d), k["wo"]: (d, h * dh),
                   k["q_norm"]: (dh,), k["k_norm"]: (dh,), k["gate"]: (f, d), k["up"]: (f, d),
                   k["down"]: (d, f)})
  f2 = cfg.dflash2
  if f2 is not None:
    taps = 2 * f2.conv_kernel * d // f2.conv_group
    for i in range(cfg.n_layer):
      k = _dflash2_keys(i)
      shapes.update({k["attn_base"]: (2, f2.conv_kernel, d), k["attn_proj"]: (taps, d),
                     k["mlp_base"]: (2, f2.conv_kernel, d), k["mlp_proj"]: (taps, d)})
    shapes.update({SELECTOR_KEYS["sel_proj"]: (f2.selector_rank, d),
                   SELECTOR_KEYS["pred"]: (cfg.n_vocab, f2.selector_rank),
                   SELECTOR_KEYS["succ"]: (cfg.n_vocab, f2.selector_rank)})
  if cfg.dspark is not None:
    shapes.update(_dspark_shapes(cfg))
  return shapes


def readers(arrays: dict[str, np.ndarray], weight_fmt: str = "bf16"):
  """(mat, vec): key -> a host QuantWeight of `weight_fmt` ("bf16" / "f32") for a matrix, key -> a
  float32 host array for a vector (a checkpoint's arrays as the params pytrees hold them)."""
  import ml_dtypes
  dt = {"bf16": ml_dtypes.bfloat16, "f32": np.float32}[weight_fmt]

  def mat(key):
    a = np.asarray(arrays[key])
    return QuantWeight(a.astype(dt), weight_fmt, tuple(int(x) for x in a.shape))

  def vec(key):
    return np.asarray(arrays[key]).astype(np.float32)

  return mat, vec


def params_from_arrays(arrays: dict[str, np.ndarray], cfg: DraftConfig, *,
                       weight_fmt="bf16") -> draft_lib.DraftParams:
  """Build DraftParams from z-lab-named arrays (host). Matrices keep `weight_fmt` ("bf16"/"f32")."""
  mat, vec = readers(arrays, weight_fmt)

  lay = []
  for i in range(cfg.n_layer):
    k = _layer_keys(i)
    fields = {n: (vec(key) if "norm" in n else mat(key)) for n, key in k.items()}
    fields["gate_up"] = layers.Projections.separate([fields.pop("gate"), fields.pop("up")])
    lay.append(draft_lib.DraftLayer(**fields))
  extra = None
  if cfg.dflash2 is not None:
    ks = [_dflash2_keys(i) for i in range(cfg.n_layer)]
    conv = lambda k, side: draft_lib.ConvParams(vec(k[side + "_base"]), mat(k[side + "_proj"]))
    extra = draft_lib.DFlash2Params(
        attn_conv=tuple(conv(k, "attn") for k in ks), mlp_conv=tuple(conv(k, "mlp") for k in ks),
        sel_proj=mat(SELECTOR_KEYS["sel_proj"]), pred=vec(SELECTOR_KEYS["pred"]),
        succ=vec(SELECTOR_KEYS["succ"]))
  dspark = None
  if cfg.dspark is not None:        # the head's parts this config has (expected_shapes)
    read = dict(w2=mat, gate=mat, joint=mat)
    heads = {n: read.get(n, vec)(key) for n, key in DSPARK_KEYS.items() if key in arrays}
    dspark = draft_lib.DSparkParams(**{n: x[0] if n in ("conf", "conf_b") else x
                                       for n, x in heads.items()})
  return draft_lib.DraftParams(fc=mat("fc.weight"), hidden_norm=vec("hidden_norm.weight"),
                               norm=vec("norm.weight"), layers=tuple(lay), dflash2=extra,
                               dspark=dspark)


def params_to_arrays(params: draft_lib.DraftParams) -> dict[str, np.ndarray]:
  """Inverse of params_from_arrays: z-lab key -> host array (matrices in their stored dtype)."""
  out = {"fc.weight": np.asarray(params.fc.data), "hidden_norm.weight": np.asarray(params.hidden_norm),
         "norm.weight": np.asarray(params.norm)}
  for i, lay in enumerate(params.layers):
    gate, up = lay.gate_up.member_weights()
    for n, key in _layer_keys(i).items():
      x = {"gate": gate, "up": up}.get(n) or getattr(lay, n)
      out[key] = np.asarray(x.data if isinstance(x, QuantWeight) else x)
  ex = params.dflash2
  if ex is not None:
    for i in range(len(params.layers)):
      k = _dflash2_keys(i)
      for side, conv in (("attn", ex.attn_conv[i]), ("mlp", ex.mlp_conv[i])):
        out[k[side + "_base"]] = np.asarray(conv.base)
        out[k[side + "_proj"]] = np.asarray(conv.proj.data)
    out[SELECTOR_KEYS["sel_proj"]] = np.asarray(ex.sel_proj.data)
    out[SELECTOR_KEYS["pred"]], out[SELECTOR_KEYS["succ"]] = np.asarray(ex.pred), np.asarray(ex.succ)
  sp = params.dspark
  if sp is not None:
    for n, key in DSPARK_KEYS.items():
      x = getattr(sp, n)
      if x is not None:
        x = np.asarray(x.data if isinstance(x, QuantWeight) else x)
        out[key] = x[None] if n in ("conf", "conf_b") else x
  return out


def validate(cfg: DraftConfig, tcfg: TargetConfig, *, path: str = "?"):
  """Check the draft against its target. Raises ValueError naming the draft and the field."""
  if cfg.d_model != tcfg.d_model:
    raise ValueError(f"{path}: draft hidden_size={cfg.d_model} does not match the target "
                     f"embedding_length={tcfg.d_model}")
  if cfg.n_vocab != tcfg.n_vocab:
    raise ValueError(f"{path}: draft vocab_size={cfg.n_vocab} does not match the target vocab "
                     f"({tcfg.n_vocab} rows in token_embd)")
  ids = list(cfg.target_layer_ids)
  dup = sorted({i for i in ids if ids.count(i) > 1})
  if dup:       # valid for the math (z-lab concatenates them as listed), but rarely meant
    warnings.warn(f"{path}: target_layer_ids {ids} repeats layer(s) {dup}: their features are "
                  f"concatenated twice, as the config lists them", stacklevel=3)
  bad = [i for i in cfg.target_layer_ids if not 0 <= i < tcfg.n_layer]
  if bad:
    raise ValueError(f"{path}: target_layer_ids {list(cfg.target_layer_ids)} has ids {bad} outside "
                     f"the target's {tcfg.n_layer} layers")
  if not 0 <= cfg.mask_token_id < tcfg.n_vocab:
    raise ValueError(f"{path}: mask_token_id={cfg.mask_token_id} is outside the target vocab")


def load(draft_dir: str, tcfg: TargetConfig, *, variants: tuple[str, ...] = DRAFT_ARCHITECTURES
         ) -> tuple[DraftConfig, draft_lib.DraftParams]:
  """Read a draft directory (config.json + model.safetensors, or the shards a
  model.safetensors.index.json lists) and validate it against tcfg.

  variants: the architectures the caller runs (DraftConfig.from_json); a DFlash-2 draft's
  codebooks are read under z-lab's names or the `.weight` form transformers' save_pretrained
  writes.
  Raises FileNotFoundError for missing files, ValueError for a mismatch or a bad tensor.
  """

  cfg_path = os.path.join(draft_dir, "config.json")
  st_path = os.path.join(draft_dir, "model.safetensors")
  if not os.path.isfile(st_path) and os.path.isfile(st_path + ".index.json"):
    st_path += ".index.json"           # sharded (transformers' save_pretrained above its shard size)
  for p in (cfg_path, st_path):
    if not os.path.isfile(p):
      raise FileNotFoundError(f"draft file not found: {p}")
  try:
    with open(cfg_path, encoding="utf-8") as fh:
      raw = json.load(fh)
  except (ValueError, OSError) as e:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise ValueError(f"{cfg_path}: not a readable JSON file: {e}") from None
  cfg = DraftConfig.from_json(raw, path=cfg_path, variants=variants)
  validate(cfg, tcfg, path=draft_dir)
  arrays = {}
  for shard in shard_paths(st_path):
    try:
      arrays.update(load_safetensors(shard))
    except Exception as e:
      raise ValueError(f"{shard}: cannot read safetensors (truncated or corrupt?): {e}") from e
  for key in (SELECTOR_KEYS["pred"], SELECTOR_KEYS["succ"]):
    if cfg.dflash2 is not None and key not in arrays and key + ".weight" in arrays:
      arrays[key] = arrays.pop(key + ".weight")
  expected = expected_shapes(cfg, tcfg.d_model)
  if cfg.dspark is not None:
    for key in DSPARK_SHIPPED:
      if key in arrays:
        if tuple(arrays[key].shape) != (cfg.n_vocab, cfg.d_model):
          raise ValueError(f"{st_path}: tensor {key!r} has shape {tuple(arrays[key].shape)}, "
                           f"expected {(cfg.n_vocab, cfg.d_model)} (the target's vocab x hidden)")
        del arrays[key]       # the target's own embedding / lm_head are used
  unused = sorted(set(arrays) - set(expected))
  if unused:
    raise ValueError(f"{st_path}: tensor {unused[0]!r} is used by no layer of this "
                     f"{cfg.n_layer}-layer {cfg.variant} ({len(unused)} such tensors; another "
                     f"draft variant, or more layers than num_hidden_layers?)")
  for key, shape in expected.items():
    if key not in arrays:
      raise ValueError(f"{st_path}: missing tensor {key!r}")
    if tuple(arrays[key].shape) != shape:
      raise ValueError(f"{st_path}: tensor {key!r} has shape {tuple(arrays[key].shape)}, "
                       f"expected {shape}")
    if arrays[key].dtype not in FLOAT_DTYPES:
      raise ValueError(f"{st_path}: tensor {key!r} has dtype {arrays[key].dtype}; a DFlash draft "
                       f"is read from float32 / float16 / bfloat16 tensors (quantized drafts are "
                       f"not supported)")
  return cfg, params_from_arrays(arrays, cfg)


def _float_dtypes():
  import ml_dtypes
  return frozenset(np.dtype(t) for t in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16))


FLOAT_DTYPES = _float_dtypes()      # the safetensors dtypes a draft's float tensors may have


def shard_paths(st_path: str) -> list[str]:
  """[st_path], or for a `model.safetensors.index.json` the shard files its weight_map names (in
  its directory). Raises ValueError naming the index when it is unreadable or names a missing
  shard."""
  if not st_path.endswith(".index.json"):
    return [st_path]
  try:
    with open(st_path, encoding="utf-8") as fh:
      shards = sorted(set(json.load(fh)["weight_map"].values()))
  except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
    raise ValueError(f"{st_path}: not a readable safetensors index (weight_map): {e!r}") from None
  paths = [os.path.join(os.path.dirname(st_path), str(s)) for s in shards]
  missing = [p for p in paths if not os.path.isfile(p)]
  if missing:
    raise ValueError(f"{st_path}: shard {missing[0]} is missing")
  return paths


def load_safetensors(path: str) -> dict[str, np.ndarray]:
  """Load with safetensors' numpy API; bf16 tensors come back as ml_dtypes.bfloat16."""
  from safetensors import safe_open
  out = {}
  with safe_open(path, framework="flax") as f:
    for k in f.keys():
      out[k] = np.asarray(f.get_tensor(k))
  return out



def config_for_target(tcfg: TargetConfig, *, n_layer: int = 1, n_features: int = 3,
                      block_size: int = 16, mask_token_id: int = 0) -> DraftConfig:
  """A draft config shaped after the target (its attention/FFN sizes, z-lab default layer ids):
  the starting point for training a new draft, and for tests. A MoE target's draft gets a dense
  FFN as wide as what one token runs (n_expert_used routed experts plus the shared one)."""
  d_ff = tcfg.d_ff or tcfg.n_expert_used * tcfg.d_ff_exp + tcfg.d_ff_shexp
  ids = default_target_layer_ids(tcfg.n_layer, n_features)
  if len(set(ids)) < len(ids) or not all(0 <= i < tcfg.n_layer for i in ids):
    # z-lab's spacing over [1, n-3] breaks down below ~5 target layers (e.g. [1, -1, -3] for 2):
    # the distinct in-range layers instead
    ids = sorted({min(max(i, 0), tcfg.n_layer - 1) for i in ids})
  return DraftConfig(
      d_model=tcfg.d_model, n_layer=n_layer, n_head=tcfg.n_head, n_kv_head=tcfg.n_kv_head,
      head_dim=tcfg.head_dim, d_ff=d_ff, n_vocab=tcfg.n_vocab, rms_eps=tcfg.rms_eps,
      rope_theta=tcfg.rope_theta, block_size=block_size, mask_token_id=mask_token_id,
      target_layer_ids=tuple(ids),
      sliding=(False,) * n_layer)


def init_params(key: jax.Array, cfg: DraftConfig, d_target: int, *, std: float = 0.02,
                weight_fmt: str = "bf16", out_norm: Optional[np.ndarray] = None) -> draft_lib.DraftParams:
  """Random draft (matrices N(0, std^2), norms 1): a starting point for training and for tests.
  DFlash-2 parts as `_dflash2_init` (identity convolutions, a small selector).

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
  if cfg.dflash2 is not None:
    arrays.update(_dflash2_init(key, cfg))
  if out_norm is not None:
    out_norm = np.asarray(out_norm, np.float32)
    if out_norm.shape != (cfg.d_model,):
      raise ValueError(f"init_params: out_norm shape {out_norm.shape} != ({cfg.d_model},)")
    arrays["norm.weight"] = out_norm
  return params_from_arrays(arrays, cfg, weight_fmt=weight_fmt)


def save(out_dir: str, params: draft_lib.DraftParams, cfg: DraftConfig, *,
         extra: Optional[dict] = None):
  """Write a z-lab format draft: config.json + model.safetensors (bf16, z-lab key names), each
  written to a temporary file first and renamed. extra: stored under config.json "dflash_jax"."""
  import ml_dtypes
  arrays = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16)
            for k, v in params_to_arrays(params).items()}
  write_checkpoint(out_dir, arrays, cfg.to_json(), extra)


def write_checkpoint(out_dir: str, arrays: dict[str, np.ndarray], conf: dict,
                     extra: Optional[dict] = None):
  """Write a draft directory: model.safetensors (`arrays` as given) and config.json (`conf`, with
  `extra` under "dflash_jax" when given), each to a temporary file first and renamed, so a reader
  never sees a half-written checkpoint. Used by `save` and `eagle3.save`."""
  from safetensors.numpy import save_file
  os.makedirs(out_dir, exist_ok=True)
  tmp = os.path.join(out_dir, "model.safetensors.tmp")
  save_file(arrays, tmp, metadata={"format": "pt"})
  os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
  conf = dict(conf, dflash_jax=extra) if extra else dict(conf)
  tmp = os.path.join(out_dir, "config.json.tmp")
  with open(tmp, "w") as fh:
    json.dump(conf, fh, indent=2)
  os.replace(tmp, os.path.join(out_dir, "config.json"))


def resize_depth(params: draft_lib.DraftParams, cfg: DraftConfig, n_layer: int, *,
                 weight_fmt: str = "f32") -> tuple[DraftConfig, draft_lib.DraftParams]:
  """A DFlash-1 draft with n_layer layers made from a trained one (for a depth study, or to
  grow a draft without starting over). Fewer layers keep the first n_layer (the final norm and
  fc unchanged); more append copies of the last layer whose output projections
  (self_attn.o_proj, mlp.down_proj) are zero, so each new layer starts as the identity on the
  residual stream and the grown draft computes exactly what the trained one did (depth
  up-scaling; the copies' other weights give the new layers' gradients a trained start).
  Returns (cfg, params) with matrices in weight_fmt. Raises ValueError for n_layer < 1, a
  DFlash-2 draft, or a draft whose layers do not all share one attention type."""
  if n_layer < 1:
    raise ValueError(f"resize_depth: n_layer={n_layer} must be >= 1")
  if cfg.dflash2 is not None:
    raise ValueError("resize_depth: DFlash-1 drafts only")
  if len(set(cfg.sliding)) > 1:
    raise ValueError(f"resize_depth: mixed layer types {cfg.sliding}: which type a new layer "
                     "takes is ambiguous")
  arrays = params_to_arrays(params)
  last = _layer_keys(cfg.n_layer - 1)
  for i in range(cfg.n_layer, n_layer):
    for n, key in _layer_keys(i).items():
      a = np.asarray(arrays[last[n]])
      arrays[key] = np.zeros_like(a) if n in ("wo", "down") else a.copy()
  cfg = dataclasses.replace(cfg, n_layer=n_layer, sliding=(cfg.sliding[0],) * n_layer)
  return cfg, params_from_arrays(arrays, cfg, weight_fmt=weight_fmt)


def _dflash2_init(key: jax.Array, cfg: DraftConfig) -> dict[str, np.ndarray]:
  """Starting values of a DFlash-2 draft's own tensors: every convolution the identity (static
  tap 0 = 1, other taps 0, kernel_projection 0: no dynamic taps yet), the selector's
  hidden_projection 0 and its codebooks N(0, 0.1^2). So a fresh DFlash-2 draft computes exactly
  what its DFlash-1 weights compute, and every new tensor still gets a gradient (each is one
  factor of a product whose other factors are nonzero). The z-lab package leaves base_kernel
  uninitialised (torch.empty) and ships no training code."""
  f = cfg.dflash2
  out = {}
  taps = 2 * f.conv_kernel * cfg.d_model // f.conv_group
  for i in range(cfg.n_layer):
    k = _dflash2_keys(i)
    for side in ("attn", "mlp"):
      base = np.zeros((2, f.conv_kernel, cfg.d_model), np.float32)
      base[:, 0] = 1.0
      out[k[side + "_base"]] = base
      out[k[side + "_proj"]] = np.zeros((taps, cfg.d_model), np.float32)
  out[SELECTOR_KEYS["sel_proj"]] = np.zeros((f.selector_rank, cfg.d_model), np.float32)
  for name, kk in zip(("pred", "succ"), jax.random.split(key)):
    out[SELECTOR_KEYS[name]] = np.asarray(
        0.1 * jax.random.normal(kk, (cfg.n_vocab, f.selector_rank), jnp.float32))
  return out


def dflash2_config(cfg: DraftConfig, *, conv_kernel: int = 3, conv_group: int = 64,
                   selector_rank: int = 32, selector_top_k: int = 8,
                   output_multiplier: float = 1.0, softcap: float = 0.0,
                   input_embedding_scale: float = 1.0) -> DraftConfig:
  """A DFlash-2 config with cfg's shapes (a DFlash-1 config, e.g. config_for_target's or a
  loaded draft's): the block keeps cfg's masks (causal exactly on its sliding layers, the
  package's default when `is_causal` is absent). Raises ValueError naming the field when
  conv_group does not divide hidden_size or a size is out of range."""
  from dflash_jax.config import DFlash2Fields
  for name, v, lo, hi in (("conv_kernel", conv_kernel, 1, cfg.block_size),
                          ("conv_group", conv_group, 1, cfg.d_model),
                          ("selector_rank", selector_rank, 1, cfg.d_model),
                          ("selector_top_k", selector_top_k, 1, cfg.n_vocab)):
    if not lo <= v <= hi:
      raise ValueError(f"dflash2_config: {name}={v} out of range [{lo}, {hi}]")
  if cfg.d_model % conv_group:
    raise ValueError(f"dflash2_config: conv_group={conv_group} must divide hidden_size="
                     f"{cfg.d_model}")
  return dataclasses.replace(cfg, dflash2=DFlash2Fields(
      conv_kernel=conv_kernel, conv_group=conv_group, selector_rank=selector_rank,
      selector_top_k=selector_top_k, output_multiplier=float(output_multiplier),
      softcap=float(softcap), input_embedding_scale=float(input_embedding_scale),
      causal=tuple(cfg.sliding)))


def upgrade_to_dflash2(key: jax.Array, params: draft_lib.DraftParams, cfg2: DraftConfig, *,
                       weight_fmt: str = "f32") -> draft_lib.DraftParams:
  """DFlash-1 params -> DFlash-2 params for cfg2 (`dflash2_config` of their config): the shared
  tensors kept, the convolutions and selector from `_dflash2_init` (identity convolutions), so
  training starts from exactly what the DFlash-1 draft proposes (its logits, and a pairwise
  term of zero)."""
  arrays = {k: np.asarray(v, np.float32) for k, v in params_to_arrays(params).items()}
  arrays.update(_dflash2_init(key, cfg2))
  missing = set(expected_shapes(cfg2, arrays["fc.weight"].shape[1] // cfg2.n_features)) - set(arrays)
  if missing:
    raise ValueError(f"upgrade_to_dflash2: no values for {sorted(missing)[:3]}")
  return params_from_arrays(arrays, cfg2, weight_fmt=weight_fmt)
