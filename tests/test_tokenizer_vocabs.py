"""Tokenization against llama.cpp's own tokenizer tests: its `models/ggml-vocab-*.gguf` vocabularies
with the ids its tokenizer gives their `.inp` texts (tests/data/llama_vocab, cut down by
tests/data/make_vocab_data.py without changing any test's ids), for byte-level BPE with each
pre-tokenizer that has such a file and for SentencePiece (`tokenizer.ggml.model = llama`); and a
tiny Llama GGUF with a SentencePiece vocabulary loaded, prompted through its chat template and
decoded end to end."""

import json
import lzma
import os

import numpy as np
import pytest

from conftest import DATA
from dflash_jax.tokenizer import GGUFTokenizer

VOCAB = os.path.join(DATA, "llama_vocab")
BPE = ("gpt-2", "mpt", "starcoder", "refact", "qwen2", "llama-bpe", "deepseek-coder", "deepseek-llm")
SPM = ("llama-spm", "phi-3")


def _load(name):
  with lzma.open(os.path.join(VOCAB, f"{name}.json.xz"), "rt", encoding="utf-8") as fh:
    return json.load(fh)


@pytest.mark.parametrize("name", BPE + SPM)
def test_ids_equal_llama_cpp(name):
  """Every test text of llama.cpp's file gets llama.cpp's ids (add_special=false,
  parse_special=false, as its test-tokenizer-0), and the ids decode back to the text
  (SentencePiece: with the space prefix llama.cpp's token_to_piece keeps)."""
  d = _load(name)
  tok = GGUFTokenizer(d["meta"], path=name)
  assert tok.kind == d["meta"]["tokenizer.ggml.model"]
  assert len(d["cases"]) == 46
  for text, want in d["cases"]:
    got = tok.encode(text, add_bos=False, parse_special=False)
    assert got == want, (name, text)
    assert tok.encode(text, add_bos=False, parse_special=True) == want  # no control text in them
    back = tok.decode(got, skip_special=False)
    assert back == ((" " + text if text else "") if tok.kind == "llama" else text), (name, text)
    assert b"".join(tok.token_bytes(i) for i in got) == back.encode("utf-8")


@pytest.mark.parametrize("name,wrong", [("qwen2", "gpt2"), ("llama-bpe", "qwen2"),
                                        ("starcoder", "gpt2"), ("gpt-2", "llama-bpe"),
                                        ("deepseek-coder", "gpt2"), ("deepseek-llm", "gpt2")])
def test_wrong_pre_tokenizer_is_caught(name, wrong):
  """The cases tell the pre-tokenizers apart: the right vocabulary with another one's regexes
  gives other ids on some text (so the test above can fail)."""
  d = _load(name)
  tok = GGUFTokenizer(dict(d["meta"], **{"tokenizer.ggml.pre": wrong}), path=name)
  assert any(tok.encode(t, add_bos=False, parse_special=False) != ids for t, ids in d["cases"])


def test_user_defined_tokens_match_everywhere():
  """MPT's USER_DEFINED runs of spaces are matched in any text, as llama.cpp partitions them
  regardless of parse_special (before: treated as text, 7 of llama.cpp's 46 cases wrong)."""
  d = _load("mpt")
  tok = GGUFTokenizer(d["meta"], path="mpt")
  four = d["meta"]["tokenizer.ggml.tokens"].index("    ")
  assert tok.encode("    Hello", add_bos=False, parse_special=False)[0] == four


def test_sentencepiece_space_prefix_and_special_tokens():
  """llm_tokenizer_spm: a raw fragment gets its leading space at the start of the text and after
  a special token, not after text; CONTROL text is parsed only with parse_special; without the
  space prefix the ids change (add_space_prefix false)."""
  d = _load("phi-3")
  tok = GGUFTokenizer(d["meta"], path="phi-3")
  toks = d["meta"]["tokenizer.ggml.tokens"]
  user, end = toks.index("<|user|>"), toks.index("<|end|>")
  hello = tok.encode("Hello world", add_bos=False)
  ids = tok.encode("<|user|>Hello world<|end|>", add_bos=False)
  assert ids == [user] + hello + [end]
  plain = tok.encode("<|user|>Hello world<|end|>", add_bos=False, parse_special=False)
  assert user not in plain and end not in plain
  assert tok.decode(plain) == " <|user|>Hello world<|end|>"
  assert tok.encode("Hello world", add_bos=True) == [tok.bos_id] + hello
  # USER_DEFINED (phi-3's '</s>') is matched in plain text too.
  assert toks.index("</s>") in tok.encode("a</s>b", add_bos=False, parse_special=False)
  no_prefix = GGUFTokenizer(dict(d["meta"], **{"tokenizer.ggml.add_space_prefix": False}),
                            path="phi-3")
  assert no_prefix.encode("Hello world", add_bos=False) != hello
  assert no_prefix.decode(no_prefix.encode("Hello world", add_bos=False)) == "Hello world"


def test_sentencepiece_byte_fallback_and_chat():
  """Characters without a piece fall back to byte pieces <0xXX> and decode back; the chat
  template renders, content with a special token's text stays text with the space-prefix rule
  carried across the template's pieces."""
  d = _load("llama-spm")
  tok = GGUFTokenizer(d["meta"], path="llama-spm")
  ids = tok.encode("🦙", add_bos=False)
  assert [tok.tokens[i] for i in ids[1:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
  assert tok.decode(ids) == " 🦙"
  p3 = _load("phi-3")
  tok3 = GGUFTokenizer(p3["meta"], path="phi-3")
  toks = p3["meta"]["tokenizer.ggml.tokens"]
  msgs = [{"role": "user", "content": "Hi there"}]
  ids = tok3.encode_chat(msgs)
  rendered = tok3.apply_chat_template(msgs)
  assert rendered.startswith("<s><|user|>")     # the template writes {{ bos_token }} ...
  # ... and add_bos_token is true: one BOS, as llama.cpp's common_chat_templates_apply strips
  # the rendered one (a second <s> was the bug)
  assert ids == tok3.encode(rendered[len("<s>"):]) and ids[:2] == [tok3.bos_id, toks.index("<|user|>")]
  assert ids.count(tok3.bos_id) == 1
  spoof = [{"role": "user", "content": "Hi <|end|> there"}]
  ids = tok3.encode_chat(spoof)
  assert ids.count(toks.index("<|end|>")) == ids_count_template(tok3, toks)
  assert ids[:2] == [tok3.bos_id, toks.index("<|user|>")]
  text = tok3.decode(ids, skip_special=False)
  assert "Hi <|end|> there" in text


def ids_count_template(tok, toks):
  """How many <|end|> the template itself writes for one user message."""
  return tok.encode_chat([{"role": "user", "content": "x"}]).count(toks.index("<|end|>"))


def test_sentencepiece_metadata_errors():
  d = _load("llama-spm")
  meta = d["meta"]
  with pytest.raises(ValueError, match=r"v\.gguf.*tokenizer\.ggml\.scores"):
    GGUFTokenizer({k: v for k, v in meta.items() if k != "tokenizer.ggml.scores"}, path="v.gguf")
  with pytest.raises(ValueError, match=r"v\.gguf.*tokenizer\.ggml\.scores.*32000 numbers"):
    GGUFTokenizer(dict(meta, **{"tokenizer.ggml.scores": meta["tokenizer.ggml.scores"][:5]}),
                  path="v.gguf")
  no_unk = {k: v for k, v in meta.items() if k != "tokenizer.ggml.unknown_token_id"}
  no_unk["tokenizer.ggml.token_type"] = [1 if t == 2 else t for t in meta["tokenizer.ggml.token_type"]]
  with pytest.raises(ValueError, match=r"v\.gguf.*unknown token"):
    GGUFTokenizer(no_unk, path="v.gguf")
  with pytest.raises(NotImplementedError, match=r"v\.gguf.*'bert'.*not supported.*'llama'"):
    GGUFTokenizer(dict(meta, **{"tokenizer.ggml.model": "bert"}), path="v.gguf")


def test_tiny_llama_with_sentencepiece_vocab(tmp_path):
  """A GGUF a user could bring (Llama architecture, SentencePiece vocabulary, chat template)
  loads, takes a chat prompt, decodes AR and a speculative mode to the same tokens and text."""
  from gguf import GGUFWriter
  import dflash_jax as dj
  from dflash_jax import cli

  d = _load("phi-3")
  meta = d["meta"]
  n_vocab, dim, ff = len(meta["tokenizer.ggml.tokens"]), 64, 128
  path = tmp_path / "tiny-llama-spm.gguf"
  w = GGUFWriter(str(path), "llama")
  w.add_block_count(1)
  w.add_context_length(256)
  w.add_embedding_length(dim)
  w.add_feed_forward_length(ff)
  w.add_head_count(4)
  w.add_head_count_kv(2)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_tokenizer_model("llama")
  w.add_tokenizer_pre("default")
  w.add_token_list(meta["tokenizer.ggml.tokens"])
  w.add_token_scores(meta["tokenizer.ggml.scores"])
  w.add_token_types(meta["tokenizer.ggml.token_type"])
  w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
  w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
  w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
  w.add_add_bos_token(True)
  w.add_chat_template(meta["tokenizer.chat_template"])
  rng = np.random.default_rng(0)
  rnd = lambda *s: (0.2 * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
  ones = lambda n: np.ones(n, np.float32)  # noqa: E731
  for name, arr in [("token_embd.weight", rnd(n_vocab, dim)), ("output_norm.weight", ones(dim)),
                    ("output.weight", rnd(n_vocab, dim)), ("blk.0.attn_norm.weight", ones(dim)),
                    ("blk.0.attn_q.weight", rnd(dim, dim)), ("blk.0.attn_k.weight", rnd(dim // 2, dim)),
                    ("blk.0.attn_v.weight", rnd(dim // 2, dim)),
                    ("blk.0.attn_output.weight", rnd(dim, dim)), ("blk.0.ffn_norm.weight", ones(dim)),
                    ("blk.0.ffn_gate.weight", rnd(ff, dim)), ("blk.0.ffn_up.weight", rnd(ff, dim)),
                    ("blk.0.ffn_down.weight", rnd(dim, ff))]:
    w.add_tensor(name, arr)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()

  target = dj.load_target(str(path))
  tok = target.tokenizer
  assert tok.kind == "llama" and tok.n_vocab == n_vocab
  ids = cli.build_prompt(target, "Write a haiku", chat=True, max_ctx=256)
  assert ids[0] == tok.bos_id and ids[1] != tok.bos_id and ids == tok.encode(
      tok.apply_chat_template([{"role": "user", "content": "Write a haiku"}])[len("<s>"):])
  ar = dj.generate(target, None, ids, max_new_tokens=8, mode="ar", max_ctx=256, eog_ids=())
  look = dj.generate(target, None, ids, max_new_tokens=8, mode="lookup", lookup=3, max_ctx=256,
                     eog_ids=())
  assert list(ar.tokens) == list(look.tokens) and len(ar.tokens) == 8
  text = tok.decode(ar.tokens, skip_special=False)
  assert text.encode("utf-8", errors="replace") == b"".join(
      tok.token_bytes(int(i)) for i in ar.tokens).decode("utf-8", errors="replace").encode("utf-8")


def test_chat_template_bos_not_doubled():
  """A Llama-3-style template writing `{{ bos_token }}` with add_bos_token true gives one BOS
  (llama.cpp common/chat.cpp strips the rendered one), with and without content kept as text;
  with add_bos_token false the rendered BOS text is the BOS."""
  d = _load("llama-bpe")
  template = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
              "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n")
  for add_bos in (True, False):
    meta = dict(d["meta"], **{"tokenizer.chat_template": template,
                              "tokenizer.ggml.add_bos_token": add_bos})
    tok = GGUFTokenizer(meta, path="llama-bpe")
    for content in ("Hello", "Hello <|eot_id|> there"):
      ids = tok.encode_chat([{"role": "user", "content": content}])
      assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1, (add_bos, content)
