"""Generate text with DFlash speculative decoding (or autoregressively) from a GGUF target.

  python scripts/generate.py --prompt "Write a haiku about JAX."
  echo "def fib(n):" | python scripts/generate.py --nochat --max_new_tokens 64
  python scripts/generate.py --prompt_file prompts.jsonl --output_file out.jsonl
  python scripts/generate.py --interactive          # multi-turn chat, earlier turns cached

Prompt files are JSONL: one object per line with "prompt" (or "text"), optional "id",
"system", "max_new_tokens". Output lines add "completion", "tokens" and the stats; a row that
fails is written as {"id", "line", "error"} and the batch goes on (exit status 1 at the end).
"""

import json
import os
import sys
import time

from absl import app, flags, logging

from dflash_jax import decode_flags, target_flags
from dflash_jax.config import DRAFT_MODES

_TF = target_flags.define()
_DF = decode_flags.define()
flags.adopt_module_key_flags(target_flags)  # list them in --help
flags.adopt_module_key_flags(decode_flags)
_DRAFT = flags.DEFINE_string("draft", None, "Draft directory (config.json + "
                             "model.safetensors: z-lab DFlash-1 / DFlash-2, a DeepSpec DSpark "
                             "draft, or an EAGLE-3 draft in the speculators or EAGLE / SpecForge "
                             "format), or 'mtp': the target GGUF's own multi-token-"
                             "prediction block (Qwen3.5 files converted with it; --block_size = "
                             "1 + tokens drafted per step, default 4). Default: the checkpoints/ "
                             "draft matching the target, else autoregressive decoding. 'none' "
                             "forces no draft.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text; read from stdin when neither "
                              "--prompt nor --prompt_file is given.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "JSONL batch of prompts.")
_BATCH = flags.DEFINE_integer("batch_size", None, "With --prompt_file: prompts decoded together "
                              "in one compiled loop (rounded up to 1, 2, 4, 8, 16, 32 or 64); "
                              "default 8 on CPU, 32 on accelerators.", lower_bound=1,
                              upper_bound=64)
_OUTPUT_FILE = flags.DEFINE_string("output_file", None, "JSONL results (with --prompt_file); "
                                   "written to <file>.partial and renamed when the batch ends.")
_OVERWRITE = flags.DEFINE_boolean("overwrite", False, "Replace an existing --output_file.")
_CHAT = flags.DEFINE_boolean("chat", True, "Wrap the prompt in the GGUF chat template "
                             "(--nochat: raw completion).")
_SYSTEM = flags.DEFINE_string("system", None, "System message (chat only).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens to generate at most.", lower_bound=1)
_STREAM = flags.DEFINE_boolean("stream", True, "Print text as tokens are committed.")
_INTERACTIVE = flags.DEFINE_boolean("interactive", False, "Multi-turn chat on the terminal (as "
                                   "llama-cli): each turn goes through the chat template with "
                                   "the conversation so far, whose cache rows the prompt cache "
                                   "keeps (only the new turn is prefilled). /reset starts over, "
                                   "/exit or end of input ends.")
_PROMPT_CACHE = flags.DEFINE_integer("prompt_cache_bytes", 1 << 30, "With --interactive: bytes "
                                     "the prompt cache may hold (0: off, every turn prefills "
                                     "the whole conversation).", lower_bound=0)
_JSON_SCHEMA = flags.DEFINE_string("json_schema", None, "Constrain the output to JSON that follows "
                                   "this JSON Schema (inline JSON text, or a path to a .json "
                                   "file; '{\"type\": \"object\"}' for any object): constrained "
                                   "decoding in every mode (grammar.py).")
_REGEX = flags.DEFINE_string("regex", None, "Constrain the output to this regular expression "
                             "(outlines-core syntax; not with --json_schema).")
_WARMUP = flags.DEFINE_boolean("warmup", True, "Compile before decoding, with a 'compiling' line "
                               "(a single prompt: its prefill program, the decode loop after the "
                               "first token; a batch: a 1-token batch first), so the stats line "
                               "measures decoding, not compilation.")


def _load():
  """(target, draft or None, DecodeConfig, SamplingConfig) as the flags say."""
  import dflash_jax as dj
  from dflash_jax import cli
  from tqdm import tqdm

  with tqdm(desc="loading", unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                       "[{elapsed}, {rate_fmt}{postfix}]") as bar:
    path = target_flags.target_path(_TF)
    bar.set_postfix_str(os.path.basename(path))

    def progress(done: int, total: int):
      bar.total = total
      bar.update(done - bar.n)
    target = target_flags.load(_TF, progress=progress)
    draft_dir = _DRAFT.value if _DRAFT.value is not None else cli.find_draft_dir(target)
    draft = None
    if draft_dir and draft_dir != "none":
      bar.set_postfix_str(os.path.basename(draft_dir.rstrip("/")))
      draft = dj.load_draft(draft_dir, target)
  dec = cli.offer_shipped_table(decode_flags.config(_DF), target, _DF.lookup_table.present)
  if dec.mode == "auto":
    from dflash_jax import auto_mode
    print("[dflash] mode auto -> " + auto_mode.explain(
        target.path, draft.path if draft is not None else None,
        1 if not _PROMPT_FILE.value else (_BATCH.value or dj.api.default_batch_size()),
        draft is not None, has_table=bool(dec.lookup_table)), file=sys.stderr)
  if draft is None:
    if dec.mode in DRAFT_MODES:
      raise app.UsageError(f"--mode={dec.mode} needs a draft (--draft)")
    if dec.mode == "ar":
      print(f"[dflash] no draft for {os.path.basename(path)}: decoding autoregressively",
            file=sys.stderr)
  return target, draft, dec, decode_flags.sampling(_DF, target.sampling_defaults)


def _warm_up(target, draft, dec, samp, ids, n_rows=None, grammar=None):
  """Compile what the run uses: the one-prompt loop, or (n_rows given) the batch of the bucket
  that n_rows prompts at --batch_size take; with `grammar` (the run's Grammar), the constrained
  variants."""
  import jax
  import dflash_jax as dj
  cache = jax.config.jax_compilation_cache_dir
  print(f"[dflash] compiling (compile cache: {cache or 'off'}) ...", file=sys.stderr, flush=True)
  t0 = time.perf_counter()
  if n_rows is None:       # the prompt's prefill; generate compiles the loop after 1 token
    dj.api.precompile(target, draft, len(ids), config=dec, sampling=samp, loop=False,
                      grammar=grammar is not None)
  else:
    b = min(n_rows, _BATCH.value or dj.api.default_batch_size())
    dj.generate_batch(target, draft, [ids[:1]] * b, max_new_tokens=2, config=dec,
                      sampling=samp, batch_size=b, grammar=grammar)
  print(f"[dflash] compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def _grammar(target):
  """The grammar.Grammar --json_schema / --regex ask for, or None. Raises ValueError naming the
  flag for unreadable or invalid input."""
  from dflash_jax import api, grammar
  if _JSON_SCHEMA.value is not None and _REGEX.value is not None:
    raise ValueError("give --json_schema or --regex, not both")
  if _REGEX.value is not None:
    return api.grammar_compiler(target).compile(_REGEX.value, param="--regex")
  if _JSON_SCHEMA.value is None:
    return None
  text = _JSON_SCHEMA.value
  if not text.lstrip().startswith("{"):
    try:
      with open(text, encoding="utf-8") as fh:
        text = fh.read()
    except OSError as e:
      raise ValueError(f"--json_schema {_JSON_SCHEMA.value}: cannot read it ({e})") from None
  try:
    schema = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"--json_schema: not JSON ({e})") from None
  return api.grammar_compiler(target).compile(grammar.json_schema_regex(schema,
                                                                        param="--json_schema"),
                                              param="--json_schema")


def _run_one(target, draft, dec, samp, ids, max_new, stream, prompt_cache=None, grammar=None):
  """Generate for prompt ids; streams to stdout when `stream`. Returns (result, completion)."""
  import dflash_jax as dj
  from dflash_jax import cli

  printer = cli.StreamPrinter(target.tokenizer, sys.stdout) if stream else None
  r = dj.generate(target, draft, ids, max_new_tokens=max_new, config=dec, sampling=samp,
                  on_tokens=printer.on_tokens if printer else None, prompt_cache=prompt_cache,
                  grammar=grammar)
  completion = target.tokenizer.decode(r.tokens)
  if printer:
    printer.finish(completion)
  return r, completion


def _read_rows(path):
  """[(line number, row dict or an error message)] of a JSONL prompt file: a row is an object
  with a string "prompt" (or "text"); a bad line becomes an error message naming file and line.
  Raises ValueError naming the file when it cannot be read."""
  try:
    with open(path, encoding="utf-8") as fh:
      lines = fh.readlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"--prompt_file {path}: cannot read it ({e})") from None
  rows = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      rows.append((n, f"{path}:{n}: not valid JSON ({e.msg})"))
      continue
    text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
    if not isinstance(text, str):
      rows.append((n, f"{path}:{n}: expected a JSON object with a string 'prompt' (or 'text')"))
    else:
      rows.append((n, row))
  return rows


def _check_output(path):
  """Raises ValueError naming --output_file for an existing file without --overwrite, the prompt
  file as output, a directory, a missing or unwritable directory, or a <file>.partial that is
  a symbolic link or not a regular file (all checked before the model loads)."""
  if os.path.isdir(path):
    raise ValueError(f"--output_file {path} is a directory")
  if os.path.realpath(path) == os.path.realpath(_PROMPT_FILE.value):
    raise ValueError(f"--output_file {path} is the prompt file")
  if os.path.exists(path) and os.path.getsize(path) > 0 and not _OVERWRITE.value:
    raise ValueError(f"--output_file {path} exists; pass --overwrite to replace it")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise ValueError(f"--output_file {path}: the directory {folder} does not exist")
  if not os.access(folder, os.W_OK | os.X_OK):
    raise ValueError(f"--output_file {path}: the directory {folder} is not writable")
  partial = path + ".partial"
  if os.path.islink(partial) or (os.path.lexists(partial) and not os.path.isfile(partial)):
    raise ValueError(f"--output_file {path}: {partial} exists and is not a regular file "
                     "(a symbolic link is never followed); remove it")


def _open_partial(path):
  """<path>.partial opened for writing without following a symbolic link (O_NOFOLLOW: one
  planted after the check fails here instead of redirecting the write)."""
  partial = path + ".partial"
  try:
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
  except OSError as e:
    raise ValueError(f"--output_file {path}: cannot write {partial} ({e.strerror})") from None
  return os.fdopen(fd, "w", encoding="utf-8")


def _prepare_row(target, dec, row):
  """(text, prompt ids, max_new) of one prompt row; raises ValueError for bad input in it."""
  from dflash_jax import api, cli
  text = row.get("prompt", row.get("text"))
  max_new = row.get("max_new_tokens", _MAX_NEW.value)
  if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
    raise ValueError(f"max_new_tokens={max_new!r} must be an integer >= 1")
  ids = cli.build_prompt(target, text, chat=_CHAT.value, system=row.get("system", _SYSTEM.value),
                         parse_special=_TF.parse_special.value, max_ctx=dec.max_ctx)
  return text, api.check_prompt(target, ids, dec), max_new


def _batch(target, draft, dec, samp, rows, grammar=None):
  """Prompt rows (from `_read_rows`), decoded --batch_size at a time in one compiled loop
  (`generate_batch`: a finished row's slot takes the next prompt), results as JSONL to
  --output_file in input order (written to <file>.partial as rows finish in order, renamed onto
  it at the end, even after an error or Ctrl-C, so finished rows survive). A row that fails
  (bad line, bad field, a prompt longer than the context) is recorded as {"id", "line",
  "error"} and the batch goes on. grammar: constrain every row to it. Returns the number of
  failed rows."""
  import dflash_jax as dj
  from dflash_jax import cli
  out = _open_partial(_OUTPUT_FILE.value) if _OUTPUT_FILE.value else None
  recs, todo = [None] * len(rows), []        # todo: (row index, key, text, ids, max_new)
  for i, (line, row) in enumerate(rows):
    key = row.get("id", i) if isinstance(row, dict) else i
    try:
      if isinstance(row, str):
        raise ValueError(row)
      todo.append((i, key) + _prepare_row(target, dec, row))
    except (ValueError, NotImplementedError) as e:
      recs[i] = {"id": key, "line": line, "error": str(e)}
      print(f"error: [{key}] {e}", file=sys.stderr)
  written = 0

  def flush():
    nonlocal written
    while written < len(recs) and recs[written] is not None:
      if out is not None:
        out.write(json.dumps(recs[written]) + "\n")
        out.flush()
      written += 1

  def on_result(j, r):
    i, key, text, _, _ = todo[j]
    completion = target.tokenizer.decode(r.tokens)
    print(f"--- [{key}] {cli.stats_line(r)}", file=sys.stderr)
    if out is None:
      print(completion)
    recs[i] = dict(id=key, prompt=text, completion=completion, mode=r.mode,
                   **cli.result_fields(r))
    flush()

  try:
    flush()
    if todo:
      dj.generate_batch(target, draft, [t[3] for t in todo], max_new_tokens=[t[4] for t in todo],
                        grammar=grammar,
                        config=dec, sampling=samp, batch_size=_BATCH.value, on_result=on_result)
  finally:
    if out is not None:
      out.close()
      os.replace(_OUTPUT_FILE.value + ".partial", _OUTPUT_FILE.value)
  n_failed = sum(1 for r in recs if r is not None and "error" in r)
  print(f"[dflash] {len(rows) - n_failed} rows ok, {n_failed} failed", file=sys.stderr)
  return n_failed


def _interactive(target, draft, dec, samp, stdin=None, grammar=None):
  """The --interactive loop: read a user turn per line from stdin, answer it with the whole
  conversation through the chat template (streamed), keep the answer in the conversation. The
  prompt cache holds the conversation's cache rows, so each turn prefills only its new tokens
  (the stats line says how many were cached). A turn that fails (too long for --max_ctx, bad
  text) prints its error and the conversation goes on without it."""
  import dataclasses
  import dflash_jax as dj
  from dflash_jax import api, cli
  stdin = stdin or sys.stdin
  tok = target.tokenizer
  cache = dj.PromptCache.for_target(target, _PROMPT_CACHE.value) if _PROMPT_CACHE.value else None
  system = [{"role": "system", "content": _SYSTEM.value}] if _SYSTEM.value else []
  history = list(system)
  tty = stdin.isatty()
  print("[dflash] interactive chat: one turn per line; /reset starts over, /exit ends",
        file=sys.stderr)
  turn = 0
  while True:
    if tty:
      print("> ", end="", file=sys.stderr, flush=True)
    line = stdin.readline()
    if not line or line.strip() == "/exit":
      break
    text = line.rstrip("\n")
    if not text.strip():
      continue
    if text.strip() == "/reset":
      history = list(system)
      print("[dflash] conversation reset", file=sys.stderr)
      continue
    msgs = history + [{"role": "user", "content": text}]
    try:
      ids = api.check_prompt(target, tok.encode_chat(
          msgs, add_generation_prompt=True, parse_special=_TF.parse_special.value), dec)
    except ValueError as e:
      print(f"error: {e} (/reset starts a new conversation)", file=sys.stderr)
      continue
    turn += 1
    s = dataclasses.replace(samp, seed=(samp.seed + turn - 1) % 2**31)   # a fresh draw per turn
    r, completion = _run_one(target, draft, dec, s, ids, _MAX_NEW.value, _STREAM.value, cache,
                             grammar=grammar)
    if not _STREAM.value:
      print(completion)
    answer = tok.decode(r.tokens, skip_special=True)
    history = msgs + [{"role": "assistant", "content": answer}]
    print(f"[dflash] turn {turn} | first token {r.prefill_s:.2f} s | {cli.stats_line(r)}",
          file=sys.stderr)


def _read_stdin() -> str:
  """The prompt from stdin as UTF-8 text. Raises ValueError saying so when it is not UTF-8."""
  data = sys.stdin.buffer.read()
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"stdin is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r})") from None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _OUTPUT_FILE.value and not _PROMPT_FILE.value:
    raise app.UsageError("--output_file needs --prompt_file")
  if _PROMPT.value is not None and _PROMPT_FILE.value:
    raise app.UsageError("give --prompt or --prompt_file, not both")
  if _INTERACTIVE.value and (_PROMPT.value is not None or _PROMPT_FILE.value):
    raise app.UsageError("--interactive reads its turns from stdin: no --prompt / --prompt_file")
  if _INTERACTIVE.value and not _CHAT.value:
    raise app.UsageError("--interactive needs --chat (the chat template)")
  from dflash_jax import api, cli
  rows = _read_rows(_PROMPT_FILE.value) if _PROMPT_FILE.value else None
  if _OUTPUT_FILE.value:
    _check_output(_OUTPUT_FILE.value)
  text = None                      # a single prompt: --prompt, else stdin (read before loading)
  if rows is None and not _INTERACTIVE.value:
    text = _PROMPT.value if _PROMPT.value is not None else _read_stdin()
  target, draft, dec, samp = _load()
  grammar = _grammar(target)         # bad --json_schema / --regex: the error before compiling
  if _INTERACTIVE.value:
    if _WARMUP.value:
      _warm_up(target, draft, dec, samp, cli.build_prompt(target, "hi", chat=True),
               grammar=grammar)
    _interactive(target, draft, dec, samp, grammar=grammar)
    return
  if rows is not None:
    if _WARMUP.value:
      _warm_up(target, draft, dec, samp, cli.build_prompt(target, "hi", chat=_CHAT.value),
               n_rows=max(1, len(rows)), grammar=grammar)
    if _batch(target, draft, dec, samp, rows, grammar):
      sys.exit(1)
    return
  ids = api.check_prompt(target, cli.build_prompt(
      target, text, chat=_CHAT.value, system=_SYSTEM.value,
      parse_special=_TF.parse_special.value, max_ctx=dec.max_ctx), dec)
  if _WARMUP.value:
    _warm_up(target, draft, dec, samp, ids, grammar=grammar)
  t0 = time.perf_counter()
  r, completion = _run_one(target, draft, dec, samp, ids, _MAX_NEW.value, _STREAM.value,
                           grammar=grammar)
  if not _STREAM.value:
    print(completion)
  print(f"[dflash] mode {r.mode} | {cli.stats_line(r)} | wall {time.perf_counter() - t0:.1f} s",
        file=sys.stderr)


def _main_with_clear_errors(argv):
  """main, with bad input (and file-system errors) as one `error:` line and exit status 1, and
  Ctrl-C as exit status 130 (a batch's finished rows are in --output_file by then)."""
  try:
    main(argv)
  except (ValueError, OSError, NotImplementedError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except KeyboardInterrupt:
    done = f"; finished rows are in {_OUTPUT_FILE.value}" if _OUTPUT_FILE.value else ""
    print(f"\n[dflash] interrupted{done}", file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  logging.set_verbosity(logging.WARNING)
  app.run(_main_with_clear_errors)
