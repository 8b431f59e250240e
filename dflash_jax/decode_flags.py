"""The absl flags that build a `DecodeConfig`, shared by scripts/generate.py and scripts/bench.py.

Call `define()` once at a script's module level; `config(holders, mode=...)` then returns the
validated DecodeConfig (a bad value is a ValueError naming the field). Kept out of `cli` so
importing the library defines no flags.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from dflash_jax.config import MODES, DecodeConfig

_DEFAULT = DecodeConfig()


@dataclasses.dataclass(frozen=True)
class DecodeFlags:
  """Holders of the decode flags (read `.value` after absl has parsed argv)."""

  mode: flags.FlagHolder
  block_size: flags.FlagHolder
  max_ctx: flags.FlagHolder
  budget: flags.FlagHolder
  top_k: flags.FlagHolder
  chain_seed: flags.FlagHolder
  draft_temp: flags.FlagHolder


def define(flag_values: flags.FlagValues = flags.FLAGS, *,
           max_ctx: int = _DEFAULT.max_ctx) -> DecodeFlags:
  """Defines --mode, --block_size, --max_ctx, --budget, --top_k, --chain_seed, --draft_temp."""
  fv = dict(flag_values=flag_values)
  return DecodeFlags(
      mode=flags.DEFINE_enum("mode", None, list(MODES), "Decoding: 'chain' (DFlash), 'ddtree' "
                             "(DDTree draft tree) or 'ar' (autoregressive). Default: chain when a "
                             "draft is loaded, else ar.", **fv),
      block_size=flags.DEFINE_integer("block_size", None, "Draft block size L (default and only "
                                      "valid value: the draft's).", **fv),
      max_ctx=flags.DEFINE_integer("max_ctx", max_ctx, "Context capacity in tokens (prompt + "
                                   "output).", **fv),
      budget=flags.DEFINE_integer("budget", _DEFAULT.budget, "DDTree nodes besides the root.", **fv),
      top_k=flags.DEFINE_integer("top_k", _DEFAULT.top_k, "DDTree candidates per depth.", **fv),
      chain_seed=flags.DEFINE_boolean("chain_seed", _DEFAULT.chain_seed, "DDTree: insert the "
                                      "draft's top-1 chain first.", **fv),
      draft_temp=flags.DEFINE_float("draft_temp", _DEFAULT.draft_temp, "DDTree: temperature of "
                                    "the draft log-probs.", **fv),
  )


def config(f: DecodeFlags, **overrides) -> DecodeConfig:
  """The DecodeConfig the flags name; `overrides` (DecodeConfig fields) win over flags. --mode
  unset means "chain" here (the caller picks "ar" when there is no draft). Raises ValueError
  naming the flag for a bad value."""
  values = dict(mode=f.mode.value or "chain", block_size=f.block_size.value,
                max_ctx=f.max_ctx.value, budget=f.budget.value, top_k=f.top_k.value,
                chain_seed=f.chain_seed.value, draft_temp=f.draft_temp.value)
  values.update(overrides)
  try:
    return DecodeConfig(**values)
  except ValueError as e:  # name the flag, not the dataclass field
    raise ValueError(str(e).replace("DecodeConfig.", "--")) from None
