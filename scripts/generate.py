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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402

from dflash_jax import target_flags  # noqa: E402

_TF = target_flags.define()
flags.adopt_module_key_flags(target_flags)  # list them in --help
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
_MODE = flags.DEFINE_enum("mode", None, ["ar", "chain", "ddtree"], "Decoding: 'chain' (DFlash), "
                          "'ddtree' (DDTree draft tree) or 'ar' (autoregressive). Default: "
                          "chain when a draft is loaded.")
_BUDGET = flags.DEFINE_integer("budget", 22, "DDTree nodes besides the root.")
_TOP_K = flags.DEFINE_integer("top_k", 8, "DDTree candidates per depth.")
_CHAIN_SEED = flags.DEFINE_boolean("chain_seed", True, "DDTree: insert the draft's top-1 chain first.")
_DRAFT_TEMP = flags.DEFINE_float("draft_temp", 1.0, "DDTree: temperature of the draft log-probs.")
_BLOCK = flags.DEFINE_integer("block_size", None, "Draft block size L (must equal the draft's).")
_MAX_CTX = flags.DEFINE_integer("max_ctx", 2048, "Context capacity in tokens (prompt + output).")
_STREAM = flags.DEFINE_boolean("stream", True, "Print text as tokens are committed.")
_WARMUP = flags.DEFINE_boolean("warmup", True, "Compile on a 1-token prompt first, so the stats "
                               "line measures decoding, not compilation.")


def _load():
  import dflash_jax as dj
  from dflash_jax import cli
  from tqdm import tqdm

  with tqdm(total=2, desc="loading", unit="model", file=sys.stderr) as bar:
    path = target_flags.target_path(_TF)
    bar.set_postfix_str(os.path.basename(path))
    target = target_flags.load(_TF)
    bar.update()
    draft_dir = _DRAFT.value
    if draft_dir is None:
      draft_dir = cli.find_draft_dir(target)
    draft = None
    if draft_dir and draft_dir != "none":
      bar.set_postfix_str(os.path.basename(draft_dir.rstrip("/")))
      draft = dj.load_draft(draft_dir, target)
    bar.update()
  mode = _MODE.value or ("chain" if draft is not None else "ar")
  if draft is None:
    if mode != "ar":
      raise app.UsageError(f"--mode={mode} needs a draft (--draft)")
    print(f"[dflash] no draft for {os.path.basename(path)}: decoding autoregressively",
          file=sys.stderr)
  return target, draft, mode


_WARM = []


def _tree_opts():
  return dict(budget=_BUDGET.value, top_k=_TOP_K.value, chain_seed=_CHAIN_SEED.value,
              draft_temp=_DRAFT_TEMP.value)


def _run_one(target, draft, mode, text, system, max_new, stream):
  import dflash_jax as dj
  from dflash_jax import cli

  ids = cli.build_prompt(target, text, chat=_CHAT.value, system=system)
  tok = target.tokenizer
  if _WARMUP.value and not _WARM:
    t0 = time.perf_counter()
    dj.generate(target, draft, ids[:1], max_new_tokens=2, mode=mode, max_ctx=_MAX_CTX.value,
                block_size=_BLOCK.value, on_tokens=(lambda _: None) if stream else None,
                **_tree_opts())
    _WARM.append(True)
    print(f"[dflash] compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
  shown = {"ids": [], "text": ""}

  def on_tokens(new):
    shown["ids"].extend(new)
    text_now = tok.decode(shown["ids"])
    if text_now.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for more tokens
      return
    sys.stdout.write(text_now[len(shown["text"]):])
    sys.stdout.flush()
    shown["text"] = text_now

  r = dj.generate(target, draft, ids, max_new_tokens=max_new, mode=mode, max_ctx=_MAX_CTX.value,
                  block_size=_BLOCK.value, on_tokens=on_tokens if stream else None, **_tree_opts())
  completion = tok.decode(r.tokens)
  if stream:
    sys.stdout.write(completion[len(shown["text"]):] + "\n")
  return ids, r, completion


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from dflash_jax import cli

  if _OUTPUT_FILE.value and not _PROMPT_FILE.value:
    raise app.UsageError("--output_file needs --prompt_file")
  if _PROMPT.value is not None and _PROMPT_FILE.value:
    raise app.UsageError("give --prompt or --prompt_file, not both")
  target, draft, mode = _load()
  if _PROMPT_FILE.value:
    rows = []
    with open(_PROMPT_FILE.value) as fh:
      for n, line in enumerate(fh, 1):
        if line.strip():
          row = json.loads(line)
          if "prompt" not in row and "text" not in row:
            raise app.UsageError(f"{_PROMPT_FILE.value}:{n}: no 'prompt' or 'text' field")
          rows.append(row)
    out = open(_OUTPUT_FILE.value, "w") if _OUTPUT_FILE.value else None
    for i, row in enumerate(rows):
      text = row.get("prompt", row.get("text"))
      print(f"--- [{row.get('id', i)}]", file=sys.stderr)
      ids, r, completion = _run_one(target, draft, mode, text, row.get("system", _SYSTEM.value),
                                    int(row.get("max_new_tokens", _MAX_NEW.value)),
                                    _STREAM.value and out is None)
      print(cli.stats_line(r), file=sys.stderr)
      if out is not None:
        out.write(json.dumps({
            "id": row.get("id", i), "prompt": text, "completion": completion, "tokens": r.tokens,
            "n_prompt_tokens": r.prompt_len, "mode": mode, "steps": r.n_steps,
            "accept_lens": r.accept_lens, "mean_accept_len": r.mean_accept_len,
            "prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s,
            "stop_reason": r.stop_reason}) + "\n")
        out.flush()
    if out is not None:
      out.close()
    return
  text = _PROMPT.value if _PROMPT.value is not None else sys.stdin.read()
  t0 = time.perf_counter()
  _, r, completion = _run_one(target, draft, mode, text, _SYSTEM.value, _MAX_NEW.value,
                              _STREAM.value)
  if not _STREAM.value:
    print(completion)
  print(f"[dflash] mode {mode} | {cli.stats_line(r)} | wall {time.perf_counter() - t0:.1f} s "
        f"(incl. compile)", file=sys.stderr)


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
