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
from typing import Any, Callable, Iterator, Optional

import fastapi
import jax
import numpy as np
import pydantic

from dflash_jax import cli
from dflash_jax import serve_format
from dflash_jax.serve_protocol import (ANTHROPIC_UNSUPPORTED, COMPLETION_UNSUPPORTED,
                                       UNSUPPORTED, AnthropicRequest,
                                       ApiError, ChatRequest, CompletionRequest,
                                       CountTokensRequest, anthropic_input_usage, anthropic_message,
                                       anthropic_messages,
                                       chat_logprobs, chat_messages, completion_logprobs,
                                       logprobs_wanted, refuse_unknown, refuse_unsupported, sse,
                                       validation_error)


@dataclasses.dataclass
class Outcome:
  """What one decode produced: text (cut at a stop string), generated token count, finish
  reason ("stop" | "length"), and the decoder's statistics."""

  text: str
  completion_tokens: int
  finish_reason: str
  stats: dict
  tokens: list = dataclasses.field(default_factory=list)    # generated ids (to a stop string)
  stop_hit: Optional[str] = None                            # the stop string that ended it
  eog: bool = False                                         # ended by an end-of-generation token


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
  t_admit: Optional[float] = None
  reused: int = 0
  prefilled: int = 0                      # prompt tokens in the slot's caches so far
  checkpoints: dict = dataclasses.field(default_factory=dict)   # recurrent state per chunk end
  grammar: Any = None                                          # grammar.Grammar or None


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
  run prefill chunks of joining requests, oldest first, up to forwards of `dec.prefill_chunk`
  tokens in all (so a long prompt never stalls the decoding rows for more than about one chunk;
  a batch that should grow admits no one while the joining rows' prefills are within two chunks
  of their end, when the rows move), one decode call of `steps_per_call` rounds for every decoding row,
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
  warm_only: rows only run programs `warm_up` has compiled (Engine.VARIANTS: sampled when any
  row samples, constrained when any row has a grammar): while a background warm-up is still
  compiling, the batch does not grow into a bucket whose variant is cold (requests wait for a
  slot of a warm one), and a request whose joining would need a cold variant waits in the queue
  while the requests behind it join, instead of stalling every row behind a compile (the server
  sets it; default False: a program compiles when first needed).
  """

  def __init__(self, target, draft, dec, sampling_defaults, model_name: str, max_queue: int,
               max_batch: Optional[int] = None, steps_per_call: int = 4,
               prompt_cache_bytes: int = 1 << 30, parse_special: bool = False,
               warm_only: bool = False):
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
    self.eog = api.resolve_eog(target, None)
    self.eog_set = set(np.asarray(self.eog).tolist())
    self.waiting = 0
    self.metrics = {"requests_total": 0, "requests_failed": 0, "tokens_generated_total": 0,
                    "decode_seconds_total": 0.0, "steps_total": 0, "cancelled_total": 0,
                    "batch_rows_peak": 0, "batch_resizes_total": 0,
                    "prompt_tokens_total": 0, "prompt_tokens_reused_total": 0,
                    "draft_tokens_total": 0, "draft_accepted_total": 0}
    from dflash_jax.serve_metrics import ServerMetrics
    self.prom = ServerMetrics(self.metrics_state)
    self._cv = threading.Condition()
    self._pending: collections.deque[_Live] = collections.deque()
    self._live: list[_Live] = []          # requests holding a slot
    self._batch = None
    self._thread: Optional[threading.Thread] = None
    self._small_since: Optional[float] = None
    self.shrink_after_s = 1.0     # a batch shrinks when fewer rows than half of it stayed busy
    self.warmed: list[tuple[int, str]] = []   # (bucket, program variant) compiled (warm_up)
    self.warm_only = warm_only

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
    def chars(v) -> int:                      # every string inside a message / prompt
      if isinstance(v, str):
        return len(v)
      if isinstance(v, dict):
        return sum(chars(x) for x in v.values())
      if isinstance(v, list):
        return sum(chars(x) for x in v)
      return 0
    if isinstance(req, CompletionRequest):
      prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
      n, param = max((chars(p) for p in prompts), default=0), "prompt"
    else:
      n = chars(req.messages) + chars(getattr(req, "system", None))
      param = "messages"
    if n > self.max_prompt_chars():
      raise ApiError(400, f"the prompt has {n} characters, more than this server's context of "
                     f"{self.dec.max_ctx} tokens can hold", param=param,
                     code="context_length_exceeded")

  def messages_ids(self, messages: list[dict], param: str = "messages", *,
                   continue_final: bool = False, **template) -> list[int]:
    """Token ids of normalized chat messages (`serve_protocol.chat_messages`) through the chat
    template (special-token text in content stays text unless parse_special), ending with the
    generation prompt, or with continue_final the last (assistant) message's content left open
    for the model to continue (Anthropic's prefill). Raises ApiError 400 for a lone surrogate or
    a template failure."""
    from dflash_jax.tokenizer import check_text
    for i, m in enumerate(messages):
      try:
        check_text(m["content"])
      except ValueError as e:
        raise ApiError(400, f"{param}[{i}].content: {e}", param=f"{param}[{i}].content") from None
    try:
      return self.target.tokenizer.encode_chat(
          messages, add_generation_prompt=not continue_final, continue_final_message=continue_final,
          parse_special=self.parse_special, **template)
    except (ValueError, NotImplementedError) as e:
      raise ApiError(400, f"cannot apply the chat template: {e}", param=param) from None

  def prompt_ids(self, req, tools: Optional[list] = None) -> list[int]:
    """Token ids of a request's (first) prompt: chat messages through the template (with
    `tools` shown to the model, serve_format.with_tools), or a completion prompt (see
    completion_prompts). Raises ApiError (400) naming the field."""
    if isinstance(req, ChatRequest):
      template = self.target.tokenizer.chat_template
      msgs, kw = chat_messages(req.messages, template), {}
      if tools:
        msgs, kw = serve_format.with_tools(msgs, tools, template)
      return self.messages_ids(msgs, **kw)
    return self.completion_prompts(req)[0]

  def grammar(self, regex: str, param: str):
    """The compiled grammar.Grammar of `regex` (cached per regex; a generic JSON object takes
    ~10 s the first time). Raises ApiError 400 naming `param` when it cannot be compiled or can
    never fit the decoder's grammar bank."""
    from dflash_jax import api, grammar as grammar_lib
    try:
      g = api.grammar_compiler(self.target).compile(regex, param=param)
      grammar_lib.GrammarBank(self.target.config.n_vocab).check(g, param=param)
      return g
    except ValueError as e:
      raise ApiError(400, str(e), param=param) from None

  def completion_prompts(self, req) -> list[list[int]]:
    """Token ids of each prompt of a completion request: a string, a list of token ids, or a
    list of either (one choice per prompt). Raises ApiError 400 naming prompt[i]."""
    from dflash_jax.tokenizer import check_text
    p = req.prompt
    many = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
    prompts, out = (p if many else [p]), []
    for i, q in enumerate(prompts):
      where = f"prompt[{i}]" if many else "prompt"
      if isinstance(q, list):
        if not q or any(not 0 <= t < self.target.config.n_vocab for t in q):
          raise ApiError(400, f"{where}: token ids must be non-empty and inside the vocabulary",
                         param=where)
        out.append(list(q))
        continue
      try:
        out.append(self.target.tokenizer.encode(check_text(q), parse_special=self.parse_special))
      except ValueError as e:
        raise ApiError(400, f"{where}: {e}", param=where) from None
      if not out[-1]:
        raise ApiError(400, f"{where}: the prompt is empty (it encodes to no tokens)",
                       param=where)
    return out

  def sampling(self, req):
    """The request's SamplingConfig: its fields over the server defaults; a request without
    `seed` gets a fresh random one (reported back in `dflash.seed`, so a result can be
    reproduced; "regenerate" gives a new answer). Raises ApiError naming the bad field."""
    import secrets
    from dflash_jax.sampling import SamplingConfig
    base = self.sampling_defaults or SamplingConfig()
    given = {k: getattr(req, k, None) for k in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                  "presence_penalty", "frequency_penalty")}
    given["repeat_penalty"] = getattr(req, "repetition_penalty", None)
    if given["repeat_penalty"] is None:
      given["repeat_penalty"] = getattr(req, "repeat_penalty", None)
    given["penalty_last_n"] = getattr(req, "repeat_last_n", None)
    bias = getattr(req, "logit_bias", None)
    if bias:
      n_vocab = self.target.config.n_vocab
      try:
        pairs = tuple((int(t), float(v)) for t, v in bias.items())
      except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids (integers as strings)",
                       param="logit_bias") from None
      if any(not 0 <= t < n_vocab for t, _ in pairs):
        raise ApiError(400, f"logit_bias: token ids must be in [0, {n_vocab})", param="logit_bias")
      given["logit_bias"] = pairs
    names = {"repeat_penalty": ("repetition_penalty" if getattr(req, "repetition_penalty", None)
                                is not None else "repeat_penalty"),
             "penalty_last_n": "repeat_last_n"}
    given = {k: v for k, v in given.items() if v is not None}
    given.setdefault("seed", secrets.randbelow(2**31 - 1024))
    for k, v in given.items():         # one at a time, so the error names the bad one
      try:
        dataclasses.replace(base, **{k: v})
      except ValueError as e:
        param = names.get(k, k)
        raise ApiError(400, str(e).replace("SamplingConfig.", "").replace(k, param),
                       param=param) from None
    try:
      return dataclasses.replace(base, **given)
    except ValueError as e:
      raise ApiError(400, str(e).replace("SamplingConfig.", ""), param=next(iter(given), None)) from None

  MAX_CHOICES = 16

  def check(self, req, ids: list[int], *, n_prompts: int = 1) -> tuple[int, list[str]]:
    """(max new tokens, stop strings) of a request (ids: its longest prompt). Raises ApiError
    400 for bad values, and when its n x prompts choices exceed the whole queue (they could
    never be queued), 503 when they do not fit the queue now. The request's fields outside its
    model (unknown, or unsupported with a value other than their no-op default) are refused
    before this, by the app's routes (serve_protocol.refuse_unknown / refuse_unsupported)."""
    from dflash_jax.tokenizer import check_text
    anthropic = isinstance(req, AnthropicRequest)
    n = 1 if anthropic else req.n
    if not 1 <= n <= self.MAX_CHOICES:
      raise ApiError(400, f"n={n}: the number of choices must be in [1, {self.MAX_CHOICES}]",
                     param="n")
    if n * n_prompts > self.max_queue:     # could never be queued: a client error, not a retry
      raise ApiError(400, f"{n} choice(s) x {n_prompts} prompt(s) = {n * n_prompts} sequences "
                     f"exceed this server's queue of {self.max_queue} (--max_queue); send fewer "
                     "prompts or choices", param="prompt" if n_prompts > 1 else "n",
                     code="queue_exceeded")
    if self.waiting + n * n_prompts > self.max_queue:
      raise ApiError(503, f"the server is busy: {n * n_prompts} choices do not fit the queue "
                     f"({self.waiting} of {self.max_queue} waiting); retry later",
                     type_="server_error", code="queue_full")
    if len(ids) + 1 > self.dec.max_ctx:
      raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context is "
                     f"{self.dec.max_ctx} tokens (prompt + at least one generated token)",
                     param="prompt" if isinstance(req, CompletionRequest) else "messages",
                     code="context_length_exceeded")
    stop = req.stop_sequences if anthropic else req.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    limit = 16 if anthropic else 4
    param = "stop_sequences" if anthropic else "stop"
    if len(stops) > limit:
      raise ApiError(400, f"at most {limit} stop strings", param=param)
    for s in stops:
      try:
        check_text(s)
      except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    limit = (req.max_tokens if anthropic else req.max_completion_tokens or req.max_tokens) \
        or self.dec.max_ctx - len(ids)
    return min(limit, self.dec.max_ctx), stops

  def submit(self, ids, max_new, stops, samp, on_text, cancelled,
             grammar=None, t_arrival: Optional[float] = None) -> concurrent.futures.Future:
    """Queue one request; the future resolves to its Outcome (or raises ApiError 400 for input
    the library rejects). on_text(str) gets streamable text increments from the scheduler
    thread; cancelled() is polled between decode calls; grammar: constrain the output to a
    grammar.Grammar (`grammar()`); t_arrival: time.perf_counter() when the request arrived
    (default now), from which its time to first token, queue time and latency count. Counts
    toward `waiting` until done."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    live = _Live(np.asarray(ids, np.int32), max_new, stops, samp, on_text, cancelled, fut,
                 scan=cli.StopScanner(self.target.tokenizer, stops),
                 t_submit=time.perf_counter() if t_arrival is None else t_arrival,
                 grammar=grammar)
    with self._cv:
      self.waiting += 1
      self._pending.append(live)
      if self._thread is None:
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()
      self._cv.notify()
    return fut

  VARIANTS = ("greedy", "sampled", "greedy+grammar", "sampled+grammar")

  def warm_up(self, buckets: Optional[list[int]] = None, variants=VARIANTS):
    """Compile (or read from the compile cache) the programs of `buckets` (default: every bucket
    up to max_batch) in the `variants` of Engine.VARIANTS (greedy or sampled rows, with or
    without a constrained-decoding row): prefill at every chunk size and one decode call, in
    the mode `dec_for` gives the bucket. The server warms the greedy and sampled variants of
    bucket 1 before it reports ready and the rest right after, bucket by bucket (`warmed`: the
    (bucket, variant) pairs done; `warm_buckets()`: buckets with every variant). With
    warm_only, rows only run programs that are warm; otherwise a request that needs a program
    not yet warm compiles it on the spot."""
    from dflash_jax import batching
    from dflash_jax.sampling import SamplingConfig
    samps = {"greedy": SamplingConfig(), "sampled": SamplingConfig(temperature=1.0)}
    for v in variants:
      if v not in self.VARIANTS:
        raise ValueError(f"warm_up: unknown variant {v!r} (one of {self.VARIANTS})")
    g = self.grammar("(ab)+", "warm_up") if any(v.endswith("+grammar") for v in variants) else None
    for bsz in (batch_buckets(self.max_batch) if buckets is None else buckets):
      dec = self.dec_for(bsz)
      for v in variants:
        if (bsz, v) in self.warmed:
          continue
        samp, constrained = samps[v.split("+")[0]], v.endswith("+grammar")
        b = batching.SlotBatch(self.target, self.draft, dec, bsz, self.eog)
        if constrained:
          b.grammar_fits(0, g)
        for n in batching.prefill_sizes(dec.prefill_chunk):
          b.prefill(0, np.zeros(n, np.int32), 3, samp, grammar=g if constrained else None)
        b.run(1)
        jax.block_until_ready(b.state.out)
        with self._cv:
          self.warmed.append((bsz, v))
          self._cv.notify_all()                 # a request waiting for this variant may join

  def default_variant(self) -> str:
    """"greedy" or "sampled": what a request without sampling fields decodes with."""
    return "greedy" if (self.sampling_defaults is None or self.sampling_defaults.greedy) else "sampled"

  def warm_buckets(self) -> list[int]:
    """Buckets whose every variant (Engine.VARIANTS) is warm."""
    return sorted({b for b, _ in self.warmed if all((b, v) in self.warmed for v in self.VARIANTS)})

  @staticmethod
  def _variant(rows) -> str:
    """The program variant (Engine.VARIANTS) a batch holding `rows` runs."""
    v = "sampled" if any(not r.samp.greedy for r in rows) else "greedy"
    return v + "+grammar" if any(r.grammar is not None for r in rows) else v

  def _stalled(self) -> bool:
    """No row is live and every queued request waits for a program variant still warming (so
    there is nothing to do until warm_up adds one, or a request is cancelled). Holding the lock."""
    if self._live or not self._pending:
      return False
    from dflash_jax import batching
    size = self._warm_bucket(batching.bucket(min(len(self._pending), self.max_batch)))
    return all(not r.cancelled() and not self._admissible(r, size) for r in self._pending)

  def _admissible(self, r: "_Live", size: int) -> bool:
    """With warm_only: whether r can join the batch of `size` slots without a compile (the
    variant of the live rows plus r is warm there). Called holding the lock."""
    return not self.warm_only or (size, self._variant([*self._live, r])) in self.warmed

  # --- the scheduler thread -------------------------------------------------------------------

  def _loop(self):
    while True:
      with self._cv:
        while (not self._pending and not self._live) or self._stalled():
          self._cv.wait(0.1 if self._pending else None)    # (warm_up notifies)
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
      size = self._warm_bucket(batching.bucket(want)) if want else 0
    if want == 0:
      return
    hold = self._fit(size)
    # While a grow waits for joining rows' prefills to end (soon: `_fit`), admit no one into
    # the small batch: under a steady stream of arrivals some row would always be mid-prefill
    # and the batch would never grow (measured: 20 clients served two at a time).
    free = [] if hold else sorted(set(range(self._batch.size)) - {r.slot for r in self._live})
    with self._cv:
      while free and self._pending:
        # the oldest request that joins without a compile (with warm_only, one whose program
        # variant is still warming waits while the others go ahead)
        r = next((q for q in self._pending if self._admissible(q, self._batch.size)), None)
        if r is None or not self._batch.grammar_fits(free[0], r.grammar):
          break                                 # the grammar bank is full: wait for a row
        self._pending.remove(r)
        r.slot = free.pop(0)
        r.t_admit = time.perf_counter()
        if self.prompt_cache is not None:
          r.reused = self._batch.reuse(r.slot, r.ids, self.prompt_cache)
        r.prefilled = r.reused
        r.prefill = self._batch.prefill_chunks(r.slot, r.ids, r.max_new, r.samp, start=r.reused,
                                               checkpoints=r.checkpoints, grammar=r.grammar)
        self.metrics["prompt_tokens_total"] += int(r.ids.size)
        self.metrics["prompt_tokens_reused_total"] += r.reused
        self._live.append(r)
      self.metrics["batch_rows_peak"] = max(self.metrics["batch_rows_peak"], len(self._live))
    for r in [r for r in self._live if r.prefill is not None and r.cancelled()]:
      self._keep(r)                             # the chunks prefilled so far
      self._batch.release(r.slot)
      self._finish(r, cancelled=True)
    # Prefill chunks of joining rows, oldest request first, until this iteration's prefill
    # forwards hold dec.prefill_chunk tokens (padding included: a forward's cost): a long prompt
    # advances one chunk per iteration (the decoding rows stall for about one chunk), while short
    # joins (a reused prefix leaves a few tokens) go in together instead of one per decode call.
    chunk = self._batch.dec.prefill_chunk
    budget = chunk
    prefilled = []
    for r in sorted((r for r in self._live if r.prefill is not None), key=lambda x: x.t_submit):
      if budget <= 0:
        break
      try:
        n_done = next(r.prefill)
        budget -= batching.prefill_len(r.ids.size - r.reused, chunk)   # this row's forward length
        r.prefilled = n_done
        if n_done >= r.ids.size:
          raise StopIteration
      except StopIteration:
        r.prefill = None
        if not self._batch.finite(r.slot):
          self._batch.release(r.slot)
          self._fail(r, ApiError(500, f"{self.target.path}: the target's logits after prefill "
                                 "are not finite (NaN or inf)", type_="server_error"))
        else:
          prefilled.append(r)
    if prefilled:
      # The prefill's last chunk drew each joining row's first token: stream it now, before the
      # decode call (time to first token is when it is handed to the client).
      n_out, idle = self._batch.progress()
      for r in prefilled:
        r.t_first = time.perf_counter()
        self._stream(r, int(n_out[r.slot]), bool(idle[r.slot]))
    decoding = [r for r in self._live if r.prefill is None]
    if not decoding:
      return
    n_out, idle = self._batch.progress()
    if not idle.all():
      self._batch.run(self.steps_per_call)
      n_out, idle = self._batch.progress()
    for r in decoding:
      self._stream(r, int(n_out[r.slot]), bool(idle[r.slot]))

  def _warm_bucket(self, want: int) -> int:
    """The bucket to use for `want` slots: want itself, or with warm_only the largest warm bucket
    below it that serves the rows' program variant (never below the current batch's size or 1).
    Called holding the lock (it reads the queue)."""
    if not self.warm_only:
      return want
    # the variant of every row, or of the rows but the constrained requests still queued (they
    # wait for their own variant: `_admissible`)
    variants = {self._variant([*self._live, *self._pending]),
                self._variant([*self._live, *(r for r in self._pending if r.grammar is None)])}
    floor = self._batch.size if self._batch is not None else 1
    b = want
    while b > floor and not any((b, v) in self.warmed for v in variants):
      b //= 2
    return b

  def _keep(self, r: _Live):
    """Put the sequence in r's slot into the prompt cache (when there is one). A failure there
    costs the cache entry, never the request's answer (logged)."""
    if self.prompt_cache is None:
      return
    try:
      self._batch.save(r.slot, r.ids, self.prompt_cache, r.checkpoints)
    except Exception:                   # noqa: BLE001 - the answer is already computed
      logging.exception("prompt cache: could not keep a finished sequence")

  def _fit(self, want: int) -> bool:
    """Make the batch `want` slots (a bucket) when that changes its size, moving live rows.
    Returns True when it should grow but waits for joining rows' prefills to end (rows move
    between prefills, not during one) and those end within about two chunks: the caller admits
    no one meanwhile (a longer prefill in the way: free slots are filled as they are)."""
    from dflash_jax import batching
    b = self._batch
    if b is None or b.size <= want:
      self._small_since = None
    elif self._live:                            # shrink once the load stayed low for a while
      now = time.perf_counter()
      if self._small_since is None:
        self._small_since = now
      if now - self._small_since < self.shrink_after_s:
        return False
    if b is not None and b.size == want:
      return False
    dec = self.dec_for(want)
    if b is not None and self._live and dec != b.dec:
      return False                              # rows cannot change mode mid-sequence
    if b is None or not self._live:
      self._batch = batching.SlotBatch(self.target, self.draft, dec, want, self.eog)
      return False
    joining = [r for r in self._live if r.prefill is not None]
    if joining:            # rows move between prefills, not during one: hold admissions while
      left = sum(r.ids.size - r.prefilled for r in joining)     # the grow is near
      return b.size < want and left <= 2 * b.dec.prefill_chunk
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
    dec = self._batch.dec if self._batch else self.dec
    accept = row.accept_lens if row else []
    per_step = dec.verify_len - 1     # drafted nodes a step verifies (lookup rounds: at most)
    drafted, accepted = per_step * len(accept), int(sum(accept)) - len(accept)
    m["draft_tokens_total"] += drafted
    m["draft_accepted_total"] += accepted
    ttft = (r.t_first - r.t_submit) if r.t_first else None
    prompt_s = (r.t_first - r.t_admit) if r.t_first and r.t_admit else 0.0
    self.prom.observe(now - r.t_submit, ttft)
    n_pre = int(r.ids.size) - r.reused
    timings = {"prompt_n": n_pre, "cache_n": r.reused, "prompt_ms": 1e3 * prompt_s,
               "prompt_per_second": n_pre / prompt_s if prompt_s > 0 else 0.0,
               "predicted_n": n_tok, "predicted_ms": 1e3 * decode_s,
               "predicted_per_second": (n_tok - 1) / decode_s if decode_s > 0 and n_tok > 1 else 0.0,
               "ttft_ms": 1e3 * ttft if ttft is not None else None,
               "queue_ms": 1e3 * ((r.t_admit or now) - r.t_submit),
               "draft_n": drafted, "draft_n_accepted": accepted,
               "mean_acceptance_length": float(np.mean(accept)) if accept else 0.0}
    stats = {"mode": dec.mode,
             "mean_acceptance_length": timings["mean_acceptance_length"],
             "decode_tokens_per_second": timings["predicted_per_second"],
             "steps": row.n_steps if row else 0,
             "time_to_first_token_s": ttft,
             "prompt_tokens_reused": r.reused,
             "sampling": r.samp.describe(), "seed": r.samp.seed, "timings": timings}
    with self._cv:
      self.waiting -= 1
    _emit(r, None)
    r.future.set_result(Outcome(r.scan.text, n_tok, finish, stats, r.scan.ids[:n_tok],
                                stop_hit=r.scan.hit, eog=eog))

  def logprobs(self, prompt: list[int], tokens: list[int], top_k: int,
               with_prompt: bool = False) -> list:
    """[(text, bytes, logprob, [(text, bytes, logprob)] * top_k)] for each generated token (and
    with_prompt, each prompt token: the first with logprob None), from the target's raw
    distribution (api.token_logprobs: one forward of prompt + tokens, the same whatever mode
    decoded them). Runs beside the engine's loop (JAX calls are thread-safe)."""
    from dflash_jax import api
    tok = self.target.tokenizer
    ids = list(prompt) + list(tokens)
    first = 1 if with_prompt else len(prompt)
    item = lambda t, lp: (tok.decode([t], skip_special=False), tok.token_bytes(t), lp)  # noqa: E731
    out = [(*item(ids[0], None), [])] if with_prompt else []
    if len(ids) <= first:
      return out
    lps, top_ids, top_lps = api.token_logprobs(self.target, ids, first, top_k)
    for j, t in enumerate(ids[first:]):
      out.append((*item(t, float(lps[j])),
                  [item(int(a), float(b)) for a, b in zip(top_ids[j], top_lps[j])]))
    return out

  def metrics_state(self) -> dict:
    """Counters (Engine.metrics) and gauges now, for /metrics (serve_metrics)."""
    m = dict(self.metrics)
    m["mean_acceptance_length"] = (m["tokens_generated_total"] / m["steps_total"]
                                   if m["steps_total"] else 0.0)
    m["decode_tokens_per_second"] = (m["tokens_generated_total"] / m["decode_seconds_total"]
                                     if m["decode_seconds_total"] else 0.0)
    m.update(queue_waiting=self.waiting, batch_rows=len(self._live),
             batch_slots=self._batch.size if self._batch is not None else 0)
    pc = self.prompt_cache
    if pc is not None:
      m.update(prompt_cache_bytes=pc.bytes, prompt_cache_entries=len(pc),
               prompt_cache_hits=pc.stats["hits"], prompt_cache_evictions=pc.stats["evictions"])
    m["memory_bytes"] = self.memory_bytes()
    return m

  def memory_bytes(self) -> dict[str, int]:
    """Device bytes by component: {"target_weights", "draft_weights", "batch_state" (KV cache,
    SSM / conv states, target features and tokens of the batch's slots: max_batch x max_ctx at
    most), "prompt_cache" (at most --prompt_cache_bytes)}. On the CPU backend device buffers are
    host memory, part of the process's RSS (`process_resident_memory_bytes`)."""
    from dflash_jax import api
    batch = self._batch
    return {"target_weights": self.target.device_bytes,
            "draft_weights": self.draft.device_bytes if self.draft is not None else 0,
            "batch_state": api.device_bytes(batch.state) if batch is not None else 0,
            "prompt_cache": self.prompt_cache.bytes if self.prompt_cache is not None else 0}

  def metrics_text(self) -> str:
    """/metrics: Prometheus text format with # HELP / # TYPE (serve_metrics.ServerMetrics)."""
    return self.prom.text()


def batch_buckets(max_batch: int) -> list[int]:
  """The batch buckets (batching.BATCH_BUCKETS) of at most max_batch slots, ascending."""
  from dflash_jax import batching
  return [b for b in batching.BATCH_BUCKETS if b <= max_batch]


def _chunk(kind: str, rid: str, created: int, model: str, index: int, text: Optional[str], finish,
           role=False):
  if kind == "chat":
    delta = {"role": "assistant"} if role else ({"content": text} if text is not None else {})
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    obj = "chat.completion.chunk"
  else:
    choice = {"index": index, "text": text or "", "finish_reason": finish}
    obj = "text_completion"
  return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def _usage(n_prompt: int, outs: list[Outcome]) -> dict:
  n_out = sum(o.completion_tokens for o in outs)
  return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
          "prompt_tokens_details": {"cached_tokens": int(sum(
              o.stats.get("prompt_tokens_reused", 0) for o in outs))}}


def _message(out: Outcome, tools) -> tuple[dict, str]:
  """(assistant message, finish_reason) of a chat choice; with tools (the request's tool list),
  `<tool_call>` blocks of the text become tool_calls (finish_reason "tool_calls")."""
  if tools:
    content, calls = serve_format.parse_tool_calls(out.text, tools)
    if calls:
      return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
  return {"role": "assistant", "content": out.text}, out.finish_reason


def _final(kind: str, rid: str, created: int, model: str, outs: list[Outcome], n_prompt: int,
           echo: Optional[list[str]] = None, lps: Optional[list] = None,
           tools: Optional[list] = None) -> dict:
  """The response object of a finished (chat) completion: one choice per Outcome, usage summed;
  `dflash` and `timings` (llama-server's shape) of the first choice, and per choice when
  there are several. tools: parse tool calls out of chat choices (`_message`)."""
  choices = []
  for i, out in enumerate(outs):
    if kind == "chat":
      message, finish = _message(out, tools)
      choice = {"index": i, "message": message, "finish_reason": finish,
                "logprobs": chat_logprobs(lps[i]) if lps else None}
    else:
      text = (echo[i] if echo else "") + out.text
      choice = {"index": i, "text": text, "finish_reason": out.finish_reason,
                "logprobs": completion_logprobs(lps[i]) if lps else None}
    if len(outs) > 1:
      choice["dflash"] = out.stats
    choices.append(choice)
  return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
          "created": created, "model": model, "choices": choices,
          "usage": _usage(n_prompt, outs), "dflash": outs[0].stats,
          "timings": outs[0].stats.get("timings")}


@dataclasses.dataclass
class _Job:
  """Choices running on the engine for one request: their futures (as asyncio futures), the
  queue of streamed (choice index, text piece) pairs (text None: that choice ended), the cancel
  flag and the disconnect watcher."""

  tasks: list
  pieces: asyncio.Queue
  cancel: threading.Event
  watcher: asyncio.Future

  def close(self):
    self.cancel.set()
    self.watcher.cancel()


def _launch(engine: Engine, runs: list, max_new, stops, request: fastapi.Request,
            grammar=None) -> _Job:
  """Submit each (ids, sampling) of `runs` to the engine's batch (they decode together; each
  constrained to `grammar` when given) and watch the client: a disconnect sets the cancel flag,
  which frees their slots between decode calls."""
  loop = asyncio.get_running_loop()
  cancel, pieces = threading.Event(), asyncio.Queue()
  tasks = []
  t_arrival = getattr(request.state, "t_arrival", None)          # set by Guard
  for i, (ids, samp) in enumerate(runs):
    fut = engine.submit(ids, max_new, stops, samp,
                        lambda t, i=i: loop.call_soon_threadsafe(pieces.put_nowait, (i, t)),
                        cancel.is_set, grammar=grammar, t_arrival=t_arrival)
    tasks.append(asyncio.wrap_future(fut))

  async def watch_disconnect():
    while not cancel.is_set():
      if await request.is_disconnected():
        cancel.set()
      await asyncio.sleep(0.05)

  return _Job(tasks, pieces, cancel, asyncio.ensure_future(watch_disconnect()))


async def _pieces(job: _Job):
  """(choice index, text) as the choices stream them, until every choice ended."""
  left = len(job.tasks)
  while left:
    i, text = await job.pieces.get()
    if text is None:
      left -= 1
    else:
      yield i, text


async def _results(job: _Job) -> list[Outcome]:
  """Every choice's Outcome (the first failure raised, after all ended)."""
  outs = await asyncio.gather(*job.tasks, return_exceptions=True)
  for o in outs:
    if isinstance(o, BaseException):
      raise o
  return outs


async def _events(engine: Engine, job: _Job, kind: str, rid: str, created: int, req, n_prompt: int,
                  echo: Optional[list[str]], scorer=None, tools: Optional[list] = None):
  """The server-sent events of a streamed request, ending with `data: [DONE]`: (chat) a role
  chunk per choice, (completions with echo) the prompt, text chunks as they come, a last chunk
  per choice with its finish_reason and `dflash` stats, then (stream_options.include_usage) a
  usage chunk with no choices. An error after the headers went out is sent as an error event.
  tools: a choice's text is held back until it ends, then sent as one content delta and one
  tool_calls delta (each call whole: id, name, arguments)."""
  name = engine.model_name
  send = lambda obj: f"data: {json.dumps(obj)}\n\n"   # noqa: E731
  try:
    for i in range(len(job.tasks)):
      if kind == "chat":
        yield send(_chunk(kind, rid, created, name, i, None, None, role=True))
      elif echo:
        yield send(_chunk(kind, rid, created, name, i, echo[i], None))
    async for i, text in _pieces(job):
      if not tools:
        yield send(_chunk(kind, rid, created, name, i, text, None))
    try:
      outs = await _results(job)
      lps = await scorer(outs) if scorer is not None else None
    except ApiError as e:   # headers are sent: report the error as an event
      yield send(e.body())
      yield "data: [DONE]\n\n"
      return
    except Exception as e:  # noqa: BLE001 (any failure still ends the stream properly)
      yield send(_server_error(e).body())
      yield "data: [DONE]\n\n"
      return
    for i, out in enumerate(outs):
      finish = out.finish_reason
      if tools:
        message, finish = _message(out, tools)
        if message["content"]:
          yield send(_chunk(kind, rid, created, name, i, message["content"], None))
        if message.get("tool_calls"):
          delta = _chunk(kind, rid, created, name, i, None, None)
          delta["choices"][0]["delta"] = {"tool_calls": [
              dict(c, index=k) for k, c in enumerate(message["tool_calls"])]}
          yield send(delta)
      last = _chunk(kind, rid, created, name, i, None, finish)
      last["dflash"] = out.stats
      if lps:         # scored once the choice is complete: every token's entry in its last chunk
        last["choices"][0]["logprobs"] = (chat_logprobs if kind == "chat" else
                                          completion_logprobs)(lps[i])
      yield send(last)
    if req.stream_options is not None and req.stream_options.include_usage:
      yield send({"id": rid, "object": "chat.completion.chunk" if kind == "chat" else
                  "text_completion", "created": created, "model": name, "choices": [],
                  "usage": _usage(n_prompt, outs)})
    yield "data: [DONE]\n\n"
  finally:
    job.close()


def _server_error(e: Exception) -> ApiError:
  return ApiError(500, f"internal error: {type(e).__name__}: {e}"[:500], type_="server_error")


def _check_queue(engine: Engine):
  if engine.waiting >= engine.max_queue:
    raise ApiError(503, "the server is busy (queue full); retry later", type_="server_error",
                   code="queue_full")


async def _complete(engine: Engine, kind: str, req, request: fastapi.Request):
  """Validate, queue and answer one (chat) completion request: n choices per prompt (several
  prompts on /v1/completions), decoded together in the batch; choice j of a prompt samples with
  seed + j. The cheap checks run first (queue bound, sizes in characters); tokenizing and the
  chat template run in a worker thread, so a large prompt never holds up the event loop."""
  from fastapi.responses import StreamingResponse
  _check_queue(engine)
  engine.check_size(req)
  plan = (serve_format.tool_plan(req.tools, req.tool_choice, engine.target.tokenizer.chat_template)
          if kind == "chat" else None)
  regex, param = serve_format.response_format_regex(req.response_format), "response_format"
  if plan is not None and regex is not None:
    raise ApiError(400, "response_format (json) and tools together are not supported: give "
                   "tool_choice 'none' or no response_format", param="response_format")
  if plan is not None and plan.regex is not None:
    regex, param = plan.regex, "tools"
  if kind == "chat":
    prompts = [await asyncio.to_thread(engine.prompt_ids, req, plan.tools if plan else None)]
  else:
    prompts = await asyncio.to_thread(engine.completion_prompts, req)
  max_new, stops = engine.check(req, max(prompts, key=len), n_prompts=len(prompts))
  grammar = await asyncio.to_thread(engine.grammar, regex, param) if regex is not None else None
  samp = engine.sampling(req)
  top_k = logprobs_wanted(req)
  if await request.is_disconnected():       # gone while its prompt was tokenized
    raise ApiError(499, "the client disconnected", code="client_disconnected")
  runs = [(ids, dataclasses.replace(samp, seed=(samp.seed + j) % 2**31))
          for ids in prompts for j in range(req.n)]
  echo = None
  if kind != "chat" and req.echo:            # the prompt's text before each choice's text
    p = req.prompt
    srcs = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
    texts = [q if isinstance(q, str) else engine.target.tokenizer.decode(ids, skip_special=False)
             for q, ids in zip(srcs, prompts)]
    echo = [t for t in texts for _ in range(req.n)]
  rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
  created = int(time.time())
  n_prompt = sum(len(p) for p in prompts)
  scorer = None
  if top_k is not None:
    async def scorer(outs):       # log-probabilities of each choice's tokens (one forward each)
      return [await asyncio.to_thread(engine.logprobs, runs[i][0], o.tokens, top_k, bool(echo))
              for i, o in enumerate(outs)]
  job = _launch(engine, runs, max_new, stops, request, grammar)
  if req.stream:
    return StreamingResponse(_events(engine, job, kind, rid, created, req, n_prompt, echo, scorer,
                                     tools=plan.tools if plan else None),
                             media_type="text/event-stream")
  try:
    outs = await _results(job)
    lps = await scorer(outs) if scorer is not None else None
  finally:
    job.close()
  return _final(kind, rid, created, engine.model_name, outs, n_prompt, echo, lps,
                tools=plan.tools if plan else None)


def _stop_reason(out: Outcome) -> tuple[str, Optional[str]]:
  """Anthropic (stop_reason, stop_sequence) of an Outcome."""
  if out.stop_hit is not None:
    return "stop_sequence", out.stop_hit
  return ("end_turn" if out.eog else "max_tokens"), None


async def _anthropic_events(engine: Engine, job: _Job, rid: str, n_prompt: int):
  """Anthropic's event stream: message_start, content_block_start, ping, content_block_delta
  (text_delta) ..., content_block_stop, message_delta (stop_reason, usage), message_stop; an
  error after the headers went out is an `error` event."""
  try:
    start = anthropic_message(rid, engine.model_name, "", None, None, n_prompt, 0, {})
    start["content"] = []
    yield sse("message_start", {"type": "message_start", "message": start})
    yield sse("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}})
    yield sse("ping", {"type": "ping"})
    async for _, text in _pieces(job):
      yield sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}})
    try:
      out = (await _results(job))[0]
    except Exception as e:  # noqa: BLE001 (any failure still ends the stream properly)
      err = e if isinstance(e, ApiError) else _server_error(e)
      yield sse("error", err.anthropic_body())
      return
    reason, seq = _stop_reason(out)
    yield sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": reason, "stop_sequence": seq},
                                "usage": {**anthropic_input_usage(n_prompt, out.stats),
                                          "output_tokens": out.completion_tokens},
                                "dflash": out.stats})
    yield sse("message_stop", {"type": "message_stop"})
  finally:
    job.close()


async def _anthropic(engine: Engine, req: AnthropicRequest, request: fastapi.Request):
  """Answer an Anthropic Messages request over the same engine (one choice)."""
  from fastapi.responses import StreamingResponse
  _check_queue(engine)
  engine.check_size(req)
  msgs = anthropic_messages(req.system, req.messages)
  ids = await asyncio.to_thread(engine.messages_ids, msgs,
                                continue_final=msgs[-1]["role"] == "assistant")
  max_new, stops = engine.check(req, ids)
  samp = engine.sampling(req)
  rid = f"msg_{uuid.uuid4().hex[:24]}"
  job = _launch(engine, [(ids, samp)], max_new, stops, request)
  if req.stream:
    return StreamingResponse(_anthropic_events(engine, job, rid, len(ids)),
                             media_type="text/event-stream")
  try:
    out = (await _results(job))[0]
  finally:
    job.close()
  reason, seq = _stop_reason(out)
  return anthropic_message(rid, engine.model_name, out.text, reason, seq, len(ids),
                           out.completion_tokens, out.stats)


def _json_error(e: ApiError, headers: Optional[dict] = None, anthropic: bool = False):
  from fastapi.responses import JSONResponse
  if e.status in (429, 503):
    headers = {"Retry-After": "1", **(headers or {})}
  return JSONResponse(e.anthropic_body() if anthropic else e.body(), status_code=e.status,
                      headers=headers)


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


def _key_matches(headers: dict, key: bytes) -> bool:
  """Whether the request presents `key`: as `Authorization: Bearer <key>` (the scheme matched
  case-insensitively, RFC 9110 11.1) or as Anthropic's `x-api-key: <key>`. Each candidate is
  compared with hmac.compare_digest."""
  scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
  ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
  return hmac.compare_digest(headers.get(b"x-api-key", b""), key) or ok


class Guard:
  """Pure ASGI middleware in front of the app (not Starlette's BaseHTTPMiddleware, which hides
  client disconnects from the routes): checks the Host header against `allowed_hosts` (400
  invalid_host), the API key on every route but /health (401; `Authorization: Bearer` with
  the scheme in any case, or `x-api-key`; hmac.compare_digest), and the
  request body size (413 request_too_large from Content-Length at once, or as soon as a body
  without one grows past the limit). max_body_bytes(): the limit now (it follows the engine)."""

  def __init__(self, app, *, api_key: Optional[str], allowed_hosts, max_body_bytes: Callable[[], int],
               body_timeout: Optional[float] = None, body_min_rate: float = 16384.0,
               max_requests: Optional[int] = None):
    self.app, self.max_body_bytes = app, max_body_bytes
    self.key = api_key.encode() if api_key else None
    self.hosts = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
    self.body_timeout, self.body_min_rate, self.max_requests = body_timeout, body_min_rate, max_requests
    self.in_flight = 0

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    # the request's arrival (its headers read): time to first token and latency count from here
    scope.setdefault("state", {})["t_arrival"] = time.perf_counter()
    headers = dict(scope.get("headers") or [])
    host = headers.get(b"host", b"").decode("latin-1")
    anthropic = _is_anthropic(scope.get("path", ""))
    if self.hosts is not None and _host_name(host) not in self.hosts:
      return await _json_error(ApiError(400, f"Host header {host[:100]!r} is not allowed (allowed: "
                                        f"{', '.join(sorted(self.hosts))}; --allowed_hosts)",
                                        code="invalid_host"), anthropic=anthropic)(scope, receive, send)
    if self.key is not None and scope["path"] != "/health" and not _key_matches(headers, self.key):
      return await _json_error(ApiError(401, "invalid or missing API key", type_="authentication_error",
                                        code="invalid_api_key"), anthropic=anthropic)(scope, receive, send)
    limit = self.max_body_bytes()
    try:
      declared = int(headers.get(b"content-length", b"0"))
    except ValueError:
      declared = 0
    if declared > limit:
      return await _json_error(_too_large(limit), {"Connection": "close"},
                               anthropic=anthropic)(scope, receive, send)
    if (self.max_requests is not None and scope["path"] != "/health"
        and self.in_flight >= self.max_requests):
      return await _json_error(ApiError(503, f"the server has {self.in_flight} requests open, its "
                                        "limit (--max_connections); retry later", type_="server_error",
                                        code="too_many_connections"), {"Retry-After": "1"},
                               anthropic=anthropic)(scope, receive, send)
    seen, body_done = 0, False
    deadline = (None if self.body_timeout is None else
                time.monotonic() + self.body_timeout + declared / self.body_min_rate)

    async def limited_receive():
      nonlocal seen, body_done
      if body_done or deadline is None:
        msg = await receive()
      else:
        try:
          msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
          raise _body_timeout_exception(self.body_timeout, self.body_min_rate) from None
      if msg["type"] == "http.request":
        seen += len(msg.get("body", b""))
        body_done = not msg.get("more_body", False)
        if seen > limit:
          raise _too_large_exception(limit)
      return msg

    self.in_flight += 1
    try:
      await self.app(scope, limited_receive, send)
    finally:
      self.in_flight -= 1


# Connections uvicorn admits beyond --max_connections (its limit_concurrency): room for /health
# and /metrics when the API's requests are at their cap.
HEALTH_RESERVE = 16


def _body_timeout_exception(seconds: float, min_rate: float):
  """What the body reader raises when a request body has not arrived in time: 408, and the
  connection closed."""
  from starlette.exceptions import HTTPException
  return HTTPException(408, f"the request body did not arrive within {seconds:g} s plus its "
                       f"length at {min_rate:g} bytes/s (--body_timeout, --body_min_rate)",
                       headers={"Connection": "close"})


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


def _is_anthropic(path: str) -> bool:
  return path == "/v1/messages" or path.startswith("/v1/messages/")


class TokenizeRequest(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True)
  content: str
  add_special: bool = False
  parse_special: bool = True
  with_pieces: bool = False


class DetokenizeRequest(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True)
  tokens: list[int]


class ApplyTemplateRequest(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="allow", strict=True)
  messages: list[dict[str, Any]]


def _props(e: Engine) -> dict:
  """GET /props: llama-server's field names where they exist, plus the speculative settings."""
  s = e.sampling_defaults
  dec = e.dec
  return {"default_generation_settings": {
              "n_ctx": dec.max_ctx,
              "params": {"temperature": s.temperature if s else 0.0, "top_k": s.top_k if s else 0,
                         "top_p": s.top_p if s else 1.0, "min_p": s.min_p if s else 0.0,
                         "seed": "random per request unless given"}},
          "total_slots": e.max_batch, "model_path": e.target.path, "model_alias": e.model_name,
          "chat_template": e.target.tokenizer.chat_template or "",
          "modalities": {"vision": False, "audio": False}, "build_info": "dflash-jax",
          "speculative": {"mode": dec.mode, "draft": e.draft.path if e.draft is not None else None,
                          "block_size": dec.block_size, "budget": dec.budget if dec.uses_tree
                          else None},
          "prompt_cache_bytes": e.prompt_cache.max_bytes if e.prompt_cache is not None else 0}


def create_app(engine, api_key: Optional[str] = None, *, allowed_hosts=None,
               max_body_bytes: Optional[int] = None, cors_origins: Optional[list[str]] = None,
               allow_unknown_fields: bool = False, body_timeout: Optional[float] = 30.0,
               body_min_rate: float = 16384.0, max_requests: Optional[int] = None):
  """The ASGI application around `engine`: an Engine, or a function returning the Engine or
  None while it is still loading (then /health answers 503 {"status": "loading"} and the other
  routes a 503 error).

  api_key: required on every route but /health (docs and /metrics included), as a Bearer token
    (`Authorization: Bearer <key>`, the scheme in any case) or Anthropic's `x-api-key` header.
  allowed_hosts: Host header names accepted (None: any; see default_allowed_hosts).
  max_body_bytes: request body limit (default Engine.max_body_bytes(), 1 MiB while loading).
  cors_origins: origins a browser page may call the API from (CORS, starlette's CORSMiddleware:
  preflights answered, Access-Control-Allow-Origin on responses); None / empty: CORS off (a
  page on another origin cannot read responses), ["*"]: any origin.
  allow_unknown_fields: accept and ignore request fields the API does not define (default: 400
  `unknown_parameter` naming the field; serve_protocol.refuse_unknown).
  body_timeout, body_min_rate: a request body must arrive within body_timeout seconds (None: no
  limit) plus its Content-Length at body_min_rate bytes/s of its headers, else 408 and the
  connection closed (slow-body slowloris).
  max_requests: requests open at once outside /health (503 `too_many_connections` beyond); with
  uvicorn's limit_concurrency set a little higher, /health keeps answering when the rest is full.
  Every error, routing ones included, has OpenAI's shape {"error": {message, type, param, code}}
  (Anthropic's {"type": "error", "error": {type, message}} under /v1/messages); 503s carry
  Retry-After.

  Routes: POST /v1/chat/completions, /v1/completions, /v1/messages (Anthropic),
  /v1/messages/count_tokens, /tokenize, /detokenize, /apply-template; GET /v1/models,
  /v1/models/{id}, /props, /health, /metrics.
  """
  from fastapi.exceptions import RequestValidationError
  from fastapi.responses import JSONResponse, Response

  from starlette.exceptions import HTTPException

  get = engine if callable(engine) else (lambda: engine)

  def _refuse(req, unsupported: dict):
    refuse_unknown(req, unsupported, allow_unknown_fields)
    refuse_unsupported(req.model_extra, unsupported)

  def ready() -> Engine:
    e = get()
    if e is None:
      raise ApiError(503, "the model is still loading; retry when /health answers 200",
                     type_="server_error", code="model_loading")
    return e

  def error(request, e: ApiError, headers=None):
    return _json_error(e, headers, anthropic=_is_anthropic(request.url.path))

  api = fastapi.FastAPI(title="dflash-jax")
  api.exception_handler(ApiError)(error)
  api.exception_handler(RequestValidationError)(lambda r, e: error(r, validation_error(e)))
  api.exception_handler(HTTPException)(lambda r, e: error(r, ApiError(
      e.status_code, str(e.detail), code={404: "not_found", 405: "method_not_allowed",
                                          408: "request_timeout",
                                          413: "request_too_large"}.get(e.status_code)),
      getattr(e, "headers", None)))
  api.exception_handler(Exception)(lambda r, e: error(r, _server_error(e)))

  @api.get("/health")
  def health():
    e = get()
    if e is None:
      return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    return {"status": "ok", "model": e.model_name, "waiting": e.waiting,
            "warm_buckets": e.warm_buckets(), "max_batch": e.max_batch}

  from dflash_jax.serve_metrics import CONTENT_TYPE
  api.get("/metrics")(lambda: Response(ready().metrics_text(), media_type=CONTENT_TYPE))

  def model_object(e: Engine) -> dict:
    return {"id": e.model_name, "object": "model", "created": 0, "owned_by": "dflash-jax",
            "meta": {"n_ctx": e.dec.max_ctx, "n_vocab": e.target.config.n_vocab}}

  api.get("/v1/models")(lambda: {"object": "list", "data": [model_object(ready())]})

  @api.get("/v1/models/{model_id:path}")
  def model(model_id: str):
    e = ready()
    if model_id != e.model_name:
      raise ApiError(404, f"the model {model_id!r} does not exist (this server has "
                     f"{e.model_name!r})", param="model", code="model_not_found")
    return model_object(e)

  api.get("/props")(lambda: _props(ready()))

  @api.post("/v1/chat/completions")
  async def chat(req: ChatRequest, request: fastapi.Request):
    _refuse(req, UNSUPPORTED)
    return await _complete(ready(), "chat", req, request)

  @api.post("/v1/completions")
  async def completions(req: CompletionRequest, request: fastapi.Request):
    _refuse(req, COMPLETION_UNSUPPORTED)
    return await _complete(ready(), "completion", req, request)

  @api.post("/v1/messages")
  async def messages(req: AnthropicRequest, request: fastapi.Request):
    _refuse(req, ANTHROPIC_UNSUPPORTED)
    return await _anthropic(ready(), req, request)

  @api.post("/v1/messages/count_tokens")
  async def count_tokens(req: CountTokensRequest):
    _refuse(req, ANTHROPIC_UNSUPPORTED)
    e = ready()
    e.check_size(req)
    msgs = anthropic_messages(req.system, req.messages)
    ids = await asyncio.to_thread(e.messages_ids, msgs,
                                  continue_final=msgs[-1]["role"] == "assistant")
    return {"input_tokens": len(ids)}

  @api.post("/tokenize")
  async def tokenize(req: TokenizeRequest):
    e = ready()
    from dflash_jax.tokenizer import check_text
    if len(req.content) > e.max_prompt_chars():
      raise ApiError(400, f"content has {len(req.content)} characters, more than "
                     f"{e.max_prompt_chars()}", param="content")
    try:
      ids = await asyncio.to_thread(e.target.tokenizer.encode, check_text(req.content),
                                    add_bos=None if req.add_special else False,
                                    parse_special=req.parse_special)
    except ValueError as err:
      raise ApiError(400, f"content: {err}", param="content") from None
    if not req.with_pieces:
      return {"tokens": ids}
    dec = e.target.tokenizer.decode
    return {"tokens": [{"id": t, "piece": dec([t], skip_special=False)} for t in ids]}

  @api.post("/detokenize")
  async def detokenize(req: DetokenizeRequest):
    e = ready()
    bad = [t for t in req.tokens if not 0 <= t < e.target.config.n_vocab]
    if bad:
      raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, "
                     f"{e.target.config.n_vocab})", param="tokens")
    return {"content": e.target.tokenizer.decode(req.tokens, skip_special=False)}

  @api.post("/apply-template")
  async def apply_template(req: ApplyTemplateRequest):
    e = ready()
    msgs = chat_messages(req.messages, e.target.tokenizer.chat_template)
    try:
      text = await asyncio.to_thread(e.target.tokenizer.apply_chat_template, msgs,
                                     add_generation_prompt=True)
    except (ValueError, NotImplementedError) as err:
      raise ApiError(400, f"cannot apply the chat template: {err}", param="messages") from None
    return {"prompt": text}

  def body_limit() -> int:
    if max_body_bytes is not None:
      return max_body_bytes
    e = get()
    return e.max_body_bytes() if e is not None else 1 << 20

  app_ = Guard(api, api_key=api_key, allowed_hosts=allowed_hosts, max_body_bytes=body_limit,
               body_timeout=body_timeout, body_min_rate=body_min_rate, max_requests=max_requests)
  if cors_origins:
    from starlette.middleware.cors import CORSMiddleware
    app_ = CORSMiddleware(app_, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                          allow_headers=["*"], max_age=600)
  return app_


if __name__ == "__main__":
  from absl import flags as _flags
  from dflash_jax import decode_flags as _df, serve_cli as _cli, target_flags as _tf
  for _m in (_cli, _tf, _df):       # --help lists them: key flags of the main module
    _flags.adopt_module_key_flags(_m)
  _cli.run()
