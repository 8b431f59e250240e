"""mode="auto": the measured table, the choice rule (never a speculative mode that measured
slower than AR at that batch size; AR without a draft or a measurement) and its use by
generate / generate_batch."""

import dataclasses
import json
import os
import types

import pytest

import dflash_jax as dj
from dflash_jax import auto_mode
from dflash_jax.auto_mode import Pick

ENTRY = {1: {"ar": 30.0, "chain": 45.0, "ddtree@8": 50.0},
         4: {"ar": 60.0, "chain": 70.0, "ddtree@8": 55.0},
         8: {"ar": 80.0, "chain": 79.9}}


@pytest.mark.parametrize("batch,want", [
    (1, ("ddtree", 8)), (2, ("ddtree", 8)),       # largest measured B <= batch
    (4, ("chain", None)), (7, ("chain", None)),
    (8, ("ar", None)), (64, ("ar", None)),        # chain measured slower than AR: not taken
])
def test_choose_rule(batch, want):
  assert auto_mode.choose(ENTRY, batch, has_draft=True) == Pick(*want)


def test_choose_fallbacks():
  assert auto_mode.choose(ENTRY, 1, has_draft=False) == Pick("ar")
  assert auto_mode.choose(None, 1, has_draft=True) == Pick("ar")
  assert auto_mode.choose({2: {"ar": 1.0, "chain": 9.0}}, 1, has_draft=True) == Pick("chain")
  assert auto_mode.choose({1: {"chain": 9.0}}, 1, has_draft=True) == Pick("ar")  # no AR to beat


def test_unresolved_auto_is_an_error():
  with pytest.raises(ValueError, match="auto"):
    dj.DecodeConfig().speculative
  with pytest.raises(ValueError, match="mode='auto' needs the target"):
    dj.api.resolve_config(None, dj.DecodeConfig())


def test_table_roundtrip_and_corrupt_table(tmp_path):
  path = str(tmp_path / "t.json")
  auto_mode.update_table(path, "k", {1: {"ar": 1.0}})
  auto_mode.update_table(path, "k", {1: {"chain": 2.0}, 4: {"ar": 3.0}})
  assert auto_mode.load_entry("k", [path]) == {1: {"ar": 1.0, "chain": 2.0}, 4: {"ar": 3.0}}
  assert auto_mode.load_entry("other", [path]) is None
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match="bad.json: unreadable auto-mode table"):
    auto_mode.load_entry("k", [str(bad)])


def test_generate_uses_the_table(qwen_f32, qwen_draft, qwen_ref, tmp_path, monkeypatch):
  """The user's table says chain is fastest for one row and AR for four: generate decodes with
  chain, generate_batch of 4 rows with AR (same tokens: both are lossless); without an entry
  auto is AR."""
  p = [qwen_ref["tokens"][0, :12], qwen_ref["tokens"][1, :9]]
  kw = dict(max_new_tokens=6, max_ctx=64, eog_ids=())
  monkeypatch.setattr(auto_mode, "user_table_path", lambda: str(tmp_path / "none.json"))
  monkeypatch.setattr(auto_mode, "SHIPPED_TABLE", str(tmp_path / "none.json"))
  assert dj.generate(qwen_f32, qwen_draft, p[0], **kw).mode == "ar"
  table = tmp_path / "auto.json"
  key = auto_mode.table_key(qwen_f32.path, qwen_draft.path)
  table.write_text(json.dumps({key: {"1": {"ar": 1.0, "chain": 2.0}, "4": {"ar": 2.0, "chain": 1.0}}}))
  monkeypatch.setattr(auto_mode, "user_table_path", lambda: str(table))
  one = dj.generate(qwen_f32, qwen_draft, p[0], **kw)
  assert one.mode == "chain"
  res = dj.generate_batch(qwen_f32, qwen_draft, p * 2, batch_size=4, **kw)
  assert {r.mode for r in res} == {"ar"} and res[0].tokens == one.tokens
  assert dj.generate(qwen_f32, None, p[0], **kw).mode == "ar"     # no draft


def test_choose_and_resolve_lookup_columns(qwen_f32, qwen_ref, tmp_path, monkeypatch):
  """"lookup@G" columns count with or without a draft (no draft model); columns the rule cannot
  name ("chain+lookup8") are ignored; a lookup length the caller set is kept; without a draft a
  measured lookup column makes generate decode in mode "lookup" (same tokens as AR)."""
  entry = {1: {"ar": 30.0, "lookup@4": 40.0, "chain": 35.0, "chain+lookup8": 99.0},
           4: {"ar": 60.0, "lookup@4": 50.0}}
  assert auto_mode.choose(entry, 1, has_draft=True) == Pick("lookup", 4)
  assert auto_mode.choose(entry, 1, has_draft=False) == Pick("lookup", 4)
  assert auto_mode.choose(entry, 4, has_draft=False) == Pick("ar")
  assert auto_mode.choose({1: {"ar": 30.0, "chain": 35.0}}, 1, has_draft=False) == Pick("ar")
  table = tmp_path / "auto.json"
  key = auto_mode.table_key(qwen_f32.path, None)
  table.write_text(json.dumps({key: {str(b): row for b, row in entry.items()}}))
  monkeypatch.setattr(auto_mode, "user_table_path", lambda: str(table))
  monkeypatch.setattr(auto_mode, "SHIPPED_TABLE", str(tmp_path / "none.json"))
  dec = auto_mode.resolve(dj.DecodeConfig(lookup=6), qwen_f32.path, None, 1, has_draft=False)
  assert (dec.mode, dec.lookup) == ("lookup", 6)
  dec = auto_mode.resolve(dj.DecodeConfig(lookup=6), qwen_f32.path, None, 4, has_draft=False)
  assert (dec.mode, dec.lookup) == ("lookup", 6)       # auto says AR, the caller asked for lookup
  p = qwen_ref["tokens"][0, :12]
  kw = dict(max_new_tokens=6, max_ctx=64, eog_ids=())
  r = dj.generate(qwen_f32, None, p, **kw)
  assert r.mode == "lookup" and r.tokens == dj.generate(qwen_f32, None, p, mode="ar", **kw).tokens
  assert "lookup@4: fastest measured at B=1" in auto_mode.explain(qwen_f32.path, None, 1, False)


def test_table_columns(tmp_path, monkeypatch):
  """"lookup@G+tableE" columns count only when the caller offers a table (has_table); resolve
  decodes such a pick in mode "lookup" with the table and the measured threshold E, drops an
  offered table that was not picked, leaves a lookup length, table and threshold the caller set
  as set, and refuses a table_mix that the pick cannot run."""
  entry = {1: {"ar": 30.0, "lookup@4": 33.0, "lookup@4+table2": 36.0, "lookup@8+table0.5": 35.0},
           4: {"ar": 60.0, "lookup@4": 50.0, "lookup@4+table2": 55.0}}
  assert auto_mode.choose(entry, 1, has_draft=False) == Pick("lookup", 4)
  assert auto_mode.choose(entry, 1, has_draft=False, has_table=True) == Pick("lookup", 4, 2.0)
  assert auto_mode.choose(entry, 4, has_draft=True, has_table=True) == Pick("ar")
  assert Pick("lookup", 4, 2.0).name == "lookup@4+table2" and Pick("ddtree", 8).name == "ddtree@8"
  assert auto_mode.choose({1: {"ar": 1.0, "lookup@8+table0.5": 2.0}}, 1, False,
                          True) == Pick("lookup", 8, 0.5)
  table = tmp_path / "auto.json"
  key = auto_mode.table_key("t.gguf", None)
  table.write_text(json.dumps({key: {str(b): row for b, row in entry.items()}}))
  monkeypatch.setattr(auto_mode, "user_table_path", lambda: str(table))
  offered = dj.DecodeConfig(lookup_table="shards/", lookup_table_expect=5.0)   # mode auto
  dec = auto_mode.resolve(offered, "t.gguf", None, 1, has_draft=False)
  assert (dec.mode, dec.lookup, dec.lookup_table, dec.lookup_table_expect) == (
      "lookup", 4, "shards/", 2.0)
  dec = auto_mode.resolve(offered, "t.gguf", None, 4, has_draft=False)
  assert (dec.mode, dec.lookup, dec.lookup_table) == ("ar", 0, "")       # offered, not picked
  dec = auto_mode.resolve(dataclasses.replace(offered, lookup=6), "t.gguf", None, 1, False)
  assert (dec.mode, dec.lookup, dec.lookup_table, dec.lookup_table_expect) == (
      "lookup", 6, "shards/", 5.0)                        # the caller's own lookup: as set
  dec = auto_mode.resolve(dataclasses.replace(offered, lookup=6), "t.gguf", None, 4, False)
  assert (dec.mode, dec.lookup, dec.lookup_table) == ("lookup", 6, "shards/")  # as the caller set
  dec = auto_mode.resolve(dj.DecodeConfig(), "t.gguf", None, 1, has_draft=False)
  assert (dec.mode, dec.lookup, dec.lookup_table) == ("lookup", 4, "")   # no table offered
  with pytest.raises(ValueError, match="table_mix=0.5: mode 'auto' picks 'lookup'"):
    auto_mode.resolve(dataclasses.replace(offered, table_mix=0.5), "t.gguf", None, 1, False)
  with pytest.raises(ValueError, match="lookup_table is set with lookup=0"):
    dj.DecodeConfig(mode="lookup", lookup_table="shards/")
  assert "lookup@4+table2: fastest measured at B=1" in auto_mode.explain("t.gguf", None, 1, False,
                                                                          has_table=True)


def test_shipped_table_found_and_offered(tmp_path):
  """cli.find_table_dir: the shipped shards of the default target (a shard names its GGUF file
  name, all name one sha256), none for another file, mixed targets or a corrupt manifest; offer_shipped_table offers it
  to mode "auto" only, and not when the user named a table (even empty) or a lookup length."""
  from dflash_jax import cli
  smol = types.SimpleNamespace(path="/x/" + cli.DEFAULT_GGUF_FILE)
  found = cli.find_table_dir(smol)
  assert found == os.path.join(cli.CHECKPOINTS, "train_data", "smollm2-135m-instruct")
  assert cli.find_table_dir(types.SimpleNamespace(path="/x/other.gguf")) is None
  d = tmp_path / "train_data" / "a"
  d.mkdir(parents=True)
  (d / "manifest.json").write_text("{not json")
  assert cli.find_table_dir(smol, str(tmp_path)) is None
  m = types.SimpleNamespace(path="m.gguf")
  (d / "manifest.json").write_text(json.dumps({"shards": [
      {"target": "m.gguf", "target_sha256": "ab"}, {"target": "gpu.gguf", "target_sha256": "ab"}]}))
  assert cli.find_table_dir(m, str(tmp_path)) == str(d)
  (d / "manifest.json").write_text(json.dumps({"shards": [
      {"target": "m.gguf", "target_sha256": "ab"}, {"target": "m.gguf", "target_sha256": "cd"}]}))
  assert cli.find_table_dir(m, str(tmp_path)) is None          # two different files' text
  auto = dj.DecodeConfig()
  assert cli.offer_shipped_table(auto, smol, False).lookup_table == found
  assert cli.offer_shipped_table(auto, smol, True).lookup_table == ""
  for dec in (dj.DecodeConfig(mode="ar"), dj.DecodeConfig(lookup=4)):
    assert cli.offer_shipped_table(dec, smol, False) == dec


def test_auto_chain_picks_verify_sampled_rows_by_matching(tmp_path, monkeypatch):
  """Where auto picks chain it verifies sampled rows with the "match" rule, the rule whose draws
  are AR's (decode.accept; tests/test_sampling.py checks the draws agree run for run), so a
  seeded request's text does not depend on the mode its batch size picks; an explicit chain
  keeps the rule it was given."""
  table = tmp_path / "auto.json"
  key = auto_mode.table_key("t.gguf", "d")
  table.write_text(json.dumps({key: {"1": {"ar": 1.0, "chain": 2.0},
                                     "4": {"ar": 2.0, "ddtree@8": 3.0}}}))
  monkeypatch.setattr(auto_mode, "user_table_path", lambda: str(table))
  monkeypatch.setattr(auto_mode, "SHIPPED_TABLE", str(tmp_path / "none.json"))
  one = auto_mode.resolve(dj.DecodeConfig(), "t.gguf", "d", 1, has_draft=True)
  assert (one.mode, one.chain_rule) == ("chain", "match")
  four = auto_mode.resolve(dj.DecodeConfig(), "t.gguf", "d", 4, has_draft=True)
  assert (four.mode, four.budget) == ("ddtree", 8)
  named = auto_mode.resolve(dj.DecodeConfig(mode="chain"), "t.gguf", "d", 1, has_draft=True)
  assert named.chain_rule == "rejection"
