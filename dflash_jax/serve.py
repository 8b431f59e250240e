"""OpenAI-compatible HTTP server: the model loaded and compiled once, one decode at a time.

  python -m dflash_jax.serve --port 8000                      # embedded default target + draft
  python -m dflash_jax.serve --target model.gguf --draft dir --mode ddtree --budget 8

Endpoints: POST /v1/chat/completions (GGUF chat template; `stream` as server-sent events ending
with `data: [DONE]`), POST /v1/completions (raw prompt), GET /v1/models, GET /health, GET /metrics
(Prometheus text). Requests carry `max_tokens` / `max_completion_tokens`, `stop`, `temperature`,
`top_p`, `top_k`, `min_p`, `seed` (unset: the server's defaults, i.e. the sampling flags, else the
GGUF's recommended sampling, else greedy); responses add a `dflash` field with the acceptance
length and decode speed. Decoding is batch 1: requests wait in a bounded queue (--max_queue; a
full queue answers 503); a client that disconnects cancels its request between decode calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from typing import Any, Optional, Union

from absl import app, flags
import fastapi
import pydantic

from dflash_jax import cli, decode_flags, target_flags

_TF = target_flags.define()
_DF = decode_flags.define()
_DRAFT = flags.DEFINE_string("draft", None, "z-lab DFlash draft directory; default: the "
                             "checkpoints/ draft matching the target; 'none': autoregressive.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_API_KEY = flags.DEFINE_string("api_key", None, "If set, /v1 requests need 'Authorization: "
                               "Bearer <key>'.")
_MAX_QUEUE = flags.DEFINE_integer("max_queue", 64, "Requests waiting for the model at most.")
_MODEL_NAME = flags.DEFINE_string("model_name", None, "Model id in the API (default: the GGUF "
                                  "file name).")


class ApiError(Exception):
  """An OpenAI-style error: HTTP status, message, type, param, code."""

  def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


class _Request(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")   # unknown fields are ignored, as OpenAI does
  model: Optional[str] = None
  max_tokens: Optional[int] = pydantic.Field(None, ge=1)
  max_completion_tokens: Optional[int] = pydantic.Field(None, ge=1)
  stop: Optional[Union[str, list[str]]] = None
  stream: bool = False
  temperature: Optional[float] = None
  top_p: Optional[float] = None
  top_k: Optional[int] = None
  min_p: Optional[float] = None
  seed: Optional[int] = None
  n: int = 1


class ChatRequest(_Request):
  messages: list[dict[str, Any]]


class CompletionRequest(_Request):
  prompt: Union[str, list[int]]


@dataclasses.dataclass
class Outcome:
  """What one decode produced: text (cut at a stop string), generated token count, finish
  reason ("stop" | "length"), and the decoder's statistics."""

  text: str
  completion_tokens: int
  finish_reason: str
  stats: dict


class Engine:
  """The resident model. `run` decodes one request on the caller's thread; a lock keeps it to
  one decode at a time; `waiting` counts requests queued for it."""

  def __init__(self, target, draft, dec, sampling_defaults, model_name: str, max_queue: int):
    self.target, self.draft, self.dec = target, draft, dec
    self.sampling_defaults, self.model_name, self.max_queue = sampling_defaults, model_name, max_queue
    self.lock = threading.Lock()
    self.waiting = 0
    self.metrics = {"requests_total": 0, "requests_failed": 0, "tokens_generated_total": 0,
                    "decode_seconds_total": 0.0, "steps_total": 0, "cancelled_total": 0}

  def prompt_ids(self, req) -> list[int]:
    """Token ids of a request's prompt (chat template for messages). Raises ApiError (400)."""
    tok = self.target.tokenizer
    if isinstance(req, ChatRequest):
      if not req.messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
      for i, m in enumerate(req.messages):
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
          raise ApiError(400, f"messages[{i}] needs a role (system, user, assistant) and string "
                         "content", param="messages")
      try:
        return tok.encode(tok.apply_chat_template(req.messages, add_generation_prompt=True))
      except (ValueError, NotImplementedError) as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    if isinstance(req.prompt, list):
      if not req.prompt or any(not 0 <= t < self.target.config.n_vocab for t in req.prompt):
        raise ApiError(400, "prompt token ids must be non-empty and inside the vocabulary",
                       param="prompt")
      return list(req.prompt)
    return tok.encode(req.prompt)

  def sampling(self, req):
    """The request's SamplingConfig: its fields over the server defaults. Raises ApiError."""
    from dflash_jax.sampling import SamplingConfig
    base = self.sampling_defaults or SamplingConfig()
    given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")
             if getattr(req, k) is not None}
    try:
      return dataclasses.replace(base, **given)
    except ValueError as e:
      raise ApiError(400, str(e).replace("SamplingConfig.", ""), param=next(iter(given), None)) from None

  def check(self, req, ids: list[int]) -> tuple[int, list[str]]:
    """(max new tokens, stop strings) of a request. Raises ApiError (400)."""
    if req.n != 1:
      raise ApiError(400, "n > 1 is not supported (batch 1 decoding)", param="n")
    if len(ids) + 1 > self.dec.max_ctx:
      raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is "
                     f"{self.dec.max_ctx} tokens (prompt + at least one generated token)",
                     param="messages" if isinstance(req, ChatRequest) else "prompt",
                     code="context_length_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
      raise ApiError(400, "at most 4 stop strings", param="stop")
    limit = req.max_completion_tokens or req.max_tokens or self.dec.max_ctx - len(ids)
    return limit, stops

  def run(self, ids, max_new, stops, samp, on_text, cancelled) -> Outcome:
    """Decode one request (holds the lock). on_text(str) gets streamable text increments;
    cancelled() is polled between decode calls."""
    import dflash_jax as dj
    scan = cli.StopScanner(self.target.tokenizer, stops)
    sent = [0]

    def on_tokens(new):
      hit = scan.add(new)
      text = scan.safe_text()
      if len(text) > sent[0]:
        on_text(text[sent[0]:])
        sent[0] = len(text)
      return hit or cancelled()

    with self.lock:
      r = dj.generate(self.target, self.draft, ids, max_new_tokens=max_new, config=self.dec,
                      sampling=samp, on_tokens=on_tokens)
    # Every token went through on_tokens: scan.text is the whole completion (cut at a stop
    # string; control tokens such as <|im_end|> dropped); send what was held back.
    if len(scan.text) > sent[0]:
      on_text(scan.text[sent[0]:])
    finish = "stop" if (scan.cut is not None or r.stop_reason == "eog") else "length"
    n_tok = scan.n_tokens
    m = self.metrics
    m["requests_total"] += 1
    m["tokens_generated_total"] += n_tok
    m["decode_seconds_total"] += r.decode_s
    m["steps_total"] += r.n_steps
    m["cancelled_total"] += int(cancelled())
    stats = {"mode": self.dec.mode, "mean_acceptance_length": r.mean_accept_len,
             "decode_tokens_per_second": r.decode_tok_s, "steps": r.n_steps,
             "sampling": r.sampling.describe()}
    return Outcome(scan.text, n_tok, finish, stats)

  def metrics_text(self) -> str:
    m = self.metrics
    al = (m["tokens_generated_total"] / m["steps_total"]) if m["steps_total"] else 0.0
    tps = (m["tokens_generated_total"] / m["decode_seconds_total"]) if m["decode_seconds_total"] else 0.0
    rows = [("dflash_requests_total", m["requests_total"]),
            ("dflash_requests_failed_total", m["requests_failed"]),
            ("dflash_requests_cancelled_total", m["cancelled_total"]),
            ("dflash_tokens_generated_total", m["tokens_generated_total"]),
            ("dflash_decode_steps_total", m["steps_total"]),
            ("dflash_mean_acceptance_length", round(al, 4)),
            ("dflash_decode_tokens_per_second", round(tps, 3)),
            ("dflash_queue_waiting", self.waiting)]
    return "".join(f"{k} {v}\n" for k, v in rows)


def _chunk(kind: str, rid: str, created: int, model: str, text: Optional[str], finish, role=False):
  if kind == "chat":
    delta = {"role": "assistant"} if role else ({"content": text} if text is not None else {})
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    obj = "chat.completion.chunk"
  else:
    choice = {"index": 0, "text": text or "", "finish_reason": finish}
    obj = "text_completion"
  return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def _final(kind: str, rid: str, created: int, model: str, out: Outcome, n_prompt: int) -> dict:
  if kind == "chat":
    choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
              "finish_reason": out.finish_reason}
    obj = "chat.completion"
  else:
    choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason}
    obj = "text_completion"
  return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
          "usage": {"prompt_tokens": n_prompt, "completion_tokens": out.completion_tokens,
                    "total_tokens": n_prompt + out.completion_tokens},
          "dflash": out.stats}


@dataclasses.dataclass
class _Job:
  """One request running on the engine: the executor future, the queue of streamed text pieces
  (None ends it), the cancel flag and the disconnect watcher."""

  task: asyncio.Future
  pieces: asyncio.Queue
  cancel: threading.Event
  watcher: asyncio.Future

  def close(self):
    self.cancel.set()
    self.watcher.cancel()


def _launch(engine: Engine, ids, max_new, stops, samp, request: fastapi.Request) -> _Job:
  """Queue the decode on a worker thread (it waits for the engine's lock) and watch the client:
  a disconnect sets the cancel flag, which stops the decode between decode calls."""
  loop = asyncio.get_running_loop()
  cancel, pieces = threading.Event(), asyncio.Queue()

  def work():
    try:
      return engine.run(ids, max_new, stops, samp,
                        lambda t: loop.call_soon_threadsafe(pieces.put_nowait, t), cancel.is_set)
    except ValueError as e:   # the library's clear errors for bad input
      engine.metrics["requests_failed"] += 1
      raise ApiError(400, str(e)) from None
    except Exception:
      engine.metrics["requests_failed"] += 1
      raise
    finally:
      loop.call_soon_threadsafe(pieces.put_nowait, None)

  async def watch_disconnect():
    while not cancel.is_set():
      if await request.is_disconnected():
        cancel.set()
      await asyncio.sleep(0.05)

  engine.waiting += 1
  task = loop.run_in_executor(None, work)
  task.add_done_callback(lambda _: setattr(engine, "waiting", engine.waiting - 1))
  return _Job(task, pieces, cancel, asyncio.ensure_future(watch_disconnect()))


async def _events(engine: Engine, job: _Job, kind: str, rid: str, created: int, req, n_prompt: int):
  """The server-sent events of a streamed request, ending with `data: [DONE]`."""
  name = engine.model_name
  try:
    if kind == "chat":
      yield f"data: {json.dumps(_chunk(kind, rid, created, name, None, None, role=True))}\n\n"
    while (text := await job.pieces.get()) is not None:
      yield f"data: {json.dumps(_chunk(kind, rid, created, name, text, None))}\n\n"
    try:
      out = await job.task
    except ApiError as e:   # headers are sent: report the error as an event
      yield f"data: {json.dumps(e.body())}\n\n"
      yield "data: [DONE]\n\n"
      return
    last = _chunk(kind, rid, created, name, None, out.finish_reason)
    last["dflash"] = out.stats
    if (getattr(req, "stream_options", None) or {}).get("include_usage"):
      last["usage"] = _final(kind, rid, created, name, out, n_prompt)["usage"]
    yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"
  finally:
    job.close()


async def _complete(engine: Engine, kind: str, req, request: fastapi.Request):
  """Validate, queue and answer one (chat) completion request."""
  from fastapi.responses import StreamingResponse
  ids = engine.prompt_ids(req)
  max_new, stops = engine.check(req, ids)
  samp = engine.sampling(req)
  if engine.waiting >= engine.max_queue:
    raise ApiError(503, "the server is busy (queue full); retry later", type_="server_error",
                   code="queue_full")
  rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
  created = int(time.time())
  job = _launch(engine, ids, max_new, stops, samp, request)
  if req.stream:
    return StreamingResponse(_events(engine, job, kind, rid, created, req, len(ids)),
                             media_type="text/event-stream")
  try:
    out = await job.task
  finally:
    job.close()
  return _final(kind, rid, created, engine.model_name, out, len(ids))


def _validation_error(e) -> ApiError:
  errs = e.errors()
  loc = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
  msg = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', ())[1:]) or 'body'}: {d.get('msg')}"
                  for d in errs) or "invalid request"
  return ApiError(400, msg, param=loc or None)


def create_app(engine: Engine, api_key: Optional[str] = None) -> fastapi.FastAPI:
  """The FastAPI application around `engine` (api_key: required as a Bearer token on /v1)."""
  from fastapi.exceptions import RequestValidationError
  from fastapi.responses import JSONResponse, PlainTextResponse

  api = fastapi.FastAPI(title="dflash-jax")
  api.exception_handler(ApiError)(
      lambda _, e: JSONResponse(e.body(), status_code=e.status))
  api.exception_handler(RequestValidationError)(
      lambda _, e: JSONResponse(_validation_error(e).body(), status_code=400))

  @api.middleware("http")
  async def _auth(request: fastapi.Request, call_next):
    if api_key and request.url.path.startswith("/v1") and \
        request.headers.get("authorization") != f"Bearer {api_key}":
      return JSONResponse(ApiError(401, "invalid or missing API key", type_="authentication_error",
                                   code="invalid_api_key").body(), status_code=401)
    return await call_next(request)

  api.get("/health")(lambda: {"status": "ok", "model": engine.model_name, "waiting": engine.waiting})
  api.get("/metrics")(lambda: PlainTextResponse(engine.metrics_text()))
  api.get("/v1/models")(lambda: {"object": "list", "data": [
      {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "dflash-jax"}]})

  @api.post("/v1/chat/completions")
  async def chat(req: ChatRequest, request: fastapi.Request):
    return await _complete(engine, "chat", req, request)

  @api.post("/v1/completions")
  async def completions(req: CompletionRequest, request: fastapi.Request):
    return await _complete(engine, "completion", req, request)

  return api


def build_engine() -> Engine:
  """Load the target and draft the flags name, compile the decode functions (greedy and
  sampling variants) with a warm-up, and return the Engine."""
  import os
  import dflash_jax as dj
  from dflash_jax import cli
  target = target_flags.load(_TF)
  draft_dir = _DRAFT.value if _DRAFT.value is not None else cli.find_draft_dir(target)
  draft = dj.load_draft(draft_dir, target) if draft_dir and draft_dir != "none" else None
  dec = decode_flags.config(_DF, mode=_DF.mode.value or ("chain" if draft is not None else "ar"))
  if dec.speculative and draft is None:
    raise app.UsageError(f"--mode={dec.mode} needs a draft (--draft)")
  defaults = decode_flags.sampling(_DF, target.sampling_defaults)
  dec = dj.api.resolve_config(draft, dec)
  for samp in (dj.SamplingConfig(), dj.SamplingConfig(temperature=1.0)):
    dj.generate(target, draft, [0], max_new_tokens=2, config=dec, sampling=samp,
                on_tokens=lambda _: None)
  name = _MODEL_NAME.value or os.path.basename(target.path)
  return Engine(target, draft, dec, defaults, name, _MAX_QUEUE.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import uvicorn
  engine = build_engine()
  print(f"[dflash] serving {engine.model_name} ({engine.dec.mode}) on http://{_HOST.value}:{_PORT.value}",
        flush=True)
  uvicorn.run(create_app(engine, _API_KEY.value), host=_HOST.value, port=_PORT.value,
              log_level="warning")


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  app.run(main)
