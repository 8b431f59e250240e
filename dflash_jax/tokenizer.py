"""Tokenizer and chat template from GGUF metadata, built on the `tokenizers`, `sentencepiece` and
`jinja2` libraries.

Two vocabulary kinds (`tokenizer.ggml.model`), as llama.cpp tokenizes them (src/llama-vocab.cpp):
  * `gpt2`: byte-level BPE (`tokenizers`) with the pre-tokenizer regexes llama.cpp uses for
    `tokenizer.ggml.pre` (llm_tokenizer_bpe);
  * `llama`: SentencePiece BPE (Llama 1/2, Mistral, TinyLlama, Phi-3 ...): the merges follow the
    pieces' scores with byte fallback (`sentencepiece` on a ModelProto built from
    `tokenizer.ggml.tokens` / `scores` / `token_type`); each text fragment that starts the text
    or follows a special token gets a leading space (`tokenizer.ggml.add_space_prefix`, default
    true) and spaces become U+2581 (llm_tokenizer_spm).
USER_DEFINED tokens are matched wherever their text occurs (llama.cpp's partition of the text,
HF's added tokens: e.g. MPT's runs of spaces). CONTROL tokens are parsed out of text the program
writes (templates, raw prompts: llama.cpp `parse_special=true`); in chat message content they are
text by default (`encode_chat`), as the OpenAI API treats them, so a message cannot open a turn of
another role.

Checked against llama.cpp's own tokenizer tests (its `models/ggml-vocab-*.gguf` with their `.inp`
/ `.out` files; tests/test_tokenizer_vocabs.py).
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

_DEEPSEEK_LLM = (  # llama.cpp's character classes, code points escaped (no NFC on the way)
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+")
_DEEPSEEK_CODER = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}")

# tokenizer.ggml.pre -> regexes applied in sequence (llama.cpp llm_tokenizer_bpe).
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2,), "gpt2": (_GPT2,), "mpt": (_GPT2,), "olmo": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,), "qwen35": (_QWEN35,),
    "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,),
    "deepseek-llm": _DEEPSEEK_LLM, "deepseek-coder": _DEEPSEEK_CODER,
}

# Token texts llama.cpp treats as end-of-generation (llama_vocab::impl::load: EOT / FIM pad,
# repo, separator heuristics), in addition to the eos / eot / eom ids from the metadata.
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|return|>",
              "<|call|>", "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>",
              "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
              }
# tokenizer.ggml.token_type values (llama.cpp llama_token_type; SentencePiece's piece types).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPM_SPACE = "\u2581"
_SPM_UNK_TEXT = "\u2585"          # what llama.cpp prints for an unknown token (token_to_piece)


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
  """Byte-level BPE or SentencePiece tokenizer + chat template of a GGUF file.

  Attributes:
    kind: `tokenizer.ggml.model` ("gpt2" or "llama").
    bos_id, eos_id: ids from the metadata (None if absent).
    eog_ids: sorted end-of-generation ids (llama.cpp's set).
    add_bos: `tokenizer.ggml.add_bos_token`.
    chat_template: `tokenizer.chat_template` or None.

  Raises NotImplementedError naming the file for another `tokenizer.ggml.model` or an unknown
  `tokenizer.ggml.pre`, ValueError naming the file and key for metadata that does not hold a
  vocabulary (missing / mismatched lists, merges of unknown tokens, SentencePiece scores or its
  unknown token missing).
  """

  def __init__(self, meta: Mapping[str, Any], *, path: str = "?"):
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
      raise NotImplementedError(f"{path}: tokenizer.ggml.model={kind!r} is not supported yet "
                                f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
      raise NotImplementedError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported yet; "
                                f"supported: {', '.join(sorted(PRE_TOKENIZERS))}")
    tokens, types, merges = _vocab(meta, path)
    self.kind = kind
    self.path = path
    self.tokens = tokens
    control = [i for i, ty in enumerate(types) if ty == _CONTROL]
    user = [i for i, ty in enumerate(types) if ty == _USER_DEFINED]
    special = control + user
    # Longest first: a leftmost-longest match, as the `tokenizers` added-token matcher.
    by_len = lambda ids: sorted({tokens[i] for i in ids if tokens[i]}, key=len, reverse=True)
    alt = lambda texts: re.compile("|".join(map(re.escape, texts))) if texts else None
    self._special_re = alt(by_len(control))     # what content must not contain (encode_chat)
    if kind == "gpt2":
      self._init_bpe(pre, tokens, merges, control, user)
    else:
      self._spm = _SentencePiece(meta, tokens, types, path)
      self._spm_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
      self._unknown_ids = frozenset(i for i, ty in enumerate(types) if ty == _UNKNOWN) | (
          {self._spm.unk_id})
      self._special_id = {}
      for i in special:
        self._special_id.setdefault(tokens[i], i)
      # Text partitions (BPE: the `tokenizers` added tokens): USER_DEFINED always, CONTROL too
      # when special tokens are parsed.
      self._split_all, self._split_user = alt(by_len(special)), alt(by_len(user))
    # Longest token in characters: a token covers at most that many characters of the text
    # (byte-level BPE: one character per byte; SentencePiece: U+2581 per space, a byte token
    # less than a character), so a text of more than max_token_chars * n characters has more
    # than n tokens, known before tokenizing it.
    self.max_token_chars = max(len(t) for t in tokens)
    self.control_ids = frozenset(control)
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

  def _init_bpe(self, pre, tokens, merges, control, user):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
      bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    except Exception as e:  # tokenizers raises its own Exception type
      raise ValueError(f"{self.path}: tokenizer vocabulary/merges rejected: {e}") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # CONTROL tokens are "special" (kept as text by _tok_text); USER_DEFINED ones are matched in
    # every text, as llama.cpp partitions them regardless of parse_special.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in control])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    self._tok = tok
    self._tok_text = Tokenizer.from_str(tok.to_str())   # special-token text stays text
    self._tok_text.encode_special_tokens = True

  @property
  def n_vocab(self) -> int:
    return len(self.tokens)

  def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
    """Text -> token ids. parse_special: CONTROL token texts in `text` become those tokens
    (llama.cpp parse_special=true), else they are tokenized as plain text (USER_DEFINED ones are
    matched either way). add_bos default: the GGUF's.

    Raises ValueError when `text` is not a str, holds a lone surrogate (not encodable as UTF-8,
    e.g. from the JSON escape "\\ud800"), or when the ids would not decode back to `text` (a
    vocabulary that lacks tokens for some characters: they would be dropped silently)."""
    check_text(text)
    ids, _ = self._encode(text, parse_special, True)
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [int(self.bos_id)] + ids
    return ids

  def _encode(self, text: str, parse_special: bool, after_special: bool) -> tuple[list[int], bool]:
    """(ids of `text`, whether its last token is special). after_special: the text starts the
    sequence or follows a special token (a SentencePiece fragment then gets its space prefix)."""
    if self.kind == "gpt2":
      ids = (self._tok if parse_special else self._tok_text).encode(
          text, add_special_tokens=False).ids
      if self._tok.decode(ids, skip_special_tokens=False) != text:
        raise ValueError(f"{self.path}: the vocabulary cannot encode this text exactly "
                         f"(characters without a token; byte-level BPE needs all 256 byte tokens)")
      return ids, bool(ids) and ids[-1] in self._special_ids
    split = self._split_all if parse_special else self._split_user
    ids, last_special, at = [], after_special, 0
    for m in (split.finditer(text) if split is not None else ()):
      if m.start() > at:
        ids += self._spm_fragment(text[at:m.start()], last_special)
      ids.append(self._special_id[m.group(0)])
      last_special, at = True, m.end()
    if at < len(text):
      ids += self._spm_fragment(text[at:], last_special)
      last_special = False
    return ids, last_special

  def _spm_fragment(self, text: str, after_special: bool) -> list[int]:
    """SentencePiece ids of one raw-text fragment (llm_tokenizer_spm: space prefix after a
    special token or at the start, spaces escaped to U+2581)."""
    if self._spm_prefix and after_special:
      text = " " + text
    ids = self._spm.encode(text.replace(" ", _SPM_SPACE))
    if any(i in self._unknown_ids for i in ids):
      raise ValueError(f"{self.path}: the vocabulary cannot encode this text exactly (characters "
                       f"without a piece and no byte-fallback pieces <0x00>..<0xFF>)")
    return ids

  def special_text(self, text: str) -> str | None:
    """The first special-token text (e.g. '<|im_end|>') inside `text`, or None."""
    m = self._special_re.search(text) if self._special_re is not None else None
    return m.group(0) if m else None

  def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                  parse_special: bool = False, continue_final_message: bool = False,
                  **kwargs) -> list[int]:
    """Token ids of `messages` rendered by the chat template (BOS once: see _without_bos).
    continue_final_message: the last message is an assistant turn to be continued (Anthropic's
    prefill; vLLM's continue_final_message): the prompt ends with its content, without the
    template's end of turn and without a generation prompt (see render_chat).

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
    kwargs = dict(kwargs, add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message)
    text = self._without_bos(self.render_chat(messages, **kwargs))
    spoof = [i for i, m in enumerate(messages) if self.special_text(m["content"])]
    if parse_special or not spoof:
      return self.encode(text)
    # Render again with a marker in place of each such content, then tokenize the template's
    # pieces with special tokens and the contents as text.
    marks = {i: f"\ue000{i}\ue001" for i in spoof}
    marked = [dict(m, content=marks[i]) if i in marks else m for i, m in enumerate(messages)]
    skeleton = self._without_bos(self.render_chat(marked, **kwargs))
    parts = re.split("\ue000(\\d+)\ue001", skeleton)
    pieces = [(parts[k], True) if k % 2 == 0 else (messages[int(parts[k])]["content"], False)
              for k in range(len(parts))]
    if "".join(p for p, _ in pieces) != text:
      i = spoof[0]
      raise ValueError(f"messages[{i}].content contains the special token text "
                       f"{self.special_text(messages[i]['content'])!r} and this chat template "
                       f"changes message content, so it cannot be kept as plain text")
    ids, after_special = self.encode("", add_bos=None), True
    for piece, special in pieces:
      if piece:
        more, after_special = self._encode(piece, special, after_special)
        ids += more
    return ids

  def _without_bos(self, text: str) -> str:
    """A rendered template without its leading BOS text when encode adds the BOS token anyway
    (llama.cpp common/chat.cpp strips it the same way; a template writing `{{ bos_token }}`,
    as Llama 2 / 3 and Phi-3 ones do, would otherwise start the prompt with two BOS tokens)."""
    if self.add_bos and self.bos_id is not None:
      bos = self.tokens[self.bos_id]
      if bos and text.startswith(bos):
        return text[len(bos):]
    return text

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes token `token_id` stands for: a control / user-defined token: its text as UTF-8;
    byte-level BPE: its characters mapped back through GPT-2's byte-to-unicode table;
    SentencePiece: a byte piece <0xXX> its byte, an unknown token U+2585 (llama.cpp's
    token_to_piece), else its text with U+2581 as a space. A token may hold part of a
    multi-byte character, so its bytes need not be valid UTF-8."""
    text = self.tokens[token_id]
    if token_id in self._special_ids:
      return text.encode("utf-8")
    if self.kind == "llama":
      if token_id in self._spm.byte_ids:
        return bytes([self._spm.byte_ids[token_id]])
      if token_id in self._unknown_ids:
        return _SPM_UNK_TEXT.encode("utf-8")
      return text.replace(_SPM_SPACE, " ").encode("utf-8")
    table = _byte_decoder()
    try:
      return bytes(table[c] for c in text)
    except KeyError:                  # not a byte-level piece: its text
      return text.encode("utf-8")

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    """Token ids -> text; CONTROL tokens (e.g. <|im_end|>) are dropped when skip_special.
    SentencePiece: the pieces' bytes joined (a leading space stays, as in llama.cpp's
    token_to_piece; invalid UTF-8 becomes U+FFFD)."""
    if skip_special:
      ids = [i for i in ids if i not in self.control_ids]
    if self.kind == "llama":
      return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")
    return self._tok.decode(list(ids), skip_special_tokens=False)

  def render_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                  continue_final_message: bool = False, **kwargs) -> str:
    """`apply_chat_template`, or with continue_final_message the rendering of `messages` without
    a generation prompt cut right after the last message's content (found by a marker appended
    to it), so that generation continues that assistant turn. Raises ValueError when the last
    message is not an assistant turn or the template does not reproduce its content."""
    if not continue_final_message:
      return self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                      **kwargs)
    if not messages or messages[-1].get("role") != "assistant":
      raise ValueError("continue_final_message needs an assistant message last")
    mark = "\ue002"
    last = dict(messages[-1], content=messages[-1]["content"] + mark)
    text = self.apply_chat_template(list(messages[:-1]) + [last], add_generation_prompt=False,
                                    **kwargs)
    if text.count(mark) != 1:
      raise ValueError("the chat template does not reproduce the final assistant message's "
                       "content, so the turn cannot be continued")
    return text[:text.index(mark)]

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


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class _SentencePiece:
  """A `sentencepiece` BPE processor over a GGUF's SentencePiece vocabulary: one piece per token
  id with its score (`tokenizer.ggml.scores`: higher merges first) and type; byte fallback when
  all 256 byte pieces <0x00>..<0xFF> are there. Normalization (space prefix, U+2581) is the
  caller's, so the processor gets text exactly as llama.cpp's merge loop does. The unknown token:
  `tokenizer.ggml.unknown_token_id`, else the first UNKNOWN piece; other UNKNOWN pieces (e.g.
  `[PAD...]` fillers) never come out of text. Raises ValueError naming the file and key."""

  def __init__(self, meta: Mapping[str, Any], tokens: list[str], types: list[int], path: str):
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores):
      raise ValueError(f"{path}: GGUF metadata key 'tokenizer.ggml.scores' must be {len(tokens)} "
                       f"numbers, one per token (SentencePiece merges by score)")
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens), path)
    if unk is None:
      unk = next((i for i, ty in enumerate(types) if ty == _UNKNOWN), None)
    if unk is None:
      raise ValueError(f"{path}: a SentencePiece vocabulary needs an unknown token "
                       f"('tokenizer.ggml.unknown_token_id' or a token of type UNKNOWN)")
    piece = pb.ModelProto.SentencePiece
    kinds = {_NORMAL: piece.NORMAL, _UNKNOWN: piece.UNUSED, _CONTROL: piece.CONTROL,
             _USER_DEFINED: piece.NORMAL, _UNUSED: piece.UNUSED, _BYTE: piece.BYTE}
    # id -> byte of each byte piece <0xXX> (token_bytes decodes them; byte fallback needs all 256)
    self.byte_ids = {i: int(t[3:5], 16) for i, (t, ty) in enumerate(zip(tokens, types))
                     if ty == _BYTE and _BYTE_PIECE.fullmatch(t)}
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = len(self.byte_ids) == 256
    m.trainer_spec.unk_id = unk
    m.trainer_spec.bos_id = m.trainer_spec.eos_id = m.trainer_spec.pad_id = -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.escape_whitespaces = False
    m.normalizer_spec.remove_extra_whitespaces = False
    for i, (t, sc, ty) in enumerate(zip(tokens, scores, types)):
      p = m.pieces.add()
      p.piece, p.score = t, float(sc)
      if i == unk:
        p.type = piece.UNKNOWN
      elif ty == _BYTE and not m.trainer_spec.byte_fallback:
        p.type = piece.UNUSED
      else:
        p.type = kinds.get(ty, piece.NORMAL)
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_proto=m.SerializeToString())
    except Exception as e:  # sentencepiece raises RuntimeError / OSError with its own text
      raise ValueError(f"{path}: SentencePiece vocabulary rejected: {e}") from None
    self.unk_id = unk

  def encode(self, text: str) -> list[int]:
    """Escaped text (U+2581 for spaces) -> piece ids."""
    return list(self._sp.encode(text)) if text else []


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
