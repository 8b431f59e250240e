"""Static n-gram table proposals (`dflash_jax.ngram`, `DecodeConfig.lookup_table`): the table
against a plain-Python count of the corpus, the in-loop proposal against a plain-Python spec,
the file format's checks, and losslessness (exact token equality with autoregressive greedy
decoding) of mode "lookup", of chain / DDTree grafts with a table and of draft rows mixed with
it (`DecodeConfig.table_mix`; its sampled exactness is in test_sampling.py)."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import ngram


def _counts(seqs, n_min, n_max):
  """{context tuple: Counter(next token)} over the positions each sequence predicts."""
  tab = collections.defaultdict(collections.Counter)
  for toks, start in seqs:
    t = [int(x) for x in toks]
    for n in range(n_min, n_max + 1):
      for i in range(max(start, n), len(t)):
        tab[tuple(t[i - n:i])][t[i]] += 1
  return tab


def _corpus(rng, vocab, n_seqs=30):
  return [(rng.integers(0, vocab, int(rng.integers(3, 40))), int(rng.integers(0, 5)))
          for _ in range(n_seqs)]


def _ref_lookup(tab, ctx, min_count):
  """(next, share) of the longest context in tab (n_max down to n_min) seen >= min_count times;
  None when the longest context present is rarer (the table has no entry for it either)."""
  c = tab.get(tuple(ctx))
  if c is None or sum(c.values()) < min_count:
    return None
  best = max(c.values())
  return min(k for k, v in c.items() if v == best), best / sum(c.values())


@pytest.mark.parametrize("seed", range(4))
def test_build_matches_plain_counts(seed):
  rng = np.random.default_rng(seed)
  vocab, n_min, n_max, min_count = 7, 1, 3, 2
  seqs = _corpus(rng, vocab)
  table = ngram.build(seqs, vocab, n_min=n_min, n_max=n_max, min_count=min_count)
  tab = _counts(seqs, n_min, n_max)
  want = {k: _ref_lookup(tab, k, min_count) for k in tab}
  want = {k: v for k, v in want.items() if v is not None}
  hashes = {k: int(ngram.context_hash(np, [np.asarray([x]) for x in k], len(k))[0]) for k in tab}
  assert len(set(hashes.values())) == len(hashes)        # no collisions in this small corpus
  assert table.size == len(want)
  keys = table.keys.tolist()
  for k, (nxt, share) in want.items():
    j = keys.index(hashes[k])
    assert table.next[j] == nxt and abs(table.share[j] - share) < 1e-6, k


def test_context_hash_same_in_numpy_and_jax():
  rng = np.random.default_rng(0)
  cols = [rng.integers(0, 49152, 64).astype(np.int32) for _ in range(4)]
  for n in range(1, 5):
    a = ngram.context_hash(np, cols[:n], n)
    b = ngram.context_hash(jnp, [jnp.asarray(c) for c in cols[:n]], n)
    assert a.dtype == np.uint32 and np.array_equal(a, np.asarray(b))


def _ref_longest(tab, ctx, n_min, n_max, min_count):
  """_ref_lookup of the longest context ending ctx (n_max down to n_min) the table holds, or None."""
  for n in range(min(n_max, len(ctx)), n_min - 1, -1):
    if tuple(ctx[-n:]) in tab and sum(tab[tuple(ctx[-n:])].values()) >= min_count:
      return _ref_lookup(tab, ctx[-n:], min_count)
  return None


def _random_table(seed, vocab, n_min, n_max, min_count):
  """(rng, table, plain counts) of a random 40-sequence corpus."""
  rng = np.random.default_rng(seed)
  seqs = _corpus(rng, vocab, 40)
  return (rng, ngram.build(seqs, vocab, n_min=n_min, n_max=n_max, min_count=min_count),
          _counts(seqs, n_min, n_max))


def _path_reference(tab, hist, n_valid, G, n_min, n_max, min_count, min_expected):
  """The spec in plain Python: G times, the top next token of the longest context (the proposal
  so far included; only real tokens count) with a table entry; stop at the first miss; keep the
  chain when the sum of its running share products is >= min_expected."""
  ctx = [int(x) for x in hist[len(hist) - n_valid:]]
  out, prob, expect = [], 1.0, 0.0
  for _ in range(G):
    hit = _ref_longest(tab, ctx, n_min, n_max, min_count)
    if hit is None:
      break
    prob *= hit[1]
    expect += prob
    out.append(hit[0])
    ctx.append(hit[0])
  return out if expect >= min_expected else []


@pytest.mark.parametrize("seed", range(4))
def test_table_path_matches_the_reference(seed):
  vocab, n_min, n_max, min_count, G, H = 5, 1, 3, 2, 6, 12
  rng, table, tab = _random_table(seed, vocab, n_min, n_max, min_count)
  n_prop = 0
  for _ in range(30):
    hist = rng.integers(0, vocab, H).astype(np.int32)
    n_valid = int(rng.integers(1, H + 1))
    for min_expected in (0.0, 1.5):
      tok, n = ngram.table_path(table, jnp.asarray(hist), jnp.int32(n_valid), G, min_expected)
      want = _path_reference(tab, hist, n_valid, G, n_min, n_max, min_count, min_expected)
      assert int(n) == len(want), (hist, n_valid, min_expected)
      assert np.asarray(tok)[:len(want)].tolist() == want
      assert not np.asarray(tok)[len(want):].any()
      n_prop += len(want)
  assert n_prop > 50                                    # the cases do propose
  empty = ngram.build([], vocab)
  tok, n = ngram.table_path(empty, jnp.asarray(hist), jnp.int32(H), G, 0.0)
  assert int(n) == 0 and not np.asarray(tok).any()


def _mix_reference(tab, dlogits, hist, n_valid, w, n_min, n_max, min_count):
  """ngram.mix_rows in float64 numpy from plain counts: row k = log((p_k + w s delta_t) /
  (1 + w s)) for the longest held context of the real history plus the mixed chain so far."""
  ctx = [int(x) for x in hist[len(hist) - n_valid:]]
  out = []
  for row in np.asarray(dlogits, np.float64):
    p = np.exp(row - row.max())
    p /= p.sum()
    hit = _ref_longest(tab, ctx, n_min, n_max, min_count)
    if hit is not None:
      q = p.copy()
      q[hit[0]] += w * hit[1]
      q /= 1.0 + w * hit[1]
    else:
      q = p
    out.append(np.log(q))
    ctx.append(int(np.argmax(q)))
  return np.stack(out)


@pytest.mark.parametrize("seed", range(3))
def test_mix_rows_matches_float64_reference(seed):
  """Max abs error of the mixed log-probs <= 1e-5 (float32 against float64), the same argmax
  chain, and the table's token does win some rows (the case is not vacuous)."""
  vocab, n_min, n_max, min_count, D, H = 6, 1, 3, 2, 7, 10
  rng, table, tab = _random_table(seed, vocab, n_min, n_max, min_count)
  won = 0
  for _ in range(20):
    dlogits = (rng.standard_normal((D, vocab)) * 2.0).astype(np.float32)
    hist = rng.integers(0, vocab, H).astype(np.int32)
    n_valid = int(rng.integers(1, H + 1))
    for w in (0.5, 3.0):
      got = np.asarray(ngram.mix_rows(table, jnp.asarray(dlogits), jnp.asarray(hist),
                                      jnp.int32(n_valid), w))
      want = _mix_reference(tab, dlogits, hist, n_valid, w, n_min, n_max, min_count)
      assert np.max(np.abs(got - want)) <= 1e-5
      assert np.array_equal(got.argmax(-1), want.argmax(-1))
      won += int(np.sum(want.argmax(-1) != dlogits.argmax(-1)))
  assert won > 20
  lp = np.asarray(ngram.mix_rows(table, jnp.asarray(dlogits), jnp.asarray(hist), jnp.int32(H), 0.0))
  assert np.allclose(lp, np.asarray(jax.nn.log_softmax(jnp.asarray(dlogits), -1)), atol=1e-6)


def test_file_checks(tmp_path):
  rng = np.random.default_rng(0)
  table = ngram.build(_corpus(rng, 9), 9, min_count=1)
  path = str(tmp_path / "t.npz")
  ngram.save(table, path)
  back = ngram.load(path, 9)
  for f in ("keys", "next", "share"):
    assert np.array_equal(getattr(back, f), getattr(table, f))
  assert (back.n_min, back.n_max, back.vocab) == (table.n_min, table.n_max, 9)
  with pytest.raises(ValueError, match=r"t\.npz: built for a vocabulary of 9, the target has 10"):
    ngram.load(path, 10)
  with pytest.raises(FileNotFoundError, match="missing.npz"):
    ngram.load(str(tmp_path / "missing.npz"), 9)
  data = open(path, "rb").read()
  bad = str(tmp_path / "cut.npz")
  open(bad, "wb").write(data[:len(data) // 2])
  with pytest.raises(ValueError, match=r"cut\.npz: unreadable"):
    ngram.load(bad, 9)
  unsorted = str(tmp_path / "unsorted.npz")
  ngram.save(ngram.NgramTable(table.keys[::-1].copy(), table.next[::-1].copy(),
                              table.share[::-1].copy(), 1, 4, 9), unsorted)
  with pytest.raises(ValueError, match=r"unsorted\.npz: keys are not strictly increasing"):
    ngram.load(unsorted, 9)
  with pytest.raises(ValueError, match="token id out of range"):
    ngram.build([(np.asarray([1, 2, 12]), 0)], 9)


def _add_shard(rng, d, V, n, **meta):
  """Writes a shard of n random sequences (`_corpus`; each prompt >= 1 token) to d with the
  manifest metadata meta; returns them as `build`'s (tokens, start) pairs."""
  from dflash_jax.train import shards
  seqs = [shards.TokenSeq(t[:max(s, 1)].astype(np.int32), t[max(s, 1):].astype(np.int32), i)
          for i, (t, s) in enumerate(_corpus(rng, V, n))]
  shards.write_shard(d, seqs, V, target="t.gguf", **meta)
  return [(q.tokens, q.prompt_len) for q in seqs]


def _same_table(a, b):
  return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("keys", "next", "share"))


def test_shard_dir_table_is_built_once(tmp_path, monkeypatch):
  """A token-shard directory's table is built once and kept under ngram.cache_dir(), keyed by the
  manifest: a second load reads it back (equal arrays, no shard read), an unreadable cache file
  is rebuilt and replaced, and a new shard (a new manifest) builds afresh."""
  cache = tmp_path / "cache"
  monkeypatch.setattr(ngram, "cache_dir", lambda: str(cache))
  rng = np.random.default_rng(5)
  V, d = 9, str(tmp_path / "data")
  build = ngram.from_shards
  add_shard = functools.partial(_add_shard, rng, d, V)
  same = _same_table

  corpus = add_shard(20)
  want = ngram.build(corpus, V)
  assert same(ngram.load(d, V), want)
  (cached,) = cache.iterdir()
  monkeypatch.setattr(ngram, "from_shards", lambda *a, **k: pytest.fail("built again"))
  assert same(ngram.load(d, V), want)                      # read back from the cache
  cached.write_bytes(b"not a zip")
  monkeypatch.setattr(ngram, "from_shards", build)
  assert same(ngram.load(d, V), want)                      # rebuilt ...
  assert same(ngram.load(str(cached), V), want)            # ... and the file replaced
  corpus += add_shard(10)
  grown = ngram.load(d, V)
  assert same(grown, ngram.build(corpus, V)) and grown.size > want.size
  assert len(list(cache.iterdir())) == 2


def test_shard_dir_table_counts_greedy_shards(tmp_path, monkeypatch):
  """A directory's table counts its temperature-0 shards only (sampled answers are draft data, not
  what greedy decoding writes); `greedy_only=False`, or a directory of sampled shards only,
  counts every shard; adding a sampled shard leaves the table as it was."""
  monkeypatch.setattr(ngram, "cache_dir", lambda: str(tmp_path / "cache"))
  rng = np.random.default_rng(7)
  V = 9
  same = _same_table

  def add_shard(d, n, temperature):
    return _add_shard(rng, d, V, n, temperature=temperature)

  mixed, sampled_only = str(tmp_path / "mixed"), str(tmp_path / "sampled")
  greedy = add_shard(mixed, 20, 0.0)
  sampled = add_shard(mixed, 20, 0.8)
  greedy += add_shard(mixed, 10, 0)
  assert not same(ngram.build(greedy, V), ngram.build(greedy + sampled, V))   # the test can fail
  assert same(ngram.load(mixed, V), ngram.build(greedy, V))
  assert same(ngram.from_shards(mixed, V, greedy_only=False), ngram.build(greedy + sampled, V))
  only = add_shard(sampled_only, 20, 1.0)
  assert same(ngram.load(sampled_only, V), ngram.build(only, V))
  before = ngram.load(mixed, V)
  add_shard(mixed, 20, 0.8)
  assert same(ngram.load(mixed, V), before)


def test_config_errors(tmp_path):
  with pytest.raises(ValueError, match="lookup_table is set with lookup=0"):
    dj.DecodeConfig(mode="chain", lookup_table="x")
  with pytest.raises(ValueError, match="lookup_table_expect=-1"):
    dj.DecodeConfig(mode="lookup", lookup=4, lookup_table="x", lookup_table_expect=-1.0)
  with pytest.raises(ValueError, match="table_mix=0.5: set lookup_table"):
    dj.DecodeConfig(mode="chain", table_mix=0.5)
  with pytest.raises(ValueError, match="table_mix=0.5 with mode='lookup'"):
    dj.DecodeConfig(mode="lookup", lookup=4, lookup_table="x", table_mix=0.5)
  with pytest.raises(ValueError, match="table_mix=-1"):
    dj.DecodeConfig(mode="chain", lookup_table="x", table_mix=-1.0)
  dj.DecodeConfig(mode="ddtree", lookup_table="x", table_mix=0.5)     # no lookup needed


def test_auto_with_table_mix_needs_a_draft_mode(monkeypatch):
  from dflash_jax import auto_mode
  monkeypatch.setattr(auto_mode, "choose", lambda *a, **k: auto_mode.Pick("lookup", 4))
  with pytest.raises(ValueError, match="table_mix=0.5: mode 'auto' picks 'lookup'"):
    auto_mode.resolve(dj.DecodeConfig(lookup_table="x", table_mix=0.5), "t.gguf", "d", 1, True)
  monkeypatch.setattr(auto_mode, "choose", lambda *a, **k: auto_mode.Pick("ddtree", 12))
  dec = auto_mode.resolve(dj.DecodeConfig(lookup_table="x", table_mix=0.5), "t.gguf", "d", 1, True)
  assert (dec.mode, dec.budget, dec.table_mix) == ("ddtree", 12, 0.5)


def test_missing_table_is_a_clear_error(smol):
  with pytest.raises(FileNotFoundError, match="no_such_table.npz"):
    dj.generate(smol, None, [1, 2, 3], max_new_tokens=4, mode="lookup", lookup=4,
                lookup_table="/nonexistent/no_such_table.npz")


def test_table_modes_lossless(tmp_path, qwen_f32, qwen_ref, qwen_draft):
  """A table built from the target's own greedy answer to one prompt: decoding that prompt again
  with the table accepts several tokens a step where prompt lookup alone does not, and mode
  "lookup", chain and DDTree with the table graft or the table mixture give autoregressive
  output token for token (on a second prompt the table knows less of, too); on the tiny Qwen3.5
  hybrid (Gated DeltaNet rollback). The dense path with a table:
  test_table_batched_rows_equal_one_row."""
  target, draft = qwen_f32, qwen_draft
  prompts = [qwen_ref["tokens"][1, :16], qwen_ref["tokens"][2, :12]]
  V = target.config.n_vocab
  ars = [dj.generate(target, None, p, max_new_tokens=40, mode="ar", max_ctx=256, eog_ids=())
         for p in prompts]
  path = str(tmp_path / "table.npz")
  first = np.concatenate([prompts[0], np.asarray(ars[0].tokens, np.int32)])
  ngram.save(ngram.build([(first, len(prompts[0]))], V, n_min=2, n_max=4, min_count=1), path)
  kw = dict(max_new_tokens=40, max_ctx=256, eog_ids=(), lookup_table=path,
            lookup_table_expect=0.0)
  for i, (prompt, ar) in enumerate(zip(prompts, ars)):
    plain = dj.generate(target, None, prompt, mode="lookup", lookup=6, max_new_tokens=40,
                        max_ctx=256, eog_ids=())
    runs = {"lookup": dj.generate(target, None, prompt, mode="lookup", lookup=6, **kw),
            "chain": dj.generate(target, draft, prompt, mode="chain", lookup=8, **kw),
            "ddtree": dj.generate(target, draft, prompt, mode="ddtree", budget=6, tree_top_k=2,
                                  lookup=5, **kw),
            "chain+mix": dj.generate(target, draft, prompt, mode="chain", table_mix=4.0, **kw),
            "ddtree+mix": dj.generate(target, draft, prompt, mode="ddtree", budget=6,
                                      tree_top_k=2, table_mix=4.0, **kw)}
    for name, r in runs.items():
      assert r.tokens == ar.tokens, (i, name)
      assert sum(r.accept_lens) == 39, (i, name)
    if i == 0:   # the table holds this very answer
      assert np.mean(runs["lookup"].accept_lens) > 3.0, runs["lookup"].accept_lens
      assert np.mean(runs["lookup"].accept_lens) > np.mean(plain.accept_lens) + 1.0
      assert np.mean(runs["chain"].accept_lens) > 3.0, runs["chain"].accept_lens
      # weight 4 > any draft probability: the table's tokens win wherever it holds the context
      assert np.mean(runs["chain+mix"].accept_lens) > 3.0, runs["chain+mix"].accept_lens


def test_table_batched_rows_equal_one_row(smol, smol_prompts, tmp_path, monkeypatch):
  """Batched mode "lookup" with a table: each row's output equals its own AR output; so does
  mode "auto" offered the table where the measured table says "lookup@4+table0.5" is fastest
  (it decodes in mode "lookup" with the table: the same program)."""
  prompts = [smol_prompts[i]["prompt_ids"] for i in (0, 3, 5)]
  ars = [dj.generate(smol, None, p, max_new_tokens=24, mode="ar", max_ctx=256, eog_ids=())
         for p in prompts]
  seqs = [(np.concatenate([np.asarray(p, np.int32), np.asarray(a.tokens[:12], np.int32)]), len(p))
          for p, a in zip(prompts, ars)]
  path = str(tmp_path / "t.npz")
  ngram.save(ngram.build(seqs, smol.config.n_vocab, min_count=1), path)
  res = dj.generate_batch(smol, None, prompts, max_new_tokens=24, batch_size=2, mode="lookup",
                          lookup=4, max_ctx=256, eog_ids=(), lookup_table=path,
                          lookup_table_expect=0.5)
  for r, a in zip(res, ars):
    assert r.tokens == a.tokens
  import json
  from dflash_jax import auto_mode
  table = tmp_path / "auto.json"
  table.write_text(json.dumps({auto_mode.table_key(smol.path, None): {
      "1": {"ar": 1.0, "lookup@4": 2.0, "lookup@4+table0.5": 3.0}}}))
  monkeypatch.setattr(auto_mode, "user_table_path", lambda: str(table))
  auto = dj.generate_batch(smol, None, prompts, max_new_tokens=24, batch_size=2, max_ctx=256,
                           eog_ids=(), lookup_table=path)
  assert {r.mode for r in auto} == {"lookup"}
  assert [r.tokens for r in auto] == [a.tokens for a in ars]
  assert [r.accept_lens for r in auto] == [r.accept_lens for r in res]


@pytest.mark.parametrize("seed", range(2))
def test_next_tokens_match_the_reference(seed):
  """ngram.next_tokens (host-side lookups for offline studies) gives, at every position, the
  plain-count longest held context's top next token and share; -1 / 0 where none is held or
  the table is empty."""
  vocab, n_min, n_max, min_count = 5, 1, 3, 2
  rng, table, tab = _random_table(seed, vocab, n_min, n_max, min_count)
  t = rng.integers(0, vocab, 40)
  pos = np.arange(40)
  tok, share = ngram.next_tokens(table, t, pos)
  hits = 0
  for q in pos:
    want = _ref_longest(tab, [int(x) for x in t[:q]], n_min, n_max, min_count) if q else None
    if want is None:
      assert tok[q] == -1 and share[q] == 0, q
    else:
      assert tok[q] == want[0] and abs(share[q] - want[1]) < 1e-6, q
      hits += 1
  assert hits > 20
  tok, share = ngram.next_tokens(ngram.build([], vocab), t, pos)
  assert (tok == -1).all() and not share.any()
