"""`mode="auto"`: the decoding mode measured fastest for this platform, model pair and batch size.

Speculative decoding pays less as the batch grows (the verify of B x L tokens turns compute-bound;
vLLM and TensorRT-LLM shrink or switch off the draft by batch size), and on a platform where the
verify of a block costs many autoregressive steps (f32 dots on a 2-core CPU) it does not pay at
all with a weak draft. So the mode is looked up in a measured table rather than assumed.

The table: JSON {key: {B: {column: aggregate decode tok/s}}}, key =
"<platform>:<device kind>|<target GGUF file name>|<draft directory name>" ("none" without a
draft), columns "ar", "chain", "ddtree@<budget>", "lookup@<G>" (prompt lookup, no draft model),
"lookup@<G>+table<E>" (prompt lookup falling back to a static n-gram table, `ngram.py`, with
`lookup_table_expect` E; no draft model).
`scripts/bench.py --batch_sizes ... --modes ar,chain,ddtree --auto_table PATH` measures and writes it. Looked up in order: the user's table
(`user_table_path()`, written by bench.py by default), then the one shipped with the package
(`auto_modes.json`, measured on the machines this project is developed on).

Rule (`choose`): at batch size B take the row of the largest measured batch size <= B (the
smallest measured one if B is below all); the mode is the fastest column of that row, and a
speculative mode only when it beats "ar" there (so auto is never slower than AR where measured).
Without a draft only "ar" and "lookup@G" columns count; "lookup@G+tableE" columns count only when
the caller gives an n-gram table (`DecodeConfig.lookup_table`: with mode "auto" and no lookup
length it names a table auto may use; `cli.find_table_dir` finds the one shipped for the target,
which generate.py and the server pass). Without a table entry for this key, auto
is "ar": it is the one mode that cannot be slower than autoregressive decoding, and an unmeasured speculative mode can be (run
bench.py once on the platform to enable the draft).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from typing import NamedTuple, Optional

import jax

from dflash_jax.config import DecodeConfig

SHIPPED_TABLE = os.path.join(os.path.dirname(__file__), "auto_modes.json")


def user_table_path() -> str:
  """~/.cache/dflash_jax/auto_modes.json: where bench.py --auto_table user writes."""
  return os.path.join(os.path.expanduser("~"), ".cache", "dflash_jax", "auto_modes.json")


def table_key(target_path: str, draft_path: Optional[str]) -> str:
  """The table key of a model pair on the default device."""
  dev = jax.devices()[0]
  return (f"{dev.platform}:{getattr(dev, 'device_kind', dev.platform)}|"
          f"{os.path.basename(target_path)}|{os.path.basename(os.path.normpath(draft_path or 'none'))}")


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime: float) -> dict:
  del mtime   # part of the cache key: a rewritten table is read again
  try:
    with open(path) as fh:
      data = json.load(fh)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: unreadable auto-mode table ({e}); delete it or rerun "
                     "scripts/bench.py --auto_table") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path}: the auto-mode table must be a JSON object")
  return data


def load_entry(key: str, paths: Optional[list[str]] = None) -> Optional[dict[int, dict[str, float]]]:
  """{B: {column: tok/s}} for `key` from the first table (user's, then shipped) that has it."""
  for path in paths if paths is not None else [user_table_path(), SHIPPED_TABLE]:
    if not os.path.exists(path):
      continue
    entry = _read(path, os.path.getmtime(path)).get(key)
    if entry:
      return {int(b): row for b, row in entry.items()}
  return None


class Pick(NamedTuple):
  """What auto decodes with: mode, its size (the ddtree budget, the lookup length; None for ar /
  chain) and, for a "lookup@G+tableE" column, the table threshold E (else None)."""
  mode: str
  size: Optional[int] = None
  table_expect: Optional[float] = None

  @property
  def name(self) -> str:
    """The column name ("ddtree@8", "lookup@4+table2", "ar")."""
    base = f"{self.mode}@{self.size}" if self.size else self.mode
    return base if self.table_expect is None else f"{base}+table{self.table_expect:g}"


_TABLE_COLUMN = re.compile(r"^lookup@(\d+)\+table(\d+(?:\.\d*)?)$")


def _column(name: str) -> Optional[Pick]:
  """Pick("ddtree", 22) for "ddtree@22", Pick("lookup", 8) for "lookup@8", Pick("lookup", 4,
  2.0) for "lookup@4+table2", Pick(name) for "ar" / "chain"; None for a column this rule cannot
  name (e.g. "chain+lookup8", "chain+mix0.5")."""
  m = _TABLE_COLUMN.match(name)
  if m:
    return Pick("lookup", int(m.group(1)), float(m.group(2)))
  if "+" in name:
    return None
  mode, _, n = name.partition("@")
  try:
    return Pick(mode, int(n) if n else None)
  except ValueError:
    return None


def choose(entry: Optional[dict[int, dict[str, float]]], batch: int, has_draft: bool,
           has_table: bool = False) -> Pick:
  """The Pick for `batch` rows by the rule in the module docstring. Columns of the draft modes
  count only with a draft; "lookup@G" (no draft model) counts either way, "lookup@G+tableE"
  only with a table (has_table); columns this rule cannot name are ignored."""
  if not entry:
    return Pick("ar")
  sizes = sorted(entry)
  below = [b for b in sizes if b <= batch]
  row = entry[below[-1] if below else sizes[0]]
  if "ar" not in row:
    return Pick("ar")
  usable = ("ar", "lookup", "chain", "ddtree") if has_draft else ("ar", "lookup")
  ok = {}
  for k, v in row.items():
    pick = _column(k)
    if pick and pick.mode in usable and (pick.table_expect is None or has_table):
      ok[k] = v
  best = max(ok, key=ok.get)
  if ok[best] <= row["ar"]:
    return Pick("ar")
  return _column(best)


def resolve(dec: DecodeConfig, target_path: str, draft_path: Optional[str], batch: int,
            has_draft: bool) -> DecodeConfig:
  """`dec` with mode "auto" replaced by the mode `choose` picks (with its budget for ddtree, its
  length for lookup unless dec.lookup is set); other modes unchanged. A lookup length the
  caller set (dec.lookup > 0) is kept: where auto picks "ar" it decodes in mode "lookup" with it,
  where it picks a draft mode it grafts it (DecodeConfig.lookup), with dec.lookup_table and its
  threshold as set. A dec.lookup_table with lookup = 0 and table_mix = 0 is offered: then the
  "lookup@G+tableE" columns count, such a pick decodes in mode "lookup" with the table, G and
  lookup_table_expect = the measured E, and a pick of another column decodes without it. Raises
  ValueError when dec.table_mix > 0 and the pick runs no draft ("ar" / "lookup").

  A chain pick verifies sampled rows by the "match" rule: every mode auto can pick (ar, lookup,
  chain-match, ddtree) then draws the token at each position with the same key
  (`decode.accept`), so a seeded sampled request gets the same text whatever mode its batch size
  picks; the "rejection" rule accepts more drafts but draws differently."""
  if dec.mode != "auto":
    return dec
  offered = bool(dec.lookup_table) and not dec.lookup and not dec.table_mix
  mode, size, expect = choose(load_entry(table_key(target_path, draft_path)), batch, has_draft,
                              has_table=offered)
  if dec.table_mix and mode not in ("chain", "ddtree"):
    raise ValueError(f"table_mix={dec.table_mix}: mode 'auto' picks {mode!r} here for batch "
                     f"{batch}, which runs no draft to mix the table into; name mode 'chain' or "
                     "'ddtree'")
  if expect is not None:
    return dataclasses.replace(dec, mode="lookup", lookup=size, lookup_table_expect=expect)
  if offered:
    dec = dataclasses.replace(dec, lookup_table="")      # offered to auto, not picked
  if mode == "ddtree":
    return dataclasses.replace(dec, mode=mode, budget=size)
  if mode == "lookup" or (mode == "ar" and dec.lookup):
    return dataclasses.replace(dec, mode="lookup", lookup=dec.lookup or size)
  if mode == "chain":                  # sampled rows: the same text as every other pick
    return dataclasses.replace(dec, mode=mode, chain_rule="match")
  return dataclasses.replace(dec, mode=mode)


def update_table(path: str, key: str, entry: dict[int, dict[str, float]]):
  """Merge `entry` ({B: {column: tok/s}}) into the table at `path` under `key` (created)."""
  data = {}
  if os.path.exists(path):
    data = _read(path, os.path.getmtime(path))
  data = dict(data)
  old = {int(b): r for b, r in data.get(key, {}).items()}
  for b, row in entry.items():
    old[int(b)] = {**old.get(int(b), {}), **row}
  data[key] = {str(b): old[b] for b in sorted(old)}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as fh:
    json.dump(data, fh, indent=1, sort_keys=True)
  os.replace(tmp, path)


def explain(target_path: str, draft_path: Optional[str], batch: int, has_draft: bool,
            has_table: bool = False) -> str:
  """Why mode "auto" picks what it picks for `batch` rows here, in one line: the measured row
  it read (tok/s per mode) or the fallback that applied. has_table: an n-gram table is
  available (the "lookup@G+tableE" columns count)."""
  entry = load_entry(table_key(target_path, draft_path))
  name = choose(entry, batch, has_draft, has_table).name
  if not has_draft and not entry:
    return f"{name}: no draft"
  if not entry:
    return (f"{name}: no measured table for this platform and draft (fallback; "
            "`bench.py --auto_table user` measures one)")
  sizes = sorted(entry)
  b = max([s for s in sizes if s <= batch] or [sizes[0]])
  row = entry[b]
  ranked = ", ".join(f"{k} {v:.1f}" for k, v in sorted(row.items(), key=lambda kv: -kv[1]))
  return f"{name}: fastest measured at B={b} on this platform (tok/s: {ranked})"

