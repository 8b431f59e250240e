"""Prompt (prefix) cache across requests (prompt_cache.py): warm output equals cold output token
for token (AR, chain, DDTree; the tiny Qwen3.5 hybrid with its Gated DeltaNet state restored from
a checkpoint, and SmolLM2), a partly matching prefix reuses the longest checkpoint, the byte bound
evicts least recently used entries. Reference: `generate` without a cache (a cold prefill)."""

import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import prompt_cache as pc


def _entry(tokens, nbytes=1000, states=(), layout=("L",)):
  kv = (np.zeros(nbytes // 4, np.float32), np.zeros(0, np.float32), None, None)
  st = {p: (np.zeros(0, np.float32), np.zeros(0, np.float32)) for p in states}
  return pc.Entry(np.asarray(tokens, np.int32), kv, st, layout)


def test_padded_rows():
  sizes = [pc.padded_rows(n, 10_000) for n in (1, 64, 65, 96, 97, 129, 200, 1000, 1100)]
  assert sizes == [64, 64, 96, 96, 128, 192, 256, 1024, 1536]
  assert all(n <= pc.padded_rows(n, 10_000) < 1.5 * n for n in range(65, 5000))
  assert pc.padded_rows(700, 512) == 512                  # capped at the capacity


def test_lookup_longest_prefix_and_lru_eviction():
  c = pc.PromptCache(2500, recurrent=False)
  c.insert(_entry([1, 2, 3, 4, 5]))
  c.insert(_entry([1, 2, 9, 9]))
  assert c.lookup(np.array([7, 1]), ("L",)) is None                # nothing shared
  assert c.lookup(np.array([1, 2, 3, 4, 5]), ("L",)).n == 4        # never the last prompt token
  hit = c.lookup(np.array([1, 2, 3, 8, 8]), ("L",))
  assert hit.n == 3 and list(hit.entry.tokens) == [1, 2, 3, 4, 5]
  assert c.lookup(np.array([1, 2, 3, 4, 5, 6]), ("other",)) is None   # another layout
  c.insert(_entry([5, 5, 5]))         # 3000 bytes > 2500: the least recently used entry goes
  assert len(c) == 2 and c.stats["evictions"] == 1
  assert c.lookup(np.array([1, 2, 9, 9, 9]), ("L",)).n == 2          # [1, 2, 9, 9] was LRU
  assert c.lookup(np.array([1, 2, 3, 4, 0]), ("L",)).n == 4
  c.insert(_entry(range(10), nbytes=4000))                            # larger than the bound
  assert len(c) == 2 and c.bytes <= 2500
  with pytest.raises(ValueError, match="max_bytes"):
    pc.PromptCache(0, recurrent=False)


def test_recurrent_entries_use_checkpoints_only():
  """A hybrid target's entry is usable only up to a checkpoint inside the shared prefix; an
  entry extending another takes over its checkpoints."""
  c = pc.PromptCache(10_000, recurrent=True)
  c.insert(_entry([1, 2, 3], states=[3]))
  c.insert(_entry([1, 2, 3, 4, 5, 6, 7], states=[7]))
  assert len(c) == 1 and set(c.lookup(np.arange(1, 10), ("L",)).entry.states) == {3, 7}
  assert c.lookup(np.array([1, 2, 3, 4, 5, 6, 7, 8]), ("L",)).n == 7
  assert c.lookup(np.array([1, 2, 3, 4, 5, 0, 0]), ("L",)).n == 3     # partial: checkpoint 3
  assert c.lookup(np.array([1, 2, 0]), ("L",)) is None                # before any checkpoint


def _turns(first_prompt, first_tokens, tail):
  """A next-turn prompt: the previous prompt, its answer, then new tokens."""
  return np.concatenate([first_prompt, np.asarray(first_tokens, np.int32), tail]).astype(np.int32)


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_warm_equals_cold_hybrid(qwen_f32, qwen_draft, qwen_ref, mode):
  """Tiny Qwen3.5 hybrid: the next turn restores the Gated DeltaNet state checkpointed at the end
  of the first sequence (and K/V, draft-context rows), a prompt that diverges inside the first
  answer restores the prompt-end checkpoint, a repeated prompt the first chunk's; each output
  equals the cold run's."""
  t = qwen_ref["tokens"]
  kw = dict(mode=mode, budget=6, max_ctx=128, prefill_chunk=32, eog_ids=())
  cache = pc.PromptCache.for_target(qwen_f32, 1 << 28)
  assert cache.recurrent
  p0 = np.asarray(t[0, :40], np.int32)             # two prefill chunks
  first = dj.generate(qwen_f32, qwen_draft, p0, max_new_tokens=10, prompt_cache=cache, **kw)
  assert first.cached_tokens == 0 and len(cache) == 1
  entry = list(cache._entries.values())[0]
  assert len(entry.tokens) == p0.size + len(first.tokens) - 1   # nothing committed past the output
  assert sorted(entry.states) == [32, 40, len(entry.tokens)]    # chunk ends and the sequence end
  turn2 = _turns(p0, first.tokens, t[1, :5])
  prompts = [(turn2, p0.size + len(first.tokens) - 1),     # AR / exact end: the whole sequence
             (_turns(p0, first.tokens[:3], t[1, 5:9]), p0.size),  # diverges: prompt-end checkpoint
             (p0, 32)]                            # a repeat: the first chunk's end checkpoint
  for ids, want in prompts:
    cold = dj.generate(qwen_f32, qwen_draft, ids, max_new_tokens=12, **kw)
    warm = dj.generate(qwen_f32, qwen_draft, ids, max_new_tokens=12, prompt_cache=cache, **kw)
    assert warm.tokens == cold.tokens and warm.accept_lens == cold.accept_lens, (mode, ids.size)
    assert warm.cached_tokens == want, (mode, warm.cached_tokens, want)


def test_warm_equals_cold_hybrid_sampled(qwen_f32, qwen_draft, qwen_ref):
  t = qwen_ref["tokens"]
  kw = dict(mode="chain", max_ctx=128, prefill_chunk=32, eog_ids=(), temperature=0.9, seed=7)
  cache = pc.PromptCache.for_target(qwen_f32, 1 << 28)
  p0 = np.asarray(t[0, :20], np.int32)
  first = dj.generate(qwen_f32, qwen_draft, p0, max_new_tokens=8, prompt_cache=cache, **kw)
  ids = _turns(p0, first.tokens, t[1, :4])
  cold = dj.generate(qwen_f32, qwen_draft, ids, max_new_tokens=10, **kw)
  warm = dj.generate(qwen_f32, qwen_draft, ids, max_new_tokens=10, prompt_cache=cache, **kw)
  assert warm.cached_tokens >= p0.size and warm.tokens == cold.tokens


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_warm_equals_cold_smollm2(smol, mode):
  """SmolLM2 (no recurrent layers: any prefix of a cached sequence is usable): a chat's second
  turn through the chat template reuses the first turn's prompt and answer; output as cold."""
  from dflash_jax import cli
  draft = dj.load_draft(cli.find_draft_dir(smol), smol)
  kw = dict(mode=mode, budget=4, max_ctx=256, prefill_chunk=32)
  cache = pc.PromptCache.for_target(smol, 1 << 28)
  tok = smol.tokenizer
  msgs = [{"role": "user", "content": "Name three colors."}]
  p1 = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
  first = dj.generate(smol, draft, p1, max_new_tokens=16, prompt_cache=cache, **kw)
  msgs += [{"role": "assistant", "content": tok.decode(first.tokens, skip_special=True)},
           {"role": "user", "content": "And three animals?"}]
  p2 = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
  cold = dj.generate(smol, draft, p2, max_new_tokens=16, **kw)
  warm = dj.generate(smol, draft, p2, max_new_tokens=16, prompt_cache=cache, **kw)
  assert warm.tokens == cold.tokens and warm.accept_lens == cold.accept_lens
  assert warm.cached_tokens >= len(p1) + 1


def test_engine_hybrid_next_turn(qwen_f32, qwen_draft, qwen_ref):
  """The server engine on the hybrid: a next turn restores the checkpoint (cached_tokens), its
  answer is the cold one; a byte bound too small for two entries evicts the older."""
  from dflash_jax import serve
  t = qwen_ref["tokens"]
  dec = dj.api.resolve_config(qwen_draft, mode="chain", max_ctx=128, prefill_chunk=32)
  eng = serve.Engine(qwen_f32, qwen_draft, dec, None, "tiny", max_queue=4, max_batch=1,
                     steps_per_call=2)
  samp = dj.SamplingConfig()
  run = lambda ids, n: eng.submit(ids, n, [], samp, lambda _t: None,
                                  lambda: False).result(timeout=600)
  p0 = np.asarray(t[0, :30], np.int32)
  first = run(p0, 8)
  ids = _turns(p0, first.tokens, t[1, :6])
  out = run(ids, 8)
  cold = dj.generate(qwen_f32, qwen_draft, ids, max_new_tokens=8, max_ctx=128, prefill_chunk=32,
                     mode="chain")
  assert out.tokens == cold.tokens
  assert out.stats["prompt_tokens_reused"] >= p0.size
  assert "dflash_prompt_cache_entries 1" in eng.metrics_text()
  one = eng.prompt_cache.bytes                      # the merged entry of both turns
  eng.prompt_cache.max_bytes = one + one // 4       # room for one entry of this size
  run(np.asarray(t[1, :40], np.int32), 8)            # an unrelated prompt evicts it
  assert eng.prompt_cache.stats["evictions"] >= 1 and eng.prompt_cache.bytes <= one + one // 4


def test_engine_restores_beside_decoding_rows(qwen_f32, qwen_draft, qwen_ref):
  """Requests that restore a cached prefix into free slots while another row decodes (their
  prefills wait their turn, one chunk per loop iteration): the decode loop's discarded writes
  for those waiting slots must not land on the restored rows. Each answer equals the cold one.
  (Before restore set the slot's position, the waiting slots' rows 0..L-1 were overwritten.)"""
  from dflash_jax import serve
  t = qwen_ref["tokens"]
  kw = dict(mode="chain", max_ctx=128, prefill_chunk=32)
  dec = dj.api.resolve_config(qwen_draft, **kw)
  eng = serve.Engine(qwen_f32, qwen_draft, dec, None, "tiny", max_queue=8, max_batch=4,
                     steps_per_call=2)
  samp = dj.SamplingConfig()
  sub = lambda ids, n: eng.submit(ids, n, [], samp, lambda _t: None, lambda: False)
  p0 = np.asarray(t[0, :30], np.int32)
  first = sub(p0, 4).result(timeout=600)
  seq = np.concatenate([p0, np.asarray(first.tokens, np.int32)])
  jobs = [(np.asarray(t[1, :5], np.int32), 30)] + [
      (np.concatenate([seq, np.asarray(t[1, i:i + 3], np.int32)]), 8) for i in (0, 3, 6)]
  futs = [sub(ids, n) for ids, n in jobs]
  for (ids, n), f in zip(jobs, futs):
    out = f.result(timeout=600)
    cold = dj.generate(qwen_f32, qwen_draft, ids, max_new_tokens=n, **kw)
    assert out.tokens == cold.tokens, ids.size
  assert eng.metrics["prompt_tokens_reused_total"] >= 3 * p0.size
