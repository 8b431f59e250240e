"""Derive tests/data/llama_vocab from llama.cpp's own tokenizer tests (run once by a developer).

  pip download --no-deps --no-binary :all: llama-cpp-python==0.3.16 -d /tmp/sd
  tar xzf /tmp/sd/llama_cpp_python-0.3.16.tar.gz -C /tmp/sd
  python tests/data/make_vocab_data.py /tmp/sd/llama_cpp_python-0.3.16/vendor/llama.cpp/models

llama.cpp's `models/ggml-vocab-<name>.gguf` are vocabulary-only GGUFs of real models; `.inp` holds
test texts (separated by "\\n__ggml_vocab_test__\\n") and `.out` the ids llama.cpp's tokenizer gives
them (tests/test-tokenizer-0.cpp: add_special=false, parse_special=false), one line per text.

Each vocabulary is cut down to what those texts can touch, which leaves every test's ids unchanged:
a token is kept if its text occurs in one of the texts as the tokenizer sees it (byte-level BPE:
the texts' bytes through GPT-2's byte-to-unicode table; SentencePiece: U+2581 for each space and
a leading one), as are every CONTROL / USER_DEFINED / UNKNOWN / BYTE token and every one-character
token (so any text stays encodable, in more pieces than the real vocabulary gives); the others get a
placeholder text that no text contains (U+E000 + id, same id, type and score). A merge is kept
when its two parts joined occur in a text. BPE merging only ever forms pieces of the text it runs
on, so a dropped token or merge could never have been used; the cut vocabulary has the same
size and ids as the real one.

Writes tests/data/llama_vocab/<name>.json.xz: {"source", "sha256", "meta" (the GGUF's tokenizer.*
keys, the cut lists), "cases": [[text, ids], ...]}.
"""

import hashlib
import json
import lzma
import os
import sys

import gguf

NAMES = ("gpt-2", "mpt", "starcoder", "refact", "qwen2", "llama-bpe", "deepseek-coder", "deepseek-llm",
         "llama-spm", "phi-3")
DST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_vocab")
KEEP_TYPES = {2, 3, 4, 6}            # UNKNOWN, CONTROL, USER_DEFINED, BYTE


def byte_level(text: str) -> str:
  """text's UTF-8 bytes through GPT-2's byte-to-unicode table (as byte-level BPE tokens spell them;
  a wrong table only keeps too few tokens, which the tests would catch)."""
  from dflash_jax.tokenizer import _byte_decoder
  enc = {b: c for c, b in _byte_decoder().items()}
  return "".join(enc[b] for b in text.encode("utf-8"))


def main(models_dir: str):
  os.makedirs(DST, exist_ok=True)
  for name in NAMES:
    src = os.path.join(models_dir, f"ggml-vocab-{name}.gguf")
    with open(src, "rb") as fh:
      sha = hashlib.sha256(fh.read()).hexdigest()
    r = gguf.GGUFReader(src)
    meta = {k: r.fields[k].contents() for k in r.fields if k.startswith("tokenizer.")}
    if name != "phi-3":
      meta.pop("tokenizer.chat_template", None)
    with open(src + ".inp", encoding="utf-8") as fh:
      texts = fh.read().split("\n__ggml_vocab_test__\n")
    with open(src + ".out", encoding="utf-8") as fh:
      outs = fh.read().split("\n")
    if texts[-1] == "" and outs[-1] == "":
      texts, outs = texts[:-1], outs[:-1]
    assert len(texts) == len(outs), (name, len(texts), len(outs))
    cases = [[t, [int(x) for x in o.split()]] for t, o in zip(texts, outs)]
    spm = meta["tokenizer.ggml.model"] == "llama"
    seen = [("\u2581" + t.replace(" ", "\u2581")) if spm else byte_level(t) for t in texts]
    assert not any("\ue000" in s for s in seen)
    hit = lambda piece: any(piece in s for s in seen)  # noqa: E731
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    kept = 0
    for i, (t, ty) in enumerate(zip(tokens, types)):
      if ty in KEEP_TYPES or len(t) == 1 or hit(t):
        kept += 1
      else:
        tokens[i] = f"\ue000{i}"
    if "tokenizer.ggml.merges" in meta:
      meta["tokenizer.ggml.merges"] = [m for m in meta["tokenizer.ggml.merges"]
                                       if hit(m.replace(" ", "", 1))]
    out = {"source": f"llama-cpp-python 0.3.16 sdist, vendor/llama.cpp/models/ggml-vocab-{name}.gguf",
           "sha256": sha, "kept_tokens": kept, "meta": meta, "cases": cases}
    with lzma.open(os.path.join(DST, f"{name}.json.xz"), "wt", encoding="utf-8", preset=9) as fh:
      json.dump(out, fh, ensure_ascii=False)
    print(name, len(tokens), "tokens,", kept, "kept,", len(meta.get("tokenizer.ggml.merges", [])),
          "merges,", len(cases), "cases")


if __name__ == "__main__":
  main(sys.argv[1])
