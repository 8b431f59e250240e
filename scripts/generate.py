"""Generate text with DFlash speculative decoding (or autoregressively) from a GGUF target.

  python scripts/generate.py --prompt "Write a haiku about JAX."
  echo "def fib(n):" | python scripts/generate.py --nochat --max_new_tokens 64
  python scripts/generate.py --prompt_file prompts.jsonl --output_file out.jsonl

Prompt files are JSONL: one object per line with "prompt" (or "text"), optional "id",
"system", "max_new_tokens". Output lines add "completion", "tokens" and the stats.
"""

import json
import os
import sys
import time

from absl import app, flags, logging

from dflash_jax import decode_flags, target_flags

_TF = target_flags.define()
_DF = decode_flags.define()
flags.adopt_module_key_flags(target_flags)  # list them in --help
flags.adopt_module_key_flags(decode_flags)
_DRAFT = flags.DEFINE_string("draft", None, "z-lab DFlash draft directory (config.json + "
                             "model.safetensors). Default: the checkpoints/ draft matching the "
                             "target, else autoregressive decoding. 'none' forces no draft.")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text; read from stdin when neither "
                              "--prompt nor --prompt_file is given.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "JSONL batch of prompts.")
_OUTPUT_FILE = flags.DEFINE_string("output_file", None, "JSONL results (with --prompt_file).")
_CHAT = flags.DEFINE_boolean("chat", True, "Wrap the prompt in the GGUF chat template "
                             "(--nochat: raw completion).")
_SYSTEM = flags.DEFINE_string("system", None, "System message (chat only).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 256, "Tokens to generate at most.")
_STREAM = flags.DEFINE_boolean("stream", True, "Print text as tokens are committed.")
_WARMUP = flags.DEFINE_boolean("warmup", True, "Compile on a 1-token prompt first, so the stats "
                               "line measures decoding, not compilation.")


def _load():
  """(target, draft or None, DecodeConfig, SamplingConfig) as the flags say."""
  import dflash_jax as dj
  from dflash_jax import cli
  from tqdm import tqdm

  with tqdm(total=2, desc="loading", unit="model", file=sys.stderr) as bar:
    path = target_flags.target_path(_TF)
    bar.set_postfix_str(os.path.basename(path))
    target = target_flags.load(_TF)
    bar.update()
    draft_dir = _DRAFT.value if _DRAFT.value is not None else cli.find_draft_dir(target)
    draft = None
    if draft_dir and draft_dir != "none":
      bar.set_postfix_str(os.path.basename(draft_dir.rstrip("/")))
      draft = dj.load_draft(draft_dir, target)
    bar.update()
  dec = decode_flags.config(_DF, mode=_DF.mode.value or ("chain" if draft is not None else "ar"))
  if draft is None:
    if dec.mode != "ar":
      raise app.UsageError(f"--mode={dec.mode} needs a draft (--draft)")
    print(f"[dflash] no draft for {os.path.basename(path)}: decoding autoregressively",
          file=sys.stderr)
  return target, draft, dec, decode_flags.sampling(_DF, target.sampling_defaults)


def _warm_up(target, draft, dec, samp, ids):
  import dflash_jax as dj
  t0 = time.perf_counter()
  dj.generate(target, draft, ids[:1], max_new_tokens=2, config=dec, sampling=samp,
              on_tokens=(lambda _: None) if _STREAM.value else None)
  print(f"[dflash] compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def _run_one(target, draft, dec, samp, ids, max_new, stream):
  """Generate for prompt ids; streams to stdout when `stream`. Returns (result, completion)."""
  import dflash_jax as dj
  from dflash_jax import cli

  printer = cli.StreamPrinter(target.tokenizer, sys.stdout) if stream else None
  r = dj.generate(target, draft, ids, max_new_tokens=max_new, config=dec, sampling=samp,
                  on_tokens=printer.on_tokens if printer else None)
  completion = target.tokenizer.decode(r.tokens)
  if printer:
    printer.finish(completion)
  return r, completion


def _read_rows(path):
  rows = []
  with open(path) as fh:
    for n, line in enumerate(fh, 1):
      if line.strip():
        row = json.loads(line)
        if "prompt" not in row and "text" not in row:
          raise app.UsageError(f"{path}:{n}: no 'prompt' or 'text' field")
        rows.append(row)
  return rows


def _batch(target, draft, dec, samp):
  """--prompt_file rows in order; results as JSONL to --output_file."""
  from dflash_jax import cli
  rows = _read_rows(_PROMPT_FILE.value)
  out = open(_OUTPUT_FILE.value, "w") if _OUTPUT_FILE.value else None
  for i, row in enumerate(rows):
    text = row.get("prompt", row.get("text"))
    print(f"--- [{row.get('id', i)}]", file=sys.stderr)
    ids = cli.build_prompt(target, text, chat=_CHAT.value, system=row.get("system", _SYSTEM.value))
    r, completion = _run_one(target, draft, dec, samp, ids,
                             int(row.get("max_new_tokens", _MAX_NEW.value)),
                             _STREAM.value and out is None)
    print(cli.stats_line(r), file=sys.stderr)
    if out is not None:
      out.write(json.dumps(dict(id=row.get("id", i), prompt=text, completion=completion,
                                mode=dec.mode, **cli.result_fields(r))) + "\n")
      out.flush()
  if out is not None:
    out.close()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _OUTPUT_FILE.value and not _PROMPT_FILE.value:
    raise app.UsageError("--output_file needs --prompt_file")
  if _PROMPT.value is not None and _PROMPT_FILE.value:
    raise app.UsageError("give --prompt or --prompt_file, not both")
  from dflash_jax import api, cli
  target, draft, dec, samp = _load()
  if _PROMPT_FILE.value:
    if _WARMUP.value:
      _warm_up(target, draft, dec, samp, cli.build_prompt(target, "hi", chat=_CHAT.value))
    return _batch(target, draft, dec, samp)
  text = _PROMPT.value if _PROMPT.value is not None else sys.stdin.read()
  ids = api.check_prompt(target, cli.build_prompt(target, text, chat=_CHAT.value,
                                                  system=_SYSTEM.value), dec)
  if _WARMUP.value:
    _warm_up(target, draft, dec, samp, ids)
  t0 = time.perf_counter()
  r, completion = _run_one(target, draft, dec, samp, ids, _MAX_NEW.value, _STREAM.value)
  if not _STREAM.value:
    print(completion)
  print(f"[dflash] mode {dec.mode} | {cli.stats_line(r)} | wall {time.perf_counter() - t0:.1f} s",
        file=sys.stderr)


def _main_with_clear_errors(argv):
  try:
    main(argv)
  except (ValueError, FileNotFoundError, NotImplementedError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  logging.set_verbosity(logging.WARNING)
  app.run(_main_with_clear_errors)
