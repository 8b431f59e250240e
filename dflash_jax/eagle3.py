"""EAGLE-3 drafts (arXiv:2503.01840): an autoregressive one-layer draft over three target layers.

The draft most serving engines ship (vLLM, SGLang, TensorRT-LLM; the DFlash paper's baseline is
RedHatAI/Qwen3-8B-speculator.eagle3), read from the two checkpoint formats in use:
  - speculators (vLLM's `Eagle3Speculator`, `speculators_model_type` "eagle3"): config.json with a
    `transformer_layer_config` (llama or qwen3), keys `layers.0.*`;
  - EAGLE / SpecForge (`LlamaForCausalLMEagle3`): a flat Llama config, keys `midlayer.*`.
Both store `fc.weight`, `norm.weight`, `lm_head.weight` (over a reduced draft vocabulary) and, when
that vocabulary is smaller than the target's, `d2t` (draft id -> target id offsets) and `t2d`.

Math, as the speculators package's `Eagle3DraftModel` (speculators/models/eagle3/core.py,
model_definitions.py) and vLLM's `llama_eagle3.py` compute it, for the token x_q at position q
and the target's residual streams a_{q-1} of position q - 1 entering the configured layers
(`eagle_aux_hidden_state_layer_ids`, vLLM's default (2, n/2, n-3); id i is HF's hidden_states[i],
the output of decoder layer i - 1, `target_layer_ids` here):

    g_{q-1} = fc([a^1 ; a^2 ; a^3])                 # [3 Dt] -> [D] (norm_before_fc / fc_norm: RMSNorms first)
    x       = [rms(embed(x_q)) * input_layernorm ; rms(g) * hidden_norm]          # [2D]
    h       = r + o_proj(attn(x))                   # r = g, or rms(g) * hidden_norm (norm_before_residual)
    o       = h + mlp(rms(h) * post_attention_layernorm)
    logits of x_{q+1} = lm_head(rms(o) * norm)      # [Vd]; draft id i is target id i + d2t[i]

Its KV row q holds the pair (x_q, g_{q-1}), kept like the target's MTP block's (mtp.py) in a
one-layer `draft.DraftCache` whose rows follow the target's positions: a commit of T tokens at
`start` writes rows start.. (`commit_rows`) and keeps g of the last kept token as the row's pending
state (`DecodeState.mtp_h`). Row 0 (x_0 has no predecessor) is never attended to: vLLM and the
speculators trainer pair x_{q} with a_{q-1} from q = 1 on (its positions are ours minus one, which
RoPE does not see). A step drafts D tokens (`propose`): step j feeds (t_j, g_j) at position
start + j, t_0 = the bonus token, g_0 = the pending g, then t_j = step j-1's token and g_j = its o
(rms(o) * norm with norm_output, EAGLE 3.1). Logits are scattered into the target vocabulary
(-inf outside the draft's), so the chain / DDTree construction and sampled verification are the
usual ones, and lossless.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import draft_io, layers, mtp
from dflash_jax import target as target_lib
from dflash_jax.config import MAX_DIM, MAX_LAYERS, TargetConfig, Fields
from dflash_jax.draft import DraftCache
from dflash_jax.quants import QuantWeight, take_rows
from dflash_jax.runtime import Runtime
from dflash_jax.target_params import AttnParams, FFNParams, TargetParams

SPECULATORS = ("Eagle3Speculator", "Eagle3DraftModel")   # vLLM speculators' architecture names
LEGACY = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")   # EAGLE / SpecForge
DEFAULT_STEPS = 3        # draft tokens per step when the config names none (vLLM's usual 3)
MAX_STEPS = 15
LAYER_TYPES = ("llama", "qwen3")
ROPE_TYPES = ("default", "llama3")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """An EAGLE-3 draft's static description, in the place of a DFlash `DraftConfig`
  (decode.Plan.dcfg; the fields the decode loop reads from a draft config are here too).

  Attributes:
    layer: the draft layer's TargetConfig (arch "llama" or "qwen3", one layer, d_model D, its
      heads, RoPE and eps); its n_vocab is the draft vocabulary Vd.
    target_layer_ids: target layers whose outputs are the aux features (HF ids minus one).
    aux_ids: the ids as the checkpoint names them (eagle_aux_hidden_state_layer_ids).
    n_vocab: the target's vocabulary V (logits are scattered into it).
    block_size: 1 + draft tokens per decode step (the default a DecodeConfig without block_size
      gets: the checkpoint's speculative_tokens + 1).
    norm_before_residual, norm_before_fc, fc_norm, norm_output: the speculators config flags.
  """

  layer: TargetConfig
  target_layer_ids: tuple[int, ...]
  aux_ids: tuple[int, ...]
  n_vocab: int
  block_size: int = DEFAULT_STEPS + 1
  norm_before_residual: bool = False
  norm_before_fc: bool = False
  fc_norm: bool = False
  norm_output: bool = False
  dflash2 = None                           # never a DFlash-2 selector
  dspark = None                            # nor a DSpark Markov head
  sliding_window = 0
  sliding = (False,)
  n_layer = 1                              # one context layer: the draft layer's own K/V

  @property
  def d_model(self) -> int:
    return self.layer.d_model

  @property
  def n_kv_head(self) -> int:
    return self.layer.n_kv_head

  @property
  def head_dim(self) -> int:
    return self.layer.head_dim


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Eagle3Params:
  """An EAGLE-3 draft's weights (host arrays until device_put).

  Attributes:
    fc: [D, F*Dt] fc.weight (F aux layers of the target's width Dt).
    fc_in_norm: [F*Dt] float32 input_norm.weight (norm_before_fc) or None.
    fc_norms: [F, Dt] float32 fc_norm.{i}.weight (fc_norm) or None.
    embed_norm, hidden_norm: [D] float32 input_layernorm / hidden_norm of the draft layer.
    layer: the layer's attention (q/k/v over [2D], o_proj; qwen3's q/k norms) and MLP
      (post_attention_layernorm, gate/up, down); AttnParams.norm is None (the two halves of the
      input are normed separately).
    norm: [D] float32 the final norm.
    lm_head: [Vd, D].
    vocab: [Vd] int32 target id of each draft id (i + d2t[i]), or None (Vd = V, the identity).
    embed: [V, D] the checkpoint's embed_tokens, or None: the target's token_embd.
    rope_freqs: [Dh/2] float32 frequency divisors (llama3 rope scaling) or None.
  """

  fc: QuantWeight
  fc_in_norm: Optional[jax.Array]
  fc_norms: Optional[jax.Array]
  embed_norm: jax.Array
  hidden_norm: jax.Array
  layer: AttnParams
  norm: jax.Array
  lm_head: QuantWeight
  vocab: Optional[jax.Array] = None
  embed: Optional[QuantWeight] = None
  rope_freqs: Optional[jax.Array] = None


# ----------------------------------------------------------------------------- loading

def read_config(draft_dir: str) -> Optional[dict]:
  """The directory's config.json when it describes an EAGLE-3 draft (either format), else None.
  Raises ValueError naming the file when it is not readable JSON."""
  path = os.path.join(draft_dir, "config.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as fh:
      raw = json.load(fh)
  except (ValueError, OSError) as e:
    raise ValueError(f"{path}: not a readable JSON file: {e}") from None
  if not isinstance(raw, Mapping):
    return None
  arch = raw.get("architectures") or []
  if (raw.get("speculators_model_type") == "eagle3"
      or any(a in SPECULATORS + LEGACY for a in arch)):
    return dict(raw)
  return None


def llama3_freq_factors(head_dim: int, theta: float, rope: Mapping[str, Any],
                        path: str) -> np.ndarray:
  """Divisors of the RoPE frequencies for rope_type "llama3" (transformers'
  `_compute_llama3_parameters`; llama.cpp's converter writes the same as `rope_freqs.weight`):
  [head_dim/2] float32, inv_freq / inv_freq_llama3. Raises ValueError naming the file and field."""
  f = Fields(rope, path, "EAGLE-3 rope field")
  factor = f.number("factor", 0.0, 1e6)
  low = f.number("low_freq_factor", 0.0, 1e6)
  high = f.number("high_freq_factor", 0.0, 1e6)
  old = f.number("original_max_position_embeddings", 0.0, 1e9)
  if not high > low:
    f.fail("high_freq_factor", high, f"must exceed low_freq_factor={low}")
  inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > old / low, inv / factor, inv)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  scaled = np.where(medium, smoothed, scaled)
  return (inv / scaled).astype(np.float32)


def _layer_config(raw: dict, path: str) -> tuple[dict, str]:
  """(the draft layer's HF config dict, its model_type) for either format."""
  if (raw.get("speculators_model_type")
      or any(a in SPECULATORS for a in raw.get("architectures") or [])):
    lc = raw.get("transformer_layer_config")
    if not isinstance(lc, Mapping):
      raise ValueError(f"{path}: an EAGLE-3 speculators config needs a transformer_layer_config "
                       f"object")
    return dict(lc), str(lc.get("model_type", "llama"))
  return raw, str(raw.get("model_type", "llama"))


def config_from_json(raw: dict, tcfg: TargetConfig, *, path: str = "?") -> Eagle3Config:
  """Parse an EAGLE-3 config.json (speculators or EAGLE / SpecForge format) and check it against
  the target. Raises ValueError naming the file and field: an unsupported layer type, rope
  scaling, activation or depth, a hidden size or vocabulary that does not match the target, aux
  layer ids outside it."""
  lc, model_type = _layer_config(raw, path)
  f = Fields(lc, path, "EAGLE-3 layer config field")
  top = Fields(raw, path, "EAGLE-3 config field")
  if model_type not in LAYER_TYPES:
    f.fail("model_type", model_type, f"supported draft layers: {', '.join(LAYER_TYPES)}")
  n_layer = f.int("num_hidden_layers", 1, MAX_LAYERS, default=1)
  if n_layer != 1:
    f.fail("num_hidden_layers", n_layer, "one draft layer is supported (the EAGLE-3 drafts "
           "published so far have one)")
  if lc.get("hidden_act", "silu") != "silu":
    f.fail("hidden_act", lc.get("hidden_act"), "only 'silu' (SwiGLU) is supported")
  if lc.get("mlp_bias"):
    f.fail("mlp_bias", lc.get("mlp_bias"), "MLP biases are not supported")
  d = f.int("hidden_size", 1, MAX_DIM)
  n_head, n_kv = f.heads("num_attention_heads", "num_key_value_heads")
  head_dim = f.int("head_dim", 2, MAX_DIM, default=max(d // n_head, 2))
  if head_dim % 2:
    f.fail("head_dim", head_dim, "must be even (RoPE rotates pairs)")
  rope = lc.get("rope_parameters") or lc.get("rope_scaling") or {}
  if not isinstance(rope, Mapping):
    f.fail("rope_scaling", rope, "expected an object")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    f.fail("rope_scaling", dict(rope), f"rope_type {rope_type!r} is not supported "
           f"({', '.join(ROPE_TYPES)})")
  if lc.get("rope_theta") is not None:
    theta = f.number("rope_theta", 0.0, 1e30)
  else:
    theta = Fields(rope, path, "EAGLE-3 rope field").number("rope_theta", 0.0, 1e30,
                                                             default=10000.0)
  v = f.int("vocab_size", 1, 1 << 24)
  if v != tcfg.n_vocab:
    f.fail("vocab_size", v, f"does not match the target vocab ({tcfg.n_vocab} rows in token_embd)")
  vd = top.int("draft_vocab_size", 1, v, default=v)
  dt = top.int("target_hidden_size", 1, MAX_DIM, default=d)
  if dt != tcfg.d_model:
    raise ValueError(f"{path}: the draft reads target hidden states of width {dt} "
                     f"(target_hidden_size / hidden_size); the target's embedding_length is "
                     f"{tcfg.d_model}")
  key = "eagle_aux_hidden_state_layer_ids"
  src = raw
  if raw.get(key) is None and isinstance(raw.get("eagle_config"), Mapping):   # SpecForge
    src = raw["eagle_config"]
  n = tcfg.n_layer
  aux = src.get(key)
  if aux is None:
    aux_ids = (2, n // 2, n - 3)                # vLLM's and the speculators package's default
  else:
    aux_ids = Fields(src, path, "EAGLE-3 config field").int_list(key, 0, MAX_LAYERS)
  if (not aux_ids or min(aux_ids) < 1 or max(aux_ids) > n
      or list(aux_ids) != sorted(set(aux_ids))):
    raise ValueError(f"{path}: eagle_aux_hidden_state_layer_ids {list(aux_ids)}"
                     f"{' (the default for this target)' if aux is None else ''} must be "
                     f"increasing ids in [1, {n}] for a target of {n} layers (id i: the "
                     f"hidden state entering layer i; 0, the embedding output, is not read)")
  steps = DEFAULT_STEPS
  sc = raw.get("speculators_config")
  methods = (sc.get("proposal_methods") if isinstance(sc, Mapping) else None) or []
  if (isinstance(methods, list) and methods and isinstance(methods[0], Mapping)
      and methods[0].get("speculative_tokens")):
    steps = Fields(methods[0], path, "EAGLE-3 proposal field").int("speculative_tokens", 1,
                                                                    MAX_STEPS)
  flags = {k: bool(raw.get(k, False)) for k in ("norm_before_residual", "norm_before_fc",
                                                 "fc_norm", "norm_output")}
  if flags["norm_before_fc"] and flags["fc_norm"]:
    top.fail("fc_norm", True, "norm_before_fc and fc_norm exclude each other")
  layer = TargetConfig(
      arch=model_type, n_layer=1, d_model=d, d_ff=f.int("intermediate_size", 1, 1 << 20),
      n_vocab=vd, n_head=n_head, n_kv_head=n_kv, head_dim=head_dim, v_head_dim=head_dim,
      rope_dim=head_dim, rope_theta=theta, rope_style="neox",
      rms_eps=f.number("rms_norm_eps", 0.0, 1.0, default=1e-6),
      qk_norm=model_type == "qwen3", attn_gate=False, recurrent=(False,),
      has_rope_freqs=rope_type == "llama3")
  return Eagle3Config(layer=layer, target_layer_ids=tuple(i - 1 for i in aux_ids),
                      aux_ids=tuple(aux_ids), n_vocab=v, block_size=steps + 1, **flags)


def _keys(cfg: Eagle3Config, prefix: str, bias: bool) -> dict[str, tuple[int, ...]]:
  """Every tensor the draft reads -> its shape (prefix: "layers.0." or "midlayer.")."""
  lc = cfg.layer
  d, h, hkv, dh = lc.d_model, lc.n_head, lc.n_kv_head, lc.head_dim
  shapes = {
      "norm.weight": (d,), "lm_head.weight": (lc.n_vocab, d),
      prefix + "input_layernorm.weight": (d,), prefix + "hidden_norm.weight": (d,),
      prefix + "post_attention_layernorm.weight": (d,),
      prefix + "self_attn.q_proj.weight": (h * dh, 2 * d),
      prefix + "self_attn.k_proj.weight": (hkv * dh, 2 * d),
      prefix + "self_attn.v_proj.weight": (hkv * dh, 2 * d),
      prefix + "self_attn.o_proj.weight": (d, h * dh),
      prefix + "mlp.gate_proj.weight": (lc.d_ff, d), prefix + "mlp.up_proj.weight": (lc.d_ff, d),
      prefix + "mlp.down_proj.weight": (d, lc.d_ff)}
  if lc.qk_norm:
    shapes[prefix + "self_attn.q_norm.weight"] = (dh,)
    shapes[prefix + "self_attn.k_norm.weight"] = (dh,)
  if bias:
    for x, n in (("q", h * dh), ("k", hkv * dh), ("v", hkv * dh)):
      shapes[prefix + f"self_attn.{x}_proj.bias"] = (n,)
  return shapes


def load(draft_dir: str, tcfg: TargetConfig, raw: Optional[dict] = None, *,
         weight_fmt: str = "bf16") -> tuple[Eagle3Config, Eagle3Params]:
  """Read an EAGLE-3 draft directory (config.json + model.safetensors or its shards) and check
  it against the target. raw: its parsed config.json (`read_config`), read here when None.
  Matrices keep `weight_fmt` ("bf16" / "f32"). Raises FileNotFoundError, or ValueError naming
  the file and the field or tensor (a missing, misshapen or unused tensor, a d2t that maps
  outside the target vocabulary or twice onto one id, a pytorch_model.bin-only checkpoint)."""
  cfg_path = os.path.join(draft_dir, "config.json")
  raw = raw if raw is not None else read_config(draft_dir)
  if raw is None:
    raise ValueError(f"{cfg_path}: not an EAGLE-3 config (architectures "
                     f"{' / '.join(SPECULATORS + LEGACY)})")
  cfg = config_from_json(raw, tcfg, path=cfg_path)
  st_path = os.path.join(draft_dir, "model.safetensors")
  if not os.path.isfile(st_path) and os.path.isfile(st_path + ".index.json"):
    st_path += ".index.json"
  if not os.path.isfile(st_path):
    bin_path = os.path.join(draft_dir, "pytorch_model.bin")
    if os.path.isfile(bin_path):
      raise ValueError(f"{bin_path}: pickled PyTorch weights are not read; save the draft as "
                       f"safetensors (e.g. torch.load + safetensors.torch.save_file)")
    raise FileNotFoundError(f"draft file not found: {st_path}")
  arrays = {}
  for shard in draft_io.shard_paths(st_path):
    try:
      arrays.update(draft_io.load_safetensors(shard))
    except Exception as e:
      raise ValueError(f"{shard}: cannot read safetensors (truncated or corrupt?): {e}") from e
  prefix = "midlayer." if any(k.startswith("midlayer.") for k in arrays) else "layers.0."
  bias = any(k.endswith("_proj.bias") for k in arrays)
  expected = _keys(cfg, prefix, bias)
  n_aux, d, v, vd = len(cfg.target_layer_ids), cfg.d_model, cfg.n_vocab, cfg.layer.n_vocab
  expected["fc.weight"] = (d, n_aux * tcfg.d_model)
  optional = {"embed_tokens.weight": (v, d), "d2t": (vd,), "t2d": (v,)}
  if cfg.norm_before_fc:
    expected["input_norm.weight"] = (n_aux * tcfg.d_model,)
  if cfg.fc_norm:
    for i in range(n_aux):
      expected[f"fc_norm.{i}.weight"] = (tcfg.d_model,)
  if vd != v:
    expected["d2t"] = (vd,)
  for key, shape in {**expected, **optional}.items():
    if key not in arrays:
      if key in expected:
        raise ValueError(f"{st_path}: missing tensor {key!r}"
                         f"{' (draft_vocab_size < vocab_size needs the d2t map)' if key == 'd2t' else ''}")
      continue
    if tuple(arrays[key].shape) != shape:
      raise ValueError(f"{st_path}: tensor {key!r} has shape {tuple(arrays[key].shape)}, "
                       f"expected {shape}")
    ints = key in ("d2t", "t2d")
    if not ints and arrays[key].dtype not in draft_io.FLOAT_DTYPES:
      raise ValueError(f"{st_path}: tensor {key!r} has dtype {arrays[key].dtype}; EAGLE-3 weights "
                       f"are read from float32 / float16 / bfloat16 tensors")
  unused = sorted(set(arrays) - set(expected) - set(optional) - {"verifier_norm.weight",
                                                                  "verifier_lm_head.weight"})
  if unused:
    raise ValueError(f"{st_path}: tensor {unused[0]!r} is used by no part of this EAGLE-3 draft "
                     f"({len(unused)} such tensors; more layers than num_hidden_layers, or "
                     f"another format?)")
  vocab = None
  if "d2t" in arrays and vd != v:
    d2t = np.asarray(arrays["d2t"])
    if not np.issubdtype(d2t.dtype, np.integer):
      raise ValueError(f"{st_path}: tensor 'd2t' has dtype {d2t.dtype}; expected integer offsets")
    ids = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
    if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != vd:
      raise ValueError(f"{st_path}: tensor 'd2t' maps draft ids outside the target vocabulary "
                       f"[0, {v}) or two draft ids onto one target id")
    if "t2d" in arrays:
      t2d = np.asarray(arrays["t2d"]).astype(bool)
      if t2d.sum() != vd or not t2d[ids].all():
        raise ValueError(f"{st_path}: tensors 't2d' and 'd2t' disagree (t2d marks "
                         f"{int(t2d.sum())} ids, d2t maps {vd})")
    vocab = ids.astype(np.int32)
  mat, vec = draft_io.readers(arrays, weight_fmt)

  p = prefix + "self_attn."
  layer = AttnParams(
      norm=None,
      qkv=layers.Projections.separate([mat(p + f"{x}_proj.weight") for x in "qkv"]),
      wo=mat(p + "o_proj.weight"),
      q_norm=vec(p + "q_norm.weight") if cfg.layer.qk_norm else None,
      k_norm=vec(p + "k_norm.weight") if cfg.layer.qk_norm else None,
      ffn=FFNParams(norm=vec(prefix + "post_attention_layernorm.weight"),
                    gate_up=layers.Projections.separate([mat(prefix + "mlp.gate_proj.weight"),
                                                         mat(prefix + "mlp.up_proj.weight")]),
                    down=mat(prefix + "mlp.down_proj.weight")),
      qkv_bias=(tuple(vec(p + f"{x}_proj.bias") for x in "qkv") if bias else None))
  rope_freqs = None
  if cfg.layer.has_rope_freqs:
    lc, _ = _layer_config(raw, cfg_path)
    rope_freqs = llama3_freq_factors(cfg.head_dim, cfg.layer.rope_theta,
                                     lc.get("rope_parameters") or lc.get("rope_scaling"), cfg_path)
  params = Eagle3Params(
      fc=mat("fc.weight"),
      fc_in_norm=vec("input_norm.weight") if cfg.norm_before_fc else None,
      fc_norms=(np.stack([vec(f"fc_norm.{i}.weight") for i in range(n_aux)])
                if cfg.fc_norm else None),
      embed_norm=vec(prefix + "input_layernorm.weight"),
      hidden_norm=vec(prefix + "hidden_norm.weight"), layer=layer, norm=vec("norm.weight"),
      lm_head=mat("lm_head.weight"), vocab=vocab,
      embed=mat("embed_tokens.weight") if "embed_tokens.weight" in arrays else None,
      rope_freqs=rope_freqs)
  if params.embed is None and d != tcfg.d_model:
    raise ValueError(f"{st_path}: no embed_tokens.weight, and the target's embedding "
                     f"({tcfg.d_model} wide) does not fit a draft of hidden_size {d}")
  return cfg, params


# ----------------------------------------------------------------------------- math

def fuse_features(ep: Eagle3Params, cfg: Eagle3Config, feats: jax.Array, eps: float,
                  rt: Runtime) -> jax.Array:
  """g = fc(aux features): feats [T, F*Dt] (the target layers' outputs, concatenated in
  target_layer_ids order) -> [T, D] float32 (RMSNorms first with norm_before_fc / fc_norm)."""
  x = feats.astype(jnp.float32)
  if ep.fc_in_norm is not None:
    x = layers.rms_norm(x, ep.fc_in_norm, eps)
  if ep.fc_norms is not None:
    t, n = x.shape[0], ep.fc_norms.shape[0]
    x = layers.rms_norm(x.reshape(t, n, -1), ep.fc_norms, eps).reshape(t, -1)
  return layers.linear(x, ep.fc, rt)


def _inputs(ep: Eagle3Params, cfg: Eagle3Config, embed: QuantWeight, tokens: jax.Array,
            g: jax.Array):
  """The layer's attention input [T, 2D] = [rms(embed(tokens)) * input_layernorm ; rms(g) *
  hidden_norm] and its residual [T, D] (g, or its normed form with norm_before_residual)."""
  eps = cfg.layer.rms_eps
  e = take_rows(ep.embed if ep.embed is not None else embed, tokens).astype(jnp.float32)
  hn = layers.rms_norm(g.astype(jnp.float32), ep.hidden_norm, eps)
  x = jnp.concatenate([layers.rms_norm(e, ep.embed_norm, eps), hn], axis=-1)
  return x, (hn if cfg.norm_before_residual else g.astype(jnp.float32))


def _qkv(ep: Eagle3Params, cfg: Eagle3Config, x: jax.Array, pos: jax.Array, rt: Runtime):
  return target_lib.attn_heads(x, ep.layer, cfg.layer, pos, ep.rope_freqs, rt)


def commit_rows(ep: Eagle3Params, tparams: TargetParams, cfg: Eagle3Config, tokens: jax.Array,
                feats: jax.Array, g_pending: jax.Array, start: jax.Array, n_keep: jax.Array,
                rt: Runtime) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The draft's K/V rows of T committed tokens at positions start..start+T-1 (a prefill chunk,
  or a verify's accepted path) and the row's next pending state: row q pairs tokens[q - start]
  with g of position q - 1 (g_pending [D] for the first row, then the tokens' own from feats
  [T, F*Dt], their aux features). n_keep: [] int32 tokens kept. Returns (k, v [1, T, Hkv, Dh]
  float32 post-RoPE, the DraftCache.write layout; g of the last kept token [D])."""
  g = fuse_features(ep, cfg, feats, cfg.layer.rms_eps, rt)
  x, _ = _inputs(ep, cfg, tparams.embed, tokens, jnp.concatenate([g_pending[None], g[:-1]]))
  pos = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
  _, k, v, _ = _qkv(ep, cfg, x, pos, rt)
  return k[None], v[None], g[n_keep - 1]


def to_target_vocab(ep: Eagle3Params, logits: jax.Array, n_vocab: int) -> jax.Array:
  """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., n_vocab] float32 (-inf
  at the ids the draft cannot propose; the identity when the vocabularies are one)."""
  logits = logits.astype(jnp.float32)
  if ep.vocab is None:
    return logits
  full = jnp.full(logits.shape[:-1] + (n_vocab,), -jnp.inf, jnp.float32)
  return full.at[..., ep.vocab].set(logits)


def step(ep: Eagle3Params, tparams: TargetParams, cfg: Eagle3Config, token: jax.Array,
         g: jax.Array, j: jax.Array, start: jax.Array, cache: DraftCache, bk: jax.Array,
         bv: jax.Array, rt: Runtime):
  """One draft step: feed (token [] int32, g [D]) at position start + j, attending to the cache
  rows 1..start-1 and the step rows bk / bv [n, Hkv, Dh] of slots < j (this step's own K/V is
  written at slot j). Returns (logits [V] float32 over the target vocabulary, -inf off the
  draft's; the g the next step feeds [D]; bk, bv with slot j written)."""
  lc = cfg.layer
  visible = (jnp.arange(cache.k.shape[-2]) >= 1)[None]      # row 0 pairs x_0 with nothing
  x, res = _inputs(ep, cfg, tparams.embed, token[None], g[None])
  q, k, v, _ = _qkv(ep, cfg, x, (start + j)[None], rt)
  o, bk, bv = mtp.attend_step(q, k, v, j, start, cache, bk, bv, rt, mask=visible)
  h = res + target_lib.attn_out(o, None, ep.layer, rt)
  h = h + target_lib.ffn(layers.rms_norm(h, ep.layer.ffn.norm, lc.rms_eps), ep.layer.ffn, lc, rt)
  normed = layers.rms_norm(h, ep.norm, lc.rms_eps)
  logits = to_target_vocab(ep, layers.linear(normed, ep.lm_head, rt)[0], cfg.n_vocab)
  return logits, (normed[0] if cfg.norm_output else h[0]), bk, bv


def propose(ep: Eagle3Params, tparams: TargetParams, cfg: Eagle3Config, bonus: jax.Array,
            start: jax.Array, g_pending: jax.Array, cache: DraftCache, rt: Runtime,
            n: int, draw=None):
  """n draft rows after the bonus token at position `start` (the committed length), as
  `mtp.propose`: step j (`step`) feeds (t_j, g_j) at position start + j (t_0 = bonus, g_0 =
  g_pending [D]; then t_j = the token step j-1 chose, g_j = its layer output, normed with
  norm_output), attending to the cache rows 1..start-1 and steps 0..j. The cache is only read.

  draw: None: each step chooses its argmax; returns logits [n, V] float32 over the target
  vocabulary (-inf outside the draft's). Or a function (logits [V] float32, step j [] int32) ->
  (token [] int32, q [V] float32); returns (tokens [n] int32, q [n, V] float32)."""
  return mtp.chain_steps(lambda tok, g, j, bk, bv: step(ep, tparams, cfg, tok, g, j, start, cache,
                                                        bk, bv, rt),
                         bonus, g_pending, (n, cfg.n_kv_head, cfg.head_dim), draw)


# ----------------------------------------------------------------------------- training

def config_json(tcfg: TargetConfig, *, d_ff: Optional[int] = None, draft_tokens: int = DEFAULT_STEPS,
                aux_ids: Optional[tuple[int, ...]] = None, draft_vocab_size: Optional[int] = None,
                norm_before_residual: bool = True, norm_before_fc: bool = True,
                verifier: str = "") -> dict:
  """The speculators-format config.json (a dict) of a fresh one-layer EAGLE-3 draft for this
  target, as `save` writes it and `config_from_json` reads it: hidden size, heads and RoPE theta
  the target's (so the draft reads the target's token embedding, never stored), a llama layer
  (qwen3 for a target with q/k norms), d_ff (default the target's), aux ids (HF convention, default
  vLLM's (2, n/2, n-3)), draft_vocab_size (default the whole vocabulary), speculative_tokens =
  draft_tokens. norm_before_residual / norm_before_fc: the speculators flags (both on by default:
  the residual and the fc input are normed, which keeps a short training run stable whatever the
  scale of the target's residual streams). Raises ValueError for an invalid size (via
  `config_from_json`)."""
  n = tcfg.n_layer
  lc = {"model_type": "qwen3" if tcfg.qk_norm else "llama", "num_hidden_layers": 1,
        "hidden_size": tcfg.d_model, "intermediate_size": int(d_ff or tcfg.d_ff),
        "num_attention_heads": tcfg.n_head, "num_key_value_heads": tcfg.n_kv_head,
        "head_dim": tcfg.head_dim, "hidden_act": "silu", "rms_norm_eps": float(tcfg.rms_eps),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(tcfg.rope_theta)},
        "vocab_size": tcfg.n_vocab, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False}
  raw = {"architectures": [SPECULATORS[1]], "speculators_model_type": "eagle3",
         "speculators_config": {
             "algorithm": "eagle3", "default_proposal_method": "greedy",
             "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft_tokens,
                                   "verifier_accept_k": 1, "accept_tolerance": 0.0}],
             "verifier": {"architectures": [], "name_or_path": verifier or None}},
         "draft_vocab_size": int(draft_vocab_size or tcfg.n_vocab),
         "eagle_aux_hidden_state_layer_ids": list(aux_ids or (2, n // 2, n - 3)),
         "target_hidden_size": tcfg.d_model, "embed_requires_grad": False,
         "tie_word_embeddings": False, "norm_before_residual": bool(norm_before_residual),
         "norm_before_fc": bool(norm_before_fc), "fc_norm": False, "norm_output": False,
         "transformer_layer_config": lc}
  config_from_json(raw, tcfg, path="<new EAGLE-3 draft>")
  return raw


def init_params(key: jax.Array, cfg: Eagle3Config, tparams: TargetParams, vocab: np.ndarray,
                *, std: float = 0.02, norm_scale: float = 0.1) -> Eagle3Params:
  """Fresh float32 weights of a draft for `config_json`'s config: matrices N(0, std) (HF's
  initializer_range), norms one, the lm_head the target's output rows of the draft vocabulary
  `vocab` ([Vd] int32 target ids, sorted) and the final norm norm_scale x the target's output
  norm (the draft reads out through the target's own head, starting with soft logits; 0: ones,
  as the DFlash trainer's --init_norm_scale). Returns Eagle3Params with vocab None (the
  trainer passes the vocabulary beside the trainable weights; `save` writes it as d2t)."""
  from dflash_jax.quants import dequantize
  lc = cfg.layer
  d, h, hkv, dh = lc.d_model, lc.n_head, lc.n_kv_head, lc.head_dim
  n_aux = len(cfg.target_layer_ids)
  d_t = tparams.out_norm.shape[0]
  shapes = {"fc": (d, n_aux * d_t), "q": (h * dh, 2 * d), "k": (hkv * dh, 2 * d),
            "v": (hkv * dh, 2 * d), "o": (d, h * dh), "gate": (lc.d_ff, d), "up": (lc.d_ff, d),
            "down": (d, lc.d_ff)}
  keys = dict(zip(shapes, jax.random.split(key, len(shapes))))
  m = {n: QuantWeight(np.asarray(std * jax.random.normal(keys[n], s, jnp.float32)), "f32", s)
       for n, s in shapes.items()}
  ones = lambda n: np.ones((n,), np.float32)
  head = np.asarray(dequantize(tparams.lm_head, jnp.float32))[np.asarray(vocab)]
  layer = AttnParams(
      norm=None, qkv=layers.Projections.separate([m["q"], m["k"], m["v"]]), wo=m["o"],
      q_norm=ones(dh) if lc.qk_norm else None, k_norm=ones(dh) if lc.qk_norm else None,
      ffn=FFNParams(norm=ones(d), gate_up=layers.Projections.separate([m["gate"], m["up"]]),
                    down=m["down"]),
      qkv_bias=None)
  return Eagle3Params(
      fc=m["fc"], fc_in_norm=ones(n_aux * d_t) if cfg.norm_before_fc else None,
      fc_norms=np.ones((n_aux, d_t), np.float32) if cfg.fc_norm else None,
      embed_norm=ones(d), hidden_norm=ones(d), layer=layer,
      norm=(norm_scale * np.asarray(tparams.out_norm, np.float32) if norm_scale > 0
            else np.ones((d,), np.float32)),
      lm_head=QuantWeight(head.astype(np.float32), "f32", head.shape))


def params_to_arrays(ep: Eagle3Params, vocab: np.ndarray, n_vocab: int) -> dict[str, np.ndarray]:
  """The speculators-format tensors of a one-layer draft (`layers.0.*`, fc / norm / lm_head,
  d2t and t2d when the draft vocabulary `vocab` [Vd] is smaller than n_vocab) as host float32
  arrays (int64 d2t, bool t2d), the inverse of `load`."""
  dense = lambda w: np.asarray(w.data, np.float32)
  q, k, v = ep.layer.qkv.member_weights()
  gate, up = ep.layer.ffn.gate_up.member_weights()
  p = "layers.0."
  out = {"fc.weight": dense(ep.fc), "norm.weight": np.asarray(ep.norm, np.float32),
         "lm_head.weight": dense(ep.lm_head),
         p + "input_layernorm.weight": np.asarray(ep.embed_norm, np.float32),
         p + "hidden_norm.weight": np.asarray(ep.hidden_norm, np.float32),
         p + "post_attention_layernorm.weight": np.asarray(ep.layer.ffn.norm, np.float32),
         p + "self_attn.q_proj.weight": dense(q), p + "self_attn.k_proj.weight": dense(k),
         p + "self_attn.v_proj.weight": dense(v), p + "self_attn.o_proj.weight": dense(ep.layer.wo),
         p + "mlp.gate_proj.weight": dense(gate), p + "mlp.up_proj.weight": dense(up),
         p + "mlp.down_proj.weight": dense(ep.layer.ffn.down)}
  if ep.layer.q_norm is not None:
    out[p + "self_attn.q_norm.weight"] = np.asarray(ep.layer.q_norm, np.float32)
    out[p + "self_attn.k_norm.weight"] = np.asarray(ep.layer.k_norm, np.float32)
  if ep.fc_in_norm is not None:
    out["input_norm.weight"] = np.asarray(ep.fc_in_norm, np.float32)
  if ep.fc_norms is not None:
    for i, w in enumerate(np.asarray(ep.fc_norms, np.float32)):
      out[f"fc_norm.{i}.weight"] = w
  vocab = np.asarray(vocab, np.int64)
  if vocab.size != n_vocab:
    out["d2t"] = vocab - np.arange(vocab.size, dtype=np.int64)
    t2d = np.zeros(n_vocab, bool)
    t2d[vocab] = True
    out["t2d"] = t2d
  return out


def save(out_dir: str, ep: Eagle3Params, raw: dict, vocab: np.ndarray, n_vocab: int, *,
         extra: Optional[dict] = None):
  """Write a speculators-format EAGLE-3 draft: config.json (`raw`, from `config_json`; extra
  stored under "dflash_jax") + model.safetensors (bf16 weights, int64 d2t, bool t2d), each
  written to a temporary file and renamed. `load` (and vLLM's speculators reader) reads it."""
  import ml_dtypes
  arrays = {k: (a if k in ("d2t", "t2d") else a.astype(ml_dtypes.bfloat16))
            for k, a in params_to_arrays(ep, vocab, n_vocab).items()}
  draft_io.write_checkpoint(out_dir, arrays, raw, extra)


def ttt_hidden(ep: Eagle3Params, tparams: TargetParams, cfg: Eagle3Config, tokens: jax.Array,
               feats: jax.Array, n_steps: int, rt: Runtime) -> jax.Array:
  """Training-time test (EAGLE-3's TTT, as the speculators and SpecForge trainers unroll it):
  every position q of a sequence starts a chain at once, and step j of each chain runs what
  `propose` runs at start = q with the true tokens forced (t_j = tokens[q + j]): its input is
  (tokens[q + j], the previous step's output; g_{q-1} for step 0) at position q + j, and it
  attends to the step-0 rows of positions 1..q (the committed rows; row 0 has no predecessor)
  and to its own chain's rows of steps 1..j. Step 0 is the committed rows' own pass.

  tokens: [T + n_steps] int32 (the sequence, padded: step j reads tokens[j:j + T]); feats:
  [T, F*Dt] float32 the target's aux features (`target_layer_ids`). Returns [n_steps, T, D]
  float32, the normed outputs whose lm_head rows are step j's logits of tokens[q + j + 1]."""
  lc = cfg.layer
  t = feats.shape[0]
  g = fuse_features(ep, cfg, feats, lc.rms_eps, rt)
  h = jnp.concatenate([jnp.zeros_like(g[:1]), g[:-1]])            # g_{q-1}
  pos = jnp.arange(t, dtype=jnp.int32)
  ok = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= 1)        # [T(query), T(key)]
  hkv, grp, dh = lc.n_kv_head, lc.n_head // lc.n_kv_head, lc.head_dim
  hi = jax.lax.Precision.HIGHEST
  outs, diag_k, diag_v = [], [], []
  for j in range(n_steps):
    x, res = _inputs(ep, cfg, tparams.embed, tokens[j:j + t], h)
    q, k, v, _ = _qkv(ep, cfg, x, pos + j, rt)
    q = q.reshape(t, hkv, grp, dh) * (dh ** -0.5)
    if j == 0:
      k0, v0 = k, v
    else:
      diag_k.append(k)
      diag_v.append(v)
    s = jnp.einsum("tgrd,sgd->tgrs", q, k0, precision=hi)
    s = jnp.where(ok[:, None, None], s, -1e30)                     # finite: row 0 sees nothing
    sd = [jnp.einsum("tgrd,tgd->tgr", q, kd, precision=hi)[..., None] for kd in diag_k]
    p = jax.nn.softmax(jnp.concatenate([s] + sd, axis=-1), axis=-1)
    o = jnp.einsum("tgrs,sgd->tgrd", p[..., :t], v0, precision=hi)
    for i, vd in enumerate(diag_v):
      o = o + p[..., t + i, None] * vd[:, :, None]
    hh = res + target_lib.attn_out(o.reshape(t, lc.n_head, dh), None, ep.layer, rt)
    hh = hh + target_lib.ffn(layers.rms_norm(hh, ep.layer.ffn.norm, lc.rms_eps), ep.layer.ffn,
                             lc, rt)
    normed = layers.rms_norm(hh, ep.norm, lc.rms_eps)
    outs.append(normed)
    h = normed if cfg.norm_output else hh
  return jnp.stack(outs)
