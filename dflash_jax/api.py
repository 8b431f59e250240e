"""Public API: load_target, load_draft, forward_logits, first_draft_logits, generate."""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import auto_mode, batching, kv_cache
from dflash_jax import decode as decode_lib
from dflash_jax import ngram as ngram_lib
from dflash_jax import draft as draft_lib
from dflash_jax import draft_io
from dflash_jax import grammar as grammar_lib
from dflash_jax import target as target_lib
from dflash_jax import layers, target_params
from dflash_jax import eagle3 as eagle3_lib
from dflash_jax import mtp as mtp_lib
from dflash_jax.config import (AUTO, DFLASH2, DRAFT_ARCHITECTURES, DSPARK, SUPPORTED_ARCHS, DecodeConfig,
                               DraftConfig, TargetConfig)
from dflash_jax.gguf_io import read_gguf
from dflash_jax.prompt_cache import PromptCache
from dflash_jax.runtime import Runtime
from dflash_jax.sampling import SamplingConfig
from dflash_jax.tokenizer import GGUFTokenizer


@dataclasses.dataclass
class Target:
  """A loaded GGUF target.

  Attributes:
    config: TargetConfig (what the GGUF says). params: TargetParams on device. runtime: Runtime
    (kernels, compute / KV dtypes) every forward of this target runs with. tokenizer:
    GGUFTokenizer (None if not requested). path: GGUF path. weights: "quantized" | "f32" |
    "bf16". gguf_tensor_bytes: bytes of all tensors in the file. general_name: `general.name`.
    sampling_defaults: the sampling the GGUF recommends (`general.sampling.temp` / `top_k` /
    `top_p` / `min_p`), or None when it names none.
  """

  config: TargetConfig
  params: target_params.TargetParams
  runtime: Runtime
  tokenizer: Optional[GGUFTokenizer]
  path: str
  weights: str
  gguf_tensor_bytes: int
  general_name: str = ""
  sampling_defaults: Optional[SamplingConfig] = None

  @property
  def device_bytes(self) -> int:
    """Bytes of the distinct device buffers holding the params (tied embeddings counted once)."""
    return device_bytes(self.params)


def device_bytes(tree) -> int:
  """Bytes of the distinct arrays among a pytree's leaves (an array held twice counts once)."""
  return int(sum({id(x): x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")}.values()))


@dataclasses.dataclass
class Draft:
  """A loaded draft: a z-lab DFlash draft or DeepSpec DSpark draft (config DraftConfig, params
  DraftParams, path its directory), an EAGLE-3 draft (config eagle3.Eagle3Config, params
  eagle3.Eagle3Params, path its directory), or the target's own MTP block
  (`load_draft(MTP, target)`: config mtp.MTPConfig, params mtp.MTPParams, path
  "<target gguf>#mtp")."""

  config: DraftConfig | mtp_lib.MTPConfig | eagle3_lib.Eagle3Config
  params: draft_lib.DraftParams | mtp_lib.MTPParams | eagle3_lib.Eagle3Params
  path: str

  @property
  def device_bytes(self) -> int:
    """Bytes of the distinct device buffers holding the params."""
    return device_bytes(self.params)

  @property
  def is_mtp(self) -> bool:
    """True for the target's own multi-token-prediction block (mtp.py)."""
    return isinstance(self.config, mtp_lib.MTPConfig)

  @property
  def ar_draft(self) -> bool:
    """True for a draft that runs one step per draft token with a pending hidden state (the MTP
    block, or EAGLE-3: eagle3.py); any block size works with it."""
    return isinstance(self.config, decode_lib.AR_CONFIGS)


WEIGHTS = ("auto", "quantized", "f32", "bf16")

_COMPILERS: dict[int, tuple[Target, grammar_lib.GrammarCompiler]] = {}


def grammar_compiler(target: Target) -> grammar_lib.GrammarCompiler:
  """The target's grammar.GrammarCompiler (built once per target: its tokenizer's vocabulary,
  its end-of-generation ids): `grammar_compiler(t).compile(grammar.json_schema_regex(schema))`
  gives the `grammar` argument of `generate`. Raises ValueError when the target was loaded
  without a tokenizer."""
  hit = _COMPILERS.get(id(target))
  if hit is not None and hit[0] is target:
    return hit[1]
  if target.tokenizer is None:
    raise ValueError(f"{target.path}: constrained decoding needs the tokenizer (load_target "
                     f"with tokenizer=True)")
  comp = grammar_lib.GrammarCompiler(target.tokenizer, target.tokenizer.eog_ids,
                                     target.config.n_vocab)
  _COMPILERS[id(target)] = (target, comp)
  return comp


def _resolve_weights(weights: str, f, rt: Runtime) -> str:
  """weights="auto": "quantized" for the Pallas kernels (they read packed GGUF blocks) and on
  accelerators; on CPU "f32" when the dequantized weights take at most half the available
  memory, else "quantized". Measured on XLA:CPU (SmolLM2 Q4_1, AR; docs/benchmarks.md): the
  dot over f32 weights streams them at ~20 GB/s, while packed weights are dequantized inside
  every device call (XLA hoists it out of the decode loop): 30 vs 35 ms/token at 32 steps per
  call, 30 vs 69 ms/token at 4 (streaming)."""
  if weights not in WEIGHTS:
    raise ValueError(f"weights={weights!r}: expected one of {WEIGHTS}")
  if weights != "auto":
    return weights
  if rt.pallas or jax.default_backend() != "cpu":
    return "quantized"
  need = 4 * sum(int(np.prod(t.shape)) for t in f.tensors.values())
  have = available_bytes()
  return "f32" if have is not None and need <= have // 2 else "quantized"


def load_target(gguf_path: str, *, weights: str = "auto", compute_dtype: str = "float32",
                kv_dtype: str = "float32", kv_dtype_v: str = "", tokenizer: bool = True,
                kernels: str = "auto", gdn_commit: str = "states", attention: str = "live",
                rounds: int = 0, fuse_projections: bool = True,
                progress: Optional[Callable[[int, int], None]] = None) -> Target:
  """Load a GGUF target (an architecture of `config.SUPPORTED_ARCHS`: qwen35, qwen35moe,
  qwen3next, llama, qwen2, qwen3, qwen3moe).

  weights: "quantized" keeps GGUF blocks packed on device and dequantizes inside the jitted
    forward; "f32"/"bf16" dequantize once at load (4-8x the memory); "auto" (default) picks per
    platform by measurement (`_resolve_weights`: f32 on CPU when it fits, else quantized).
  compute_dtype, kv_dtype, kv_dtype_v, kernels, gdn_commit, attention, rounds: the target's
    Runtime (see runtime.Runtime;
    kv_dtype in float32 / bfloat16 / float16 / q8_0 / q4_0, for the draft's context cache too;
    kv_dtype_v the values' format when it differs, "" = kv_dtype); kernels "auto"
    = Pallas kernels on GPU, the pure-JAX reference elsewhere; "mosaic" (Hopper) also tiles the
    Q4_K / Q5_K / Q6_K weights for the Mosaic GPU kernel (`target_params.tile_kquants`). The Pallas
    dequantizing matmul needs weights="quantized" (float weights always use XLA's dot; "mosaic"
    refuses them).
  tokenizer: build the tokenizer from the GGUF vocabulary (errors if unsupported).
  fuse_projections: stack the packed rows of same-format projections of one input (q/k/v, ffn
    gate/up, Gated DeltaNet qkv/z/beta/alpha) at load so each group is one matmul.
  progress: called as progress(bytes read, total tensor bytes) as tensors are read (a bar).
  Raises FileNotFoundError, ValueError (unknown architecture or quant type, truncated file,
  tensor shape mismatch, bad option) or NotImplementedError (unsupported tokenizer kind),
  naming the file or option.
  """
  rt = Runtime.for_backend(kernels, compute_dtype=compute_dtype, kv_dtype=kv_dtype,
                           kv_dtype_v=kv_dtype_v, gdn_commit=gdn_commit, attention=attention,
                           rounds=rounds)
  f = read_gguf(gguf_path)
  if progress is not None:
    done, total = [0], f.n_tensor_bytes

    def on_read(n: int):
      done[0] += n
      progress(done[0], total)
    f.on_read = on_read
  weights = _resolve_weights(weights, f, rt)
  if "token_embd.weight" not in f.tensors:
    if f.meta.get("general.architecture") not in SUPPORTED_ARCHS:
      TargetConfig.from_gguf(f.meta, n_vocab=0, path=f.path)  # raises the architecture error
    raise ValueError(f"{f.path}: missing tensor 'token_embd.weight'")
  cfg = TargetConfig.from_gguf(f.meta, n_vocab=f.tensors["token_embd.weight"].shape[0],
                               path=f.path, has_rope_freqs="rope_freqs.weight" in f.tensors)
  kv_cache.check_format(rt.k_format, cfg.head_dim, f"kv_dtype (keys of {f.path})")
  kv_cache.check_format(rt.v_format, cfg.v_head_dim, f"kv_dtype_v (values of {f.path})")
  if rt.mosaic and weights != "quantized":
    raise ValueError(f"kernels={kernels!r} multiplies packed Q4_K blocks: it needs "
                     f"weights='quantized' (or 'auto'), not {weights!r}")
  params = target_params.load_params(f, cfg, weights=weights, fuse=fuse_projections)
  if rt.mosaic:                     # K-quant weights in the Mosaic GPU kernel's tiles
    params = target_params.tile_kquants(params, rows_multiple=layers.mosaic_rows_multiple(rt))
  params = jax.device_put(params)
  tok = GGUFTokenizer(f.meta, path=f.path) if tokenizer else None
  return Target(cfg, params, rt, tok, f.path, weights, f.n_tensor_bytes,
                str(f.meta.get("general.name", "")), _recommended_sampling(f.meta, f.path))


_GGUF_SAMPLING_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
                       "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p"}


def _recommended_sampling(meta, path: str) -> Optional[SamplingConfig]:
  """SamplingConfig from the GGUF's `general.sampling.*` keys (None if it has none). Raises
  ValueError naming the file and key for a value out of range."""
  found = {k: meta[key] for k, key in _GGUF_SAMPLING_KEYS.items() if key in meta}
  if not found:
    return None
  try:
    return SamplingConfig(**{k: (int(v) if k == "top_k" else float(v)) for k, v in found.items()})
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: bad recommended sampling metadata {found}: {e}") from None


DRAFT_VARIANTS = (DRAFT_ARCHITECTURES[0], DFLASH2, DSPARK)
MTP = "mtp"     # load_draft's name for the target's own multi-token-prediction block


def load_draft(draft_dir: str, target: Target, *, mtp_steps: int = mtp_lib.DEFAULT_STEPS) -> Draft:
  """Load a z-lab draft directory, DFlash-1 (`DFlashDraftModel`) or DFlash-2
  (`DFlash2DraftModel`: draft2.py, proposing through its candidate selector), or a DeepSpec
  DSpark draft (`Qwen3DSparkModel`: dspark.py, anchor-first blocks with a Markov head; a block
  of L slots proposes L tokens, so the decode block size defaults to L + 1), or an EAGLE-3
  draft (eagle3.py: the speculators format or EAGLE / SpecForge's; the block size defaults to
  1 + its speculative_tokens, and any other works), and check it
  against `target` (hidden size, vocab, target_layer_ids, mask id); or, for draft_dir "mtp"
  (`MTP`), the target GGUF's own multi-token-prediction block (mtp.py: Qwen3.5 files converted
  with it), drafting `mtp_steps` tokens per step by default (the block size is 1 + that unless
  the DecodeConfig names another). Raises FileNotFoundError / ValueError naming the draft (for
  "mtp": naming the target file when it has no MTP block)."""
  if draft_dir == MTP:
    if not 1 <= mtp_steps <= mtp_lib.MAX_STEPS:
      raise ValueError(f"mtp_steps={mtp_steps}: must be in [1, {mtp_lib.MAX_STEPS}]")
    mtp_lib.check_target(target.config, target.path)
    kv_cache.check_format(target.runtime.k_format, target.config.head_dim,
                          f"kv_dtype (MTP block of {target.path})")
    mp = mtp_lib.load_params(read_gguf(target.path), target.config, weights=target.weights)
    return Draft(mtp_lib.MTPConfig(target.config, block_size=mtp_steps + 1), jax.device_put(mp),
                 f"{target.path}#{MTP}")
  raw = eagle3_lib.read_config(draft_dir)
  if raw is not None:
    cfg, params = eagle3_lib.load(draft_dir, target.config, raw)
  else:
    cfg, params = draft_io.load(draft_dir, target.config, variants=DRAFT_VARIANTS)
  kv_cache.check_format(target.runtime.k_format, cfg.head_dim, f"kv_dtype (draft {draft_dir})")
  kv_cache.check_format(target.runtime.v_format, cfg.head_dim, f"kv_dtype_v (draft {draft_dir})")
  return Draft(cfg, jax.device_put(params), draft_dir)


@functools.partial(jax.jit, static_argnames=("cfg", "rt", "feature_layers"))
def _full_forward(params, tokens, n_valid, cache, *, cfg, rt, feature_layers):
  pre = target_lib.prefill(params, cfg, tokens, jnp.int32(0), n_valid, cache, rt,
                           feature_layers=feature_layers)
  return target_lib.logits(params, cfg, pre.hidden, rt), pre.feats


def forward_logits(target: Target, token_ids: Sequence[int], *,
                   feature_layers: tuple[int, ...] = (), pad_to: int = 64):
  """Full forward of a token sequence from an empty cache (prefill math, one call).

  token_ids: [T] ints. The call is padded to a multiple of `pad_to` tokens so that nearby lengths
  share one compiled function (padding sits after the real tokens and cannot affect them).
  Returns logits [T, V] float32 (numpy); with feature_layers, (logits, features [T, F*D]).
  Raises ValueError for ids that are not a non-empty 1-D sequence of integers in the
  vocabulary (check_ids).
  """
  ids = check_ids(target, token_ids, "token_ids")
  n = ids.size
  padded = -(-n // pad_to) * pad_to
  cache = target_lib.init_cache(target.config, padded, target.runtime)
  logits, feats = _full_forward(target.params, jnp.asarray(np.pad(ids, (0, padded - n))),
                                jnp.int32(n), cache, cfg=target.config, rt=target.runtime,
                                feature_layers=tuple(feature_layers))
  if feature_layers:
    return np.asarray(logits)[:n], np.asarray(feats)[:n]
  return np.asarray(logits)[:n]


@functools.partial(jax.jit, static_argnames=("cfg", "rt", "k", "n_out"))
def _score(params, tokens, n_valid, first, cache, *, cfg, rt, k, n_out):
  pre = target_lib.prefill(params, cfg, tokens, jnp.int32(0), n_valid, cache, rt)
  h = jax.lax.dynamic_slice_in_dim(pre.hidden, first - 1, n_out)
  lp = jax.nn.log_softmax(target_lib.logits(params, cfg, h, rt).astype(jnp.float32), axis=-1)
  nxt = jax.lax.dynamic_slice_in_dim(tokens, first, n_out)
  chosen = jnp.take_along_axis(lp, nxt[:, None], axis=1)[:, 0]
  top_lp, top_ids = jax.lax.top_k(lp, max(k, 1))
  return chosen, top_ids, top_lp


def _pow2(n: int, lo: int = 64) -> int:
  return max(lo, 1 << (max(n, 1) - 1).bit_length())


def token_logprobs(target: Target, token_ids: Sequence[int], first: int, top_k: int = 0):
  """Log-probabilities the target gives tokens token_ids[first:], each after all the tokens
  before it: the raw model distribution, log_softmax(logits) at temperature 1 with no top-k /
  top-p cut (what OpenAI's `logprobs` report), from one full forward of the sequence (prefill
  math; the same for whatever mode decoded the tokens).

  token_ids: [T] ints; first: in [1, T). top_k: also return the top_k most likely tokens of
  each position (0..20). Returns (logprobs [T-first] float32, top_ids [T-first, top_k] int32,
  top_logprobs [T-first, top_k] float32) as numpy. Padded to power-of-two shapes (>= 64) so
  nearby lengths share a compiled program. Raises ValueError for bad ids or arguments.
  """
  ids = check_ids(target, token_ids, "token_ids")
  n = ids.size
  if not 1 <= first < n:
    raise ValueError(f"first={first} must be in [1, {n})")
  if not 0 <= top_k <= 20:
    raise ValueError(f"top_k={top_k} must be in [0, 20]")
  n_out = _pow2(n - first)
  padded = _pow2(first - 1 + n_out + 1)
  cache = target_lib.init_cache(target.config, padded, target.runtime)
  chosen, top_ids, top_lp = _score(target.params, jnp.asarray(np.pad(ids, (0, padded - n))),
                                   jnp.int32(n), jnp.int32(first), cache, cfg=target.config,
                                   rt=target.runtime, k=top_k, n_out=n_out)
  m = n - first
  return (np.asarray(chosen)[:m], np.asarray(top_ids)[:m, :top_k],
          np.asarray(top_lp)[:m, :top_k])


@dataclasses.dataclass
class GenerateResult:
  """Output of `generate`.

  Attributes:
    tokens: generated ids (first = greedy token after the prompt; an EOG token, if hit, is last).
    accept_lens: tokens committed per decode step (accepted drafts + bonus); mean = acceptance length.
    n_steps: decode steps (target verify forwards after prefill).
    prompt_len: prompt tokens. stop_reason: "eog" | "max_new_tokens" | "max_ctx" | "stopped"
      (on_tokens asked to stop).
    prefill_s, decode_s: wall seconds, compile excluded (`generate` compiles its programs ahead
      of time and counts that in compile_s; generate_batch: after the first call with these
      shapes).
    sampling: the SamplingConfig used (temperature 0 = greedy).
    mode: the mode decoded with ("ar", "chain", "ddtree"; what "auto" resolved to).
    cached_tokens: prompt tokens taken from the prompt cache instead of prefilled (0 without one).
    compile_s: seconds `generate` spent compiling (tracing, and the XLA compile or a persistent
      compile-cache read; 0 when this process had compiled the programs already).
  """

  tokens: list[int]
  accept_lens: list[int]
  n_steps: int
  prompt_len: int
  stop_reason: str
  prefill_s: float
  decode_s: float
  sampling: SamplingConfig = SamplingConfig()
  mode: str = ""
  cached_tokens: int = 0
  compile_s: float = 0.0

  @property
  def mean_accept_len(self) -> float:
    return float(np.mean(self.accept_lens)) if self.accept_lens else 0.0

  @property
  def decode_tok_s(self) -> float:
    """Tokens generated by decode steps (the first token comes from prefill) per second."""
    return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0

  @property
  def prefill_tok_s(self) -> float:
    return self.prompt_len / self.prefill_s if self.prefill_s > 0 else 0.0


DEFAULT_DRAFT_WINDOW = 4096   # z-lab's drafts are trained on 4096-token sequences


def resolve_config(draft: Optional[Draft], config: Optional[DecodeConfig] = None, *,
                   has_proposer: bool = False, target: Optional[Target] = None, batch: int = 1,
                   **overrides) -> DecodeConfig:
  """The DecodeConfig a call decodes with: `config` (default DecodeConfig()) with `overrides`
  (DecodeConfig field names) applied, mode "auto" replaced by the mode measured fastest for
  `target`, `draft` and `batch` rows on this platform (auto_mode.py; "ar" without a draft or a
  measurement), and block_size taken from the draft when unset (a DSpark draft's block_size + 1:
  its L slots propose L tokens; 16 for a proposer without a draft). Raises ValueError for an
  unknown field or a bad value (naming it), a speculative mode without a draft, mode "auto"
  without `target` or with a proposer, or a block size that differs from the draft's (above a
  DSpark draft's block_size + 1)."""
  fields = {f.name for f in dataclasses.fields(DecodeConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown option(s) {unknown}; DecodeConfig fields: {sorted(fields)}, "
                     f"SamplingConfig fields: {sorted(f.name for f in dataclasses.fields(SamplingConfig))}")
  dec = dataclasses.replace(config or DecodeConfig(), **overrides)
  if dec.mode == AUTO:
    if has_proposer or target is None:
      raise ValueError("mode='auto' needs the target and a DFlash draft (not a proposer) to "
                       "look up the measured mode; name the mode (ar, chain, ddtree)")
    dec = auto_mode.resolve(dec, target.path, draft.path if draft is not None else None, batch,
                            has_draft=draft is not None)
  if dec.uses_draft and draft is None and not has_proposer:
    raise ValueError(f"mode={dec.mode!r} needs a draft (or a proposer)")
  ar = draft is not None and draft.ar_draft
  dspark = not ar and draft is not None and draft.config.dspark is not None
  if dspark and dec.block_size is not None and dec.block_size > draft.config.block_size + 1:
    raise ValueError(f"block_size={dec.block_size}: a DSpark draft of block_size="
                     f"{draft.config.block_size} proposes at most {draft.config.block_size} "
                     f"tokens a step (block_size <= {draft.config.block_size + 1})")
  if (not ar and not dspark and draft is not None
      and dec.block_size not in (None, draft.config.block_size)):
    raise ValueError(f"block_size={dec.block_size} differs from the draft's block_size="
                     f"{draft.config.block_size}")
  if dec.block_size is None:
    dec = dataclasses.replace(dec, block_size=(
        16 if draft is None else draft.config.block_size + (1 if dspark else 0)))
  if ar and dec.draft_window:
    raise ValueError(f"draft_window={dec.draft_window}: the {'MTP block' if draft.is_mtp else 'EAGLE-3 draft'} "
                     "attends to every position (a full-attention layer); use draft_window=0 "
                     "(the default with it)")
  if ar and dec.draft_window is None:
    dec = dataclasses.replace(dec, draft_window=0)
  if dec.draft_window is None:
    # Every layer windowed: nothing past its window is read anyway; else the full layers' 4096.
    sw = draft.config.sliding_window if draft is not None and all(draft.config.sliding) else 0
    dec = dataclasses.replace(dec, draft_window=sw or DEFAULT_DRAFT_WINDOW)
  return dec


def state_bytes(target: Target, draft: Optional[Draft], dec: DecodeConfig, batch: int = 1) -> int:
  """Bytes of the DecodeState `generate` / `generate_batch` allocate for `dec` and `batch` rows
  (target KV / SSM / conv cache, draft context cache, output buffers),
  from the shapes alone (jax.eval_shape: nothing is allocated; cached per static
  configuration, since generate asks on every call)."""
  return batch * _state_bytes(target.config, _draft_config(draft, dec), dec, target.runtime)


@functools.lru_cache(maxsize=64)
def _state_bytes(tcfg: TargetConfig, dcfg: Optional[DraftConfig], dec: DecodeConfig,
                 rt: Runtime) -> int:
  shapes = jax.eval_shape(lambda: decode_lib.init_row(decode_lib.Plan(tcfg, dcfg, dec, rt)))
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)
                 if hasattr(x, "dtype") and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))


def available_bytes() -> Optional[int]:
  """Memory free for new buffers on the default device: GPU/TPU `memory_stats()` (limit - in
  use), else the host's MemAvailable (/proc/meminfo); None when unknown."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as fh:
      for line in fh:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def check_config(target: Target, draft: Optional[Draft], dec: DecodeConfig, batch: int = 1):
  """Checks made before anything is compiled or allocated: tree_top_k within the vocabulary; the
  decode state of `batch` rows must fit in the memory available (ValueError saying how much it
  needs and has; lower max_ctx or the batch size); warns when max_ctx exceeds the model's trained
  context length (`context_length`); loads dec.lookup_table (FileNotFoundError / ValueError
  naming it)."""
  if dec.uses_tree and dec.tree_top_k > target.config.n_vocab:
    raise ValueError(f"tree_top_k={dec.tree_top_k} exceeds the vocabulary ({target.config.n_vocab})")
  if dec.lookup_table:   # FileNotFoundError / ValueError naming the table; kept for the batch
    ngram_lib.load_cached(dec.lookup_table, target.config.n_vocab)
  need, have = state_bytes(target, draft, dec, batch), available_bytes()
  if have is not None and need > have:
    rows = f" x batch {batch}" if batch > 1 else ""
    rt = target.runtime
    fmt = rt.k_format if rt.k_format == rt.v_format else f"{rt.k_format} K / {rt.v_format} V"
    smaller = "" if rt.v_format == "q4_0" else ", a smaller --kv_dtype (q8_0, q4_0)"
    raise ValueError(f"max_ctx={dec.max_ctx}{rows}: the decode cache with a {fmt} KV cache needs "
                     f"{need / 2**30:.2f} GiB ({need} bytes) but only {have / 2**30:.2f} GiB is "
                     f"available on {jax.devices()[0].platform}; lower --max_ctx" +
                     (", --batch_size" if batch > 1 else "") + smaller)
  n_train = target.config.n_ctx_train
  if n_train and dec.max_ctx > n_train:
    warnings.warn(f"max_ctx={dec.max_ctx} exceeds the model's context_length={n_train} "
                  f"({target.path}): quality past it is not what the model was trained for",
                  stacklevel=3)


def check_ids(target: Target, token_ids, name: str = "prompt") -> np.ndarray:
  """token_ids as [P] int32, checked: one-dimensional, non-empty, integers (not bools, not
  floats), every id in [0, n_vocab). Raises ValueError naming `name` and saying which."""
  try:
    ids = np.asarray(token_ids)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{name} token ids are not a sequence of integers ({e})") from None
  if ids.ndim != 1:
    raise ValueError(f"{name} token ids must be one-dimensional [P], got shape {ids.shape}")
  if ids.size == 0:
    raise ValueError(f"empty {name}: at least one token is needed")
  if not np.issubdtype(ids.dtype, np.integer) or ids.dtype == np.bool_:
    raise ValueError(f"{name} token ids must be integers, got dtype {ids.dtype}")
  n_vocab = target.config.n_vocab
  bad = np.flatnonzero((ids < 0) | (ids >= n_vocab))
  if bad.size:
    raise ValueError(f"{name} token ids must be in [0, {n_vocab}): {name}[{bad[0]}] = "
                     f"{ids[bad[0]]}")
  return ids.astype(np.int32)


def check_prompt(target: Target, prompt_ids, dec: DecodeConfig) -> np.ndarray:
  """prompt_ids as [P] int32, checked as `check_ids` does, and P < dec.max_ctx. Raises
  ValueError saying which."""
  ids = check_ids(target, prompt_ids)
  if ids.size >= dec.max_ctx:
    raise ValueError(f"prompt has {ids.size} tokens, which does not fit max_ctx={dec.max_ctx} "
                     f"(prompt + at least one generated token); raise --max_ctx")
  return ids


def resolve_eog(target: Target, eog_ids):
  """[E] int32 end-of-generation ids: `eog_ids` checked (a sequence of ids in the vocabulary;
  ValueError naming eog_ids otherwise), default the tokenizer's."""
  if eog_ids is None:
    eog_ids = target.tokenizer.eog_ids if target.tokenizer is not None else ()
  elif isinstance(eog_ids, (str, bytes)) or not hasattr(eog_ids, "__iter__"):
    raise ValueError(f"eog_ids={eog_ids!r} must be a sequence of token ids")
  else:
    eog_ids = list(eog_ids)
    for v in eog_ids:
      if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or \
          not 0 <= v < target.config.n_vocab:
        raise ValueError(f"eog_ids: {v!r} is not a token id in [0, {target.config.n_vocab})")
  return jnp.asarray([int(v) for v in eog_ids] or [-1], jnp.int32)


def _check_types(config, sampling):
  """TypeError naming the argument when `config` / `sampling` are not the dataclasses."""
  if config is not None and not isinstance(config, DecodeConfig):
    hint = f"; for a mode pass mode={config!r}" if isinstance(config, str) else ""
    raise TypeError(f"config must be a DecodeConfig or None, got {type(config).__name__}{hint}")
  if sampling is not None and not isinstance(sampling, SamplingConfig):
    hint = "; use SamplingConfig(**fields) or pass the fields as keywords" \
        if isinstance(sampling, dict) else ""
    raise TypeError(f"sampling must be a SamplingConfig or None, got "
                    f"{type(sampling).__name__}{hint}")


def _draft_config(draft: Optional[Draft], dec: DecodeConfig) -> Optional[DraftConfig]:
  """The DraftConfig the decode functions get: the draft's in the draft modes, else None."""
  return draft.config if (draft is not None and dec.uses_draft) else None


def _positive_int(name: str, value):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}={value!r} must be an integer >= 1")


def first_draft_logits(target: Target, draft: Draft, prompt_ids: Sequence[int], *,
                       max_ctx: int = 2048, prefill_chunk: int = 128) -> np.ndarray:
  """Prefill prompt_ids, take the greedy next token as the bonus, run one draft step over the
  prompt's target features. Returns draft logits [D, V] float32 (row j predicts the token at
  position P+1+j; D = block_size-1, a DSpark draft's block_size)."""
  dec = resolve_config(draft, mode="chain", max_ctx=max_ctx, prefill_chunk=prefill_chunk)
  b = batching.SlotBatch(target, draft, dec, 1, resolve_eog(target, None))
  b.prefill(0, check_prompt(target, prompt_ids, dec), 2, SamplingConfig())
  return np.asarray(decode_lib.draft_once(target.params, draft.params, b.state, jnp.int32(0),
                                          plan=b.plan))


def _split_overrides(sampling: Optional[SamplingConfig], overrides: dict):
  """(SamplingConfig, DecodeConfig overrides): keyword fields split by which config owns them."""
  samp_fields = {f.name for f in dataclasses.fields(SamplingConfig)}
  sampling = dataclasses.replace(sampling or SamplingConfig(),
                                 **{k: v for k, v in overrides.items() if k in samp_fields})
  return sampling, {k: v for k, v in overrides.items() if k not in samp_fields}


def _result(row: batching.Row, ids: np.ndarray, max_new: int, eog, stopped: bool,
            prefill_s: float, decode_s: float, sampling: SamplingConfig,
            mode: str, cached_tokens: int = 0, compile_s: float = 0.0) -> GenerateResult:
  """GenerateResult of a row read back, with its stop reason."""
  tokens = row.tokens
  stop = ("eog" if tokens and tokens[-1] in set(np.asarray(eog).tolist()) else
          "stopped" if stopped else "max_new_tokens" if len(tokens) >= max_new else "max_ctx")
  return GenerateResult(tokens=tokens, accept_lens=row.accept_lens, n_steps=row.n_steps,
                        prompt_len=int(ids.size), stop_reason=stop, prefill_s=prefill_s,
                        decode_s=decode_s, sampling=sampling, mode=mode,
                        cached_tokens=cached_tokens, compile_s=compile_s)


def _check_finite(target: Target, b: batching.SlotBatch, slot: int):
  if not b.finite(slot):
    raise ValueError(f"{target.path}: the target's logits after prefill are not finite (NaN or "
                     f"inf): corrupt weights or metadata")


def generate(target: Target, draft: Optional[Draft], prompt_ids: Sequence[int], *,
             max_new_tokens: int, config: Optional[DecodeConfig] = None,
             eog_ids: Optional[Sequence[int]] = None,
             on_tokens: Optional[Callable[[list[int]], None]] = None, steps_per_call: int = 4,
             proposer: Optional[Callable] = None, proposer_params=None,
             sampling: Optional[SamplingConfig] = None,
             prompt_cache: Optional[PromptCache] = None,
             grammar: Optional[grammar_lib.Grammar] = None, **overrides) -> GenerateResult:
  """Generation: speculative (mode "chain": DFlash chain; "ddtree": DDTree) or autoregressive
  ("ar"), as `config` (a DecodeConfig) says (default mode "auto": the mode measured fastest on
  this platform for one row, auto_mode.py; GenerateResult.mode says which), greedy or sampled as `sampling` (a SamplingConfig;
  default greedy) says. DecodeConfig and SamplingConfig fields may also be given as keywords
  (e.g. mode="ddtree", budget=8, temperature=0.7, top_p=0.95, seed=1); they override the two.
  The one-prompt form of `generate_batch` (a batch of one slot, the same compiled loop).

  prompt_ids: [P] ints, P < max_ctx. max_new_tokens: tokens to generate at most (the loop also
  stops after an EOG token, or when the context reaches max_ctx).
  on_tokens: called with the newly committed token ids; the loop then runs `steps_per_call`
    steps per device call (the same compiled function), else all steps in one call. Returning
    True from it stops generation there (stop_reason "stopped"; a server's stop strings and
    client disconnects).
  proposer / proposer_params: replace the DFlash draft (see decode.dflash_proposer), e.g. an oracle.
  prompt_cache: a `PromptCache` (prompt_cache.py): the longest cached prefix of the prompt is
    restored instead of prefilled (GenerateResult.cached_tokens), and this sequence is added to
    it afterwards, so a chat's next turn prefills only its new tokens. Output is unchanged.
  grammar: constrain the output to a grammar.Grammar (from `grammar_compiler(target)`, e.g. a
    JSON schema's): every token is drawn from the target's distribution masked to the tokens
    the automaton allows after the output so far; end-of-generation only in accepting states.
  Greedy chain and DDTree output equal autoregressive output token for token (constrained or
  not); sampled output has the distribution of autoregressive sampling (sampling.py).
  Raises ValueError for a bad option (naming it), an empty or too long prompt, out-of-vocabulary
  ids, a block size mismatch, a decode state larger than the memory available (check_config),
  or non-finite logits after prefill (naming the GGUF).
  """
  _check_types(config, sampling)
  _positive_int("max_new_tokens", max_new_tokens)
  _positive_int("steps_per_call", steps_per_call)
  sampling, overrides = _split_overrides(sampling, overrides)
  dec = resolve_config(draft, config, has_proposer=proposer is not None, target=target,
                       **overrides)
  ids = check_prompt(target, prompt_ids, dec)
  check_config(target, draft if proposer is None else None, dec)
  max_new_tokens = min(max_new_tokens, dec.max_ctx)    # never more than the context holds
  eog = resolve_eog(target, eog_ids)
  t0 = time.perf_counter()
  b = batching.SlotBatch(target, draft, dec, 1, eog, proposer=proposer,
                         proposer_params=proposer_params)
  start = b.reuse(0, ids, prompt_cache) if prompt_cache is not None else 0
  checkpoints = {} if prompt_cache is not None else None
  if grammar is not None:
    b.grammars.check(grammar, param="grammar")
  compile_s = b.compile_prefill(ids.size - start, sampling, grammar=grammar is not None)
  for _ in b.prefill_chunks(0, ids, max_new_tokens, sampling, start, checkpoints,
                            grammar=grammar):
    pass
  _check_finite(target, b, 0)                  # waits for the prefill: the first token exists
  t1 = time.perf_counter()
  stopped, shown = False, 0

  def show() -> bool:
    """Hand new tokens to on_tokens; True when it asks to stop."""
    nonlocal shown
    n_out = int(b.progress()[0][0])
    if n_out > shown:
      new, shown = b.new_tokens(0, shown, n_out), n_out
      return on_tokens(new) is True
    return False

  if on_tokens is not None:
    stopped = show()                              # the first token, before the loop compiles
  t_loop = time.perf_counter()
  loop_compile_s = 0.0 if stopped or b.progress()[1][0] else b.compile_loop()
  t2 = time.perf_counter()
  if not stopped:
    if on_tokens is None:
      b.run(1 << 30)
    else:
      while not b.progress()[1][0]:
        b.run(steps_per_call)
        if show():
          stopped = True
          break
  jax.block_until_ready(b.state.out)
  t3 = time.perf_counter()
  if prompt_cache is not None:
    b.save(0, ids, prompt_cache, checkpoints)
  return _result(b.row(0), ids, max_new_tokens, eog, stopped, t1 - t0 - compile_s,
                 (t3 - t2) + (t_loop - t1), sampling, dec.mode, cached_tokens=start,
                 compile_s=compile_s + loop_compile_s)


def precompile(target: Target, draft: Optional[Draft], prompt_len: int, *,
               config: Optional[DecodeConfig] = None, sampling: Optional[SamplingConfig] = None,
               loop: bool = True, grammar: bool = False, **overrides) -> float:
  """Compile ahead of time (nothing runs) the programs `generate` runs for a prompt of
  prompt_len tokens with this config and sampling: the prefill, and the decode loop when `loop`
  (`generate` compiles the loop itself right after the first token, so a caller that wants the
  first token soonest passes loop=False); grammar: the constrained-decoding variants. Returns
  the seconds it took. Raises ValueError as `generate` does for a bad config."""
  _check_types(config, sampling)
  sampling, overrides = _split_overrides(sampling, overrides)
  dec = resolve_config(draft, config, target=target, **overrides)
  if not 0 < prompt_len < dec.max_ctx:
    raise ValueError(f"prompt_len={prompt_len} must be in [1, max_ctx={dec.max_ctx})")
  check_config(target, draft, dec)             # before the decode state is allocated
  b = batching.SlotBatch(target, draft, dec, 1, resolve_eog(target, None))
  t = b.compile_prefill(prompt_len, sampling, grammar=grammar)
  if loop:
    t += b.compile_loop(sampled=not sampling.greedy, grammar=grammar)
  return t


def _per_prompt(name: str, value, n: int, check) -> list:
  """One value per prompt from a scalar or a length-n sequence; ValueError naming `name`."""
  if isinstance(value, (list, tuple, np.ndarray)):
    if len(value) != n:
      raise ValueError(f"{name}: {len(value)} values for {n} prompts")
    vals = list(value)
  else:
    vals = [value] * n
  for i, v in enumerate(vals):
    try:
      check(v)
    except ValueError as e:
      raise ValueError(f"{name}[{i}]: {e}") from None
  return vals


def default_batch_size() -> int:
  """Rows decoded together by default: 8 on CPU (an autoregressive step of 8 rows costs about
  two of one row there: the weights are read once), 32 on accelerators."""
  return 8 if jax.default_backend() == "cpu" else 32


def generate_batch(target: Target, draft: Optional[Draft], prompts: Sequence[Sequence[int]], *,
                   max_new_tokens, config: Optional[DecodeConfig] = None,
                   sampling: Optional[SamplingConfig] = None, batch_size: Optional[int] = None,
                   eog_ids: Optional[Sequence[int]] = None, steps_per_call: int = 8,
                   proposer: Optional[Callable] = None, proposer_params=None,
                   on_result: Optional[Callable[[int, GenerateResult], None]] = None,
                   grammar=None, **overrides) -> list[GenerateResult]:
  """Decode many prompts together in one compiled loop of B slots (continuous batching: a
  finished row's slot is refilled with the next prompt between loop calls, no recompile).

  prompts: sequence of token-id sequences (each [P_i] ints, P_i < max_ctx). max_new_tokens and
  the sampling `seed` (keyword or `sampling.seed`) may each be one value or one per prompt; the
  other DecodeConfig / SamplingConfig fields are shared, as `generate` takes them.
  batch_size: slots B (rounded up to a bucket in batching.BATCH_BUCKETS, at most the number of
  prompts); default `default_batch_size()`.
  on_result(i, result): called as soon as prompt i finishes (results come back in input order
  regardless).
  grammar: a grammar.Grammar for every prompt, or one per prompt (None: unconstrained), as
  `generate` takes it.
  Row i gives what `generate` gives for prompt i alone: the same tokens greedy, and the same
  tokens sampled with the same seed (each row draws from its own key).
  Returns one GenerateResult per prompt, in input order (prefill_s: that prompt's prefill;
  decode_s: from its first decode call to the call it finished in).
  Raises ValueError for an empty prompt list, a bad prompt (naming its index), a bad option, or
  a decode state of B rows larger than the memory available.
  """
  _check_types(config, sampling)
  if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
    raise ValueError("generate_batch: the prompt list is empty or not a list (prompts: a "
                     "non-empty sequence of token-id sequences)")
  _positive_int("steps_per_call", steps_per_call)
  n = len(prompts)
  max_news = _per_prompt("max_new_tokens", max_new_tokens, n,
                         lambda v: _positive_int("max_new_tokens", v))
  seed = overrides.pop("seed", None)
  sampling, overrides = _split_overrides(sampling, overrides)
  samps = [dataclasses.replace(sampling, seed=v) for v in
           _per_prompt("seed", sampling.seed if seed is None else seed, n,
                       lambda v: SamplingConfig(seed=v))]
  grammars = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * n
  if len(grammars) != n:
    raise ValueError(f"grammar: {len(grammars)} values for {n} prompts")
  b_req = default_batch_size() if batch_size is None else batch_size
  _positive_int("batch_size", b_req)
  B = batching.bucket(min(b_req, n))
  dec = resolve_config(draft, config, has_proposer=proposer is not None, target=target, batch=B,
                       **overrides)
  ids = []
  for i, p in enumerate(prompts):
    try:
      ids.append(check_prompt(target, p, dec))
    except ValueError as e:
      raise ValueError(f"prompts[{i}]: {e}") from None
  check_config(target, draft if proposer is None else None, dec, B)
  max_news = [min(m, dec.max_ctx) for m in max_news]
  eog = resolve_eog(target, eog_ids)
  b = batching.SlotBatch(target, draft, dec, B, eog, proposer=proposer,
                         proposer_params=proposer_params)
  results: list[Optional[GenerateResult]] = [None] * n
  slot_of: dict[int, tuple[int, float, float]] = {}        # slot -> (prompt, prefill_s, t_start)
  nxt = 0

  def admit(slot) -> bool:
    nonlocal nxt
    i = nxt
    if not b.grammar_fits(slot, grammars[i]):
      return False               # other rows' grammars fill the bank: wait for one to finish
    nxt += 1
    t0 = time.perf_counter()
    b.prefill(slot, ids[i], max_news[i], samps[i], grammar=grammars[i])
    _check_finite(target, b, slot)
    slot_of[slot] = (i, time.perf_counter() - t0, time.perf_counter())
    return True

  for g in grammars:
    if g is not None:
      b.grammars.check(g, param="grammar")
  free = list(range(B))
  while free and nxt < n and admit(free[0]):
    free.pop(0)
  while slot_of:
    _, idle = b.progress()
    for slot in [s for s in slot_of if idle[s]]:
      i, pre_s, t_start = slot_of.pop(slot)
      results[i] = _result(b.row(slot), ids[i], max_news[i], eog, False, pre_s,
                           time.perf_counter() - t_start, samps[i], dec.mode)
      if on_result is not None:
        on_result(i, results[i])
      b.grammars.release(slot)
      free.append(slot)
    while free and nxt < n and admit(free[0]):
      free.pop(0)
    if slot_of:
      b.run(steps_per_call)
  return results
