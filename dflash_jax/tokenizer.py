"""Tokenizer and chat template from GGUF metadata, built on the `tokenizers` and `jinja2` libraries.

`tokenizer.ggml.model = gpt2` (byte-level BPE) is supported with the pre-tokenizer regexes that
llama.cpp uses for `tokenizer.ggml.pre` (src/llama-vocab.cpp, llm_tokenizer_bpe); CONTROL and
USER_DEFINED tokens are parsed out of the text as special tokens (llama.cpp `parse_special=true`).
"""

from __future__ import annotations

import datetime
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
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [i for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    self._tok = tok
    self.tokens = tokens
    self.control_ids = frozenset(i for i, ty in enumerate(types) if ty == _CONTROL)
    self.bos_id = meta.get("tokenizer.ggml.bos_token_id")
    self.eos_id = meta.get("tokenizer.ggml.eos_token_id")
    self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    self.chat_template = meta.get("tokenizer.chat_template")
    eog = {meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id")} - {None}
    eog |= {i for i in special if tokens[i] in _EOG_TEXTS}
    self.eog_ids = tuple(sorted(int(i) for i in eog))

  @property
  def n_vocab(self) -> int:
    return len(self.tokens)

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Text -> token ids (special tokens in the text are parsed). add_bos default: the GGUF's."""
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [int(self.bos_id)] + ids
    return ids

  def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
    """Token ids -> text; CONTROL tokens (e.g. <|im_end|>) are dropped when skip_special."""
    if skip_special:
      ids = [i for i in ids if i not in self.control_ids]
    return self._tok.decode(list(ids), skip_special_tokens=False)

  def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *,
                          add_generation_prompt: bool = True, **kwargs) -> str:
    """Render `tokenizer.chat_template` with jinja2 (sandboxed, trim_blocks, lstrip_blocks, as
    transformers and llama-cpp-python's Jinja2ChatFormatter do).

    Raises ValueError if the GGUF has no chat template.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not self.chat_template:
      raise ValueError("this GGUF has no tokenizer.chat_template; use raw prompts (--nochat)")

    def raise_exception(msg):
      raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    tmpl = env.from_string(self.chat_template)
    tok = lambda i: self.tokens[i] if i is not None and 0 <= i < len(self.tokens) else ""
    return tmpl.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                       bos_token=tok(self.bos_id), eos_token=tok(self.eos_id), **kwargs)
