"""The absl flags that build a `DecodeConfig` and a `SamplingConfig`, shared by the scripts.

Call `define()` once at a script's module level; `config(holders, mode=...)` then returns the
validated DecodeConfig and `sampling(holders, defaults)` the SamplingConfig (a bad value is a
ValueError naming the flag). Kept out of `cli` so importing the library defines no flags.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from dflash_jax.config import AUTO, CHAIN_RULES, DRAFT_POSITIONS, MODES, DecodeConfig
from dflash_jax.sampling import SamplingConfig

_DEFAULT = DecodeConfig()


@dataclasses.dataclass(frozen=True)
class DecodeFlags:
  """Holders of the decode flags (read `.value` after absl has parsed argv)."""

  mode: flags.FlagHolder
  block_size: flags.FlagHolder
  max_ctx: flags.FlagHolder
  budget: flags.FlagHolder
  tree_top_k: flags.FlagHolder
  chain_seed: flags.FlagHolder
  draft_temp: flags.FlagHolder
  chain_rule: flags.FlagHolder
  draft_window: flags.FlagHolder
  draft_positions: flags.FlagHolder
  invariant_rows: flags.FlagHolder
  lookup: flags.FlagHolder
  lookup_ngram_min: flags.FlagHolder
  lookup_ngram_max: flags.FlagHolder
  lookup_table: flags.FlagHolder
  lookup_table_expect: flags.FlagHolder
  table_mix: flags.FlagHolder
  temperature: flags.FlagHolder
  top_k: flags.FlagHolder
  top_p: flags.FlagHolder
  min_p: flags.FlagHolder
  seed: flags.FlagHolder
  repeat_penalty: flags.FlagHolder
  presence_penalty: flags.FlagHolder
  frequency_penalty: flags.FlagHolder
  penalty_last_n: flags.FlagHolder


def define(flag_values: flags.FlagValues = flags.FLAGS, *,
           max_ctx: int = _DEFAULT.max_ctx) -> DecodeFlags:
  """Defines --mode, --block_size, --max_ctx, --budget, --tree_top_k, --chain_seed,
  --draft_temp, --chain_rule, --draft_window, --draft_positions, --invariant_rows, --lookup,
  --lookup_ngram_min, --lookup_ngram_max, --lookup_table, --lookup_table_expect, --table_mix and the
  sampling flags --temperature, --top_k, --top_p, --min_p,
  --seed (unset sampling flags take the GGUF's recommended values, else greedy)."""
  fv = dict(flag_values=flag_values)
  return DecodeFlags(
      mode=flags.DEFINE_enum("mode", AUTO, list(MODES) + [AUTO], "Decoding: 'chain' (DFlash), "
                             "'ddtree' (DDTree draft tree), 'lookup' (prompt-lookup n-gram "
                             "drafts, no draft model; needs --lookup), 'ar' (autoregressive) or "
                             "'auto' (the "
                             "mode measured fastest for this platform, model pair and batch size; "
                             "ar without a draft or a measurement: see dflash_jax/auto_mode.py).",
                             **fv),
      block_size=flags.DEFINE_integer("block_size", None, "Draft block size L (default and only "
                                      "valid value: the draft's).", **fv),
      max_ctx=flags.DEFINE_integer("max_ctx", max_ctx, "Context capacity in tokens (prompt + "
                                   "output).", **fv),
      budget=flags.DEFINE_integer("budget", _DEFAULT.budget, "DDTree nodes besides the root.", **fv),
      tree_top_k=flags.DEFINE_integer("tree_top_k", _DEFAULT.tree_top_k, "DDTree candidates "
                                      "per depth.", **fv),
      chain_seed=flags.DEFINE_boolean("chain_seed", _DEFAULT.chain_seed, "DDTree: insert the "
                                      "draft's top-1 chain first.", **fv),
      draft_temp=flags.DEFINE_float("draft_temp", _DEFAULT.draft_temp, "DDTree: temperature of "
                                    "the draft log-probs.", **fv),
      chain_rule=flags.DEFINE_enum("chain_rule", _DEFAULT.chain_rule, list(CHAIN_RULES),
                                   "Chain verification when sampling: 'rejection' (standard "
                                   "speculative sampling) or 'match' (accept while the draft's "
                                   "argmax equals the target's draw).", **fv),
      draft_window=flags.DEFINE_integer(
          "draft_window", None, "The draft attends to the target features of the last "
          "draft_window positions only (a fixed-size ring buffer: its memory does not grow with "
          "--max_ctx). Default: the draft config's sliding_window when all its layers slide, "
          "else 4096 (z-lab's training length); 0 = every position.", **fv),
      draft_positions=flags.DEFINE_enum(
          "draft_positions", _DEFAULT.draft_positions, list(DRAFT_POSITIONS), "The draft's RoPE "
          "positions with a --draft_window ring buffer: 'absolute' (position in the sequence) or "
          "'window' (relative to the window's first position, as in training on window-length "
          "sequences). RoPE sees only key-query offsets, so they agree up to float rounding.",
          **fv),
      invariant_rows=flags.DEFINE_integer(
          "invariant_rows", _DEFAULT.invariant_rows, "Batch-invariant decoding: every decode "
          "forward (AR step, chain / DDTree verify) runs this many rows with position-ordered "
          "attention, so chain and DDTree output equals AR output bit for bit in every "
          "--kv_dtype when all use the same value (>= the mode's verify size, e.g. 23 for "
          "DDTree at budget 22). 0 = off (faster).", **fv),
      lookup=flags.DEFINE_integer(
          "lookup", _DEFAULT.lookup, "Prompt-lookup drafting: up to this many tokens that followed "
          "the latest earlier occurrence of the context's last n-gram (in the last 2048 tokens). "
          "--mode lookup drafts with it alone; chain / ddtree graft it into the draft's tree as "
          "one more branch (<= block_size - 1). 0 = off.", **fv),
      lookup_ngram_min=flags.DEFINE_integer("lookup_ngram_min", _DEFAULT.lookup_ngram_min,
                                            "Shortest n-gram --lookup matches.", **fv),
      lookup_ngram_max=flags.DEFINE_integer("lookup_ngram_max", _DEFAULT.lookup_ngram_max,
                                            "Longest n-gram --lookup matches (tried first).", **fv),
      lookup_table=flags.DEFINE_string(
          "lookup_table", _DEFAULT.lookup_table, "A static n-gram table (an .npz from "
          "dflash_jax.ngram.save, or a token-shard directory such as checkpoints/train_data/"
          "<target>/, built from its greedy shards when loaded): where the context has no "
          "--lookup match, propose the table's chain of most frequent next tokens (needs "
          "--lookup). Empty = off.", **fv),
      lookup_table_expect=flags.DEFINE_float(
          "lookup_table_expect", _DEFAULT.lookup_table_expect, "Propose a --lookup_table chain "
          "only when its expected accepted length (tokens, from the table's counts) is at least "
          "this; 0 = always (where a verify costs about one step, e.g. on a GPU).", **fv),
      table_mix=flags.DEFINE_float(
          "table_mix", _DEFAULT.table_mix, "chain / ddtree with --lookup_table: mix each draft "
          "row with the table's next token after the chain so far, weight w on the table's "
          "share (q = (p + w s delta_t) / (1 + w s)). 0 = off.", **fv),
      temperature=flags.DEFINE_float("temperature", None, "Sampling temperature; 0 = greedy. "
                                     "Default: the GGUF's general.sampling.temp, else 0.", **fv),
      top_k=flags.DEFINE_integer("top_k", None, "Sampling top-k (0 = off). Default: the GGUF's, "
                                 "else 0.", **fv),
      top_p=flags.DEFINE_float("top_p", None, "Sampling top-p (1 = off). Default: the GGUF's, "
                               "else 1.", **fv),
      min_p=flags.DEFINE_float("min_p", None, "Sampling min-p (0 = off). Default: the GGUF's, "
                               "else 0.", **fv),
      seed=flags.DEFINE_integer("seed", 0, "Sampling seed.", **fv),
      repeat_penalty=flags.DEFINE_float("repeat_penalty", 1.0, "Penalize repeated tokens: logit "
                                        "/ p if > 0, else * p (1 = off; llama.cpp's).", **fv),
      presence_penalty=flags.DEFINE_float("presence_penalty", 0.0, "Subtracted from the logit of "
                                          "a token seen in the window (0 = off).", **fv),
      frequency_penalty=flags.DEFINE_float("frequency_penalty", 0.0, "Times a token's count in "
                                           "the window, subtracted from its logit (0 = off).",
                                           **fv),
      penalty_last_n=flags.DEFINE_integer("penalty_last_n", 64, "The penalties' window: the "
                                          "last n tokens, prompt included (0..256).", **fv),
  )


def config(f: DecodeFlags, **overrides) -> DecodeConfig:
  """The DecodeConfig the flags name; `overrides` (DecodeConfig fields) win over flags (mode
  "auto" is resolved later, by `api.resolve_config`, per batch size). Raises ValueError naming
  the flag for a bad value."""
  values = dict(mode=f.mode.value, block_size=f.block_size.value,
                max_ctx=f.max_ctx.value, budget=f.budget.value, tree_top_k=f.tree_top_k.value,
                chain_seed=f.chain_seed.value, draft_temp=f.draft_temp.value,
                chain_rule=f.chain_rule.value, draft_window=f.draft_window.value,
                draft_positions=f.draft_positions.value,
                invariant_rows=f.invariant_rows.value, lookup=f.lookup.value,
                lookup_ngram_min=f.lookup_ngram_min.value,
                lookup_ngram_max=f.lookup_ngram_max.value, lookup_table=f.lookup_table.value,
                lookup_table_expect=f.lookup_table_expect.value, table_mix=f.table_mix.value)
  values.update(overrides)
  try:
    return DecodeConfig(**values)
  except ValueError as e:  # name the flag, not the dataclass field
    raise ValueError(str(e).replace("DecodeConfig.", "--")) from None


def sampling(f: DecodeFlags, defaults: SamplingConfig | None = None) -> SamplingConfig:
  """The SamplingConfig the flags name; a sampling flag left unset takes its value from
  `defaults` (the GGUF's recommended sampling, `Target.sampling_defaults`), else greedy. Raises
  ValueError naming the flag for a bad value."""
  base = defaults or SamplingConfig()
  values = {name: getattr(f, name).value for name in ("temperature", "top_k", "top_p", "min_p")}
  values = {k: (getattr(base, k) if v is None else v) for k, v in values.items()}
  values.update({name: getattr(f, name).value for name in (
      "repeat_penalty", "presence_penalty", "frequency_penalty", "penalty_last_n")})
  try:
    return SamplingConfig(seed=f.seed.value, **values)
  except ValueError as e:
    raise ValueError(str(e).replace("SamplingConfig.", "--")) from None
