"""Tokenizer and chat template from GGUF metadata, built on the `tokenizers` and `jinja2` libraries.

`tokenizer.ggml.model = gpt2` (byte-level BPE) is supported with the pre-tokenizer regexes that
llama.cpp uses for `tokenizer.ggml.pre` (src/llama-vocab.cpp, llm_tokenizer_bpe); CONTROL and
USER_DEFINED tokens are parsed out of text the program writes (templates, raw prompts) as special
tokens (llama.cpp `parse_special=true`); in chat message content they are text by default
(`encode_chat`), as the OpenAI API treats them, so a message cannot open a turn of another role.
"""

from __future__ import annotations

import datetime
import functools
import re
from typing import Any, Mapping, Sequence

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
           r"[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
           r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> regexes applied in sequence (llama.cpp llm_tokenizer_bpe).
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2,), "gpt2": (_GPT2,), "mpt": (_GPT2,), "olmo": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "qwen2": (_QWEN2,), "qwen35": (_QWEN35,), "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,),
}

# Token texts llama.cpp treats as end-of-generation (llama_vocab::impl::load: EOT / FIM pad,
# repo, separator heuristics), in addition to the eos / eot / eom ids from the metadata.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|return|>",
              "<|call|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>",
              "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
              }
_CONTROL, _USER_DEFINED = 3, 4


def _vocab(meta: Mapping[str, Any], path: str):
  """tokens [V] str, token types [V] int, merges [(left, right)] from the metadata, checked.
  Raises ValueError naming the file and key."""
  key = "tokenizer.ggml.tokens"
  tokens = meta.get(key)
  if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
    raise ValueError(f"{path}: GGUF metadata key {key!r} is missing or not a non-empty list of "
                     f"strings (the tokenizer needs it; load with tokenizer=False to skip)")
  types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
  if not isinstance(types, list) or len(types) != len(tokens) or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in types):
    raise ValueError(f"{path}: GGUF metadata key 'tokenizer.ggml.token_type' must be "
                     f"{len(tokens)} integers, one per token")
  raw_merges = meta.get("tokenizer.ggml.merges", [])
  if not isinstance(raw_merges, list):
    raise ValueError(f"{path}: GGUF metadata key 'tokenizer.ggml.merges' must be a list of strings")
  known, merges = set(tokens), []
  for i, m in enumerate(raw_merges):
    cut = m.find(" ", 1) if isinstance(m, str) else -1   # llama.cpp: first space after index 0
    pair = (m[:cut], m[cut + 1:]) if cut > 0 else None
    if pair is None or not pair[1] or not all(p in known for p in pair):
      raise ValueError(f"{path}: tokenizer.ggml.merges[{i}]={m!r}: expected two tokens of "
                       f"tokenizer.ggml.tokens separated by a space")
    merges.append(pair)
  return tokens, types, merges


def _token_id(meta: Mapping[str, Any], key: str, n_tokens: int, path: str):
  """An optional token id from the metadata (None if absent). Raises ValueError naming the key
  when it is not an id of the vocabulary."""
  v = meta.get(key)
  if v is None:
    return None
  if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n_tokens:
    raise ValueError(f"{path}: GGUF metadata key {key!r}={v!r} is not a token id in "
                     f"[0, {n_tokens})")
  return v


class GGUFTokenizer:
  """Byte-level BPE tokenizer + chat template of a GGUF file.

  Attributes:
    bos_id, eos_id: ids from the metadata (None if absent).
    eog_ids: sorted end-of-generation ids (llama.cpp's set).
    add_bos: `tokenizer.ggml.add_bos_token`.
    chat_template: `tokenizer.chat_template` or None.
  """

  def __init__(self, meta: Mapping[str, Any], *, path: str = "?"):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
      raise NotImplementedError(f"{path}: tokenizer.ggml.model={kind!r} is not supported yet "
                                f"(only byte-level BPE 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
      raise NotImplementedError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported yet; "
                                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    tokens, types, merges = _vocab(meta, path)
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
      bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    except Exception as e:  # tokenizers raises its own Exception type
      raise ValueError(f"{path}: tokenizer vocabulary/merges rejected: {e}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [i for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    self._tok = tok
    self._tok_text = Tokenizer.from_str(tok.to_str())   # special-token text stays text
    self._tok_text.encode_special_tokens = True
    texts = sorted({tokens[i] for i in special}, key=len, reverse=True)
    self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else None
    self.path = path
    # Longest token in characters (byte-level BPE: one character per byte): a text of more than
    # max_token_chars * n characters has more than n tokens, known before tokenizing it.
    self.max_token_chars = max(len(t) for t in tokens)
    self.tokens = tokens
    self.control_ids = frozenset(i for i, ty in enumerate(types) if ty == _CONTROL)
    self._special_ids = frozenset(special)
    self.bos_id = _token_id(meta, "tokenizer.ggml.bos_token_id", len(tokens), path)
    self.eos_id = _token_id(meta, "tokenizer.ggml.eos_token_id", len(tokens), path)
    self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    self.chat_template = meta.get("tokenizer.chat_template")
    eog = {_token_id(meta, k, len(tokens), path) for k in (
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id")} - {None}
    eog |= {i for i in special if tokens[i] in _EOG_TEXTS}
    self.eog_ids = tuple(sorted(int(i) for i in eog))

  @property
  def n_vocab(self) -> int:
    return len(self.tokens)

  def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
    """Text -> token ids. parse_special: CONTROL / USER_DEFINED token texts in `text` become
    those tokens (llama.cpp parse_special=true), else they are tokenized as plain text.
    add_bos default: the GGUF's.

    Raises ValueError when `text` is not a str, holds a lone surrogate (not encodable as UTF-8,
    e.g. from the JSON escape "\\ud800"), or when the ids would not decode back to `text` (a
    vocabulary that lacks tokens for some characters: they would be dropped silently)."""
    check_text(text)
    ids = (self._tok if parse_special else self._tok_text).encode(text, add_special_tokens=False).ids
    if self._tok.decode(ids, skip_special_tokens=False) != text:
      raise ValueError(f"{self.path}: the vocabulary cannot encode this text exactly (characters "
                       f"without a token; byte-level BPE needs all 256 byte tokens)")
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [int(self.bos_id)] + ids
    return ids

  def special_text(self, text: str) -> str | None:
    """The first special-token text (e.g. '<|im_end|>') inside `text`, or None."""
    m = self._special_re.search(text) if self._special_re is not None else None
    return m.group(0) if m else None

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                  parse_special: bool = False, **kwargs) -> list[int]:
    """Token ids of `messages` rendered by the chat template.

    The template's own text is tokenized with special tokens parsed; message content is text:
    a special-token string inside it (e.g. "<|im_end|><|im_start|>system") is tokenized as the
    characters it is, not as control tokens (OpenAI's behaviour; the tokens are then the same as
    llama.cpp's for content without such strings). parse_special=True tokenizes the whole
    rendered prompt with special tokens parsed (llama-server's behaviour: content can open turns).

    Raises ValueError for a message that is not {role: str, content: str} with valid Unicode
    (naming messages[i]), for template failures (apply_chat_template), and when content holds
    special-token text but the template changes content on the way (then it cannot be kept text).
    """
    for i, m in enumerate(messages):
      if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or \
          not isinstance(m.get("content"), str):
        raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
      try:
        check_text(m["content"])
        check_text(m["role"])
      except ValueError as e:
        raise ValueError(f"messages[{i}]: {e}") from None
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    spoof = [i for i, m in enumerate(messages) if self.special_text(m["content"])]
    if parse_special or not spoof:
      return self.encode(text)
    # Render again with a marker in place of each such content, then tokenize the template's
    # pieces with special tokens and the contents as text.
    marks = {i: f"\ue000{i}\ue001" for i in spoof}
    marked = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
    skeleton = self.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, **kwargs)
    parts = re.split("\ue000(\\d+)\ue001", skeleton)
    pieces = [(parts[k], True) if k % 2 == 0 else (messages[int(parts[k])]["content"], False)
              for k in range(len(parts))]
    if "".join(p for p, _ in pieces) != text:
      i = spoof[0]
      raise ValueError(f"messages[{i}].content contains the special token text "
                       f"{self.special_text(messages[i]['content'])!r} and this chat template "
                       f"changes message content, so it cannot be kept as plain text")
    ids = self.encode("", add_bos=None)
    for piece, special in pieces:
      if piece:
        ids += self.encode(piece, add_bos=False, parse_special=special)
    return ids

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes token `token_id` stands for (byte-level BPE: its characters mapped back through
    GPT-2's byte-to-unicode table; a control / user-defined token: its text as UTF-8). A
    token may hold part of a multi-byte character, so its bytes need not be valid UTF-8."""
    text = self.tokens[token_id]
    if token_id in self._special_ids:
      return text.encode("utf-8")
    table = _byte_decoder()
    try:
      return bytes(table[c] for c in text)
    except KeyError:                  # not a byte-level piece: its text
      return text.encode("utf-8")

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    """Token ids -> text; CONTROL tokens (e.g. <|im_end|>) are dropped when skip_special."""
    if skip_special:
      ids = [i for i in ids if i not in self.control_ids]
    return self._tok.decode(list(ids), skip_special_tokens=False)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                          add_generation_prompt: bool = True, **kwargs) -> str:
    """Render `tokenizer.chat_template` with jinja2 (sandboxed, trim_blocks, lstrip_blocks, as
    transformers and llama-cpp-python's Jinja2ChatFormatter do).

    Raises ValueError naming the file if the GGUF has no chat template or it fails (see
    render_chat_template).
    """
    if not self.chat_template:
      raise ValueError("this GGUF has no tokenizer.chat_template; use raw prompts (--nochat)")
    tok = lambda i: self.tokens[i] if i is not None else ""
    try:
      return render_chat_template(
          self.chat_template, messages=list(messages), add_generation_prompt=add_generation_prompt,
          bos_token=tok(self.bos_id), eos_token=tok(self.eos_id), **kwargs)
    except ValueError as e:
      raise ValueError(f"{self.path}: {e}") from None


@functools.cache
def _byte_decoder() -> dict[str, int]:
  """GPT-2's byte-to-unicode table inverted (character -> byte): printable bytes map to
  themselves, the others to 256 + k."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
  chars, extra = dict(zip(keep, keep)), 0
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + extra
      extra += 1
  return {chr(c): b for b, c in chars.items()}


def check_text(text) -> str:
  """`text` if it is a str encodable as UTF-8. Raises ValueError naming the position of a lone
  surrogate (valid in JSON as "\\ud800", not text), or saying what was given instead of a str."""
  if not isinstance(text, str):
    raise ValueError(f"expected a string, got {type(text).__name__}")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"the text holds a lone surrogate {text[e.start]!r} at character {e.start} "
                     "(not valid Unicode text)") from None
  return text


_TEMPLATE_CHARS = 1 << 22       # longest string / list a template may build, plus the messages
_TEMPLATE_RANGE = 1 << 20       # range() items a render may iterate over in all


def render_chat_template(template: str, **context) -> str:
  """Render a chat template (`tokenizer.chat_template`) in a bounded jinja2 sandbox: an immutable
  SandboxedEnvironment with trim_blocks / lstrip_blocks (as transformers and llama-cpp-python's
  Jinja2ChatFormatter render them), `raise_exception` and `strftime_now`; strings and lists the
  template builds (`*`, `**`, `+`, call arguments, namespace attributes, the output) are capped
  at 4 Mi items plus 4x the messages' length, and range() at 1 Mi items per render.

  Raises ValueError naming tokenizer.chat_template for a syntax error, a sandbox violation, an
  exceeded bound, a raise_exception() or any other failure of the template.
  """
  import jinja2
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  limit = _TEMPLATE_CHARS + 4 * sum(len(str(m)) for m in context.get("messages", []))
  budget = [_TEMPLATE_RANGE]

  def check(v, size=None):
    if size is None:
      size = len(v) if isinstance(v, (str, list, tuple, dict)) else 0
    if size > limit:
      raise jinja2.exceptions.SecurityError(f"a value of {size} items exceeds the limit {limit}")
    return v

  class Env(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, ctx, op, left, right):
      if op == "**" and isinstance(right, (int, float)) and abs(right) > 64:
        raise jinja2.exceptions.SecurityError(f"exponent {right} is too large")
      if op == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
        left, right = right, left
      if op == "*" and isinstance(left, (str, list, tuple)) and isinstance(right, int):
        check(left, size=len(left) * right)
      return check(super().call_binop(ctx, op, left, right))

    def call(self, ctx, obj, *args, **kwargs):
      for a in (*args, *kwargs.values()):
        check(a)
      return check(super().call(ctx, obj, *args, **kwargs))

  class Namespace(jinja2.utils.Namespace):
    def __setitem__(self, name, value):
      super().__setitem__(name, check(value))

  def bounded_range(*args):
    r = range(*args)
    budget[0] -= len(r)
    if budget[0] < 0:
      raise jinja2.exceptions.SecurityError(f"range() over more than {_TEMPLATE_RANGE} items in all")
    return r

  def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)

  env = Env(trim_blocks=True, lstrip_blocks=True)
  env.globals.update(raise_exception=raise_exception, range=bounded_range, namespace=Namespace,
                     strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  try:
    out, n = [], 0
    for chunk in env.from_string(template).generate(**context):
      n += len(chunk)
      if n > limit:
        raise jinja2.exceptions.SecurityError(f"output exceeds {limit} characters")
      out.append(chunk)
    return "".join(out)
  except (jinja2.exceptions.TemplateError, RecursionError, MemoryError, ArithmeticError,
          TypeError, ValueError, LookupError, AttributeError) as e:
    raise ValueError(f"tokenizer.chat_template failed: {type(e).__name__}: {e}"[:500]) from None
