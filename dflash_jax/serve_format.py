"""Structured output for the server: OpenAI `response_format` (json_object, json_schema) and
`tools` / `tool_choice`, as regular expressions the decoder constrains to (grammar.py), and the
parsing of tool calls out of the generated text.

Tool-call format: the Hermes / Qwen form the Qwen chat templates ask for,
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A chat template that renders
`tools` itself gets them as the `tools` variable (transformers' convention); one that does not
(SmolLM2's) gets Qwen2.5's tool instructions as (the start of) the system message.
`tool_choice`:
  * "none": the tools are not shown to the model and nothing is parsed.
  * "auto" (default with tools): free generation; `<tool_call>` blocks in the output become
    `tool_calls` (JSON form, and the `<function=name><parameter=p>` XML form of Qwen3-Coder
    templates), the text outside them the content.
  * "required" / {"type": "function", "function": {"name": X}}: the output is constrained to
    one tool call (any tool / tool X) whose arguments follow the tool's `parameters` schema.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Optional

from dflash_jax import grammar as grammar_lib
from dflash_jax.serve_protocol import ApiError

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def response_format_regex(rf: Any) -> Optional[str]:
  """The regex `response_format` asks for: None for {"type": "text"} or no value; any JSON
  object for json_object; the schema of json_schema ({"json_schema": {"name", "schema",
  "strict"}}; without a schema: any JSON object). Raises ApiError 400 param response_format."""
  if rf is None:
    return None
  if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema'",
                   param="response_format")
  kind = rf["type"]
  if kind == "text":
    return None
  schema: Any = grammar_lib.JSON_OBJECT_SCHEMA
  if kind == "json_schema":
    js = rf.get("json_schema")
    if not isinstance(js, dict):
      raise ApiError(400, "response_format.json_schema must be an object {name, schema, strict}",
                     param="response_format.json_schema")
    if js.get("schema") is not None:
      schema = js["schema"]
      if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be a JSON Schema object",
                       param="response_format.json_schema.schema")
  try:
    return grammar_lib.json_schema_regex(schema, param="response_format")
  except ValueError as e:
    raise ApiError(400, str(e), param="response_format") from None


@dataclasses.dataclass(frozen=True)
class ToolPlan:
  """What a request's tools ask for: tools (OpenAI tool objects), choice ("auto", "required", or
  the name of the forced tool) and the regex a forced call is constrained to (None for auto)."""

  tools: list
  choice: str
  regex: Optional[str]


def uses_xml_calls(chat_template: Optional[str]) -> bool:
  """Whether the chat template writes tool calls in Qwen3-Coder's XML form
  (`<function=name>` / `<parameter=p>`) rather than as JSON."""
  return bool(chat_template) and "<function=" in chat_template


def tool_plan(tools: Any, tool_choice: Any, chat_template: Optional[str] = None) -> Optional[ToolPlan]:
  """The ToolPlan of a request's `tools` / `tool_choice`, or None (no tools, or choice "none");
  a forced call takes the template's call syntax (`uses_xml_calls`). Raises ApiError 400 naming
  the field for a malformed tool, an unknown choice or a forced tool that is not in the list."""
  if tools in (None, []):
    if tool_choice not in (None, "none", "auto"):
      raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    return None
  if not isinstance(tools, list):
    raise ApiError(400, "tools must be a list", param="tools")
  names = []
  for i, t in enumerate(tools):
    fn = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type", "function") != "function" or \
        not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
      raise ApiError(400, f"tools[{i}] must be {{type: 'function', function: {{name, description, "
                     f"parameters}}}}", param=f"tools[{i}]")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
      raise ApiError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                     param=f"tools[{i}].function.parameters")
    names.append(fn["name"])
  choice = "auto" if tool_choice is None else tool_choice
  if choice == "none":
    return None
  if isinstance(choice, dict):
    name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
    if name not in names:
      raise ApiError(400, f"tool_choice names a function that is not in tools: {name!r}",
                     param="tool_choice")
    choice = name
  elif choice not in ("auto", "required"):
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {type: 'function', "
                   "function: {name}}", param="tool_choice")
  regex = None
  if choice != "auto":
    forced = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
    regex = tool_call_regex(forced, xml=uses_xml_calls(chat_template))
  return ToolPlan(tools=tools, choice=choice, regex=regex)


def _call_schema(fn: dict) -> dict:
  params = fn.get("parameters") or {"type": "object", "properties": {}}
  return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
          "required": ["name", "arguments"]}


def _xml_value_regex(schema: Any) -> str:
  """A Qwen3-Coder parameter value: strings raw (no '<'; an enum: its literals), anything else
  as JSON of its schema."""
  if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and \
      all(isinstance(v, str) for v in schema["enum"]):
    return "(" + "|".join(re.escape(v) for v in schema["enum"]) + ")"
  if not isinstance(schema, dict) or schema.get("type") in (None, "string"):
    return r"[^<]*"
  return grammar_lib.json_schema_regex(schema, param="tools")


def _xml_call_regex(fn: dict) -> str:
  """One `<function=name>` element with its parameters in schema order (required ones present,
  the others optional)."""
  params = fn.get("parameters") or {}
  props = params.get("properties") or {}
  required = set(params.get("required") or [])
  body = ""
  for name, sub in props.items():
    one = (re.escape(f"<parameter={name}>") + r"\n" + _xml_value_regex(sub) + r"\n" +
           re.escape("</parameter>") + r"\n")
    body += one if name in required else f"({one})?"
  return re.escape(f"<function={fn['name']}>") + r"\n" + body + re.escape("</function>")


def tool_call_regex(functions: list, xml: bool = False) -> str:
  """The regex of exactly one `<tool_call>` block calling one of `functions` (OpenAI function
  objects) with arguments that follow its `parameters` schema: JSON {"name", "arguments"}
  (Hermes / Qwen2.5), or with xml Qwen3-Coder's `<function=..>` / `<parameter=..>` elements."""
  try:
    if xml:
      inner = "(" + "|".join(_xml_call_regex(f) for f in functions) + ")"
    else:
      schema = (_call_schema(functions[0]) if len(functions) == 1
                else {"anyOf": [_call_schema(f) for f in functions]})
      inner = grammar_lib.json_schema_regex(schema, param="tools")
  except ValueError as e:
    raise ApiError(400, str(e), param="tools") from None
  return re.escape(TOOL_OPEN) + r"\n" + inner + r"\n" + re.escape(TOOL_CLOSE)


def tools_system_text(tools: list) -> str:
  """Qwen2.5's tool instructions (for templates that do not render `tools` themselves)."""
  lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
  return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n"
          f"<tools>\n{lines}\n</tools>\n\n"
          "For each function call, return a json object with function name and arguments within "
          "<tool_call></tool_call> XML tags:\n<tool_call>\n"
          '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tools(messages: list[dict], tools: list, chat_template: Optional[str]) -> tuple[list, dict]:
  """(messages, template kwargs) that show `tools` to the model: the template's own rendering
  when it uses a `tools` variable, else the instructions merged into the system message."""
  if chat_template and re.search(r"\btools\b", chat_template):
    return messages, {"tools": tools}
  text = tools_system_text(tools)
  if messages and messages[0]["role"] == "system":
    first = dict(messages[0], content=messages[0]["content"] + "\n\n" + text)
    return [first] + messages[1:], {}
  return [{"role": "system", "content": text}] + messages, {}


_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)",
                    re.S)
_XML_FN = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|$)", re.S)


def _parse_block(body: str, tools: Optional[list] = None) -> Optional[dict]:
  """One tool call from a block's body (JSON or Qwen3-Coder XML), or None. XML values are JSON
  when they parse as JSON, except parameters the tool's schema types as strings (kept raw)."""
  try:
    obj = json.loads(body)
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
      args = obj.get("arguments", obj.get("parameters", {}))
      return {"name": obj["name"],
              "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}
  except json.JSONDecodeError:
    pass
  m = _XML_FN.search(body)
  if m:
    name = m.group(1).strip()
    props = next(((t["function"].get("parameters") or {}).get("properties") or {}
                  for t in tools or [] if t["function"]["name"] == name), {})
    args = {}
    for k, v in _XML_PARAM.findall(m.group(2)):
      k = k.strip()
      sub = props.get(k)
      if isinstance(sub, dict) and (sub.get("type") == "string" or isinstance(sub.get("enum"), list)
                                    and all(isinstance(e, str) for e in sub["enum"])):
        args[k] = v
        continue
      try:
        args[k] = json.loads(v)
      except json.JSONDecodeError:
        args[k] = v
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
  return None


def parse_tool_calls(text: str, tools: Optional[list] = None) -> tuple[Optional[str], list[dict]]:
  """(content, tool_calls) of a generated text: every `<tool_call>` block that parses becomes an
  OpenAI tool call {id, type: "function", function: {name, arguments: JSON text}}; the text
  outside the parsed blocks (stripped; None when empty) is the content. A block that does not
  parse stays in the content. tools: the request's tools (their schemas type XML values)."""
  calls, keep, at = [], [], 0
  for m in _BLOCK.finditer(text):
    call = _parse_block(m.group(1), tools)
    if call is None:
      continue
    keep.append(text[at:m.start()])
    at = m.end()
    calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": call})
  keep.append(text[at:])
  content = "".join(keep).strip()
  return (content or None), calls
