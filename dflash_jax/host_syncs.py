"""Where a compiled function makes the host wait for the GPU: its data-dependent control flow.

XLA:GPU runs a `while` loop whose trip count it cannot prove by copying the predicate to the
host and blocking until the stream drains, every iteration, and a `cond` by copying its
branch index the same way (`WhileThunk` / `ConditionalThunk`; command buffers capture them only
when `--xla_gpu_enable_command_buffer` lists WHILE / CONDITIONAL, which the defaults do not).
Each such round trip stalls the GPU while the host launches the next kernels: for a small model
(SmolLM2-135M: ~3 ms an autoregressive step on an H100) a few dozen per step are a large part
of the step. A `fori_loop` or `scan` with static bounds lowers to a loop of known trip count,
which runs with no round trip.

`count` walks a function's jaxpr and counts those constructs (not their iterations: a
data-dependent loop costs one round trip per iteration plus one). `jax.lax.fori_loop` with
traced bounds appears as `while`; with Python int bounds as `scan`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Syncs:
  """Data-dependent control flow in a traced function.

  loops / conds: `while` loops (a host round trip per iteration on a GPU, plus one) and `cond`
  / `switch` ops (one round trip each) outside any `while`, each counted once per execution (a
  construct inside a static loop of n trips counts n times); nested_loops / nested_conds: the
  same inside `while` loops, counted per iteration of the loop around them (for
  `decode.decode_loop`: per decode round). Every branch of a cond is walked, so what only one
  branch runs counts once per branch (mode lookup's AR fallback doubles its round's loops)."""

  loops: int
  conds: int
  nested_loops: int
  nested_conds: int


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
        yield x.jaxpr
      elif hasattr(x, "eqns"):
        yield x


def _walk(jaxpr, mult: int, nested: bool, acc: dict) -> None:
  for e in jaxpr.eqns:
    name = e.primitive.name
    if name == "while":
      acc["nested_loops" if nested else "loops"] += mult
      for j in _sub_jaxprs(e):
        _walk(j, mult, True, acc)
    elif name == "cond":
      acc["nested_conds" if nested else "conds"] += mult
      for j in _sub_jaxprs(e):
        _walk(j, mult, nested, acc)
    elif name == "scan":
      for j in _sub_jaxprs(e):
        _walk(j, mult * int(e.params["length"]), nested, acc)
    else:
      for j in _sub_jaxprs(e):
        _walk(j, mult, nested, acc)


def count(fn: Callable, *args, **kwargs) -> Syncs:
  """Trace fn(*args, **kwargs) (`jax.make_jaxpr`; nothing is compiled or run) and count its
  data-dependent loops and conds (`Syncs`). Raises whatever tracing fn raises."""
  jaxpr = jax.make_jaxpr(fn)(*args, **kwargs).jaxpr
  acc = dict(loops=0, conds=0, nested_loops=0, nested_conds=0)
  _walk(jaxpr, 1, False, acc)
  return Syncs(**acc)


def decode_round(batch, sampled: bool = False) -> Syncs:
  """`count` of `decode.decode_loop` as `batching.SlotBatch.run` calls it. With the default
  Runtime the loop itself is one of `loops` and what one decode round holds is in the
  `nested_*` counts; with `Runtime.rounds` > 0 the round is inside a static loop and its counts
  appear R times in `loops` / `conds`."""
  import jax.numpy as jnp

  from dflash_jax import decode as decode_lib

  return count(lambda s: decode_lib.decode_loop(
      batch.target.params, batch.dparams, s, jnp.int32(1), batch.eog, None, batch.table,
      plan=batch.plan, sampled=sampled, proposer=batch.proposer), batch.state)
