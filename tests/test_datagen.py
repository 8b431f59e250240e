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
  order or garbage is a ValueError naming the file."""
  rng = np.random.default_rng(7)
  prompts = [(3 * i + 2, rng.integers(0, 1000, 1 + i % 5).tolist()) for i in range(9)]
  path = str(tmp_path / "p.npz")
  datagen.save_prompts(path, prompts, {"target_sha256": "ab", "corpus_seed": 0})
  back, meta = datagen.load_prompts(path, 1000)
  assert back == prompts and meta == {"target_sha256": "ab", "corpus_seed": 0}
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
