"""The server's command line: `python -m dflash_jax.serve` (this module's `run`). Defines the
model (target_flags), decoding and sampling (decode_flags) and server flags, opens the port at
once and loads + compiles the model in a background thread; /health answers 503
{"status": "loading"} until the model is ready (a load error ends the process with one `error:`
line and exit status 1).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from absl import app, flags

from dflash_jax import decode_flags, serve, target_flags

_TF = target_flags.define()
_DF = decode_flags.define()
_DRAFT = flags.DEFINE_string("draft", None, "Draft directory (z-lab DFlash-1 / DFlash-2, "
                             "DeepSpec DSpark, EAGLE-3), or 'mtp' (the "
                             "target GGUF's own multi-token-prediction block); default: the "
                             "checkpoints/ draft matching the target; 'none': autoregressive.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_API_KEY = flags.DEFINE_string("api_key", None, "If set, every route but /health needs "
                               "'Authorization: Bearer <key>'. Visible to other users in `ps`: "
                               "prefer --api_key_file.")
_API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "Read the API key from this file (its "
                                    "first line), or from standard input with '-'.")
_ALLOWED_HOSTS = flags.DEFINE_list("allowed_hosts", None, "Host header names answered (others "
                                   "get 400 invalid_host: no DNS rebinding). Default: localhost, "
                                   "127.0.0.1, ::1 when --host is a loopback address, else any; "
                                   "'*': any.")
_MAX_BODY = flags.DEFINE_integer("max_body_bytes", None, "Request body limit in bytes (413 "
                                 "above it). Default: 1 MiB + 12 bytes per character that "
                                 "max_ctx tokens can hold.", lower_bound=1024)
_MAX_CONNECTIONS = flags.DEFINE_integer("max_connections", 1024, "Requests open at once (503 "
                                        "beyond); connections are capped a little above it "
                                        "(uvicorn limit_concurrency) so /health still answers.",
                                        lower_bound=1)
_HEADER_TIMEOUT = flags.DEFINE_float("header_timeout", 10.0, "Seconds a connection may take to "
                                     "send a request's headers before it is closed.",
                                     lower_bound=0.1)
_BODY_TIMEOUT = flags.DEFINE_float("body_timeout", 30.0, "Seconds a request body may take to arrive "
                                   "after its headers, plus its length at --body_min_rate; later: "
                                   "408 and the connection closed.", lower_bound=0.1)
_BODY_MIN_RATE = flags.DEFINE_float("body_min_rate", 16384.0, "Bytes per second a request body is "
                                    "allowed on top of --body_timeout.", lower_bound=1.0)
_KEEP_ALIVE = flags.DEFINE_float("keep_alive_timeout", 5.0, "Seconds an idle keep-alive "
                                 "connection stays open.", lower_bound=0.1)
_DRAIN_TIMEOUT = flags.DEFINE_float("drain_timeout", 30.0, "On SIGTERM / Ctrl-C: seconds "
                                    "running requests get to finish before the server stops.",
                                    lower_bound=0.0)
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 64, "Requests waiting for the model at most.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", None, "Requests decoded together at most (1..64; "
                                  "default 8 on CPU, 32 on accelerators).", lower_bound=1,
                                  upper_bound=64)
_STEPS_PER_CALL = flags.DEFINE_integer("steps_per_call", 4, "Decode rounds per loop call: new "
                                       "requests join and text streams between calls.",
                                       lower_bound=1)
_PROMPT_CACHE = flags.DEFINE_integer("prompt_cache_bytes", 1 << 30, "Bytes the prompt (prefix) "
                                     "cache may hold: finished requests' cache rows, reused by "
                                     "requests that share their prefix (0: off). Device memory, "
                                     "on top of the decode state.", lower_bound=0)
_CORS = flags.DEFINE_list("cors_origins", None, "Origins a browser page may call the API from "
                          "(CORS: preflights answered, Access-Control-Allow-Origin sent), e.g. "
                          "http://localhost:3000; '*': any. Default: off (no cross-origin "
                          "reads). The API key still applies.")
_ALLOW_UNKNOWN = flags.DEFINE_boolean("allow_unknown_fields", False, "Accept and ignore request "
                                      "fields the OpenAI / Anthropic APIs do not define (default: "
                                      "400 unknown_parameter naming the field, so a typo such as "
                                      "max_token is not silently dropped).")
_MODEL_NAME = flags.DEFINE_string("model_name", None, "Model id in the API (default: the GGUF "
                                  "file name).")


def build_engine() -> serve.Engine:
  """Load the target and draft the flags name, compile the decode functions of batch bucket 1
  (greedy and sampling variants) with a warm-up, and return the Engine (the other buckets are
  warmed after it reports ready: `main`). Raises ValueError / FileNotFoundError /
  app.UsageError for bad flags or files."""
  import dflash_jax as dj
  from dflash_jax import cli
  target = target_flags.load(_TF)
  draft_dir = _DRAFT.value if _DRAFT.value is not None else cli.find_draft_dir(target)
  draft = dj.load_draft(draft_dir, target) if draft_dir and draft_dir != "none" else None
  dec = cli.offer_shipped_table(decode_flags.config(_DF), target, _DF.lookup_table.present)
  if dec.mode not in ("ar", "auto") and draft is None:
    raise app.UsageError(f"--mode={dec.mode} needs a draft (--draft)")
  defaults = decode_flags.sampling(_DF, target.sampling_defaults)
  decs = {b: dj.api.resolve_config(draft, dec, target=target, batch=b)
          for b in serve.batch_buckets(64)}          # mode "auto": per batch size
  name = _MODEL_NAME.value or os.path.basename(target.path)
  engine = serve.Engine(target, draft, decs.__getitem__, defaults, name, _MAX_QUEUE.value,
                        _MAX_BATCH.value, _STEPS_PER_CALL.value, prompt_cache_bytes=_PROMPT_CACHE.value,
                        parse_special=_TF.parse_special.value, warm_only=True)
  dj.api.check_config(target, draft, decs[engine.max_batch], engine.max_batch)
  dj.api.check_config(target, draft, decs[1])     # loads an n-gram table auto picked for one row
  engine.warm_up([1], ("greedy", "sampled"))   # the rest (constrained too) after ready
  return engine


def api_key() -> str | None:
  """The API key from --api_key_file (first line; '-': standard input) or --api_key. Raises
  ValueError naming the flag for an unreadable or empty file, or both flags given."""
  if _API_KEY_FILE.value is None:
    return _API_KEY.value
  if _API_KEY.value is not None:
    raise ValueError("give --api_key or --api_key_file, not both")
  return serve.read_api_key_file(_API_KEY_FILE.value)


def allowed_hosts():
  """--allowed_hosts as a tuple, None for any ('*', or the default on a non-loopback --host)."""
  if _ALLOWED_HOSTS.value is None:
    return serve.default_allowed_hosts(_HOST.value)
  return None if "*" in _ALLOWED_HOSTS.value else tuple(_ALLOWED_HOSTS.value)


def _raise_fd_limit():
  """Raise the soft open-files limit to the hard one (each connection holds a descriptor)."""
  try:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
      resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
  except (ImportError, ValueError, OSError):
    pass


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import uvicorn
  try:
    key, hosts = api_key(), allowed_hosts()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  if _API_KEY.value is not None:
    print("[dflash] warning: --api_key is visible to other users of this machine (ps); prefer "
          "--api_key_file", file=sys.stderr, flush=True)
  if key is None and hosts is None:
    print(f"[dflash] warning: listening on {_HOST.value} with no API key: anyone who can reach "
          "this address can use the model (--api_key_file)", file=sys.stderr, flush=True)
  holder: dict = {}

  def load():
    try:
      engine = build_engine()
    except Exception as e:          # the server cannot serve anything: say why and stop
      print(f"error: {e}", file=sys.stderr, flush=True)
      os._exit(1)
    holder["engine"] = engine
    modes = ", ".join(f"B={b}: {engine.dec_for(b).mode}" for b in serve.batch_buckets(engine.max_batch))
    print(f"[dflash] ready: {engine.model_name} ({modes}) on http://{_HOST.value}:{_PORT.value}",
          flush=True)
    # the other programs while the first requests are served (one needed sooner compiles then)
    t0 = time.perf_counter()
    try:
      engine.warm_up()
    except Exception as e:      # the engine compiles what it needs when a request comes
      print(f"[dflash] warning: warming the other batch buckets failed: {e}", flush=True)
      return
    print(f"[dflash] every batch bucket warm ({time.perf_counter() - t0:.0f} s more)", flush=True)

  print(f"[dflash] listening on http://{_HOST.value}:{_PORT.value}; loading and compiling the "
        "model (/health: 503 until ready)", flush=True)
  threading.Thread(target=load, name="dflash-load", daemon=True).start()
  _raise_fd_limit()
  app_ = serve.create_app(lambda: holder.get("engine"), key, allowed_hosts=hosts,
                          max_body_bytes=_MAX_BODY.value, cors_origins=_CORS.value,
                          allow_unknown_fields=_ALLOW_UNKNOWN.value,
                          body_timeout=_BODY_TIMEOUT.value, body_min_rate=_BODY_MIN_RATE.value,
                          max_requests=_MAX_CONNECTIONS.value)
  uvicorn.run(app_, host=_HOST.value, port=_PORT.value, log_level="warning",
              http=serve.header_timeout_protocol(_HEADER_TIMEOUT.value),
              limit_concurrency=_MAX_CONNECTIONS.value + serve.HEALTH_RESERVE,
              timeout_keep_alive=_KEEP_ALIVE.value,
              timeout_graceful_shutdown=_DRAIN_TIMEOUT.value)


def run():
  """Entry point of `python -m dflash_jax.serve` (which makes these flags and the model,
  decoding and sampling flags key flags, so `--help` lists them)."""
  import jax
  jax.config.config_with_absl()
  app.run(main)
