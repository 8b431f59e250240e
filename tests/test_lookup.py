"""Prompt-lookup drafting (`DecodeConfig.lookup`): the n-gram proposal against a plain-Python
reference, the graft of a proposal into a draft tree, and losslessness (exact token equality
with autoregressive greedy decoding) of mode "lookup" and of lookup branches in chain / DDTree,
on the tiny Qwen3.5 hybrid and on SmolLM2, one row and batched."""

import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import tree as tree_lib
from test_draft_and_decode import _random_draft


def _lookup_reference(hist, n_valid, G, nmin, nmax):
  """The spec in plain Python: over the real entries h = hist[-n_valid:], the longest n in
  nmax..nmin whose suffix h[-n:] occurs earlier (ending before h's last entry), the most recent
  such occurrence; its continuation, at most G tokens."""
  h = [int(x) for x in hist[len(hist) - n_valid:]]
  for n in range(nmax, nmin - 1, -1):
    if len(h) < n + 1:
      continue
    suf = h[-n:]
    for s in range(len(h) - 1 - n, -1, -1):
      if h[s:s + n] == suf:
        return h[s + n:s + n + G]
  return []


@pytest.mark.parametrize("seed", range(6))
def test_lookup_path_matches_the_reference(seed):
  rng = np.random.default_rng(seed)
  H, G = 40, 6
  for _ in range(25):
    vocab = int(rng.integers(2, 6))                    # small vocabularies: many matches
    hist = rng.integers(0, vocab, H).astype(np.int32)
    n_valid = int(rng.integers(1, H + 1))
    nmin = int(rng.integers(1, 4))
    nmax = int(rng.integers(nmin, 6))
    tok, n = tree_lib.lookup_path(jnp.asarray(hist), jnp.int32(n_valid), G, nmin, nmax)
    want = _lookup_reference(hist, n_valid, G, nmin, nmax)
    assert int(n) == len(want), (hist, n_valid, nmin, nmax)
    assert np.asarray(tok)[:len(want)].tolist() == want
    assert not np.asarray(tok)[len(want):].any()


def test_lookup_path_hand_cases():
  # ... 5 6 7 8 9 ... 6 7 | bonus 8: "6 7 8" occurred before, followed by 9 1 2
  hist = jnp.asarray([3, 5, 6, 7, 8, 9, 1, 2, 6, 7, 8], jnp.int32)
  tok, n = tree_lib.lookup_path(hist, jnp.int32(11), 4, 2, 4)
  assert np.asarray(tok).tolist() == [9, 1, 2, 6] and int(n) == 4
  # the occurrence lies outside the real entries: no match
  tok, n = tree_lib.lookup_path(hist, jnp.int32(4), 4, 2, 4)
  assert int(n) == 0 and not np.asarray(tok).any()
  # the continuation is cut at the bonus token: "7 8" -> [9, 7, 8] at the end
  hist = jnp.asarray([7, 8, 9, 7, 8], jnp.int32)
  tok, n = tree_lib.lookup_path(hist, jnp.int32(5), 5, 2, 2)
  assert np.asarray(tok).tolist() == [9, 7, 8, 0, 0] and int(n) == 3
  # the longest n-gram wins over a more recent shorter one
  hist = jnp.asarray([1, 2, 3, 4, 9, 3, 5, 2, 3], jnp.int32)
  tok, n = tree_lib.lookup_path(hist, jnp.int32(9), 2, 1, 3)
  assert np.asarray(tok).tolist() == [4, 9]          # "2 3" -> 4 9 (not "3" -> 5 2)


def _tree(tokens, parents):
  n = len(tokens)
  depths = [0] * n
  for i in range(1, n):
    depths[i] = depths[parents[i]] + 1
  return tree_lib.Tree(tokens=jnp.asarray(tokens, jnp.int32), parents=jnp.asarray(parents, jnp.int32),
                       depths=jnp.asarray(depths, jnp.int32), valid=jnp.ones((n,), bool),
                       scores=jnp.zeros((n,), jnp.float32), max_depth=max(depths))


def test_graft_path_shares_nodes_and_follow_takes_the_longer_branch():
  base = _tree([50, 10, 11, 12, 20], [-1, 0, 1, 2, 0])   # chain 10 11 12, sibling 20 at depth 1
  g = tree_lib.graft_path(base, jnp.asarray([10, 11, 30, 31], jnp.int32), jnp.int32(4), 4)
  assert g.n == 9 and not g.is_path
  # 10 and 11 reuse nodes 1 and 2; 30 and 31 are new nodes 7 and 8 below node 2
  assert np.asarray(g.valid).tolist() == [True] * 5 + [False, False, True, True]
  assert np.asarray(g.parents)[7:].tolist() == [2, 7]
  assert np.asarray(g.depths)[7:].tolist() == [3, 4]
  # the target's argmax per node: root -> 10 -> 11 -> 30 -> 31 -> 99
  post = np.zeros(9, np.int32)
  post[[0, 1, 2, 7, 8]] = [10, 11, 30, 31, 99]
  path, n_acc, bonus = tree_lib.follow(g, jnp.asarray(post), 4)
  assert np.asarray(path).tolist() == [0, 1, 2, 7, 8] and int(n_acc) == 4 and int(bonus) == 99
  # a proposal off the root's children is a new branch; n limits the real tokens
  g = tree_lib.graft_path(base, jnp.asarray([40, 41, 42, 43], jnp.int32), jnp.int32(2), 4)
  assert np.asarray(g.valid).tolist() == [True] * 7 + [False, False]
  assert np.asarray(g.parents)[5:7].tolist() == [0, 5] and np.asarray(g.tokens)[5:7].tolist() == [40, 41]
  # no proposal: the tree's own nodes only, follow unchanged
  g = tree_lib.graft_path(base, jnp.asarray([10, 11, 12, 13], jnp.int32), jnp.int32(0), 4)
  assert np.asarray(g.valid).tolist() == [True] * 5 + [False] * 4
  post = np.asarray([10, 11, 12, 7, 0, 0, 0, 0, 0], np.int32)
  a = tree_lib.follow(base, jnp.asarray(post[:5]), 4)
  b = tree_lib.follow(g, jnp.asarray(post), 4)
  assert [np.asarray(x).tolist() for x in a] == [np.asarray(x).tolist() for x in b]


def test_lookup_config_errors():
  with pytest.raises(ValueError, match="lookup=0 with mode='lookup'"):
    dj.DecodeConfig(mode="lookup")
  with pytest.raises(ValueError, match="lookup=4 with mode='ar'"):
    dj.DecodeConfig(mode="ar", lookup=4)
  with pytest.raises(ValueError, match=r"lookup=16: a chain step accepts at most block_size - 1 = 15"):
    dj.DecodeConfig(mode="chain", block_size=16, lookup=16)
  with pytest.raises(ValueError, match="lookup_ngram_max=1"):
    dj.DecodeConfig(mode="lookup", lookup=4, lookup_ngram_min=2, lookup_ngram_max=1)
  c = dj.DecodeConfig(mode="lookup", lookup=8)
  assert c.L == 9 and c.verify_len == 9 and not c.uses_draft and c.speculative
  assert dj.DecodeConfig(mode="ddtree", budget=22, block_size=16, lookup=8).verify_len == 31


@pytest.mark.parametrize("which", ["tiny_hybrid", "smollm2"])
def test_lookup_modes_lossless(which, qwen_f32, qwen_ref, qwen_draft, smol, smol_prompts):
  """Greedy output of mode "lookup" and of chain / DDTree with a lookup branch equals
  autoregressive output token for token; a repetitive prompt makes the lookup accept several
  tokens a step (on SmolLM2, whose answer repeats the pattern)."""
  if which == "tiny_hybrid":
    target, draft = qwen_f32, qwen_draft
    prompts = [qwen_ref["tokens"][1, :16], np.tile(qwen_ref["tokens"][2, :5], 5)]
  else:
    target, draft = smol, _random_draft(smol)
    rep = smol.tokenizer.encode("1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4,")
    prompts = [np.asarray(smol_prompts[0]["prompt_ids"], np.int32), np.asarray(rep, np.int32)]
  for i, prompt in enumerate(prompts):
    ar = dj.generate(target, None, prompt, max_new_tokens=40, mode="ar", max_ctx=256, eog_ids=())
    runs = {"lookup": dj.generate(target, None, prompt, max_new_tokens=40, mode="lookup",
                                  lookup=6, max_ctx=256, eog_ids=()),
            "chain": dj.generate(target, draft, prompt, max_new_tokens=40, mode="chain",
                                 lookup=8, max_ctx=256, eog_ids=()),
            "ddtree": dj.generate(target, draft, prompt, max_new_tokens=40, mode="ddtree",
                                  budget=6, tree_top_k=2, lookup=5, max_ctx=256, eog_ids=())}
    for name, r in runs.items():
      assert r.tokens == ar.tokens, (which, i, name)
      assert sum(r.accept_lens) == 39, (which, i, name)       # the first token is prefill's
    if which == "smollm2" and i == 1:
      assert np.mean(runs["lookup"].accept_lens) > 3.0, runs["lookup"].accept_lens
      assert np.mean(runs["chain"].accept_lens) > 3.0, runs["chain"].accept_lens


def test_lookup_batched_rows_equal_one_row(smol, smol_prompts):
  """Batched mode "lookup": rows with and without lookup matches decode together (a round is a
  lookup verify when any row has a match), each row's output equal to its own AR output."""
  rep = smol.tokenizer.encode("a b c d e a b c d e a b c d e a b c")
  prompts = [smol_prompts[3]["prompt_ids"], rep, smol_prompts[0]["prompt_ids"]]
  res = dj.generate_batch(smol, None, prompts, max_new_tokens=24, batch_size=2, mode="lookup",
                          lookup=4, max_ctx=256, eog_ids=())
  for p, r in zip(prompts, res):
    ar = dj.generate(smol, None, p, max_new_tokens=24, mode="ar", max_ctx=256, eog_ids=())
    assert r.tokens == ar.tokens


def test_lookup_searches_a_long_prompt(smol):
  """Prompt lookup searches the row's last decode.RECENT_WINDOW tokens (2048), not only the
  penalties' 256: after a 1,100-token prompt prefilled in 128-token chunks the row's window holds
  the prompt's tail in order; a repeat ~1,000 tokens back is proposed (`lookup_proposal`); and
  greedy mode "lookup" on that prompt equals AR token for token."""
  import dataclasses

  import jax
  from dflash_jax import api, batching, decode
  from dflash_jax.sampling import PENALTY_WINDOW, SamplingConfig
  W = decode.RECENT_WINDOW
  assert W >= 2048 > PENALTY_WINDOW
  rng = np.random.default_rng(0)
  v = smol.config.n_vocab
  code = np.asarray(smol.tokenizer.encode(
      "def reverse_words(sentence):\n    words = sentence.split()\n    return ' '.join(words[::-1])\n"),
      np.int32)
  filler = rng.permutation(np.arange(1000, v))[:1000].astype(np.int32)     # no repeated n-gram
  prompt = np.concatenate([code, filler, code[:6]])
  assert prompt.size > 1000
  dec = api.resolve_config(None, dj.DecodeConfig(mode="lookup", lookup=4, max_ctx=2048))
  sb = batching.SlotBatch(smol, None, dec, 1, jnp.zeros((0,), jnp.int32))
  sb.prefill(0, prompt, 8, SamplingConfig())
  row = jax.tree.map(lambda a: a[0], sb.state)
  assert int(row.pos) == prompt.size
  np.testing.assert_array_equal(np.asarray(row.recent)[-prompt.size:], prompt)
  # the bonus token as the copy would continue: the suffix (code[4], code[5], bonus) sits
  # ~1,000 tokens back, so the proposal is the code's next tokens
  row = dataclasses.replace(row, bonus=jnp.int32(code[6]))
  tok, n = decode.lookup_proposal(row, dec)
  assert int(n) == 4 and np.array_equal(np.asarray(tok), code[7:11]), (tok, n)
  ar = dj.generate(smol, None, prompt, max_new_tokens=24, mode="ar", max_ctx=2048, eog_ids=())
  lk = dj.generate(smol, None, prompt, max_new_tokens=24, mode="lookup", lookup=4, max_ctx=2048,
                   eog_ids=())
  assert lk.tokens == ar.tokens


def test_sampled_chain_rejection_ignores_the_lookup_branch(qwen_f32, qwen_draft, draft_ref):
  """Under chain_rule "rejection" a sampled row verifies the draft's chain only: with the same
  seed its output equals the run without a lookup branch, token for token."""
  p = draft_ref["prompt_ids"]
  kw = dict(max_new_tokens=30, mode="chain", max_ctx=256, temperature=0.8, seed=3)
  a = dj.generate(qwen_f32, qwen_draft, p, **kw)
  b = dj.generate(qwen_f32, qwen_draft, p, lookup=6, **kw)
  assert a.tokens == b.tokens and a.accept_lens == b.accept_lens
