"""mode="auto": the measured table, the choice rule (never a speculative mode that measured
slower than AR at that batch size; AR without a draft or a measurement) and its use by
generate / generate_batch."""

import json

import pytest

import dflash_jax as dj
from dflash_jax import auto_mode

ENTRY = {1: {"ar": 30.0, "chain": 45.0, "ddtree@8": 50.0},
         4: {"ar": 60.0, "chain": 70.0, "ddtree@8": 55.0},
         8: {"ar": 80.0, "chain": 79.9}}


@pytest.mark.parametrize("batch,want", [
    (1, ("ddtree", 8)), (2, ("ddtree", 8)),       # largest measured B <= batch
    (4, ("chain", None)), (7, ("chain", None)),
    (8, ("ar", None)), (64, ("ar", None)),        # chain measured slower than AR: not taken
])
def test_choose_rule(batch, want):
  assert auto_mode.choose(ENTRY, batch, has_draft=True) == want


def test_choose_fallbacks():
  assert auto_mode.choose(ENTRY, 1, has_draft=False) == ("ar", None)
  assert auto_mode.choose(None, 1, has_draft=True) == ("ar", None)
  assert auto_mode.choose({2: {"ar": 1.0, "chain": 9.0}}, 1, has_draft=True) == ("chain", None)
  assert auto_mode.choose({1: {"chain": 9.0}}, 1, has_draft=True) == ("ar", None)  # no AR to beat


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
  assert auto_mode.choose(entry, 1, has_draft=True) == ("lookup", 4)
  assert auto_mode.choose(entry, 1, has_draft=False) == ("lookup", 4)
  assert auto_mode.choose(entry, 4, has_draft=False) == ("ar", None)
  assert auto_mode.choose({1: {"ar": 30.0, "chain": 35.0}}, 1, has_draft=False) == ("ar", None)
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
