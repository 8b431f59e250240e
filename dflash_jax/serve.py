"""OpenAI-compatible HTTP server: the model loaded and compiled once, requests decoded together.

  python -m dflash_jax.serve --port 8000                      # embedded default target + draft
  python -m dflash_jax.serve --target model.gguf --draft dir --mode ddtree --budget 8

The port opens at once: /health answers 503 {"status": "loading"} (and /v1 routes a 503 error)
while the model loads and compiles, then 200. This module defines the Engine and the app; the
command line (flags, start-up) lives in `dflash_jax.serve_cli`, so importing this module defines
no absl flags.

Endpoints: POST /v1/chat/completions (GGUF chat template; `stream` as server-sent events ending
with `data: [DONE]`), POST /v1/completions (raw prompt), GET /v1/models, GET /health, GET /metrics
(Prometheus text). Requests carry `max_tokens` / `max_completion_tokens`, `stop`, `temperature`,
`top_p`, `top_k`, `min_p`, `seed` (unset: the server's defaults, i.e. the sampling flags, else the
GGUF's recommended sampling, else greedy); responses add a `dflash` field with the acceptance
length, decode speed and time to first token. Continuous batching: up to --max_batch requests
decode together in one compiled loop (each streams its own tokens); a request joins between loop
calls (its prompt prefilled chunk by chunk, interleaved with the others' decode calls) and leaves
when it ends, is cancelled or its client disconnects, freeing its slot at once. Requests beyond
the batch wait in a bounded queue (--max_queue counts all unfinished requests; a full queue
answers 503).

Under hostile load (`Guard`, `header_timeout_protocol`, the Engine's checks): request bodies are
bounded (413), prompts are bounded in characters before tokenizing (which runs off the event
loop), special-token text in message content stays text (parse_special=False), the Host header
is checked against an allow-list, the API key is compared in constant time on every route but
/health, connections must send their headers in time, and every error has OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Union

import fastapi
import jax
import numpy as np
import pydantic

from dflash_jax import cli


class ApiError(Exception):
  """An OpenAI-style error: HTTP status, message, type, param, code."""

  def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


class StreamOptions(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow")
  include_usage: Optional[bool] = None


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
  stream_options: Optional[StreamOptions] = None


class ChatRequest(_Request):
  messages: list[dict[str, Any]]


class CompletionRequest(_Request):
  prompt: Union[str, list[int]]


# Request fields this server does not implement -> the values that ask for nothing (accepted).
UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,),
}


@dataclasses.dataclass
class Outcome:
  """What one decode produced: text (cut at a stop string), generated token count, finish
  reason ("stop" | "length"), and the decoder's statistics."""

  text: str
  completion_tokens: int
  finish_reason: str
  stats: dict
  tokens: list = dataclasses.field(default_factory=list)    # generated ids (to a stop string)


@dataclasses.dataclass(eq=False)
class _Live:
  """A request inside the engine: its inputs, the prefill in progress (chunk iterator, None once
  its row decodes), its slot, its stop scanner and how much of it was read and streamed."""

  ids: np.ndarray
  max_new: int
  stops: list
  samp: Any
  on_text: Callable[[str], None]
  cancelled: Callable[[], bool]
  future: concurrent.futures.Future
  scan: Any = None
  slot: int = -1
  prefill: Optional[Iterator[int]] = None
  shown: int = 0
  sent: int = 0
  t_submit: float = 0.0
  t_first: Optional[float] = None
  reused: int = 0
  checkpoints: dict = dataclasses.field(default_factory=dict)   # recurrent state per chunk end


def _emit(r: _Live, text: Optional[str]):
  """Hand streamed text (None: the end) to a request's consumer; a consumer that is gone (its
  event loop closed) must not stop the scheduler."""
  try:
    r.on_text(text)
  except RuntimeError:
    pass


class Engine:
  """The resident model, decoding requests together (continuous batching).

  One scheduler thread owns a `batching.SlotBatch` of B slots (a bucket; B grows with the number
  of requests up to `max_batch` and shrinks when they leave, rows moving with their caches, one
  compiled program per bucket). Each loop iteration: admit waiting requests into free slots,
  run one prefill chunk of a joining request (so a long prompt never stalls the decoding rows
  for more than one chunk), one decode call of `steps_per_call` rounds for every decoding row,
  then stream each row's new text; a row that finishes, hits a stop string or whose client is
  gone (`cancelled()`) frees its slot at once. `waiting` counts requests submitted and not
  finished (the queue bound).

  dec: resolved DecodeConfig, or a function B -> DecodeConfig (mode "auto": the mode measured
  fastest for B rows); rows only move between buckets with the same mode.
  prompt_cache_bytes: bound of the prompt (prefix) cache (prompt_cache.py; 0: none). Every
  finished or cancelled request leaves its sequence (prompt and answer) there; a new request
  restores the cached sequence sharing the longest usable prefix with its prompt into its slot
  and prefills only the rest (a chat's next turn skips the previous turn's prompt and answer; a
  shared system prompt is prefilled once). Hybrid targets restore the Gated DeltaNet state
  checkpointed at the end of a prefill chunk or of a cached sequence. Output is unchanged.
  parse_special: tokenize special-token text inside chat content and raw prompts as control
  tokens (llama-server); default False: it stays text (tokenizer.encode_chat).
  """

  def __init__(self, target, draft, dec, sampling_defaults, model_name: str, max_queue: int,
               max_batch: Optional[int] = None, steps_per_call: int = 4,
               prompt_cache_bytes: int = 1 << 30, parse_special: bool = False):
    from dflash_jax import api, batching
    self.target, self.draft = target, draft
    self.dec_for = dec if callable(dec) else (lambda _b, d=dec: d)
    self.dec = self.dec_for(1)
    self.sampling_defaults, self.model_name, self.max_queue = sampling_defaults, model_name, max_queue
    self.max_batch = batching.bucket(max_batch or api.default_batch_size())
    self.steps_per_call = steps_per_call
    self.parse_special = parse_special
    from dflash_jax.prompt_cache import PromptCache
    self.prompt_cache = (PromptCache.for_target(target, prompt_cache_bytes)
                         if prompt_cache_bytes > 0 else None)
    self.eog = api._eog(target, None)
    self.eog_set = set(np.asarray(self.eog).tolist())
    self.waiting = 0
    self.metrics = {"requests_total": 0, "requests_failed": 0, "tokens_generated_total": 0,
                    "decode_seconds_total": 0.0, "steps_total": 0, "cancelled_total": 0,
                    "batch_rows_peak": 0, "batch_resizes_total": 0,
                    "prompt_tokens_total": 0, "prompt_tokens_reused_total": 0}
    self._cv = threading.Condition()
    self._pending: collections.deque[_Live] = collections.deque()
    self._live: list[_Live] = []          # requests holding a slot
    self._batch = None
    self._thread: Optional[threading.Thread] = None
    self._small_since: Optional[float] = None
    self.shrink_after_s = 1.0     # a batch shrinks when fewer rows than half of it stayed busy
    self.warmed: list[tuple[int, str]] = []   # (bucket, sampling variant) compiled (warm_up)

  def max_prompt_chars(self) -> int:
    """Characters a prompt may have: more than max_ctx tokens of the longest token cannot fit
    the context, whatever their tokenization (checked before tokenizing)."""
    return self.dec.max_ctx * self.target.tokenizer.max_token_chars

  def max_body_bytes(self) -> int:
    """Default request body limit: 1 MiB of JSON around max_prompt_chars characters at their
    longest JSON form (12 bytes: an escaped surrogate pair)."""
    return (1 << 20) + 12 * self.max_prompt_chars()

  def check_size(self, req):
    """Refuse a prompt (or conversation) longer in characters than the context could hold
    (ApiError 400 context_length_exceeded), before any tokenizing."""
    if isinstance(req, ChatRequest):
      n = sum(len(m.get("content")) for m in req.messages
              if isinstance(m, dict) and isinstance(m.get("content"), str))
      param = "messages"
    else:
      n = len(req.prompt) if isinstance(req.prompt, str) else 0
      param = "prompt"
    if n > self.max_prompt_chars():
      raise ApiError(400, f"the prompt has {n} characters, more than this server's context of "
                     f"{self.dec.max_ctx} tokens can hold", param=param,
                     code="context_length_exceeded")

  def prompt_ids(self, req) -> list[int]:
    """Token ids of a request's prompt (chat template for messages; special-token text inside
    message content stays text unless the engine's parse_special). Raises ApiError (400) naming
    the field for a bad message, a lone surrogate or a template failure."""
    from dflash_jax.tokenizer import check_text
    tok = self.target.tokenizer
    if isinstance(req, ChatRequest):
      if not req.messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
      for i, m in enumerate(req.messages):
        if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
          raise ApiError(400, f"messages[{i}] needs a role (system, user, assistant) and string "
                         "content", param=f"messages[{i}]")
        try:
          check_text(m["content"])
        except ValueError as e:
          raise ApiError(400, f"messages[{i}].content: {e}", param=f"messages[{i}].content") from None
      try:
        return tok.encode_chat(req.messages, add_generation_prompt=True,
                               parse_special=self.parse_special)
      except (ValueError, NotImplementedError) as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    if isinstance(req.prompt, list):
      if not req.prompt or any(not 0 <= t < self.target.config.n_vocab for t in req.prompt):
        raise ApiError(400, "prompt token ids must be non-empty and inside the vocabulary",
                       param="prompt")
      return list(req.prompt)
    try:
      return tok.encode(check_text(req.prompt), parse_special=self.parse_special)
    except ValueError as e:
      raise ApiError(400, f"prompt: {e}", param="prompt") from None

  def sampling(self, req):
    """The request's SamplingConfig: its fields over the server defaults. Raises ApiError naming
    the bad field."""
    from dflash_jax.sampling import SamplingConfig
    base = self.sampling_defaults or SamplingConfig()
    given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")
             if getattr(req, k) is not None}
    for k, v in given.items():         # one at a time, so the error names the bad one
      try:
        dataclasses.replace(base, **{k: v})
      except ValueError as e:
        raise ApiError(400, str(e).replace("SamplingConfig.", ""), param=k) from None
    try:
      return dataclasses.replace(base, **given)
    except ValueError as e:
      raise ApiError(400, str(e).replace("SamplingConfig.", ""), param=next(iter(given), None)) from None

  def check(self, req, ids: list[int]) -> tuple[int, list[str]]:
    """(max new tokens, stop strings) of a request. Raises ApiError (400), also for a field this
    server does not implement (`UNSUPPORTED`) given with a value other than its no-op default:
    nothing a client asks for is silently dropped."""
    from dflash_jax.tokenizer import check_text
    extra = req.model_extra or {}
    for name, noop in UNSUPPORTED.items():
      if name in extra and extra[name] not in noop:
        raise ApiError(400, f"{name} is not supported by this server (dflash-jax)", param=name,
                       code="unsupported_parameter")
    if req.n < 1:
      raise ApiError(400, f"n={req.n}: the number of choices must be at least 1", param="n")
    if req.n != 1:
      raise ApiError(400, "n > 1 is not supported (one choice per request)", param="n")
    if len(ids) + 1 > self.dec.max_ctx:
      raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is "
                     f"{self.dec.max_ctx} tokens (prompt + at least one generated token)",
                     param="messages" if isinstance(req, ChatRequest) else "prompt",
                     code="context_length_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
      raise ApiError(400, "at most 4 stop strings", param="stop")
    for s in stops:
      try:
        check_text(s)
      except ValueError as e:
        raise ApiError(400, f"stop: {e}", param="stop") from None
    limit = req.max_completion_tokens or req.max_tokens or self.dec.max_ctx - len(ids)
    return min(limit, self.dec.max_ctx), stops

  def submit(self, ids, max_new, stops, samp, on_text, cancelled) -> concurrent.futures.Future:
    """Queue one request; the future resolves to its Outcome (or raises ApiError 400 for input
    the library rejects). on_text(str) gets streamable text increments from the scheduler
    thread; cancelled() is polled between decode calls. Counts toward `waiting` until done."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    live = _Live(np.asarray(ids, np.int32), max_new, stops, samp, on_text, cancelled, fut,
                 scan=cli.StopScanner(self.target.tokenizer, stops), t_submit=time.perf_counter())
    with self._cv:
      self.waiting += 1
      self._pending.append(live)
      if self._thread is None:
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()
      self._cv.notify()
    return fut

  def warm_up(self, buckets: Optional[list[int]] = None, variants=("greedy", "sampled")):
    """Compile (or read from the compile cache) the programs of `buckets` (default: every bucket
    up to max_batch) for the sampling `variants` ("greedy", "sampled"): prefill at every chunk
    size and one decode call. The server warms the variant of its default sampling at bucket 1
    before it reports ready and the rest right after (`warmed`: the (bucket, variant) pairs
    done; `warm_buckets()`: buckets with both); a request that needs a program not yet warm
    compiles it on the spot."""
    from dflash_jax import batching
    from dflash_jax.sampling import SamplingConfig
    samps = {"greedy": SamplingConfig(), "sampled": SamplingConfig(temperature=1.0)}
    for bsz in (_buckets(self.max_batch) if buckets is None else buckets):
      dec = self.dec_for(bsz)
      for v in variants:
        if (bsz, v) in self.warmed:
          continue
        b = batching.SlotBatch(self.target, self.draft, dec, bsz, self.eog)
        for n in batching.prefill_sizes(dec.prefill_chunk):
          b.prefill(0, np.zeros(n, np.int32), 3, samps[v])
        b.run(1)
        jax.block_until_ready(b.state.out)
        self.warmed.append((bsz, v))

  def default_variant(self) -> str:
    """"greedy" or "sampled": what a request without sampling fields decodes with."""
    return "greedy" if (self.sampling_defaults is None or self.sampling_defaults.greedy) else "sampled"

  def warm_buckets(self) -> list[int]:
    """Buckets whose greedy and sampled programs are both warm."""
    return sorted({b for b, _ in self.warmed if (b, "greedy") in self.warmed
                   and (b, "sampled") in self.warmed})

  # --- the scheduler thread -------------------------------------------------------------------

  def _loop(self):
    while True:
      with self._cv:
        while not self._pending and not self._live:
          self._cv.wait()
      try:
        self._iteration()
      except Exception as e:       # a failed device call: its rows' state is gone
        if isinstance(e, ValueError):          # the library's clear errors for bad input
          e = ApiError(400, str(e))
        for r in list(self._live):
          self._fail(r, e)
        self._batch = None

  def _iteration(self):
    from dflash_jax import batching
    with self._cv:
      for r in [r for r in self._pending if r.cancelled()]:
        self._pending.remove(r)
        self._finish(r, cancelled=True)
      want = min(len(self._live) + len(self._pending), self.max_batch)
    if want == 0:
      return
    self._fit(batching.bucket(want))
    free = sorted(set(range(self._batch.size)) - {r.slot for r in self._live})
    with self._cv:
      while free and self._pending:
        r = self._pending.popleft()
        r.slot = free.pop(0)
        if self.prompt_cache is not None:
          r.reused = self._batch.reuse(r.slot, r.ids, self.prompt_cache)
        r.prefill = self._batch.prefill_chunks(r.slot, r.ids, r.max_new, r.samp, start=r.reused,
                                               checkpoints=r.checkpoints)
        self.metrics["prompt_tokens_total"] += int(r.ids.size)
        self.metrics["prompt_tokens_reused_total"] += r.reused
        self._live.append(r)
      self.metrics["batch_rows_peak"] = max(self.metrics["batch_rows_peak"], len(self._live))
    for r in [r for r in self._live if r.prefill is not None and r.cancelled()]:
      self._keep(r)                             # the chunks prefilled so far
      self._batch.release(r.slot)
      self._finish(r, cancelled=True)
    joining = [r for r in self._live if r.prefill is not None]
    if joining:                                 # one chunk per iteration, oldest request first
      r = min(joining, key=lambda x: x.t_submit)
      try:
        n_done = next(r.prefill)
        if n_done >= r.ids.size:
          raise StopIteration
      except StopIteration:
        r.prefill = None
        r.t_first = time.perf_counter()
        if not self._batch.finite(r.slot):
          self._batch.release(r.slot)
          self._fail(r, ApiError(500, f"{self.target.path}: the target's logits after prefill "
                                 "are not finite (NaN or inf)", type_="server_error"))
    decoding = [r for r in self._live if r.prefill is None]
    if not decoding:
      return
    n_out, idle = self._batch.progress()
    if not idle.all():
      self._batch.run(self.steps_per_call)
      n_out, idle = self._batch.progress()
    for r in decoding:
      self._stream(r, int(n_out[r.slot]), bool(idle[r.slot]))

  def _keep(self, r: _Live):
    """Put the sequence in r's slot into the prompt cache (when there is one). A failure there
    costs the cache entry, never the request's answer (logged)."""
    if self.prompt_cache is None:
      return
    try:
      self._batch.save(r.slot, r.ids, self.prompt_cache, r.checkpoints)
    except Exception:                   # noqa: BLE001 - the answer is already computed
      logging.exception("prompt cache: could not keep a finished sequence")

  def _fit(self, want: int):
    """Make the batch `want` slots (a bucket) when that changes its size, moving live rows."""
    from dflash_jax import batching
    b = self._batch
    if b is None or b.size <= want:
      self._small_since = None
    elif self._live:                            # shrink once the load stayed low for a while
      now = time.perf_counter()
      if self._small_since is None:
        self._small_since = now
      if now - self._small_since < self.shrink_after_s:
        return
    if b is not None and b.size == want:
      return
    dec = self.dec_for(want)
    if b is not None and self._live and dec != b.dec:
      return                                    # rows cannot change mode mid-sequence
    if b is None or not self._live:
      self._batch = batching.SlotBatch(self.target, self.draft, dec, want, self.eog)
      return
    if any(r.prefill is not None for r in self._live):
      return                                    # move rows between prefills, not during one
    keep = sorted(self._live, key=lambda r: r.slot)
    self._batch = b.resized(want, [r.slot for r in keep])
    self.metrics["batch_resizes_total"] += 1
    for i, r in enumerate(keep):
      r.slot = i

  def _stream(self, r: _Live, n_out: int, idle: bool):
    if n_out > r.shown:
      new = self._batch.new_tokens(r.slot, r.shown, n_out)
      r.shown = n_out
      hit = r.scan.add(new)
      text = r.scan.safe_text()
      if len(text) > r.sent:
        _emit(r, text[r.sent:])
        r.sent = len(text)
      if hit:
        idle = True
    cancelled = r.cancelled()
    if idle or cancelled:
      self._batch.release(r.slot)
      self._finish(r, cancelled=cancelled and not idle)

  def _fail(self, r: _Live, e: Exception):
    if r in self._live:
      self._live.remove(r)
    self.metrics["requests_failed"] += 1
    with self._cv:
      self.waiting -= 1
    _emit(r, None)
    r.future.set_exception(e)

  def _finish(self, r: _Live, cancelled: bool):
    """Resolve a request's future with its Outcome and free its slot."""
    if r in self._live:
      self._live.remove(r)
    row = self._batch.row(r.slot) if r.t_first is not None else None
    if row is not None:
      # The slot's caches hold the prompt and the committed tokens (every generated token but
      # the last, never fed): a next turn that repeats this answer after the prompt reuses them.
      self._keep(r)
    # Every token went through the scanner: scan.text is the whole completion (cut at a stop
    # string; control tokens such as <|im_end|> dropped); send what was held back.
    if len(r.scan.text) > r.sent:
      _emit(r, r.scan.text[r.sent:])
    eog = bool(row and row.tokens and row.tokens[-1] in self.eog_set and
               r.scan.n_tokens >= len(row.tokens))
    finish = "stop" if (r.scan.cut is not None or eog) else "length"
    now = time.perf_counter()
    decode_s = now - r.t_first if r.t_first is not None else 0.0
    n_tok = r.scan.n_tokens
    m = self.metrics
    m["requests_total"] += 1
    m["tokens_generated_total"] += n_tok
    m["decode_seconds_total"] += decode_s
    m["steps_total"] += row.n_steps if row else 0
    m["cancelled_total"] += int(cancelled)
    accept = row.accept_lens if row else []
    stats = {"mode": self._batch.dec.mode if self._batch else self.dec.mode,
             "mean_acceptance_length": float(np.mean(accept)) if accept else 0.0,
             "decode_tokens_per_second": (n_tok - 1) / decode_s if decode_s > 0 and n_tok > 1 else 0.0,
             "steps": row.n_steps if row else 0,
             "time_to_first_token_s": (r.t_first - r.t_submit) if r.t_first else None,
             "prompt_tokens_reused": r.reused,
             "sampling": r.samp.describe()}
    with self._cv:
      self.waiting -= 1
    _emit(r, None)
    r.future.set_result(Outcome(r.scan.text, n_tok, finish, stats, r.scan.ids[:n_tok]))

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
            ("dflash_queue_waiting", self.waiting),
            ("dflash_batch_rows", len(self._live)),
            ("dflash_batch_slots", self._batch.size if self._batch is not None else 0),
            ("dflash_batch_rows_peak", m["batch_rows_peak"]),
            ("dflash_batch_resizes_total", m["batch_resizes_total"]),
            ("dflash_prompt_tokens_total", m["prompt_tokens_total"]),
            ("dflash_prompt_tokens_reused_total", m["prompt_tokens_reused_total"])]
    pc = self.prompt_cache
    if pc is not None:
      rows += [("dflash_prompt_cache_bytes", pc.bytes), ("dflash_prompt_cache_entries", len(pc)),
               ("dflash_prompt_cache_hits_total", pc.stats["hits"]),
               ("dflash_prompt_cache_evictions_total", pc.stats["evictions"])]
    return "".join(f"{k} {v}\n" for k, v in rows)


def _buckets(max_batch: int) -> list[int]:
  from dflash_jax import batching
  return [b for b in batching.BATCH_BUCKETS if b <= max_batch]


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
                    "total_tokens": n_prompt + out.completion_tokens,
                    "prompt_tokens_details": {
                        "cached_tokens": int(out.stats.get("prompt_tokens_reused", 0))}},
          "dflash": out.stats}


@dataclasses.dataclass
class _Job:
  """One request running on the engine: its future (as an asyncio future), the queue of streamed
  text pieces (None ends it), the cancel flag and the disconnect watcher."""

  task: asyncio.Future
  pieces: asyncio.Queue
  cancel: threading.Event
  watcher: asyncio.Future

  def close(self):
    self.cancel.set()
    self.watcher.cancel()


def _launch(engine: Engine, ids, max_new, stops, samp, request: fastapi.Request) -> _Job:
  """Submit the request to the engine's batch and watch the client: a disconnect sets the
  cancel flag, which frees its slot between decode calls."""
  loop = asyncio.get_running_loop()
  cancel, pieces = threading.Event(), asyncio.Queue()
  fut = engine.submit(ids, max_new, stops, samp,
                      lambda t: loop.call_soon_threadsafe(pieces.put_nowait, t), cancel.is_set)

  async def watch_disconnect():
    while not cancel.is_set():
      if await request.is_disconnected():
        cancel.set()
      await asyncio.sleep(0.05)

  return _Job(asyncio.wrap_future(fut), pieces, cancel, asyncio.ensure_future(watch_disconnect()))


async def _events(engine: Engine, job: _Job, kind: str, rid: str, created: int, req, n_prompt: int):
  """The server-sent events of a streamed request, ending with `data: [DONE]` (an error after
  the headers went out is sent as an error event before it)."""
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
    except Exception as e:  # noqa: BLE001 (any failure still ends the stream properly)
      yield f"data: {json.dumps(_server_error(e).body())}\n\n"
      yield "data: [DONE]\n\n"
      return
    last = _chunk(kind, rid, created, name, None, out.finish_reason)
    last["dflash"] = out.stats
    if req.stream_options is not None and req.stream_options.include_usage:
      last["usage"] = _final(kind, rid, created, name, out, n_prompt)["usage"]
    yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"
  finally:
    job.close()


def _server_error(e: Exception) -> ApiError:
  return ApiError(500, f"internal error: {type(e).__name__}: {e}"[:500], type_="server_error")


async def _complete(engine: Engine, kind: str, req, request: fastapi.Request):
  """Validate, queue and answer one (chat) completion request. The cheap checks run first (queue
  bound, sizes in characters); tokenizing and the chat template run in a worker thread, so a
  large prompt never holds up the event loop (other clients, /health)."""
  from fastapi.responses import StreamingResponse
  if engine.waiting >= engine.max_queue:
    raise ApiError(503, "the server is busy (queue full); retry later", type_="server_error",
                   code="queue_full")
  engine.check_size(req)
  ids = await asyncio.to_thread(engine.prompt_ids, req)
  max_new, stops = engine.check(req, ids)
  samp = engine.sampling(req)
  if await request.is_disconnected():       # gone while its prompt was tokenized
    raise ApiError(499, "the client disconnected", code="client_disconnected")
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
  if errs and errs[0].get("type") == "json_invalid":     # loc is (body, character offset)
    ctx = errs[0].get("ctx") or {}
    return ApiError(400, f"the request body is not valid JSON ({ctx.get('error', 'parse error')} "
                    f"at character {errs[0].get('loc', (None, '?'))[-1]})", param=None)
  loc = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
  msg = "; ".join(f"{'.'.join(str(x) for x in d.get('loc', ())[1:]) or 'body'}: {d.get('msg')}"
                  for d in errs) or "invalid request"
  return ApiError(400, msg, param=loc or None)


def _json_error(e: ApiError, headers: Optional[dict] = None):
  from fastapi.responses import JSONResponse
  if e.status in (429, 503):
    headers = {"Retry-After": "1", **(headers or {})}
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


def read_api_key_file(path: str, stdin=None) -> str:
  """The API key on the first line of `path` ('-': `stdin`, default sys.stdin), stripped.
  Raises ValueError naming --api_key_file when it cannot be read or the line is empty."""
  import sys
  try:
    if path == "-":
      line = (stdin or sys.stdin).readline()
    else:
      with open(path, encoding="utf-8") as fh:
        line = fh.readline()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"--api_key_file {path}: cannot read it ({e})") from None
  key = line.strip()
  if not key:
    raise ValueError(f"--api_key_file {path}: the first line is empty")
  return key


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str) -> Optional[tuple[str, ...]]:
  """Host header names the server answers to by default: the loopback names when it listens
  on a loopback address (a page on another site cannot then reach it through DNS rebinding),
  else None (any; protect such a server with an API key)."""
  import ipaddress
  if bind_host == "localhost":
    return LOOPBACK_HOSTS
  try:
    return LOOPBACK_HOSTS if ipaddress.ip_address(bind_host).is_loopback else None
  except ValueError:
    return None


def _host_name(value: str) -> str:
  """The name in a Host header value, without its port ("[::1]:8000" -> "::1")."""
  value = value.strip().lower()
  if value.startswith("["):
    return value[1:value.find("]")] if "]" in value else value
  return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _too_large(limit: int) -> ApiError:
  return ApiError(413, f"the request body exceeds {limit} bytes (--max_body_bytes)",
                  code="request_too_large")


def _too_large_exception(limit: int):
  """What the body reader raises past the limit: an HTTPException (FastAPI passes those on,
  where it turns any other error while reading the body into a 400)."""
  from starlette.exceptions import HTTPException
  return HTTPException(413, _too_large(limit).message, headers={"Connection": "close"})


class Guard:
  """Pure ASGI middleware in front of the app (not Starlette's BaseHTTPMiddleware, which hides
  client disconnects from the routes): checks the Host header against `allowed_hosts` (400
  invalid_host), the API key on every route but /health (401; hmac.compare_digest), and the
  request body size (413 request_too_large from Content-Length at once, or as soon as a body
  without one grows past the limit). max_body_bytes(): the limit now (it follows the engine)."""

  def __init__(self, app, *, api_key: Optional[str], allowed_hosts, max_body_bytes: Callable[[], int]):
    self.app, self.max_body_bytes = app, max_body_bytes
    self.key = f"Bearer {api_key}".encode() if api_key else None
    self.hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope.get("headers") or [])
    host = headers.get(b"host", b"").decode("latin-1")
    if self.hosts is not None and _host_name(host) not in self.hosts:
      return await _json_error(ApiError(400, f"Host header {host[:100]!r} is not allowed (allowed: "
                                        f"{', '.join(sorted(self.hosts))}; --allowed_hosts)",
                                        code="invalid_host"))(scope, receive, send)
    if self.key is not None and scope["path"] != "/health" and not hmac.compare_digest(
        headers.get(b"authorization", b""), self.key):
      return await _json_error(ApiError(401, "invalid or missing API key", type_="authentication_error",
                                        code="invalid_api_key"))(scope, receive, send)
    limit = self.max_body_bytes()
    try:
      declared = int(headers.get(b"content-length", b"0"))
    except ValueError:
      declared = 0
    if declared > limit:
      return await _json_error(_too_large(limit), {"Connection": "close"})(scope, receive, send)
    seen = 0

    async def limited_receive():
      nonlocal seen
      msg = await receive()
      if msg["type"] == "http.request":
        seen += len(msg.get("body", b""))
        if seen > limit:
          raise _too_large_exception(limit)
      return msg

    await self.app(scope, limited_receive, send)


def header_timeout_protocol(seconds: float):
  """uvicorn's h11 protocol class with a header-read timeout: a connection that has not sent a
  request's complete headers `seconds` after it opened (or after its previous response) is
  closed, so idle or trickling connections cannot pile up (uvicorn's own keep-alive timeout
  starts only after a first response). Pass as uvicorn.Config(http=...)."""
  from uvicorn.protocols.http.h11_impl import H11Protocol

  class HeaderTimeoutProtocol(H11Protocol):
    _header_timer = None

    def _arm(self):
      self._disarm()
      self._header_timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self):
      if self._header_timer is not None:
        self._header_timer.cancel()
        self._header_timer = None

    def _expired(self):
      self._header_timer = None
      if not self.transport.is_closing():
        self.transport.close()

    def connection_made(self, transport):
      super().connection_made(transport)
      self._arm()

    def data_received(self, data: bytes):
      before = self.cycle
      super().data_received(data)
      if self.cycle is not before:          # a request's headers are complete
        self._disarm()

    def on_response_complete(self):
      before = self.cycle
      self._arm()
      super().on_response_complete()
      if self.cycle is not before:          # a pipelined request started at once
        self._disarm()

    def connection_lost(self, exc):
      self._disarm()
      super().connection_lost(exc)

  return HeaderTimeoutProtocol


def create_app(engine, api_key: Optional[str] = None, *, allowed_hosts=None,
               max_body_bytes: Optional[int] = None) -> Guard:
  """The ASGI application around `engine`: an Engine, or a function returning the Engine or
  None while it is still loading (then /health answers 503 {"status": "loading"} and the other
  routes a 503 error).

  api_key: required as a Bearer token on every route but /health (docs and /metrics included).
  allowed_hosts: Host header names accepted (None: any; see default_allowed_hosts).
  max_body_bytes: request body limit (default Engine.max_body_bytes(), 1 MiB while loading).
  Every error, routing ones included, has OpenAI's shape {"error": {message, type, param, code}};
  503s carry Retry-After.
  """
  from fastapi.exceptions import RequestValidationError
  from fastapi.responses import JSONResponse, PlainTextResponse
  from starlette.exceptions import HTTPException

  get = engine if callable(engine) else (lambda: engine)

  def ready() -> Engine:
    e = get()
    if e is None:
      raise ApiError(503, "the model is still loading; retry when /health answers 200",
                     type_="server_error", code="model_loading")
    return e

  api = fastapi.FastAPI(title="dflash-jax")
  api.exception_handler(ApiError)(lambda _, e: _json_error(e))
  api.exception_handler(RequestValidationError)(lambda _, e: _json_error(_validation_error(e)))
  api.exception_handler(HTTPException)(lambda _, e: _json_error(ApiError(
      e.status_code, str(e.detail), code={404: "not_found", 405: "method_not_allowed",
                                          413: "request_too_large"}.get(e.status_code)),
      getattr(e, "headers", None)))
  api.exception_handler(Exception)(lambda _, e: _json_error(_server_error(e)))

  @api.get("/health")
  def health():
    e = get()
    if e is None:
      return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    return {"status": "ok", "model": e.model_name, "waiting": e.waiting,
            "warm_buckets": e.warm_buckets(), "max_batch": e.max_batch}

  api.get("/metrics")(lambda: PlainTextResponse(ready().metrics_text()))
  api.get("/v1/models")(lambda: {"object": "list", "data": [
      {"id": ready().model_name, "object": "model", "created": 0, "owned_by": "dflash-jax"}]})

  @api.post("/v1/chat/completions")
  async def chat(req: ChatRequest, request: fastapi.Request):
    return await _complete(ready(), "chat", req, request)

  @api.post("/v1/completions")
  async def completions(req: CompletionRequest, request: fastapi.Request):
    return await _complete(ready(), "completion", req, request)

  def body_limit() -> int:
    if max_body_bytes is not None:
      return max_body_bytes
    e = get()
    return e.max_body_bytes() if e is not None else 1 << 20

  return Guard(api, api_key=api_key, allowed_hosts=allowed_hosts, max_body_bytes=body_limit)


if __name__ == "__main__":
  from absl import flags as _flags
  from dflash_jax import decode_flags as _df, serve_cli as _cli, target_flags as _tf
  for _m in (_cli, _tf, _df):       # --help lists them: key flags of the main module
    _flags.adopt_module_key_flags(_m)
  _cli.run()
