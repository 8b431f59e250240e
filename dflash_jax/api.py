"""Public API: load_target, load_draft, forward_logits, first_draft_logits, generate."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import decode as decode_lib
from dflash_jax import draft as draft_lib
from dflash_jax import target as target_lib
from dflash_jax.config import DecodeConfig, DraftConfig, TargetConfig
from dflash_jax.gguf_io import read_gguf
from dflash_jax.tokenizer import GGUFTokenizer


@dataclasses.dataclass
class Target:
  """A loaded GGUF target.

  Attributes:
    config: TargetConfig. params: TargetParams on device. tokenizer: GGUFTokenizer (None if the
    GGUF has no usable vocabulary). path: GGUF path. weights: "quantized" | "f32" | "bf16".
    compute_dtype: "float32" | "bfloat16" activations/matmul operands. gguf_tensor_bytes: bytes of
    all tensors in the file. general_name: GGUF `general.name`.
  """

  config: TargetConfig
  params: target_lib.TargetParams
  tokenizer: Optional[GGUFTokenizer]
  path: str
  weights: str
  compute_dtype: str
  gguf_tensor_bytes: int
  general_name: str = ""

  @property
  def device_bytes(self) -> int:
    """Bytes of the distinct device buffers holding the params (tied embeddings counted once)."""
    seen = {id(x): x.nbytes for x in jax.tree.leaves(self.params)}
    return int(sum(seen.values()))


@dataclasses.dataclass
class Draft:
  config: DraftConfig
  params: draft_lib.DraftParams
  path: str


def load_target(gguf_path: str, *, weights: str = "quantized", compute_dtype: str = "float32",
                tokenizer: bool = True, kernels: str = "auto",
                fuse_projections: bool = True) -> Target:
  """Load a GGUF target (`qwen35`, `llama`, `qwen3`).

  weights: "quantized" (default) keeps GGUF blocks packed on device and dequantizes inside the
    jitted forward; "f32"/"bf16" dequantize once at load (faster on CPU, 4-8x the memory).
  compute_dtype: "float32" (default; what the references are compared in) or "bfloat16".
  tokenizer: build the tokenizer from the GGUF vocabulary (errors if unsupported).
  kernels: "auto" (Pallas kernels on GPU, the pure-JAX reference elsewhere), "pallas",
    "reference", or "pallas_interpret" (Pallas interpreter; slow, for tests). The Pallas
    dequantizing matmul needs weights="quantized" (float weights always use XLA's dot).
  fuse_projections: stack the packed rows of same-format projections of one input (q/k/v, ffn
    gate/up, Gated DeltaNet qkv/z/beta/alpha) at load so each group is one matmul.
  Raises FileNotFoundError, ValueError (unknown architecture or quant type, truncated file,
  tensor shape mismatch) or NotImplementedError (unsupported tokenizer kind), naming the file.
  """
  if compute_dtype not in ("float32", "bfloat16"):
    raise ValueError(f"compute_dtype={compute_dtype!r}: expected 'float32' or 'bfloat16'")
  from dflash_jax.layers import KERNEL_CHOICES
  if kernels == "auto":
    kernels = "pallas" if jax.default_backend() == "gpu" else "reference"
  if kernels not in KERNEL_CHOICES:
    raise ValueError(f"kernels={kernels!r}: expected 'auto' or one of {KERNEL_CHOICES}")
  f = read_gguf(gguf_path)
  if "token_embd.weight" not in f.tensors:
    arch = f.meta.get("general.architecture")
    if arch not in ("qwen35", "llama", "qwen3"):
      TargetConfig.from_gguf(f.meta, n_vocab=0, path=f.path)  # raises the architecture error
    raise ValueError(f"{f.path}: missing tensor 'token_embd.weight'")
  cfg = TargetConfig.from_gguf(f.meta, n_vocab=f.tensors["token_embd.weight"].shape[0],
                               path=f.path, has_rope_freqs="rope_freqs.weight" in f.tensors)
  cfg = dataclasses.replace(cfg, kernels=kernels)
  params = jax.device_put(target_lib.load_params(f, cfg, weights=weights, fuse=fuse_projections))
  tok = GGUFTokenizer(f.meta, path=f.path) if tokenizer else None
  return Target(cfg, params, tok, f.path, weights, compute_dtype, f.n_tensor_bytes,
                str(f.meta.get("general.name", "")))


def load_draft(draft_dir: str, target: Target) -> Draft:
  """Load a z-lab DFlash draft directory and check it against `target` (hidden size, vocab,
  target_layer_ids, mask id). Raises FileNotFoundError / ValueError naming the draft."""
  cfg, params = draft_lib.load(draft_dir, target.config)
  return Draft(cfg, jax.device_put(params), draft_dir)


_forward_jit = jax.jit(target_lib.forward, static_argnames=(
    "cfg", "mode", "feature_layers", "logits_rows", "compute_dtype"))


def forward_logits(target: Target, token_ids: Sequence[int], *,
                   feature_layers: tuple[int, ...] = (), pad_to: int = 64):
  """Full forward of a token sequence from an empty cache (prefill math, one call).

  token_ids: [T] ints. The call is padded to a multiple of `pad_to` tokens so that nearby lengths
  share one compiled function (padding sits after the real tokens and cannot affect them).
  Returns logits [T, V] float32 (numpy); with feature_layers, (logits, features [T, F*D]).
  """
  ids = np.asarray(token_ids, np.int32).reshape(-1)
  n = ids.size
  if n == 0:
    raise ValueError("forward_logits needs at least one token")
  padded = -(-n // pad_to) * pad_to
  cache = target_lib.init_cache(target.config, padded)
  logits, feats, _, _ = _forward_jit(target.params, target.config,
                                     jnp.asarray(np.pad(ids, (0, padded - n))), jnp.int32(0),
                                     cache, n_valid=jnp.int32(n), mode="prefill",
                                     feature_layers=tuple(feature_layers),
                                     compute_dtype=target.compute_dtype)
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
    prompt_len: prompt tokens. stop_reason: "eog" | "max_new_tokens" | "max_ctx".
    prefill_s, decode_s: wall seconds (compile excluded after the first call with these shapes).
  """

  tokens: list[int]
  accept_lens: list[int]
  n_steps: int
  prompt_len: int
  stop_reason: str
  prefill_s: float
  decode_s: float

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


def _prepare(target: Target, draft: Optional[Draft], prompt_ids, mode, max_ctx, block_size,
             prefill_chunk, tree_opts=None):
  if mode not in ("ar", "chain", "ddtree"):
    raise ValueError(f"mode={mode!r}: expected 'ar', 'chain' or 'ddtree'")
  if mode != "ar" and draft is None and block_size is None:
    raise ValueError(f"mode={mode!r} needs a draft (or a proposer and block_size)")
  tree_opts = dict(tree_opts or {})
  if tree_opts.get("budget", 1) < 1 or tree_opts.get("top_k", 1) < 1:
    raise ValueError(f"budget and top_k must be >= 1, got {tree_opts}")
  if block_size is None:
    block_size = draft.config.block_size if draft is not None else 16
  if draft is not None and block_size != draft.config.block_size:
    raise ValueError(f"block_size={block_size} differs from the draft's block_size="
                     f"{draft.config.block_size}")
  ids = np.asarray(prompt_ids, np.int32).reshape(-1)
  if ids.size == 0:
    raise ValueError("empty prompt: at least one token is needed")
  if ids.size >= max_ctx:
    raise ValueError(f"prompt has {ids.size} tokens, which does not fit max_ctx={max_ctx} "
                     f"(prompt + at least one generated token); raise --max_ctx")
  if ids.max() >= target.config.n_vocab or ids.min() < 0:
    raise ValueError(f"prompt token ids must be in [0, {target.config.n_vocab})")
  dec = DecodeConfig(mode=mode, block_size=block_size, max_ctx=max_ctx,
                     prefill_chunk=prefill_chunk, **tree_opts)
  return ids, dec


def _eog(target: Target, eog_ids):
  if eog_ids is None:
    eog_ids = target.tokenizer.eog_ids if target.tokenizer is not None else ()
  return jnp.asarray(list(eog_ids) or [-1], jnp.int32)


def _prefill(target, draft, ids, dec, eog):
  """Prefill `ids` chunk by chunk into a fresh DecodeState."""
  dcfg = draft.config if (draft is not None and dec.mode != "ar") else None
  dparams = draft.params if dcfg is not None else None
  state = decode_lib.init_state(target.config, dcfg, dec)
  c = dec.prefill_chunk
  for s0 in range(0, ids.size, c):
    chunk = ids[s0:s0 + c]
    n = chunk.size
    chunk = np.pad(chunk, (0, c - n))
    state = decode_lib.prefill_chunk(target.params, dparams, state, jnp.asarray(chunk),
                                     jnp.int32(s0), jnp.int32(n), eog, tcfg=target.config,
                                     dcfg=dcfg, dec=dec, compute_dtype=target.compute_dtype)
  return state, dcfg, dparams


def first_draft_logits(target: Target, draft: Draft, prompt_ids: Sequence[int], *,
                       max_ctx: int = 2048, prefill_chunk: int = 128) -> np.ndarray:
  """Prefill prompt_ids, take the greedy next token as the bonus, run one draft step over the
  prompt's target features. Returns draft logits [block_size-1, V] float32 (row j predicts the
  token at position P+1+j)."""
  ids, dec = _prepare(target, draft, prompt_ids, "chain", max_ctx, None, prefill_chunk)
  state, dcfg, dparams = _prefill(target, draft, ids, dec, _eog(target, None))
  return np.asarray(decode_lib.draft_once(target.params, dparams, state, tcfg=target.config,
                                          dcfg=dcfg, dec=dec, compute_dtype=target.compute_dtype))


def generate(target: Target, draft: Optional[Draft], prompt_ids: Sequence[int], *,
             max_new_tokens: int, mode: str = "chain", max_ctx: int = 2048,
             block_size: Optional[int] = None, prefill_chunk: int = 128, budget: int = 22,
             top_k: int = 8, chain_seed: bool = True, draft_temp: float = 1.0,
             eog_ids: Optional[Sequence[int]] = None,
             on_tokens: Optional[Callable[[list[int]], None]] = None, steps_per_call: int = 4,
             proposer: Optional[Callable] = None, proposer_params=None) -> GenerateResult:
  """Greedy generation: speculative (mode="chain": DFlash chain; mode="ddtree": DDTree with
  `budget` nodes, `top_k` candidates per depth, the top-1 `chain_seed` and `draft_temp`) or
  autoregressive (mode="ar").

  prompt_ids: [P] ints, P < max_ctx. max_new_tokens: tokens to generate at most (the loop also
  stops after an EOG token, or when the context reaches max_ctx).
  on_tokens: called with the newly committed token ids; the loop then runs `steps_per_call`
    steps per device call (the same compiled function), else all steps in one call.
  proposer / proposer_params: replace the DFlash draft (see decode.dflash_proposer), e.g. an oracle.
  Greedy chain and DDTree output equal autoregressive output token for token.
  Raises ValueError for a bad mode, an empty or too long prompt, or a block size mismatch.
  """
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
  tree_opts = (dict(budget=budget, top_k=top_k, chain_seed=chain_seed, draft_temp=draft_temp)
               if mode == "ddtree" else None)
  ids, dec = _prepare(target, draft, prompt_ids, mode, max_ctx, block_size, prefill_chunk,
                      tree_opts)
  eog = _eog(target, eog_ids)
  t0 = time.perf_counter()
  if proposer is not None:
    state, dcfg, _ = _prefill(target, None, ids, dec, eog)
    dparams = proposer_params
  else:
    proposer = decode_lib.dflash_proposer
    state, dcfg, dparams = _prefill(target, draft, ids, dec, eog)
  jax.block_until_ready(state.out)
  t1 = time.perf_counter()
  max_new = jnp.int32(max_new_tokens)
  run = lambda st, k: decode_lib.decode_loop(
      target.params, dparams, st, max_new, jnp.int32(k), eog, tcfg=target.config, dcfg=dcfg,
      dec=dec, compute_dtype=target.compute_dtype, proposer=proposer)
  if on_tokens is None:
    state = run(state, 1 << 30)
  else:
    on_tokens([int(state.out[0])])
    shown = 1
    while True:
      state = run(state, steps_per_call)
      n_out = int(state.n_out)
      if n_out > shown:
        on_tokens([int(x) for x in np.asarray(state.out[shown:n_out])])
        shown = n_out
      if (bool(state.done) or n_out >= max_new_tokens or int(state.pos) >= dec.max_ctx):
        break
  jax.block_until_ready(state.out)
  t2 = time.perf_counter()
  n_out, n_steps = int(state.n_out), int(state.n_steps)
  tokens = [int(x) for x in np.asarray(state.out[:n_out])]
  eogs = set(np.asarray(eog).tolist())
  stop = ("eog" if tokens and tokens[-1] in eogs else
          "max_new_tokens" if n_out >= max_new_tokens else "max_ctx")
  return GenerateResult(tokens=tokens, accept_lens=[int(x) for x in np.asarray(state.accept_lens[:n_steps])],
                        n_steps=n_steps, prompt_len=int(ids.size), stop_reason=stop,
                        prefill_s=t1 - t0, decode_s=t2 - t1)
