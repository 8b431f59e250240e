"""Frozen, hashable configs: TargetConfig (from GGUF metadata), DraftConfig (from z-lab config.json),
DecodeConfig (decode-loop shapes and options). All are static jit arguments. How the math runs
(kernels, dtypes) is `runtime.Runtime`."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Optional

import jax

SUPPORTED_ARCHS = ("qwen35", "qwen35moe", "qwen3next", "llama", "qwen2", "qwen3", "qwen3moe")
MOE_ARCHS = ("qwen35moe", "qwen3next", "qwen3moe")
HYBRID_ARCHS = ("qwen35", "qwen35moe", "qwen3next")
# Sane bounds for model sizes read from files (far above any released model; a corrupt or hostile
# value fails here with the key named instead of as a huge allocation or a division by zero).
MAX_DIM = 1 << 20
MAX_LAYERS = 4096
MAX_CTX = 1 << 24


def _int_problem(v: Any, lo: int, hi: int | None) -> str | None:
  """Why v is not an integer (bools excluded) in [lo, hi] (no upper bound when hi is None), or
  None when it is."""
  if isinstance(v, bool) or not isinstance(v, numbers.Integral):
    return "expected an integer"
  if v < lo or (hi is not None and v > hi):
    return f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}"
  return None


def _is_finite_real(v: Any) -> bool:
  """A finite real number (bools excluded)."""
  return not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v)


class Fields:
  """Typed, bounded reads of a metadata mapping (GGUF metadata or config.json). Errors name the
  file and the key: "{path}: {what} {key}={value!r}: ..."."""

  def __init__(self, src: Mapping[str, Any], path: str, what: str, prefix: str = ""):
    self.src, self.path, self.what, self.prefix = src, path, what, prefix

  def raw(self, key: str, default: Any = None):
    full = self.prefix + key
    if full in self.src and self.src[full] is not None:
      return self.src[full]
    if default is None:
      raise ValueError(f"{self.path}: missing {self.what} {full!r}")
    return default

  def fail(self, key: str, value: Any, msg: str):
    raise ValueError(f"{self.path}: {self.what} {self.prefix + key}={value!r}: {msg}")

  def int(self, key: str, lo: int, hi: int, default: Any = None) -> int:
    v = self.raw(key, default)
    problem = _int_problem(v, lo, hi)
    if problem:
      self.fail(key, v, problem)
    return int(v)

  def number(self, key: str, lo: float, hi: float, default: Any = None) -> float:
    """A finite real number in (lo, hi]."""
    v = self.raw(key, default)
    if not _is_finite_real(v) or not lo < v <= hi:
      self.fail(key, v, f"must be a finite number in ({lo}, {hi}]")
    return float(v)

  def heads(self, key: str, kv_key: str) -> tuple[int, int]:
    """(query heads, KV heads): the KV heads default to the query heads and must divide them."""
    n = self.int(key, 1, MAX_DIM)
    kv = self.int(kv_key, 1, n, default=n)
    if n % kv:
      self.fail(kv_key, kv, f"must divide {key}={n}")
    return n, kv

  def int_list(self, key: str, lo: int, hi: int, default: Any = None) -> tuple[int, ...]:
    v = self.raw(key, default)
    if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__iter__"):
      self.fail(key, v, "expected a list of integers")
    v = list(v)
    if any(_int_problem(x, lo, hi) for x in v):
      self.fail(key, v, f"expected a list of integers in [{lo}, {hi}]")
    return tuple(int(x) for x in v)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TargetConfig:
  """Target model hyper-parameters, every value read from GGUF metadata.

  Attributes:
    arch: GGUF `general.architecture` (one of SUPPORTED_ARCHS).
    n_layer: trunk layers (`block_count - nextn_predict_layers`; MTP blocks excluded).
    d_model, d_ff, n_vocab: embedding width, FFN width, vocabulary rows.
    n_head, n_kv_head, head_dim, v_head_dim: softmax-attention heads (`attention.key_length`/`value_length`).
    rope_dim: rotated dims per head (`rope.dimension_count`); rope_theta: `rope.freq_base`.
    rope_style: "neox" (pairs (i, i + rope_dim/2); the qwen architectures) or "norm" (adjacent
      pairs; llama, whose q/k rows llama.cpp's converter permutes).
    rms_eps: `attention.layer_norm_rms_epsilon`.
    qk_norm: per-head RMSNorm of q and k (qwen3, qwen3moe, qwen35, qwen35moe).
    attn_gate: `attn_q` packs per head [query | gate] and the output is multiplied by sigmoid(gate) (qwen35).
    recurrent: [n_layer] True = Gated DeltaNet layer, False = softmax attention.
    gdn_n_k_head, gdn_n_v_head, gdn_d_k, gdn_d_v, conv_kernel: Gated DeltaNet shapes (`ssm.*`);
      V head h reads K head h % gdn_n_k_head (llama.cpp's tiled layout for qwen35 / qwen35moe, whose
      converter reorders the V heads), or h // (gdn_n_v_head / gdn_n_k_head) with gdn_grouped.
    gdn_grouped: qwen3next (Qwen3-Next-80B-A3B): V heads in the checkpoint's grouped order (each K
      head's V heads next to each other; llama.cpp src/models/qwen3next.cpp, transformers
      Qwen3NextGatedDeltaNet's repeat_interleave).
    n_ctx_train: `context_length`.
    has_rope_freqs: a `rope_freqs.weight` tensor divides the RoPE frequencies (llama 3.x).
    n_expert, n_expert_used: routed experts per layer and experts each token uses (`expert_count`,
      `expert_used_count`; 0 for a dense FFN). qwen35moe / qwen3moe (llama.cpp
      src/models/qwen35moe.cpp, qwen3moe.cpp): softmax router over `ffn_gate_inp`, top
      n_expert_used, weights renormalised to sum 1, then scaled by expert_weights_scale when that
      is neither 0 nor 1 (`expert_weights_scale`).
    d_ff_exp, d_ff_shexp: a routed expert's and the shared expert's FFN width
      (`expert_feed_forward_length`, `expert_shared_feed_forward_length`; llama.cpp's defaults
      d_ff / n_expert_used and d_ff); d_ff_shexp 0: no shared expert (qwen3moe).
    n_nextn: multi-token-prediction (MTP / NextN) blocks stored after the trunk
      (`nextn_predict_layers`; Qwen3.5 files converted with MTP have 1, at block n_layer): the
      built-in draft of `mtp.py`.
  """

  arch: str
  n_layer: int
  d_model: int
  d_ff: int
  n_vocab: int
  n_head: int
  n_kv_head: int
  head_dim: int
  v_head_dim: int
  rope_dim: int
  rope_theta: float
  rope_style: str
  rms_eps: float
  qk_norm: bool
  attn_gate: bool
  recurrent: tuple[bool, ...]
  gdn_n_k_head: int = 0
  gdn_grouped: bool = False
  gdn_n_v_head: int = 0
  gdn_d_k: int = 0
  gdn_d_v: int = 0
  conv_kernel: int = 0
  n_ctx_train: int = 0
  has_rope_freqs: bool = False
  n_expert: int = 0
  n_expert_used: int = 0
  d_ff_exp: int = 0
  d_ff_shexp: int = 0
  expert_weights_scale: float = 0.0
  n_nextn: int = 0

  @property
  def moe(self) -> bool:
    """Routed-expert FFN in every layer (qwen35moe, qwen3moe)."""
    return self.n_expert > 0

  @property
  def attn_layers(self) -> tuple[int, ...]:
    return tuple(i for i, r in enumerate(self.recurrent) if not r)

  @property
  def gdn_layers(self) -> tuple[int, ...]:
    return tuple(i for i, r in enumerate(self.recurrent) if r)

  @property
  def conv_dim(self) -> int:
    """Channels of the GDN causal conv: [Q (Hk*Dk) | K (Hk*Dk) | V (Hv*Dv)]."""
    return 2 * self.gdn_n_k_head * self.gdn_d_k + self.gdn_n_v_head * self.gdn_d_v

  @classmethod
  def from_gguf(cls, meta: Mapping[str, Any], *, n_vocab: int, path: str = "?",
                has_rope_freqs: bool = False) -> "TargetConfig":
    """Build from GGUF metadata (`GGUFReader.fields[k].contents()` values).

    Raises ValueError naming the file and key for an unsupported architecture, a missing key,
    or a value of the wrong type or out of range (zero heads, an odd rope.dimension_count, ...).
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
      raise ValueError(f"{path}: unsupported architecture general.architecture={arch!r}; "
                       f"supported: {', '.join(SUPPORTED_ARCHS)}")

    m = Fields(meta, path, "GGUF metadata key", prefix=f"{arch}.")
    n_block = m.int("block_count", 1, MAX_LAYERS)
    n_nextn = m.int("nextn_predict_layers", 0, n_block - 1, default=0)
    n_layer = n_block - n_nextn
    d_model = m.int("embedding_length", 1, MAX_DIM)
    n_head, n_kv_head = m.heads("attention.head_count", "attention.head_count_kv")
    head_dim = m.int("attention.key_length", 1, MAX_DIM, default=max(d_model // n_head, 1))
    rope_dim = m.int("rope.dimension_count", 2, head_dim, default=head_dim)
    if rope_dim % 2:
      m.fail("rope.dimension_count", rope_dim, "must be even (RoPE rotates pairs)")
    moe = {}
    if arch in MOE_ARCHS:
      n_expert = m.int("expert_count", 1, MAX_DIM)
      n_used = m.int("expert_used_count", 1, n_expert)
      d_ff = m.int("feed_forward_length", 0, MAX_DIM, default=0)
      moe = dict(n_expert=n_expert, n_expert_used=n_used,
                 d_ff_exp=m.int("expert_feed_forward_length", 1, MAX_DIM,
                                default=d_ff // n_used or None),
                 d_ff_shexp=(m.int("expert_shared_feed_forward_length", 1, MAX_DIM,
                                   default=d_ff or None) if arch in ("qwen35moe", "qwen3next")
                             else 0),
                 expert_weights_scale=m.number("expert_weights_scale", -1e30, 1e30, default=0.0))
    else:
      d_ff = m.int("feed_forward_length", 1, MAX_DIM)
    common = dict(
        arch=arch, n_layer=n_layer, d_model=d_model, d_ff=d_ff,
        n_vocab=int(n_vocab), n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
        v_head_dim=m.int("attention.value_length", 1, MAX_DIM, default=head_dim),
        rope_dim=rope_dim, rope_theta=m.number("rope.freq_base", 0.0, 1e30, default=10000.0),
        rms_eps=m.number("attention.layer_norm_rms_epsilon", 0.0, 1.0),
        n_ctx_train=m.int("context_length", 0, 1 << 40, default=0),
        has_rope_freqs=has_rope_freqs, n_nextn=n_nextn, **moe)
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe"):
      return cls(**common, rope_style="norm" if arch == "llama" else "neox",
                 qk_norm=arch in ("qwen3", "qwen3moe"), attn_gate=False,
                 recurrent=(False,) * n_layer)
    # qwen35 / qwen35moe / qwen3next: hybrid Gated DeltaNet + gated attention.
    rec = meta.get(f"{arch}.attention.recurrent_layers")
    if rec is not None and len(rec):
      if len(rec) < n_layer:
        m.fail("attention.recurrent_layers", f"<{len(rec)} entries>",
               f"needs one entry per layer ({n_layer})")
      recurrent = tuple(bool(x) for x in list(rec)[:n_layer])
    else:
      every = m.int("full_attention_interval", 1, MAX_LAYERS, default=4)
      recurrent = tuple((i + 1) % every != 0 for i in range(n_layer))
    n_v = m.int("ssm.time_step_rank", 1, MAX_DIM)
    n_k = m.int("ssm.group_count", 1, n_v)
    if n_v % n_k:
      m.fail("ssm.time_step_rank", n_v, f"must be a multiple of ssm.group_count={n_k}")
    inner = m.int("ssm.inner_size", n_v, MAX_DIM)
    if inner % n_v:
      m.fail("ssm.inner_size", inner, f"must be a multiple of ssm.time_step_rank={n_v}")
    return cls(**common, rope_style="neox", qk_norm=True, attn_gate=True, recurrent=recurrent,
               gdn_grouped=arch == "qwen3next",
               gdn_n_k_head=n_k, gdn_n_v_head=n_v, gdn_d_k=m.int("ssm.state_size", 1, MAX_DIM),
               gdn_d_v=inner // n_v, conv_kernel=m.int("ssm.conv_kernel", 1, 64))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
  """z-lab `build_target_layer_ids` (dflash/model.py): evenly spread layers in [1, n-3]."""
  if num_draft_layers == 1:
    return [num_target_layers // 2]
  start, end = 1, num_target_layers - 3
  span = end - start
  return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


DRAFT_ARCHITECTURES = ("DFlashDraftModel",)
DFLASH2 = "DFlash2DraftModel"
DSPARK = "Qwen3DSparkModel"
MARKOV_HEADS = ("vanilla", "gated", "rnn")
# Config fields of other draft variants (DFlash-2: z-lab's DFlash2DraftModel) -> the values that
# mean "off", i.e. what the DFlash-1 forward computes. Any other value is refused.
_DRAFT_FIELDS_OFF = {
    "is_causal": (None, False), "output_multiplier": (None, 1, 1.0),
    "final_logit_softcapping": (None, 0, 0.0), "attn_logit_softcapping": (None, 0, 0.0),
    "input_embedding_scale": (None, 1, 1.0), "attention_bias": (None, False),
    "hidden_act": (None, "silu"), "mlp_bias": (None, False),
}
_DRAFT_PREFIXES_OFF = ("conv_", "selector_")
# DeepSpec's DSpark fields (deepspec/modeling/dspark/qwen3/config.py); a DFlash-1 config with any
# of them at a value that turns a head on is refused (its forward would ignore the head).
_DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head",
                  "confidence_head_with_markov")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DFlash2Fields:
  """What a DFlash-2 draft (z-lab `DFlash2DraftModel`, PyPI `dflash` 0.1.0 dflash/model.py) adds
  to DFlash-1, read from `dflash_config`, then the top level, then the package's default.

  Attributes:
    conv_kernel: K, taps of the grouped dynamic causal convolutions (K-1 look-back block rows).
    conv_group: G, channels per dynamic-tap group (D / G groups).
    selector_rank: R, rank of the candidate selector's codebooks.
    selector_top_k: k, candidates per block row.
    output_multiplier: logits = lm_head(h) * output_multiplier.
    softcap: `final_logit_softcapping` (0: none): logits = cap * tanh(logits / cap).
    input_embedding_scale: block embeddings are multiplied by it.
    causal: [n_layer] causal mask inside the block per layer (`is_causal` for every layer when
      present, else the sliding layers only).
  """

  conv_kernel: int
  conv_group: int
  selector_rank: int
  selector_top_k: int
  output_multiplier: float
  softcap: float
  input_embedding_scale: float
  causal: tuple[bool, ...]


def _dflash2_fields(cfg, dfl: "Fields", top: "Fields", d_model: int, n_vocab: int,
                    sliding: tuple[bool, ...]) -> DFlash2Fields:
  g = dfl.int("conv_group_size", 1, d_model)
  if d_model % g:
    dfl.fail("conv_group_size", g, f"must divide hidden_size={d_model}")
  causal = cfg.get("is_causal")
  if causal is not None and not isinstance(causal, bool):
    top.fail("is_causal", causal, "expected a bool or absent")
  return DFlash2Fields(
      conv_kernel=dfl.int("conv_kernel_size", 1, MAX_BLOCK_SIZE), conv_group=g,
      selector_rank=dfl.int("selector_rank", 1, MAX_DIM),
      selector_top_k=dfl.int("selector_top_k", 1, n_vocab),
      output_multiplier=dfl.number("output_multiplier", 0.0, 1e30, default=1.0),
      softcap=(0.0 if dfl.src.get("final_logit_softcapping") in (None, 0)
               else dfl.number("final_logit_softcapping", 0.0, 1e30)),
      input_embedding_scale=dfl.number("input_embedding_scale", 0.0, 1e30, default=1.0),
      causal=tuple(sliding) if causal is None else (causal,) * len(sliding))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DSparkFields:
  """What a DeepSeek DSpark draft (DeepSpec `Qwen3DSparkModel`,
  deepspec/modeling/dspark/qwen3/modeling.py; DSpark paper, Cheng et al. 2026) adds to the
  DFlash-1 backbone, read from its config.json top level.

  The block is anchor-first: slot j of [anchor, MASK x (L-1)] predicts position anchor+1+j (in
  z-lab's DFlash slot 0 predicts nothing and slot j predicts anchor+j).

  Attributes:
    markov_rank: r, rank of the Markov head (0: none: DeepSpec's DFlash configuration).
    markov_head: "vanilla" (bias = W2 W1[prev]), "gated" (W2 (g * W1[prev]), g =
      sigmoid(gate([h; W1[prev]]))) or "rnn" (a GRU-like state over the block's slots); None
      when markov_rank is 0 (markov_head.py).
    confidence: the block has a confidence head (`enable_confidence_head`): per slot a logit of
      the probability that the chain is accepted up to it.
    confidence_with_markov: the confidence head reads [h; W1[prev]] (else h alone).
  """

  markov_rank: int
  markov_head: Optional[str]
  confidence: bool
  confidence_with_markov: bool


def _dspark_fields(top: "Fields") -> DSparkFields:
  rank = top.int("markov_rank", 0, MAX_DIM, default=0)
  head = None
  if rank:
    head = top.raw("markov_head_type")
    if head not in MARKOV_HEADS:
      top.fail("markov_head_type", head, f"expected one of {list(MARKOV_HEADS)} with "
               f"markov_rank={rank}")
  conf = top.raw("enable_confidence_head", False)
  with_markov = top.raw("confidence_head_with_markov", False) if conf else False
  for k, v in (("enable_confidence_head", conf), ("confidence_head_with_markov", with_markov)):
    if not isinstance(v, bool):
      top.fail(k, v, "expected a bool")
  if with_markov and not rank:
    top.fail("confidence_head_with_markov", True, "needs a Markov head (markov_rank > 0)")
  return DSparkFields(markov_rank=rank, markov_head=head, confidence=conf,
                      confidence_with_markov=with_markov)


def _check_variant(cfg: Mapping[str, Any], dfc: Mapping[str, Any], path: str,
                   variants: tuple[str, ...] = DRAFT_ARCHITECTURES):
  """Refuse a draft variant or a config value the DFlash-1 forward does not implement (the
  draft would propose garbage with no error): `architectures` other than DFlashDraftModel
  (absent: DFlash-1), the fields of `_DRAFT_FIELDS_OFF` at other values, conv_* / selector_*
  fields (DFlash-2's grouped convolutions and candidate selector). ValueError naming the file
  and the field."""
  arch = cfg.get("architectures")
  if arch == [DFLASH2] and DFLASH2 in variants:
    for k in ("attention_bias", "hidden_act", "mlp_bias", "attn_logit_softcapping"):
      for where, fields in (("dflash_config.", dfc), ("", cfg)):
        if k in fields and fields[k] not in _DRAFT_FIELDS_OFF[k]:
          raise ValueError(f"{path}: {where}{k}={fields[k]!r} is not implemented by the "
                           f"DFlash-2 draft forward")
    return
  dspark = arch == [DSPARK] and DSPARK in variants
  if arch is not None and not dspark:
    if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in DRAFT_ARCHITECTURES:
      named = arch if isinstance(arch, list) else [arch]
      extra = next((f" ({v} drafts are read by api.load_draft, which runs them; this caller "
                    f"does not)" for v in (DFLASH2, DSPARK) if v in named), "")
      raise ValueError(f"{path}: architectures={arch!r} is not a supported draft variant; "
                       f"supported: {list(DRAFT_ARCHITECTURES)}{extra}")
  if not dspark:
    for k in _DSPARK_FIELDS:
      if cfg.get(k) not in (None, 0, False):
        raise ValueError(f"{path}: {k}={cfg[k]!r} belongs to a DSpark draft (architectures "
                         f"[{DSPARK!r}]); the DFlash-1 draft forward has no such head")
  for where, fields in (("dflash_config.", dfc), ("", cfg)):
    for k, v in fields.items():
      if k in _DRAFT_FIELDS_OFF and v not in _DRAFT_FIELDS_OFF[k]:
        raise ValueError(f"{path}: {where}{k}={v!r} is not implemented by the DFlash-1 draft "
                         f"forward (supported: {[x for x in _DRAFT_FIELDS_OFF[k] if x is not None]}"
                         f" or absent)")
      if k.startswith(_DRAFT_PREFIXES_OFF) and v is not None:
        raise ValueError(f"{path}: {where}{k}={v!r} belongs to another draft variant (DFlash-2 "
                         f"convolutions / candidate selector), not implemented here")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DraftConfig:
  """z-lab DFlash draft (a Qwen3 config plus `dflash_config`), see dflash/model.py.

  Attributes:
    d_model, n_layer, n_head, n_kv_head, head_dim, d_ff, n_vocab, rms_eps: Qwen3 fields.
    rope_theta: `rope_theta` or `rope_parameters.rope_theta`.
    block_size: L, tokens per draft block incl. the bonus slot.
    mask_token_id: id (in the target vocab) whose embedding fills the L-1 masked slots.
    target_layer_ids: target layers whose outputs are concatenated into the draft context.
    sliding: [n_layer] True where `layer_types` says "sliding_attention" (causal + window in the block).
    sliding_window: window for sliding layers (tokens; 0 = unwindowed).
    dflash2: DFlash2Fields for a `DFlash2DraftModel` (read only when the caller accepts that
      variant, `from_json(variants=...)`), None for DFlash-1.
    dspark: DSparkFields for a DeepSpec `Qwen3DSparkModel` (likewise), None otherwise.
  """

  d_model: int
  n_layer: int
  n_head: int
  n_kv_head: int
  head_dim: int
  d_ff: int
  n_vocab: int
  rms_eps: float
  rope_theta: float
  block_size: int
  mask_token_id: int
  target_layer_ids: tuple[int, ...]
  sliding: tuple[bool, ...]
  sliding_window: int = 0
  dflash2: Optional[DFlash2Fields] = None
  dspark: Optional[DSparkFields] = None

  @property
  def n_features(self) -> int:
    return len(self.target_layer_ids)

  @property
  def variant(self) -> str:
    """The architecture: "DFlashDraftModel", "DFlash2DraftModel" or "Qwen3DSparkModel"."""
    if self.dspark is not None:
      return DSPARK
    return DFLASH2 if self.dflash2 is not None else DRAFT_ARCHITECTURES[0]

  @classmethod
  def from_json(cls, cfg: Mapping[str, Any], *, path: str = "?",
                variants: tuple[str, ...] = DRAFT_ARCHITECTURES) -> "DraftConfig":
    """Parse a z-lab config.json dict; every DFlash field is read from `dflash_config` first,
    then from the top level (as the dflash package's `_draft_value` does).

    variants: the architectures the caller runs (DFlash-1 by default; add DFLASH2 to read a
    DFlash-2 config's conv / selector / logit fields into `dflash2`).
    Raises ValueError naming the file when a field is missing or invalid, or the variant (or a
    field's value) is one the caller does not run.
    """
    if not isinstance(cfg, Mapping):
      raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    dfc = cfg.get("dflash_config") or {}
    if not isinstance(dfc, Mapping):
      raise ValueError(f"{path}: dflash_config must be a JSON object, got {type(dfc).__name__}")
    top = Fields(cfg, path, "draft config field")
    _check_variant(cfg, dfc, path, variants)
    # DFlash fields: dflash_config first, then the top level.
    dfl = Fields({**{k: v for k, v in cfg.items() if v is not None},
                   **{k: v for k, v in dfc.items() if v is not None}}, path, "draft config field")
    n_layer = top.int("num_hidden_layers", 1, MAX_LAYERS)
    d_model = top.int("hidden_size", 1, MAX_DIM)
    n_head, n_kv_head = top.heads("num_attention_heads", "num_key_value_heads")
    rope = cfg.get("rope_parameters")
    if cfg.get("rope_theta") is not None:
      rope_theta = top.number("rope_theta", 0.0, 1e30)
    elif isinstance(rope, Mapping) and "rope_theta" in rope:
      rope_theta = Fields(rope, path, "draft config field rope_parameters.").number(
          "rope_theta", 0.0, 1e30)
    else:
      raise ValueError(f"{path}: no rope_theta or rope_parameters.rope_theta")
    if cfg.get("rope_scaling"):
      raise NotImplementedError(f"{path}: rope_scaling={cfg['rope_scaling']!r} is not supported yet")
    if "target_layer_ids" in dfc or "target_layer_ids" in cfg:
      raw_ids = dfl.raw("target_layer_ids")
      if isinstance(raw_ids, list) and -1 in raw_ids:
        dfl.fail("target_layer_ids", raw_ids, "-1 (DeepSpec's embedding-output feature) is not "
                 "supported: features come from decoder layers 0..n-1")
      layer_ids = dfl.int_list("target_layer_ids", 0, MAX_LAYERS)
      if not layer_ids:
        dfl.fail("target_layer_ids", [], "needs at least one layer")
    else:
      layer_ids = tuple(default_target_layer_ids(dfl.int("num_target_layers", 4, MAX_LAYERS),
                                                 n_layer))
    layer_types = cfg.get("layer_types") or ["full_attention"] * n_layer
    if not isinstance(layer_types, list) or len(layer_types) != n_layer or not all(
        t in ("full_attention", "sliding_attention") for t in layer_types):
      top.fail("layer_types", layer_types, f"expected {n_layer} entries, each "
               f"'full_attention' or 'sliding_attention'")
    sliding = tuple(t == "sliding_attention" for t in layer_types)
    dflash2 = None
    window = top.int("sliding_window", 1, MAX_CTX) if any(sliding) else 0
    dspark = None
    if cfg.get("architectures") == [DFLASH2]:
      vocab = top.int("vocab_size", 1, 1 << 31)
      dflash2 = _dflash2_fields(cfg, dfl, top, d_model, vocab, sliding)
      if not cfg.get("use_sliding_window", False):
        window = 0   # transformers' Qwen3Config drops sliding_window: the package runs unwindowed
    elif cfg.get("architectures") == [DSPARK]:
      dspark = _dspark_fields(top)
      if any(sliding):
        top.fail("layer_types", layer_types, "a DSpark draft's layers are all full_attention "
                 "(DeepSpec's Qwen3 build_draft_config)")
    return cls(
        d_model=d_model, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
        head_dim=top.int("head_dim", 1, MAX_DIM, default=max(d_model // n_head, 1)),
        d_ff=top.int("intermediate_size", 1, MAX_DIM), n_vocab=top.int("vocab_size", 1, 1 << 31),
        rms_eps=top.number("rms_norm_eps", 0.0, 1.0, default=1e-6), rope_theta=rope_theta,
        block_size=dfl.int("block_size", 2, MAX_BLOCK_SIZE, default=16),
        mask_token_id=dfl.int("mask_token_id", 0, 1 << 31),
        target_layer_ids=layer_ids, sliding=sliding, sliding_window=window, dflash2=dflash2,
        dspark=dspark)

  def to_json(self) -> dict[str, Any]:
    """The z-lab config.json fields this config came from (transformers Qwen3 + dflash_config)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "hidden_size": self.d_model, "num_hidden_layers": self.n_layer,
        "num_attention_heads": self.n_head, "num_key_value_heads": self.n_kv_head,
        "head_dim": self.head_dim, "intermediate_size": self.d_ff, "vocab_size": self.n_vocab,
        "rms_norm_eps": self.rms_eps, "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in self.sliding],
        "sliding_window": self.sliding_window or None, "use_sliding_window": any(self.sliding),
        "max_position_embeddings": 32768, "block_size": self.block_size,
        "dflash_config": {"mask_token_id": self.mask_token_id,
                          "target_layer_ids": list(self.target_layer_ids),
                          "block_size": self.block_size},
        "dtype": "bfloat16",
    } | ({} if self.dflash2 is None else self._dflash2_json()) | (
        {} if self.dspark is None else self._dspark_json())

  def _dspark_json(self) -> dict[str, Any]:
    f = self.dspark
    out = {"architectures": [DSPARK], "auto_map": None, "dflash_config": None,
           "mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
           "markov_rank": f.markov_rank, "enable_confidence_head": f.confidence}
    if f.markov_head is not None:
      out["markov_head_type"] = f.markov_head
    if f.confidence:
      out["confidence_head_with_markov"] = f.confidence_with_markov
    return out

  def _dflash2_json(self) -> dict[str, Any]:
    f = self.dflash2
    if f.causal == self.sliding:
      causal = None
    elif len(set(f.causal)) == 1:
      causal = f.causal[0]
    else:
      raise ValueError(f"DraftConfig.to_json: per-layer causal {f.causal} has no z-lab form")
    return {
        "architectures": [DFLASH2], "auto_map": None, "is_causal": causal,
        "use_sliding_window": bool(self.sliding_window),
        "dflash_config": {"mask_token_id": self.mask_token_id,
                          "target_layer_ids": list(self.target_layer_ids),
                          "block_size": self.block_size, "conv_kernel_size": f.conv_kernel,
                          "conv_group_size": f.conv_group, "selector_rank": f.selector_rank,
                          "selector_top_k": f.selector_top_k,
                          "output_multiplier": f.output_multiplier,
                          "final_logit_softcapping": f.softcap or None,
                          "input_embedding_scale": f.input_embedding_scale}}


MODES = ("ar", "chain", "ddtree", "lookup")
DRAFT_MODES = ("chain", "ddtree")   # the modes that run a DFlash draft (or a proposer)
AUTO = "auto"   # resolved to one of MODES per platform and batch size (auto_mode.py)
CHAIN_RULES = ("rejection", "match")
DRAFT_POSITIONS = ("absolute", "window")
# Bounds for sizes a user can set (sane limits checked before anything is allocated).
MAX_BLOCK_SIZE = 64
MAX_BUDGET = 256
MAX_NGRAM = 16


def check_int(cfg, name: str, lo: int, hi: int | None = None):
  """Check that field `name` of frozen dataclass `cfg` is an integer in [lo, hi]; store it as
  int. Raises ValueError naming the class and field."""
  value = getattr(cfg, name)
  problem = _int_problem(value, lo, hi)
  if problem:
    raise ValueError(f"{type(cfg).__name__}.{name}={value!r}: {problem}")
  object.__setattr__(cfg, name, int(value))


def check_number(cfg, name: str, lo: float, hi: float, *, lo_open: bool = False):
  """Check that field `name` of frozen dataclass `cfg` is a finite real number in [lo, hi]
  ((lo, hi] with lo_open). Raises ValueError naming the class and field."""
  v = getattr(cfg, name)
  if not _is_finite_real(v) or v < lo or v > hi or (lo_open and v == lo):
    raise ValueError(f"{type(cfg).__name__}.{name}={v!r}: must be a number in "
                     f"{'(' if lo_open else '['}{lo}, {hi}]")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How to decode: the mode and the static shapes of the decode loop (changing any field
  recompiles). The currency of the API (`generate(..., config=...)`) and the scripts.

  Attributes:
    mode: "ar" (autoregressive baseline: a root-only tree per step), "chain" (DFlash: the
      draft's top-1 block as a path tree), "ddtree" (DDTree: a best-first draft tree) or
      "auto" (the default: the mode measured fastest for the platform, model pair and batch
      size, see auto_mode.py; `api.resolve_config` replaces it before anything compiles).
    block_size: L, draft block incl. the bonus slot; None = the draft's (resolved by
      `generate`); ignored for "ar".
    max_ctx: cache capacity in tokens (prompt + generated must fit).
    prefill_chunk: tokens per prefill forward (prompts are padded to a multiple of it; one
      shorter than it to chunk/2 or chunk/4 if that holds it: batching.prefill_len).
    budget: DDTree nodes excluding the root. tree_top_k: DDTree candidates per depth.
    chain_seed: DDTree: insert the draft's top-1 chain first (acceptance never below chain).
    draft_temp: DDTree: temperature applied to the draft logits before scoring the tree.
    chain_rule: how a chain is verified when sampling (temperature > 0; greedy ignores it):
      "rejection" (drafts drawn from the draft's processed distribution, the standard
      speculative sampling rule) or "match" (drafts = the draft's argmax, accepted while equal
      to the target's own draws). Both are exact; see sampling.py.
    draft_window: the draft attends to the target features of the most recent draft_window
      positions only, kept in a ring buffer of draft_window + `draft_margin` rows, so the
      draft's memory and per-step work do not grow with max_ctx (z-lab's drafts are trained on
      4096-token sequences); 0 = every committed position (a buffer of `capacity` rows);
      None = the draft config's sliding_window when every layer is a sliding layer, else 4096
      (resolved by `api.resolve_config`).
    draft_positions: the draft's RoPE positions with a ring buffer: "absolute" (the position in
      the sequence; context keys are stored rotated) or "window" (relative to the window's
      first position, max(0, pos - draft_window): the block always sits at positions <=
      draft_window + L, as in training on draft_window-token sequences; keys are stored
      unrotated and rotated as each chunk is read). RoPE scores depend only on key-query
      offsets, so the two agree up to float rounding (measured: docs/benchmarks.md, "KV cache
      formats"). Without a ring buffer they are the same computation.
    invariant_rows: 0 (off), or R >= the mode's `verify_len`: batch-invariant decoding. Every
      decode forward (an autoregressive step, a chain or DDTree verify) runs R rows rounded up
      to a multiple of 32 (`target.invariant_slots`; the tree padded with nodes nothing
      descends from) in the tree forms, with
      `layers.attention_ordered`, so a token's logits, K/V and recurrent states are the same
      float32 bits whichever mode produced them: with the same R, chain and DDTree greedy output
      equals autoregressive greedy output token for token in every KV format, where otherwise a
      quantized cache can round a last-bit difference into a flipped near tie (README
      "Limitations"). Costs: each autoregressive step computes R rows, and attention is
      elementwise instead of a dot. Prefill is shared by every mode and unchanged.
    lookup: G > 0: prompt lookup (n-gram) drafting over the row's own recent tokens. The longest
      n-gram (lookup_ngram_max down to lookup_ngram_min tokens) ending at the bonus token that
      also occurs earlier in the row's last `decode.RECENT_WINDOW` (2048) committed tokens
      (prompt included; the most recent occurrence) proposes the <= G tokens that followed it
      (`tree.lookup_path`). In "chain" / "ddtree" the proposal is grafted into the draft's
      tree as one more branch (`tree.graft_path`: nodes the tree already has are shared), so a
      step accepts the longer of the two; mode "lookup" drafts with it alone, no draft model:
      a round verifies [bonus, G proposed tokens] when some row has a match, else the bonus
      alone (an autoregressive step). 0 (default) = off; "lookup" needs G >= 1, the draft modes
      G <= L - 1. Lossless like every proposal (a grafted token is accepted only where it is the
      target's own choice); sampled chain rows under chain_rule "rejection" verify the draft's
      chain only.
    lookup_ngram_min / lookup_ngram_max: n-gram lengths the lookup matches (1 <= min <= max <=
      MAX_NGRAM).
    lookup_table: "" (default: off) or a static n-gram table (`dflash_jax.ngram`: an .npz written
      by `ngram.save`, or a token-shard directory such as the target's generated training data,
      built from its greedy shards when loaded, `ngram.from_shards`): a round whose row has no
      prompt-lookup match proposes the table's chain of most frequent next tokens instead
      (`ngram.table_path`; llama.cpp's static lookup cache, REST). Needs lookup >= 1 (the chain's
      length), except with mode "auto", where a table with lookup = 0 is one auto may use (its
      "lookup@G+tableE" columns, `auto_mode`). Lossless like every proposal.
    lookup_table_expect: a table chain is proposed only when its expected accepted length under
      the table's shares is >= this (tokens; 0 = always). A verify of a few tokens costs ~2
      autoregressive steps on a 2-core CPU, about one on a GPU: lower it where verify is cheap.
    table_mix: w > 0 (chain / ddtree with a lookup_table): each draft row is mixed with the
      table's top next token after the chain so far, q = (p + w s delta_t) / (1 + w s)
      (`ngram.mix_rows`), before the chain or tree is built from the rows; 0 (default) = off.
      Lossless like every proposal (sampled chains draw from, and are verified against, q).

  Raises ValueError naming the field (and the valid choices) for a bad value.
  """

  mode: str = AUTO
  block_size: int | None = None
  max_ctx: int = 2048
  prefill_chunk: int = 128
  budget: int = 22
  tree_top_k: int = 8
  chain_seed: bool = True
  draft_temp: float = 1.0
  chain_rule: str = "rejection"
  draft_window: int | None = None
  draft_positions: str = "absolute"
  invariant_rows: int = 0
  lookup: int = 0
  lookup_ngram_min: int = 2
  lookup_ngram_max: int = 4
  lookup_table: str = ""
  lookup_table_expect: float = 2.0
  table_mix: float = 0.0

  def __post_init__(self):
    if self.mode not in MODES + (AUTO,):
      raise ValueError(f"DecodeConfig.mode={self.mode!r}: expected one of {MODES + (AUTO,)}")
    if self.block_size is not None:
      check_int(self, "block_size", 2, MAX_BLOCK_SIZE)
    check_int(self, "max_ctx", 2, MAX_CTX)
    check_int(self, "prefill_chunk", 1)
    check_int(self, "budget", 1, MAX_BUDGET)
    check_int(self, "tree_top_k", 1)
    if self.chain_rule not in CHAIN_RULES:
      raise ValueError(f"DecodeConfig.chain_rule={self.chain_rule!r}: expected one of {CHAIN_RULES}")
    if not isinstance(self.chain_seed, bool):
      raise ValueError(f"DecodeConfig.chain_seed={self.chain_seed!r}: expected a bool")
    check_number(self, "draft_temp", 0.0, math.inf, lo_open=True)
    if self.draft_window is not None:
      check_int(self, "draft_window", 0, MAX_CTX)
    if self.draft_positions not in DRAFT_POSITIONS:
      raise ValueError(f"DecodeConfig.draft_positions={self.draft_positions!r}: expected one of "
                       f"{DRAFT_POSITIONS}")
    check_int(self, "invariant_rows", 0, 2 * MAX_BUDGET + 1 + MAX_BLOCK_SIZE)
    check_int(self, "lookup", 0, MAX_BUDGET)
    check_int(self, "lookup_ngram_min", 1, MAX_NGRAM)
    check_int(self, "lookup_ngram_max", self.lookup_ngram_min, MAX_NGRAM)
    if not isinstance(self.lookup_table, str):
      raise ValueError(f"DecodeConfig.lookup_table={self.lookup_table!r}: expected a path (str)")
    check_number(self, "lookup_table_expect", 0.0, math.inf)
    check_number(self, "table_mix", 0.0, math.inf)
    if self.table_mix and not self.lookup_table:
      raise ValueError(f"DecodeConfig.table_mix={self.table_mix}: set lookup_table (the n-gram "
                       "table the draft's rows are mixed with)")
    if self.table_mix and self.mode in ("ar", "lookup"):
      raise ValueError(f"DecodeConfig.table_mix={self.table_mix} with mode={self.mode!r}: the "
                       "table is mixed into a draft's rows (mode 'chain' or 'ddtree')")
    if self.lookup_table and not (self.lookup or self.table_mix) and self.mode != AUTO:
      raise ValueError("DecodeConfig.lookup_table is set with lookup=0 and table_mix=0: set "
                       "lookup >= 1 (the length of the table's proposals) or table_mix > 0 "
                       "(or mode 'auto', which may use the table)")
    if self.mode == "lookup" and not self.lookup:
      raise ValueError("DecodeConfig.lookup=0 with mode='lookup': set lookup >= 1 (the tokens "
                       "a lookup proposal holds)")
    if self.block_size is not None:
      self.check_lookup()
    if self.mode == "ar" and self.lookup:
      raise ValueError(f"DecodeConfig.lookup={self.lookup} with mode='ar': lookup drafting is "
                       "mode 'lookup' (or a lookup branch in 'chain' / 'ddtree')")
    if self.invariant_rows and self.mode != AUTO and (self.mode in ("ar", "lookup")
                                                      or self.block_size is not None):
      self.check_invariant_rows()

  def check_lookup(self) -> None:
    """Raises ValueError when a draft mode's lookup branch would be deeper than its block (the
    accepted path holds at most L - 1 drafts). Needs a resolved block size."""
    if self.lookup and self.mode in DRAFT_MODES and self.lookup > self.L - 1:
      raise ValueError(f"DecodeConfig.lookup={self.lookup}: a {self.mode} step accepts at most "
                       f"block_size - 1 = {self.L - 1} tokens; use lookup <= {self.L - 1}")

  def check_invariant_rows(self) -> None:
    """Raises ValueError when invariant_rows is on but below this mode's verify_len (needs a
    resolved mode and block size)."""
    if self.invariant_rows and self.invariant_rows < self.verify_len:
      raise ValueError(f"DecodeConfig.invariant_rows={self.invariant_rows}: a {self.mode} verify "
                       f"has {self.verify_len} nodes; use 0 (off) or >= {self.verify_len}")

  @property
  def speculative(self) -> bool:
    """True for the modes that draft (chain, ddtree, lookup); False for autoregressive
    decoding. Raises ValueError for an unresolved "auto"."""
    return self._mode() != "ar"

  @property
  def uses_draft(self) -> bool:
    """True for the modes that run a DFlash draft or a proposer (chain, ddtree); False for
    "ar" and "lookup" (no draft model). Raises ValueError for an unresolved "auto"."""
    return self._mode() in DRAFT_MODES

  @property
  def uses_tree(self) -> bool:
    """True when the verify takes a best-first draft tree (ddtree) rather than a path."""
    return self.mode == "ddtree"

  @property
  def L(self) -> int:
    """The resolved block size: tokens a step commits at most (1 for "ar", 1 + lookup for
    "lookup"). Raises ValueError while block_size is None in a draft mode."""
    if self.mode == "ar":
      return 1
    if self.mode == "lookup":
      return 1 + self.lookup
    if self.block_size is None:
      raise ValueError("DecodeConfig.block_size is unset: pass a draft (its block_size is "
                       "used) or block_size=")
    return self.block_size

  @property
  def draft_depth(self) -> int:
    """Draft rows (depths) the step uses: L-1 (chain); min(budget, L-1) (ddtree: a tree of
    `budget` nodes below the root is never deeper than that); 0 (autoregressive, lookup)."""
    return {"ar": 0, "lookup": 0, "chain": self.L - 1,
            "ddtree": min(self.budget, self.L - 1)}[self._mode()]

  @property
  def verify_len(self) -> int:
    """Tree nodes per verify forward (at most): L (chain), 1 + budget (ddtree), 1
    (autoregressive), plus `lookup` in the modes with a lookup branch (1 + lookup for
    "lookup")."""
    m = self._mode()
    return {"ar": 1, "lookup": 1, "chain": self.L, "ddtree": self.budget + 1}[m] + (
        self.lookup if m != "ar" else 0)

  def _mode(self) -> str:
    if self.mode == AUTO:
      raise ValueError("DecodeConfig.mode='auto' is unresolved: api.resolve_config picks the mode")
    return self.mode

  @property
  def draft_margin(self) -> int:
    """Ring-buffer rows beyond the draft window: a commit or prefill chunk writes up to
    max(verify_len, L, prefill_chunk) rows past the committed length, which must not land on
    rows the window still reads."""
    return max(self.verify_len, self.L, self.prefill_chunk)

  @property
  def draft_rows(self) -> int:
    """Rows of the draft's context cache: draft_window + draft_margin when that is below
    `capacity` (a ring buffer), else capacity (every position, as with draft_window 0)."""
    return self.draft_window + self.draft_margin if self.draft_ring else self.capacity

  @property
  def draft_ring(self) -> bool:
    """True when the draft's context cache is a ring buffer (a window smaller than `capacity`)."""
    w = self.draft_window or 0
    return 0 < w and w + self.draft_margin < self.capacity

  @property
  def capacity(self) -> int:
    """Cache rows: max_ctx plus slack for a padded prefill chunk and a verify overhang."""
    c = self.max_ctx + max(self.verify_len, self.L, self.prefill_chunk)
    return -(-c // self.prefill_chunk) * self.prefill_chunk
