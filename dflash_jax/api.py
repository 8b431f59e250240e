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

from dflash_jax import decode as decode_lib
from dflash_jax import draft as draft_lib
from dflash_jax import draft_io
from dflash_jax import target as target_lib
from dflash_jax import target_params
from dflash_jax.config import SUPPORTED_ARCHS, DecodeConfig, DraftConfig, TargetConfig
from dflash_jax.gguf_io import read_gguf
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
    seen = {id(x): x.nbytes for x in jax.tree.leaves(self.params)}
    return int(sum(seen.values()))


@dataclasses.dataclass
class Draft:
  """A loaded z-lab DFlash draft: config, params on device, and the directory it came from."""

  config: DraftConfig
  params: draft_lib.DraftParams
  path: str


WEIGHTS = ("auto", "quantized", "f32", "bf16")


def _resolve_weights(weights: str, f, rt: Runtime) -> str:
  """weights="auto": "quantized" for the Pallas kernels (they read packed GGUF blocks) and on
  accelerators; on CPU "f32" when the dequantized weights take at most half the available
  memory, else "quantized". Measured on XLA:CPU (SmolLM2 Q4_1, AR, bench_out/cpu_profile): the
  dot over f32 weights streams them at ~20 GB/s, while packed weights are dequantized inside
  every device call (XLA hoists it out of the decode loop): 30 vs 35 ms/token at 32 steps per
  call, 30 vs 69 ms/token at 4 (streaming)."""
  if weights not in WEIGHTS:
    raise ValueError(f"weights={weights!r}: expected one of {WEIGHTS}")
  if weights != "auto":
    return weights
  if rt.kernels != "reference" or jax.default_backend() != "cpu":
    return "quantized"
  need = 4 * sum(int(np.prod(t.shape)) for t in f.tensors.values())
  have = available_bytes()
  return "f32" if have is not None and need <= have // 2 else "quantized"


def load_target(gguf_path: str, *, weights: str = "auto", compute_dtype: str = "float32",
                kv_dtype: str = "float32", tokenizer: bool = True, kernels: str = "auto",
                fuse_projections: bool = True) -> Target:
  """Load a GGUF target (`qwen35`, `llama`, `qwen3`).

  weights: "quantized" keeps GGUF blocks packed on device and dequantizes inside the jitted
    forward; "f32"/"bf16" dequantize once at load (4-8x the memory); "auto" (default) picks per
    platform by measurement (`_resolve_weights`: f32 on CPU when it fits, else quantized).
  compute_dtype, kv_dtype, kernels: the target's Runtime (see runtime.Runtime); kernels "auto"
    = Pallas kernels on GPU, the pure-JAX reference elsewhere. The Pallas dequantizing matmul
    needs weights="quantized" (float weights always use XLA's dot).
  tokenizer: build the tokenizer from the GGUF vocabulary (errors if unsupported).
  fuse_projections: stack the packed rows of same-format projections of one input (q/k/v, ffn
    gate/up, Gated DeltaNet qkv/z/beta/alpha) at load so each group is one matmul.
  Raises FileNotFoundError, ValueError (unknown architecture or quant type, truncated file,
  tensor shape mismatch, bad option) or NotImplementedError (unsupported tokenizer kind),
  naming the file or option.
  """
  rt = Runtime.for_backend(kernels, compute_dtype=compute_dtype, kv_dtype=kv_dtype)
  f = read_gguf(gguf_path)
  weights = _resolve_weights(weights, f, rt)
  if "token_embd.weight" not in f.tensors:
    if f.meta.get("general.architecture") not in SUPPORTED_ARCHS:
      TargetConfig.from_gguf(f.meta, n_vocab=0, path=f.path)  # raises the architecture error
    raise ValueError(f"{f.path}: missing tensor 'token_embd.weight'")
  cfg = TargetConfig.from_gguf(f.meta, n_vocab=f.tensors["token_embd.weight"].shape[0],
                               path=f.path, has_rope_freqs="rope_freqs.weight" in f.tensors)
  params = jax.device_put(target_params.load_params(f, cfg, weights=weights,
                                                    fuse=fuse_projections))
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


def load_draft(draft_dir: str, target: Target) -> Draft:
  """Load a z-lab DFlash draft directory and check it against `target` (hidden size, vocab,
  target_layer_ids, mask id). Raises FileNotFoundError / ValueError naming the draft."""
  cfg, params = draft_io.load(draft_dir, target.config)
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
  Raises ValueError for an empty sequence.
  """
  ids = np.asarray(token_ids, np.int32).reshape(-1)
  n = ids.size
  if n == 0:
    raise ValueError("forward_logits needs at least one token")
  padded = -(-n // pad_to) * pad_to
  cache = target_lib.init_cache(target.config, padded, target.runtime)
  logits, feats = _full_forward(target.params, jnp.asarray(np.pad(ids, (0, padded - n))),
                                jnp.int32(n), cache, cfg=target.config, rt=target.runtime,
                                feature_layers=tuple(feature_layers))
  if feature_layers:
    return np.asarray(logits)[:n], np.asarray(feats)[:n]
  return np.asarray(logits)[:n]


@dataclasses.dataclass
class GenerateResult:
  """Output of `generate`.

  Attributes:
    tokens: generated ids (first = greedy token after the prompt; an EOG token, if hit, is last).
    accept_lens: tokens committed per decode step (accepted drafts + bonus); mean = acceptance length.
    n_steps: decode steps (target verify forwards after prefill).
    prompt_len: prompt tokens. stop_reason: "eog" | "max_new_tokens" | "max_ctx" | "stopped"
      (on_tokens asked to stop).
    prefill_s, decode_s: wall seconds (compile excluded after the first call with these shapes).
    sampling: the SamplingConfig used (temperature 0 = greedy).
  """

  tokens: list[int]
  accept_lens: list[int]
  n_steps: int
  prompt_len: int
  stop_reason: str
  prefill_s: float
  decode_s: float
  sampling: SamplingConfig = SamplingConfig()

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


def resolve_config(draft: Optional[Draft], config: Optional[DecodeConfig] = None, *,
                   has_proposer: bool = False, **overrides) -> DecodeConfig:
  """The DecodeConfig a call decodes with: `config` (default DecodeConfig()) with `overrides`
  (DecodeConfig field names) applied and block_size taken from the draft when unset (16 for a
  proposer without a draft). Raises ValueError for an unknown field or a bad value (naming
  it), a speculative mode without a draft, or a block size that differs from the draft's."""
  fields = {f.name for f in dataclasses.fields(DecodeConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown option(s) {unknown}; DecodeConfig fields: {sorted(fields)}, "
                     f"SamplingConfig fields: {sorted(f.name for f in dataclasses.fields(SamplingConfig))}")
  dec = dataclasses.replace(config or DecodeConfig(), **overrides)
  if dec.mode != "ar" and draft is None and not has_proposer:
    raise ValueError(f"mode={dec.mode!r} needs a draft (or a proposer)")
  if draft is not None and dec.block_size not in (None, draft.config.block_size):
    raise ValueError(f"block_size={dec.block_size} differs from the draft's block_size="
                     f"{draft.config.block_size}")
  if dec.block_size is None:
    dec = dataclasses.replace(dec, block_size=draft.config.block_size if draft is not None else 16)
  return dec


def state_bytes(target: Target, draft: Optional[Draft], dec: DecodeConfig) -> int:
  """Bytes of the DecodeState `generate` allocates for `dec` (target KV / SSM / conv cache,
  draft context cache, target-feature buffer, output buffers), from the shapes alone
  (jax.eval_shape: nothing is allocated; cached per static configuration, since generate asks
  on every call)."""
  return _state_bytes(target.config, _draft_config(draft, dec), dec, target.runtime)


@functools.lru_cache(maxsize=64)
def _state_bytes(tcfg: TargetConfig, dcfg: Optional[DraftConfig], dec: DecodeConfig,
                 rt: Runtime) -> int:
  shapes = jax.eval_shape(lambda: decode_lib.init_state(tcfg, dcfg, dec, rt))
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


def check_config(target: Target, draft: Optional[Draft], dec: DecodeConfig):
  """Checks made before anything is compiled or allocated: tree_top_k within the vocabulary; the
  decode state must fit in the memory available (ValueError saying how much it needs and has;
  lower max_ctx); warns when max_ctx exceeds the model's trained context length
  (`context_length`)."""
  if dec.mode == "ddtree" and dec.tree_top_k > target.config.n_vocab:
    raise ValueError(f"tree_top_k={dec.tree_top_k} exceeds the vocabulary ({target.config.n_vocab})")
  need, have = state_bytes(target, draft, dec), available_bytes()
  if have is not None and need > have:
    raise ValueError(f"max_ctx={dec.max_ctx}: the decode cache needs {need / 2**30:.2f} GiB but "
                     f"only {have / 2**30:.2f} GiB is available on {jax.devices()[0].platform}; "
                     f"lower --max_ctx")
  n_train = target.config.n_ctx_train
  if n_train and dec.max_ctx > n_train:
    warnings.warn(f"max_ctx={dec.max_ctx} exceeds the model's context_length={n_train} "
                  f"({target.path}): quality past it is not what the model was trained for",
                  stacklevel=3)


def check_prompt(target: Target, prompt_ids, dec: DecodeConfig) -> np.ndarray:
  """prompt_ids as [P] int32, checked: non-empty, integer, P < dec.max_ctx, ids in the
  vocabulary. Raises ValueError saying which."""
  ids = np.asarray(prompt_ids).reshape(-1)
  if ids.size == 0:
    raise ValueError("empty prompt: at least one token is needed")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"prompt token ids must be integers, got dtype {ids.dtype}")
  if ids.size >= dec.max_ctx:
    raise ValueError(f"prompt has {ids.size} tokens, which does not fit max_ctx={dec.max_ctx} "
                     f"(prompt + at least one generated token); raise --max_ctx")
  if ids.max() >= target.config.n_vocab or ids.min() < 0:
    raise ValueError(f"prompt token ids must be in [0, {target.config.n_vocab})")
  return ids.astype(np.int32)


def _eog(target: Target, eog_ids):
  if eog_ids is None:
    eog_ids = target.tokenizer.eog_ids if target.tokenizer is not None else ()
  return jnp.asarray(list(eog_ids) or [-1], jnp.int32)


def _draft_config(draft: Optional[Draft], dec: DecodeConfig) -> Optional[DraftConfig]:
  """The DraftConfig the decode functions get: the draft's in speculative modes, else None."""
  return draft.config if (draft is not None and dec.mode != "ar") else None


def _positive_int(name: str, value):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _prefill(target: Target, draft: Optional[Draft], ids: np.ndarray, dec: DecodeConfig, eog,
             sampling: SamplingConfig = SamplingConfig()):
  """Prefill `ids` chunk by chunk into a fresh DecodeState (the draft ingests the prompt's
  target features when given and the mode is speculative); the first token is drawn as
  `sampling` says."""
  dcfg = _draft_config(draft, dec)
  state = decode_lib.init_state(target.config, dcfg, dec, target.runtime, seed=sampling.seed)
  c = dec.prefill_chunk
  for s0 in range(0, ids.size, c):
    chunk = ids[s0:s0 + c]
    n = chunk.size
    state = decode_lib.prefill_chunk(
        target.params, draft.params if dcfg is not None else None, state,
        jnp.asarray(np.pad(chunk, (0, c - n))), jnp.int32(s0), jnp.int32(n), eog,
        sampling.params(), tcfg=target.config, dcfg=dcfg, dec=dec, rt=target.runtime)
  return state


def first_draft_logits(target: Target, draft: Draft, prompt_ids: Sequence[int], *,
                       max_ctx: int = 2048, prefill_chunk: int = 128) -> np.ndarray:
  """Prefill prompt_ids, take the greedy next token as the bonus, run one draft step over the
  prompt's target features. Returns draft logits [block_size-1, V] float32 (row j predicts the
  token at position P+1+j)."""
  dec = resolve_config(draft, mode="chain", max_ctx=max_ctx, prefill_chunk=prefill_chunk)
  state = _prefill(target, draft, check_prompt(target, prompt_ids, dec), dec, _eog(target, None))
  return np.asarray(decode_lib.draft_once(target.params, draft.params, state, dcfg=draft.config,
                                          rt=target.runtime))


def _run_loop(run, state, max_new_tokens: int, dec: DecodeConfig, on_tokens, steps_per_call: int):
  """Drive `run(state, max_steps)` to the end: one call, or `steps_per_call` steps per call
  with the newly committed tokens passed to on_tokens after each. Returns (state, stopped:
  on_tokens returned True)."""
  if on_tokens is None:
    return run(state, 1 << 30), False
  if on_tokens([int(state.out[0])]) is True:
    return state, True
  shown = 1
  while True:
    if bool(state.done) or shown >= max_new_tokens or int(state.pos) >= dec.max_ctx:
      return state, False
    state = run(state, steps_per_call)
    n_out = int(state.n_out)
    if n_out > shown:
      new, shown = [int(x) for x in np.asarray(state.out[shown:n_out])], n_out
      if on_tokens(new) is True:
        return state, True


def generate(target: Target, draft: Optional[Draft], prompt_ids: Sequence[int], *,
             max_new_tokens: int, config: Optional[DecodeConfig] = None,
             eog_ids: Optional[Sequence[int]] = None,
             on_tokens: Optional[Callable[[list[int]], None]] = None, steps_per_call: int = 4,
             proposer: Optional[Callable] = None, proposer_params=None,
             sampling: Optional[SamplingConfig] = None, **overrides) -> GenerateResult:
  """Generation: speculative (mode "chain": DFlash chain; "ddtree": DDTree) or autoregressive
  ("ar"), as `config` (a DecodeConfig) says, greedy or sampled as `sampling` (a SamplingConfig;
  default greedy) says. DecodeConfig and SamplingConfig fields may also be given as keywords
  (e.g. mode="ddtree", budget=8, temperature=0.7, top_p=0.95, seed=1); they override the two.

  prompt_ids: [P] ints, P < max_ctx. max_new_tokens: tokens to generate at most (the loop also
  stops after an EOG token, or when the context reaches max_ctx).
  on_tokens: called with the newly committed token ids; the loop then runs `steps_per_call`
    steps per device call (the same compiled function), else all steps in one call. Returning
    True from it stops generation there (stop_reason "stopped"; a server's stop strings and
    client disconnects).
  proposer / proposer_params: replace the DFlash draft (see decode.dflash_proposer), e.g. an oracle.
  Greedy chain and DDTree output equal autoregressive output token for token; sampled output
  has the distribution of autoregressive sampling (sampling.py).
  Raises ValueError for a bad option (naming it), an empty or too long prompt, out-of-vocabulary
  ids, a block size mismatch, a decode state larger than the memory available (check_config),
  or non-finite logits after prefill (naming the GGUF).
  """
  _positive_int("max_new_tokens", max_new_tokens)
  _positive_int("steps_per_call", steps_per_call)
  samp_fields = {f.name for f in dataclasses.fields(SamplingConfig)}
  sampling = dataclasses.replace(sampling or SamplingConfig(),
                                 **{k: v for k, v in overrides.items() if k in samp_fields})
  dec = resolve_config(draft, config, has_proposer=proposer is not None,
                       **{k: v for k, v in overrides.items() if k not in samp_fields})
  ids = check_prompt(target, prompt_ids, dec)
  check_config(target, draft if proposer is None else None, dec)
  max_new_tokens = min(max_new_tokens, dec.max_ctx)    # never more than the context holds
  eog = _eog(target, eog_ids)
  t0 = time.perf_counter()
  if proposer is None:
    proposer, dparams = decode_lib.dflash_proposer, draft.params if draft is not None else None
  else:            # a proposer replaces the DFlash draft: no draft cache, no target features
    draft, dparams = None, proposer_params
  state = _prefill(target, draft, ids, dec, eog, sampling)
  dcfg = _draft_config(draft, dec)
  if not bool(state.finite):
    raise ValueError(f"{target.path}: the target's logits after prefill are not finite (NaN or "
                     f"inf): corrupt weights or metadata")
  t1 = time.perf_counter()
  run = functools.partial(decode_lib.decode_loop, target.params, dparams,
                          max_new=jnp.int32(max_new_tokens), eog_ids=eog,
                          sampling=sampling.params(), tcfg=target.config,
                          dcfg=dcfg, dec=dec, rt=target.runtime, proposer=proposer)
  state, stopped = _run_loop(lambda st, k: run(st, max_steps=jnp.int32(k)), state,
                             max_new_tokens, dec, on_tokens, steps_per_call)
  jax.block_until_ready(state.out)
  t2 = time.perf_counter()
  n_out, n_steps = int(state.n_out), int(state.n_steps)
  tokens = [int(x) for x in np.asarray(state.out[:n_out])]
  stop = ("eog" if tokens and tokens[-1] in set(np.asarray(eog).tolist()) else
          "stopped" if stopped else "max_new_tokens" if n_out >= max_new_tokens else "max_ctx")
  return GenerateResult(tokens=tokens,
                        accept_lens=[int(x) for x in np.asarray(state.accept_lens[:n_steps])],
                        n_steps=n_steps, prompt_len=int(ids.size), stop_reason=stop,
                        prefill_s=t1 - t0, decode_s=t2 - t1, sampling=sampling)
