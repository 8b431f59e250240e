"""The repository's text speaks of the product: no development-log references in tracked files, a short
README whose set-up commands are the ones CI runs, results (not code) in bench_out/, and a flag page
generated from the flag definitions (scripts/gen_cli_docs.py) that fails when it drifts."""

import functools
import importlib.util
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Numbered work periods (the word "session" followed by a number, also plural or hyphenated), tracker
# numbers ("issue" followed by a number, with or without "#"), result files named by them (a "_s" and
# two or more digits before the extension) and runs named by them ("gpu" and two or more digits).
DEVLOG = re.compile(
    r"\bsessions?[ -]?\d+"
    r"|\bissues?[ #-]{0,2}\d+"
    r"|_s\d{2,}\.(?:json|jsonl|txt|md|png|npz)\b"
    r"|\bgpu\d{2,}(?:_|\b)",
    re.IGNORECASE)


def devlog_references(text: str) -> list[str]:
  """The development-log references in text (empty when it has none)."""
  return [m.group(0) for m in DEVLOG.finditer(text)]


@functools.cache
def _git_ls_files() -> tuple[str, ...] | None:
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  return tuple(p for p in out.decode().split("\0") if p)


def tracked_files() -> tuple[str, ...]:
  """Paths (relative to the repository root) of the files git tracks (listed once a process);
  skips the test when the checkout is not a git work tree."""
  files = _git_ls_files()
  if files is None:
    pytest.skip("not a git work tree")
  return files


def _text(path: str) -> str | None:
  """The file's text, or None for a binary file (a NUL byte or invalid UTF-8)."""
  with open(os.path.join(ROOT, path), "rb") as fh:
    data = fh.read()
  if b"\0" in data:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


# Planted references, spelled with placeholders so that this file itself stays clean.
@pytest.mark.parametrize("planted", [
    "measured in {s} 46 on the H100", "{S}s 26-27 trained it", "the {s}-27 draft",
    "{i} 24's goals", "see {i} #30", "({i}30)", "bench_out/ngram_cpu/chat{u}55.json",
    "bench_out/train/{g}46_log.json"])
def test_devlog_check_finds_planted_references(planted):
  text = planted.format(s="session", S="Session", i="issue", u="_s", g="gpu")
  assert devlog_references(f"Some text, {text}, more text.")


@pytest.mark.parametrize("clean", [
    "2026-11-29 on an NVIDIA H200: `python scripts/bench.py --json_out bench_out/gpu/x_h200.json`",
    "the session's compile cache", "llama.cpp's server", "Qwen3.5-27B Q4_K_M, 64 sessions of users"])
def test_devlog_check_passes_clean_text(clean):
  assert not devlog_references(clean)


def test_no_devlog_references_in_tracked_files():
  found = []
  for path in tracked_files():
    found += [f"{path}: file name" for _ in devlog_references(os.path.basename(path))]
    text = _text(path)
    if text is None:
      continue
    for i, line in enumerate(text.splitlines(), 1):
      found += [f"{path}:{i}: {ref!r}" for ref in devlog_references(line)]
  assert not found, "development-log references:\n" + "\n".join(found[:50])


def test_readme_is_short_and_starts_with_the_setup_commands():
  with open(os.path.join(ROOT, "README.md")) as fh:
    lines = fh.read().splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200; details go in docs/)"
  with open(os.path.join(ROOT, ".ci", "run")) as fh:
    ci_line = [l for l in fh.read().splitlines() if l.startswith("python -m venv")]
  assert len(ci_line) == 1
  test_cmd = ci_line[0]
  head = lines[:40]
  assert test_cmd in head, "the test command of .ci/run must appear verbatim in README.md's first 40 lines"
  run_cmd = [l for l in head if l.startswith("python -m venv") and "scripts/generate.py" in l]
  assert run_cmd, "the command that runs the embedded default must be in README.md's first 40 lines"


def test_readme_and_docs_links_resolve():
  pages = ["README.md"] + [os.path.join("docs", p) for p in sorted(os.listdir(os.path.join(ROOT, "docs")))
                           if p.endswith(".md")]
  bad = []
  for page in pages:
    with open(os.path.join(ROOT, page)) as fh:
      text = fh.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
      if "://" in target:
        continue
      if not os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)):
        bad.append(f"{page}: {target}")
  assert not bad, "links to missing files:\n" + "\n".join(bad)


def test_bench_out_holds_results_not_code():
  code = [p for p in tracked_files() if p.startswith("bench_out/") and p.endswith((".py", ".sh"))]
  assert not code, f"scripts belong under scripts/: {code}"
  pointers = []
  for path in tracked_files():
    if path.startswith(("dflash_jax/", "pallas_kernels/")):
      text = _text(path)
      if text and "bench_out" in text:
        pointers.append(path)
  assert not pointers, f"package files pointing into bench_out/: {pointers}"


def test_results_name_their_machine_and_command():
  import json
  missing = []
  for path in tracked_files():
    if path.startswith("bench_out/") and path.endswith(".json"):
      with open(os.path.join(ROOT, path)) as fh:
        d = json.load(fh)
      if not (isinstance(d, dict) and d.get("machine") and d.get("command")):
        missing.append(path)
  assert not missing, f"results without 'machine' and 'command': {missing}"


def _gen_cli_docs():
  spec = importlib.util.spec_from_file_location(
      "gen_cli_docs", os.path.join(ROOT, "scripts", "gen_cli_docs.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def cli_docs():
  gen = _gen_cli_docs()
  with open(gen.DOC) as fh:
    doc = fh.read()
  per = gen.programs_flags([p for _, p, _ in gen.PROGRAMS])
  return gen, doc, per


def test_flag_page_matches_the_flag_definitions(cli_docs):
  gen, doc, per = cli_docs
  assert gen.splice(doc, gen.render(per)) == doc, (
      "docs/cli.md is out of date with the flag definitions: run python scripts/gen_cli_docs.py")


def test_flag_page_check_fails_on_an_added_flag(cli_docs):
  gen, doc, per = cli_docs
  planted = [list(fl) for fl in per]
  planted[0].append({"name": "a_new_flag", "type": "int", "default": "1", "help": "Planted.",
                     "boolean": False})
  assert gen.splice(doc, gen.render(planted)) != doc


def test_every_flag_of_generate_is_documented(cli_docs):
  gen, doc, per = cli_docs
  names = [f["name"] for f in per[0]]
  assert {"target", "draft", "mode", "max_new_tokens", "budget", "kv_dtype"} <= set(names)
  for n in names:
    assert f"`--{n}`" in doc, n


def test_flag_page_does_not_depend_on_the_checkout_location(cli_docs):
  """Defaults that are paths inside the repository are shown relative to its root: the page must
  read the same in a checkout anywhere (CI checks out elsewhere than a developer)."""
  gen, doc, per = cli_docs
  defaults = [f["default"] for fl in per for f in fl]
  assert "tests/data/qwen35_tiny/model-q4_k_m.gguf" in defaults
  assert not [d for d in defaults if ROOT in d]
  assert ROOT not in doc
