"""The server's request and response shapes: OpenAI chat / completions and Anthropic messages,
normalized to what the engine decodes (token ids from the chat template, a token budget, stop
strings, sampling fields), and the errors each API answers with.

OpenAI chat messages (https://platform.openai.com/docs/api-reference/chat/create): content is a
string, null (an assistant turn holding only tool calls) or a list of text parts (joined with
"\\n", as vLLM and llama-server do); other part types (images, audio, files) are refused with a
400 naming the part. The `developer` role is the system role of newer OpenAI models and is
rendered as `system`. Tool results (`tool` role, `tool_call_id`) and assistant `tool_calls` in the
history go to the chat template; a template that does not render tool calls gets them appended
to the assistant's content in the Hermes / Qwen `<tool_call>` JSON form, so no turn of the
history is dropped.

Anthropic Messages (https://docs.anthropic.com/en/api/messages): `system` (string or text
blocks), user / assistant messages with string or text-block content, `max_tokens` (required),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `metadata`; answered with a
`message` object (or its server-sent event sequence) and Anthropic-shaped errors.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

import pydantic


class ApiError(Exception):
  """An OpenAI-style error: HTTP status, message, type, param, code."""

  def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None):
    super().__init__(message)
    self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

  def body(self) -> dict:
    """OpenAI's error object {"error": {message, type, param, code}}."""
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}

  def anthropic_body(self) -> dict:
    """Anthropic's error object {"type": "error", "error": {type, message}}."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            503: "overloaded_error"}.get(self.status, "api_error" if self.status >= 500
                                         else "invalid_request_error")
    msg = self.message + (f" (param: {self.param})" if self.param else "")
    return {"type": "error", "error": {"type": kind, "message": msg}}


# Requests are validated strictly: a field of the wrong JSON type is a 400 naming it, never coerced
# ("10" is not an int, true is not a number, "yes" is not a boolean), as OpenAI does. Fields
# outside a request's model are kept in `model_extra` and checked by `refuse_unknown`.
_STRICT = pydantic.ConfigDict(extra="allow", strict=True)


class StreamOptions(pydantic.BaseModel):
  model_config = _STRICT
  include_usage: Optional[bool] = None


class _Request(pydantic.BaseModel):
  model_config = _STRICT
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
  user: Optional[str] = None          # an end-user id (OpenAI's abuse monitoring): accepted
  logit_bias: Optional[dict[str, float]] = None
  presence_penalty: Optional[float] = None
  frequency_penalty: Optional[float] = None
  repetition_penalty: Optional[float] = None     # vLLM's name
  repeat_penalty: Optional[float] = None         # llama-server's name
  repeat_last_n: Optional[int] = None            # llama-server's penalty window
  stream_options: Optional[StreamOptions] = None
  response_format: Optional[Any] = None          # serve_format.response_format_regex


class ChatRequest(_Request):
  messages: list[dict[str, Any]]
  tools: Optional[Any] = None                    # serve_format.tool_plan
  tool_choice: Optional[Any] = None
  parallel_tool_calls: Optional[bool] = None     # accepted: a forced call is one call
  logprobs: Optional[bool] = None
  top_logprobs: Optional[int] = None


class CompletionRequest(_Request):
  prompt: Union[str, list[int], list[str], list[list[int]]]
  echo: bool = False
  logprobs: Optional[Union[bool, int]] = None     # false: none; an int: top alternatives


class AnthropicRequest(pydantic.BaseModel):
  model_config = _STRICT
  model: Optional[str] = None
  messages: list[dict[str, Any]]
  max_tokens: int = pydantic.Field(..., ge=1)
  system: Optional[Union[str, list[dict[str, Any]]]] = None
  stop_sequences: Optional[list[str]] = None
  stream: bool = False
  temperature: Optional[float] = pydantic.Field(None, ge=0.0, le=1.0)
  top_p: Optional[float] = None
  top_k: Optional[int] = None
  metadata: Optional[dict[str, Any]] = None


class CountTokensRequest(pydantic.BaseModel):
  model_config = _STRICT
  model: Optional[str] = None
  messages: list[dict[str, Any]]
  system: Optional[Union[str, list[dict[str, Any]]]] = None


# Request fields this server does not implement -> the values that ask for nothing (accepted).
UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"),
    "best_of": (None, 1), "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "store": (None, False),
    "service_tier": (None, "auto", "default"), "web_search_options": (None,),
    "verbosity": (None, "medium"),
}
# /v1/completions has no tools (OpenAI's legacy completions API): refused there.
COMPLETION_UNSUPPORTED = dict(UNSUPPORTED, tools=(None, []), tool_choice=(None, "none"),
                              parallel_tool_calls=(None, True, False))
ANTHROPIC_UNSUPPORTED = {
    "tools": (None, []), "tool_choice": (None, {"type": "none"}, {"type": "auto"}),
    "thinking": (None, {"type": "disabled"}), "mcp_servers": (None, []),
    "container": (None,), "service_tier": (None, "auto", "standard_only"),
}
# Documented request fields that are hints this server has no use for: accepted and ignored.
IGNORED = {"metadata", "prompt_cache_key", "safety_identifier"}


def refuse_unknown(req: pydantic.BaseModel, unsupported: dict, allow: bool = False):
  """ApiError 400 `unknown_parameter` naming the first field of `req` that is neither one of its
  model's fields nor in `unsupported` (the endpoint's table above) nor in `IGNORED`: a typo such as
  `max_token` is reported, not silently dropped (OpenAI: "Unrecognized request argument"). allow:
  accept and ignore such fields (the server's --allow_unknown_fields)."""
  if allow or not req.model_extra:
    return
  for name in req.model_extra:
    if name not in unsupported and name not in IGNORED:
      raise ApiError(400, f"Unrecognized request argument supplied: {name} (a server started "
                     "with --allow_unknown_fields ignores such fields)", param=name,
                     code="unknown_parameter")


def refuse_unsupported(extra: Optional[dict], table: dict, where: str = ""):
  """ApiError 400 unsupported_parameter for the first field of `table` given with a value other
  than its no-op values (nothing a client asks for is silently dropped)."""
  for name, noop in table.items():
    if extra and name in extra and extra[name] not in noop:
      raise ApiError(400, f"{name} is not supported by this server (dflash-jax){where}",
                     param=name, code="unsupported_parameter")


MAX_TOP_LOGPROBS = 20


def logprobs_wanted(req) -> Optional[int]:
  """None when a request asks for no log-probabilities, else how many top alternatives per
  token (chat: `logprobs: true` + `top_logprobs` 0..20; completions: `logprobs` 0..20).
  Raises ApiError 400 naming the field."""
  if isinstance(req, ChatRequest):
    k = req.top_logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
      raise ApiError(400, f"top_logprobs={k} must be in [0, {MAX_TOP_LOGPROBS}]",
                     param="top_logprobs")
    if k and not req.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (k or 0) if req.logprobs else None
  k = getattr(req, "logprobs", None)
  if isinstance(k, bool):
    k = 0 if k else None
  if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
    raise ApiError(400, f"logprobs={k} must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
  return k


def chat_logprobs(items: list) -> dict:
  """OpenAI chat `logprobs` from [(token text, token bytes, logprob, [(text, bytes, logprob)])]."""
  entry = lambda t, b, lp: {"token": t, "logprob": lp, "bytes": list(b)}   # noqa: E731
  return {"content": [dict(entry(t, b, lp), top_logprobs=[entry(*x) for x in tops])
                      for t, b, lp, tops in items], "refusal": None}


def completion_logprobs(items: list, offset: int = 0) -> dict:
  """OpenAI completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) from the
  same items (logprob None: the first prompt token under echo); offsets start at `offset`."""
  offs, pos = [], offset
  for t, _, _, _ in items:
    offs.append(pos)
    pos += len(t)
  return {"tokens": [t for t, _, _, _ in items], "token_logprobs": [lp for _, _, lp, _ in items],
          "top_logprobs": [({x[0]: x[2] for x in tops} if lp is not None else None)
                           for _, _, lp, tops in items], "text_offset": offs}


def content_text(content, where: str) -> str:
  """The text of a message's content: a string, None (""), or a list of text parts
  ({"type": "text", "text": str}, joined with "\\n"). Raises ApiError 400 naming the part for
  any other part type or shape."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise ApiError(400, f"{where} must be a string or a list of content parts", param=where)
  texts = []
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind != "text":
      raise ApiError(400, f"{where}[{j}]: content parts of type {kind!r} are not supported "
                     "(this model reads text parts only)", param=f"{where}[{j}]")
    if not isinstance(part.get("text"), str):
      got = "missing" if "text" not in part else f"a {type(part['text']).__name__}"
      raise ApiError(400, f"{where}[{j}].text must be a string (a text part is {{type: 'text', "
                     f"text: str}}); it is {got}", param=f"{where}[{j}].text")
    texts.append(part["text"])
  return "\n".join(texts)


def _tool_calls(calls, where: str) -> list[dict]:
  if not isinstance(calls, list):
    raise ApiError(400, f"{where} must be a list", param=where)
  out = []
  for j, c in enumerate(calls):
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
        not isinstance(fn.get("arguments", ""), (str, dict)):
      raise ApiError(400, f"{where}[{j}] must be {{type: 'function', function: {{name, "
                     "arguments}}}", param=f"{where}[{j}]")
    out.append({"id": c.get("id"), "type": "function",
                "function": {"name": fn["name"], "arguments": fn.get("arguments", "")}})
  return out


def _tool_call_text(call: dict) -> str:
  args = call["function"]["arguments"]
  try:
    args = json.loads(args) if isinstance(args, str) else args
  except json.JSONDecodeError:
    pass
  return ("<tool_call>\n" + json.dumps({"name": call["function"]["name"], "arguments": args},
                                       ensure_ascii=False) + "\n</tool_call>")


def chat_messages(messages, chat_template: Optional[str]) -> list[dict]:
  """OpenAI chat messages -> [{role, content: str, ...}] for the chat template (see the module
  docstring): text parts joined, developer -> system, tool turns and assistant tool_calls kept
  (appended to the content as <tool_call> JSON when the template has no `tool_calls`). Raises
  ApiError 400 naming messages[i] (and the part or field) for anything else."""
  if not isinstance(messages, list) or not messages:
    raise ApiError(400, "messages must be a non-empty list", param="messages")
  renders_calls = bool(chat_template) and "tool_calls" in chat_template
  out = []
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("system", "developer", "user", "assistant", "tool"):
      raise ApiError(400, f"{where} needs a role (system, developer, user, assistant, tool); got "
                     f"{role!r}", param=where)
    if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
      raise ApiError(400, f"{where} has no content (a string or a list of text parts; null only "
                     "in an assistant turn with tool_calls)", param=f"{where}.content")
    msg = {"role": "system" if role == "developer" else role,
           "content": content_text(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
      calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
      if renders_calls:
        msg["tool_calls"] = calls
      else:
        msg["content"] = "\n".join([msg["content"]] * bool(msg["content"]) +
                                   [_tool_call_text(c) for c in calls])
    if role == "tool":
      if not isinstance(m.get("tool_call_id", ""), str):
        raise ApiError(400, f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
      msg["tool_call_id"] = m.get("tool_call_id", "")
    if isinstance(m.get("name"), str):
      msg["name"] = m["name"]
    out.append(msg)
  return out


def anthropic_messages(system, messages) -> list[dict]:
  """An Anthropic request's `system` and `messages` -> chat-template messages. Content: a string
  or text blocks ({"type": "text", "text"}); other block types (images, tool_use, tool_result,
  documents) are refused with a 400 naming the block. Roles: user, assistant; a final assistant
  message is a prefill the reply continues (the caller renders it with continue_final)."""
  out = []
  if system is not None:
    out.append({"role": "system", "content": content_text(system, "system")})
  if not messages:
    raise ApiError(400, "messages must be a non-empty list", param="messages")
  for i, m in enumerate(messages):
    where = f"messages[{i}]"
    role = m.get("role") if isinstance(m, dict) else None
    if role not in ("user", "assistant"):
      raise ApiError(400, f"{where}.role must be 'user' or 'assistant', got {role!r}",
                     param=f"{where}.role")
    if m.get("content") is None:
      raise ApiError(400, f"{where} has no content (a string or a list of text blocks)",
                     param=f"{where}.content")
    out.append({"role": role, "content": content_text(m["content"], f"{where}.content")})
  return out


def anthropic_message(rid: str, model: str, text: str, stop_reason: str,
                      stop_sequence: Optional[str], n_prompt: int, n_out: int, stats: dict) -> dict:
  """A non-streamed Anthropic `message` object. Its usage counts the prompt as Anthropic does:
  `input_tokens` are the prompt tokens prefilled, `cache_read_input_tokens` those restored from
  the prompt cache (together the prompt's length)."""
  return {"id": rid, "type": "message", "role": "assistant", "model": model,
          "content": [{"type": "text", "text": text}], "stop_reason": stop_reason,
          "stop_sequence": stop_sequence, "usage": {**anthropic_input_usage(n_prompt, stats),
                                                    "output_tokens": n_out},
          "dflash": stats}


def anthropic_input_usage(n_prompt: int, stats: dict) -> dict:
  """{"input_tokens", "cache_read_input_tokens"} of a prompt of n_prompt tokens of which
  stats["prompt_tokens_reused"] came from the prompt cache."""
  reused = int(stats.get("prompt_tokens_reused", 0))
  return {"input_tokens": n_prompt - reused, "cache_read_input_tokens": reused}


def sse(event: Optional[str], data: dict) -> str:
  """One server-sent event (with an `event:` line for Anthropic's named events)."""
  head = f"event: {event}\n" if event else ""
  return f"{head}data: {json.dumps(data)}\n\n"


# pydantic's tags of a union's members inside an error's location ("stop.str", "prompt.list[int]")
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\])$")


def _loc(err: dict) -> str:
  """The request field a pydantic error is about, e.g. "logit_bias.1" (the leading "body" and
  union-member tags dropped)."""
  return ".".join(str(x) for x in err.get("loc", ())[1:] if not _UNION_TAG.match(str(x)))


def validation_error(e) -> ApiError:
  """ApiError 400 for a pydantic RequestValidationError, naming the first bad field."""
  errs = e.errors()
  if errs and errs[0].get("type") == "json_invalid":     # loc is (body, character offset)
    ctx = errs[0].get("ctx") or {}
    return ApiError(400, f"the request body is not valid JSON ({ctx.get('error', 'parse error')} "
                    f"at character {errs[0].get('loc', (None, '?'))[-1]})", param=None)
  loc = _loc(errs[0]) if errs else None
  msg = "; ".join(f"{_loc(d) or 'body'}: {d.get('msg')}" for d in errs) or "invalid request"
  return ApiError(400, msg, param=loc or None)
