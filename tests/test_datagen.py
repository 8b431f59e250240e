"""Training data at scale: token shards round-trip and are validated when read (a corrupt shard
is a clear error naming the file), the batched generation gives each prompt what `generate`
gives it alone, and a resumed run gives the same shards as an uninterrupted one."""

import json
import os

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax.train import datagen
from dflash_jax.train import shards as shards_lib


def _seqs(n, vocab=1000, seed=0):
  rng = np.random.default_rng(seed)
  return [shards_lib.TokenSeq(rng.integers(0, vocab, rng.integers(1, 9)).astype(np.int32),
                              rng.integers(0, vocab, rng.integers(0, 20)).astype(np.int32), 10 + i)
          for i in range(n)]


def test_shards_round_trip_and_manifest(tmp_path):
  d = str(tmp_path / "data")
  a, b = _seqs(5), _seqs(3, seed=1)
  e0 = shards_lib.write_shard(d, a, 1000, temperature=0.0, seed=0, minutes=0.5)
  shards_lib.write_shard(d, b, 1000, temperature=0.8, seed=1, minutes=0.25)
  got = shards_lib.read_shards(d, 1000)
  assert len(got) == 8
  for x, y in zip(a + b, got):
    assert x.prompt.tolist() == y.prompt.tolist() and x.response.tolist() == y.response.tolist()
    assert x.prompt_index == y.prompt_index
  assert e0["file"] == "shard_00000.npz" and e0["n_seqs"] == 5
  assert e0["response_tokens"] == sum(s.response.size for s in a)
  s = shards_lib.summary(d)
  assert s["shards"] == 2 and s["sequences"] == 8 and s["minutes"] == 0.75
  with np.load(os.path.join(d, "shard_00000.npz")) as z:
    assert z["ids"].dtype == np.uint16            # a vocabulary below 65536 is stored as uint16


def test_corrupt_shards_are_clear_errors(tmp_path):
  d = str(tmp_path / "data")
  shards_lib.write_shard(d, _seqs(4), 1000)
  path = os.path.join(d, "shard_00000.npz")
  raw = bytearray(open(path, "rb").read())
  raw[len(raw) // 2] ^= 0xFF
  open(path, "wb").write(bytes(raw))
  with pytest.raises(ValueError, match="shard_00000.npz: sha256"):
    shards_lib.read_shards(d, 1000)
  shards_lib.write_shard(str(tmp_path / "v"), _seqs(2, vocab=1000), 1000)
  with pytest.raises(ValueError, match="outside the vocabulary"):   # read with a smaller vocab
    shards_lib.read_shards(str(tmp_path / "v"), 10)
  os.remove(path)
  with pytest.raises(ValueError, match="shard_00000.npz: listed in manifest.json but missing"):
    shards_lib.read_shards(d, 1000)
  with pytest.raises(ValueError, match="no token shards"):
    shards_lib.read_shards(str(tmp_path / "empty"), 1000)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    shards_lib.write_shard(d, _seqs(2, vocab=2000), 1000)
  open(os.path.join(d, "manifest.json"), "w").write("{not json")
  with pytest.raises(ValueError, match="manifest.json: not a readable shard manifest"):
    shards_lib.read_shards(d, 1000)


def test_prompt_file_round_trip_and_errors(tmp_path):
  """Encoded prompts written for another machine (gen_data.py --export_prompts) come back
  exactly, meta included; a file with a flipped id, an id outside the vocabulary, indices out of
  order, garbage or another target's sha256 is a ValueError naming the file."""
  rng = np.random.default_rng(7)
  prompts = [(3 * i + 2, rng.integers(0, 1000, 1 + i % 5).tolist()) for i in range(9)]
  path = str(tmp_path / "p.npz")
  datagen.save_prompts(path, prompts, {"target_sha256": "ab", "corpus_seed": 0})
  back, meta = datagen.load_prompts(path, 1000)
  assert back == prompts and meta == {"target_sha256": "ab", "corpus_seed": 0}
  assert datagen.load_prompts(path, 1000, target_sha256="ab")[0] == prompts
  with pytest.raises(ValueError, match="p.npz was made for target None .sha256 ab., not the "
                                       "target of sha256 cd"):
    datagen.load_prompts(path, 1000, target_sha256="cd")
  with pytest.raises(ValueError, match=r"p.npz: token id \d+ outside the vocabulary \[0, 10\)"):
    datagen.load_prompts(path, 10)
  z = dict(np.load(path))
  z["ids"] = z["ids"].copy()
  z["ids"][3] += 1
  np.savez(str(tmp_path / "flip.npz"), **z)
  with pytest.raises(ValueError, match="flip.npz: sha256 of the prompt arrays does not match"):
    datagen.load_prompts(str(tmp_path / "flip.npz"), 1000)
  datagen.save_prompts(str(tmp_path / "order.npz"), prompts[::-1], {})
  with pytest.raises(ValueError, match="order.npz: corpus indices are not increasing"):
    datagen.load_prompts(str(tmp_path / "order.npz"), 1000)
  open(tmp_path / "junk.npz", "wb").write(b"PK\x03\x04 not a zip")
  with pytest.raises(ValueError, match="junk.npz: not a readable prompt file"):
    datagen.load_prompts(str(tmp_path / "junk.npz"), 1000)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generated_shards_match_generate_and_resume(qwen_f32, tmp_path, temperature):
  """Batched generation (B = 4 rows, 7 prompts of different lengths, 3 shards) gives per prompt
  exactly `generate`'s tokens for it alone (greedy, and sampled with seed + corpus index); a run
  stopped after its first shard and resumed writes the same shards as one uninterrupted run."""
  rng = np.random.default_rng(3)
  prompts = [(2 * i + 1, rng.integers(5, 900, 3 + 2 * i).tolist()) for i in range(7)]
  kw = dict(max_new_tokens=12, temperature=temperature, seed=5, batch_size=4, max_ctx=64,
            shard_prompts=3, meta={"command": "test"})
  full = str(tmp_path / "full")
  datagen.generate_shards(qwen_f32, prompts, full, **kw)
  part = str(tmp_path / "part")
  datagen.generate_shards(qwen_f32, prompts, part, max_response_tokens=1, **kw)  # stops after 1
  assert shards_lib.summary(part)["shards"] == 1
  assert datagen.resume_index(part, temperature, 5) == prompts[2][0] + 1
  datagen.generate_shards(qwen_f32, prompts, part, **kw)
  a, b = shards_lib.read_shards(full, 1024), shards_lib.read_shards(part, 1024)
  assert [s.prompt_index for s in a] == [i for i, _ in prompts] == [s.prompt_index for s in b]
  assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]
  man = json.load(open(os.path.join(full, "manifest.json")))
  assert [e["n_seqs"] for e in man["shards"]] == [3, 3, 1]
  assert all(e["temperature"] == temperature and e["command"] == "test" for e in man["shards"])
  samp = dj.SamplingConfig(temperature=temperature, top_p=1.0)
  for (i, ids), s in zip(prompts, a):
    r = dj.generate(qwen_f32, None, ids, max_new_tokens=12, mode="ar", max_ctx=64,
                    sampling=samp, seed=5 + i)
    assert s.prompt.tolist() == ids and s.response.tolist() == r.tokens


def test_self_query_cleaning_and_decontamination():
  """Self-written queries (train.self_queries, Magpie): unfinished (None), too short / too long
  and repeated texts are dropped, and so is every text sharing an 8-word run with an evaluation
  text, or occurring whole in one when shorter; unrelated texts on the same topics stay."""
  from dflash_jax.train import self_queries as sq
  ev = ["Write a Python function that checks whether a number is prime.",
        "How do I reverse a string in JavaScript?",
        'def add(a, b):\n    """ Add two numbers a and b.\n    >>> add(2, 3)\n    5\n    """\n']
  texts = ["How can I sort a dictionary by value in Python?",              # 0 kept
           None,                                                            # 1 unfinished
           "Hi",                                                            # 2 too short
           "x" * 700,                                                       # 3 too long
           "how can i sort a dictionary by VALUE in python",                # 4 repeat of 0
           "Please write a python function that checks whether a number is prime or not",  # 5: 8-gram
           "How do I reverse a string",                                     # 6: whole inside ev[1]
           "Write a Python function that counts vowels in a word.",         # 7 kept (< 8 shared)
           "Explain what this does: add two numbers a and b, add 2 3 gives 5",  # 8: 8-gram of ev[2]
           "What is a prime number?"]                                       # 9 kept
  assert sq.clean_queries(texts, ev) == [0, 7, 9]
  assert sq.contaminated("HOW DO I REVERSE A STRING IN JAVASCRIPT", ev)
  assert not sq.contaminated("Reverse the string", ev)        # 3 words, not a run of ev's
  assert not sq.contaminated("Hi there", ["Hi there friend"])  # runs < 3 words: equality only
  assert sq.contaminated("Hi there", ["hi, there!"])
  he = sq.eval_texts()
  assert len(he) == 16 + 164 and sq.contaminated(he[20][:200], he)


def test_self_queries_follow_the_template_and_generate(qwen_f32):
  """pre_query_ids is a token prefix of every one-turn chat prompt (so a sampled query continues
  the template where a user's text goes); sample_queries gives query i what `generate` samples
  alone after that prefix and its opener with seed j = seed + i (text from the opener on, None
  where no end-of-turn token came); query_prompts keeps each query's sample index."""
  import copy
  import dataclasses
  from dflash_jax import cli
  from dflash_jax.train import self_queries as sq
  with pytest.raises(ValueError, match="no tokenizer.chat_template"):
    sq.pre_query_ids(qwen_f32)
  tok = copy.copy(qwen_f32.tokenizer)       # the tiny GGUF has no template: give a copy ChatML's
  tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                       "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
                       "assistant\n{% endif %}")
  qwen_f32 = dataclasses.replace(qwen_f32, tokenizer=tok)
  pre = sq.pre_query_ids(qwen_f32)
  assert tok.decode(pre, skip_special=False).endswith("user\n")
  for q in ["Hello there", "Write a Python function that adds two numbers."]:
    assert cli.build_prompt(qwen_f32, q, chat=True)[:len(pre)] == pre
  openers = ("", "Explain")
  samp = dj.SamplingConfig(temperature=1.0, top_p=0.95)
  # Query j (here 11, 12, 13) opens with openers[j % 2]. Make the third token query 11 samples
  # an end-of-turn token, so some queries end (a random tiny model rarely samples its real ones).
  r0 = dj.generate(qwen_f32, None, pre + tok.encode("Explain"), max_new_tokens=6, mode="ar",
                   max_ctx=128, sampling=samp, seed=11, eog_ids=()).tokens
  tok.eog_ids = tuple(sorted(set(tok.eog_ids) | {int(r0[2])}))
  got = sq.sample_queries(qwen_f32, 3, seed=11, openers=openers, max_query_tokens=6,
                          batch_size=1, max_ctx=128)    # one slot: generate's compiled loop
  assert len(got) == 3 and got[0] == "Explain" + tok.decode(r0[:2])
  eog = set(tok.eog_ids)
  for i, g in enumerate(got):
    o = openers[(11 + i) % 2]
    r = dj.generate(qwen_f32, None, pre + (tok.encode(o) if o else []), max_new_tokens=6,
                    mode="ar", max_ctx=128, sampling=samp, seed=11 + i).tokens
    want = (o + tok.decode(r[:-1])) if r and r[-1] in eog else None
    assert g == want
  ps = sq.query_prompts(qwen_f32, ["a question", "another one"], 256, indices=[4, 9])
  assert [i for i, _ in ps] == [sq.SELF_QUERY_BASE + 4, sq.SELF_QUERY_BASE + 9]
  assert ps[1][1] == cli.build_prompt(qwen_f32, "another one", chat=True)
  with pytest.raises(ValueError, match="2 indices for 1 queries"):
    sq.query_prompts(qwen_f32, ["x"], 256, indices=[1, 2])


def test_resume_windows_keep_prompt_sets_apart(tmp_path):
  """Shards of the corpus (indices from 0) and of self-written queries (from SELF_QUERY_BASE)
  in one directory resume independently: each set's resume index counts only its own range."""
  from dflash_jax.train import self_queries as sq
  d = str(tmp_path / "d")
  b = sq.SELF_QUERY_BASE
  for first, n in ((0, 3), (3, 2), (b, 4)):
    seqs = [shards_lib.TokenSeq(np.array([1, 2], np.int32), np.array([3], np.int32), first + k)
            for k in range(n)]
    shards_lib.write_shard(d, seqs, 1000, temperature=0.0, seed=0, last_prompt=first + n - 1)
  assert datagen.resume_index(d, 0.0, 0) == b + 4                 # no window: the old rule
  assert datagen.resume_index(d, 0.0, 0, 0, b) == 5
  assert datagen.resume_index(d, 0.0, 0, b) == b + 4
  assert datagen.resume_index(d, 0.0, 0, 2 * b) == 2 * b          # nothing there yet


def test_earlier_query_files_are_kept_apart(tmp_path):
  """earlier_queries: the ids of the other self-query files in the directory (not the one being
  written), and a clear error naming the file for an overlapping query range (the same
  samples), another target's file, or a corrupt one."""
  from dflash_jax.train import self_queries as sq
  d = tmp_path / "d"
  d.mkdir()
  meta = {"target": "t.gguf", "target_sha256": "abc", "query_seed": 0, "self_queries": 8}
  f0 = str(d / "self_queries_seed0_n8.npz")
  datagen.save_prompts(f0, [(sq.SELF_QUERY_BASE + 1, [5, 6]), (sq.SELF_QUERY_BASE + 4, [7])],
                       meta)
  new = str(d / "self_queries_seed8_n8.npz")
  assert sq.earlier_queries(str(d), new, 8, 8, 100, "abc") == {(5, 6), (7,)}
  assert sq.earlier_queries(str(d), f0, 0, 8, 100, "abc") == set()     # itself: not earlier
  with pytest.raises(ValueError, match=r"\[4, 12\) overlap \[0, 8\) of .*seed0_n8.npz.*query 8"):
    sq.earlier_queries(str(d), new, 4, 8, 100, "abc")
  with pytest.raises(ValueError, match="seed0_n8.npz was made for target t.gguf"):
    sq.earlier_queries(str(d), new, 8, 8, 100, "other")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    sq.earlier_queries(str(d), new, 8, 8, 7, "abc")
  (d / "self_queries_bad.npz").write_bytes(b"not a zip")
  with pytest.raises(ValueError, match="self_queries_bad.npz: not a readable prompt file"):
    sq.earlier_queries(str(d), new, 8, 8, 100, "abc")
