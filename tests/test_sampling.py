"""Lossless sampling: the processed distribution vs a float64 numpy reference of llama.cpp's chain,
the acceptance rule's induced distribution on hand-made distributions, temperature 0 == greedy,
and exactness by distribution of chain (rejection and match rules) and DDTree sampling against
the exact autoregressive distribution of the tiny Qwen3.5 target.

Statistical tests are deterministic (fixed seeds). Each compares N_SAMPLES = 1000 runs' first
four generated tokens (temperature 1, top_k 3: at most 81 joint outcomes) against the exact
joint distribution, computed from the target's logits on every prefix with the numpy reference
sampler; Pearson chi-square over cells with expected count >= 5 (the rest pooled), failing
below p = 1e-4. Power: `test_chi_square_catches_a_wrong_rule` runs the same check on a rule
with the classic bug (resample from p instead of the residual after a rejection) and requires
p < 1e-6 (measured: p = 0.0 in float64 at 1000 and 1500 samples, while the correct rule gave
p = 0.44 and 0.15).
"""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import batching, decode, sampling
from dflash_jax.sampling import SamplingConfig

from conftest import optimized_xla

TOP_K = 3
N_TOKENS = 4
N_SAMPLES = 1000
CFG = SamplingConfig(temperature=1.0, top_k=TOP_K, seed=11)
SMALL_CTX = dict(max_ctx=48, prefill_chunk=32)   # the 24-token prompt in one chunk, small caches


def ref_process(logits, temperature, top_k, top_p, min_p):
  """float64 numpy llama.cpp chain (top-k, top-p, min-p, temperature) -> probabilities [V]."""
  x = np.asarray(logits, np.float64)
  cand = np.argsort(-x, kind="stable")
  if top_k > 0:
    cand = cand[:top_k]
  if top_p < 1.0:
    pr = np.exp(x[cand] - x[cand].max())
    cum = np.cumsum(pr / pr.sum())
    hit = np.nonzero(cum >= top_p)[0]
    cand = cand[:hit[0] + 1] if hit.size else cand
  if min_p > 0:
    cand = cand[x[cand] >= x[cand].max() + np.log(min_p)]
  z = np.full_like(x, -np.inf)
  z[cand] = x[cand] / temperature
  e = np.exp(z - z[cand].max())
  return e / e.sum()


@pytest.mark.parametrize("settings", [(1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (1.3, 0, 0.9, 0.0),
                                      (0.8, 0, 1.0, 0.05), (0.5, 20, 0.8, 0.02), (2.0, 1, 0.3, 0.5)])
def test_processed_distribution_matches_numpy_reference(settings):
  t, k, p, m = settings
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((6, 300)).astype(np.float32) * 3
  sp = SamplingConfig(temperature=t, top_k=k, top_p=p, min_p=m).params()
  got = np.exp(np.asarray(sampling.process_logits(jnp.asarray(logits), sp), np.float64))
  for r in range(logits.shape[0]):
    ref = ref_process(logits[r], t, k, p, m)
    np.testing.assert_array_equal(got[r] > 0, ref > 0)   # same kept set
    assert np.abs(got[r] - ref).max() < 1e-6


def test_acceptance_rule_induced_distribution_is_p():
  """For one draft drawn from q, the rule outputs x with probability
  q(x) a(x) + (1 - sum_d q(d) a(d)) r(x), a = accept_prob, r = residual: this must equal p."""
  cases = [([.5, .3, .2, 0, 0], [.2, .2, .2, .2, .2]), ([.1, .1, .8, 0, 0], [1, 0, 0, 0, 0]),
           ([.25, .25, .25, .25, 0], [.25, .25, .25, .25, 0]), ([0, 0, 1, 0, 0], [0, .5, 0, .5, 0]),
           ([.6, .4, 0, 0, 0], [0, 0, 0, .3, .7])]
  for p, q in cases:
    p, q = np.asarray(p, np.float32), np.asarray(q, np.float32)
    ds = np.arange(5, dtype=np.int32)
    a = np.asarray(sampling.accept_prob(jnp.asarray(np.tile(p, (5, 1))),
                                        jnp.asarray(np.tile(q, (5, 1))), jnp.asarray(ds)))
    r = np.exp(np.asarray(sampling.residual(jnp.asarray(p[None]), jnp.asarray(q[None]))[0]))
    induced = q * a + (1 - np.sum(q * a)) * r
    assert np.abs(induced - p).max() < 1e-6, (p, q, induced)


def test_rejection_chain_monte_carlo():
  """rejection_chain itself (one draft + bonus), 40000 keys: the first emitted token ~ p0."""
  p = np.log(np.asarray([[.5, .3, .2, 1e-30], [.1, .2, .3, .4]], np.float32))
  q = np.log(np.asarray([[.1, .1, .1, .7]], np.float32))

  def one(key):
    kd, ka = jax.random.split(key)
    d = jax.random.categorical(kd, jnp.asarray(q[0])).astype(jnp.int32)[None]
    n_acc, bonus = sampling.rejection_chain(ka, jnp.asarray(p), jnp.asarray(q), d)
    return jnp.where(n_acc == 1, d[0], bonus)

  first = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), 40000)))
  freq = np.bincount(first, minlength=4) / first.size
  assert np.abs(freq - [.5, .3, .2, 0]).max() < 0.01, freq


# ----------------------------------------------------------------------------- in the decoder

def test_temperature_zero_is_greedy(qwen_f32, qwen_draft, draft_ref):
  p = draft_ref["prompt_ids"]
  want = draft_ref["greedy_output_ids"][len(p):].tolist()[:24]
  for mode in ("ar", "chain", "ddtree"):
    r = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=24, mode=mode, max_ctx=256,
                    temperature=0.0, top_k=3, top_p=0.5, seed=7)
    assert r.tokens == want, mode


def _proposer(kind, n_vocab):
  """Adversarial proposers (logits for every depth, from the state only):
  "wrong": confidently the target's second choice (in the top-3 support, never the argmax);
  "right": confidently the target's first choice; "random": random logits per position."""

  def prop(tparams, dparams, s, *, dcfg, dec, rt):
    del dcfg, rt
    rows = dec.L - 1
    if kind == "random":
      key = jax.random.fold_in(jax.random.key(123), s.pos)
      return jax.random.normal(key, (rows, n_vocab)) * 3.0, s.draft
    choice = dparams["second"] if kind == "wrong" else dparams["first"]
    tok = choice[s.bonus]                       # a fixed function of the last token
    logits = jnp.full((rows, n_vocab), -20.0).at[:, tok].set(5.0)
    return logits, s.draft

  return decode.LogitsProposer(prop)


def _sample_many(target, draft, prompt, dec, cfg: SamplingConfig, n, proposer=None, pparams=None,
                 table=None):
  """[n, N_TOKENS] int32: the first N_TOKENS generated tokens of n independent runs (seeds
  cfg.seed * n + 0..n-1), prefill + decode loop of a one-slot batch vmapped over the seeds.
  table: the n-gram table of dec.lookup_table (an NgramTable), if set."""
  dcfg = draft.config if (draft is not None and proposer is None and dec.mode != "ar") else None
  dparams = pparams if proposer is not None else (draft.params if dcfg is not None else None)
  proposer = proposer or decode.dflash_proposer
  toks = np.zeros(dec.prefill_chunk, np.int32)
  toks[:len(prompt)] = prompt
  sp, eog = cfg.params(), jnp.asarray([-1], jnp.int32)
  plan = decode.Plan(target.config, dcfg, dec, target.runtime)

  def run(seed):
    st = decode.init_state(plan, 1)
    st = decode.prefill_chunk(target.params, dparams, st, jnp.int32(0), jnp.asarray(toks),
                              jnp.int32(0), jnp.int32(len(prompt)), jnp.bool_(True), eog, seed,
                              jnp.int32(N_TOKENS), sp, jnp.asarray(batching.tokens_before([], 0)),
                              plan=plan.prefill, sampled=True)
    st = decode.decode_loop(target.params, dparams, st, jnp.int32(1 << 20), eog, None, table,
                            plan=plan, sampled=True, proposer=proposer)
    return st.out[0, :N_TOKENS]

  seeds = jnp.arange(n, dtype=jnp.int32) + jnp.int32(cfg.seed * n)
  with optimized_xla():                 # bound by running the n rows, not by compiling
    return np.asarray(jax.jit(jax.vmap(run))(seeds))


def _exact_joint(target, draft_ref):
  """(prompt, exact joint distribution {tokens: prob} of the first N_TOKENS tokens under the
  numpy reference sampler at CFG, proposer tables) for `target` (its cache format included):
  the tables map a token to the target's first / second choice after the prefix ending with it
  (a fixed function of the last token, so the proposers below can be adversarial)."""
  prompt = [int(x) for x in draft_ref["prompt_ids"]]
  v = target.config.n_vocab
  first, second = np.zeros(v, np.int32), np.zeros(v, np.int32)
  frontier = [((), 1.0)]
  for _ in range(N_TOKENS):
    nxt = []
    for prefix, pr in frontier:
      lg = np.asarray(dj.forward_logits(target, prompt + list(prefix)))[-1]
      d = ref_process(lg, CFG.temperature, CFG.top_k, CFG.top_p, CFG.min_p)
      last = prefix[-1] if prefix else prompt[-1]
      first[last], second[last] = np.argsort(-d, kind="stable")[:2]
      nxt += [(prefix + (int(t),), pr * d[t]) for t in np.nonzero(d)[0]]
    frontier = nxt
  return prompt, dict(frontier), {"first": jnp.asarray(first), "second": jnp.asarray(second)}


@pytest.fixture(scope="module")
def exact_joint(qwen_f32, draft_ref):
  return _exact_joint(qwen_f32, draft_ref)


def _chi_square_p(samples, joint):
  """p-value of Pearson's chi-square of the sampled joint outcomes against `joint`."""
  n = samples.shape[0]
  counts = {}
  for row in map(tuple, samples.tolist()):
    counts[row] = counts.get(row, 0) + 1
  assert set(counts) <= set(joint), set(counts) - set(joint)  # nothing outside the support
  exp_big, obs_big, exp_rest, obs_rest = [], [], 0.0, 0
  for outcome, pr in joint.items():
    e = n * pr
    if e >= 5:
      exp_big.append(e)
      obs_big.append(counts.get(outcome, 0))
    else:
      exp_rest += e
      obs_rest += counts.get(outcome, 0)
  exp = np.asarray(exp_big + ([exp_rest] if exp_rest > 0 else []))
  obs = np.asarray(obs_big + ([obs_rest] if exp_rest > 0 else []))
  stat = float(np.sum((obs - exp) ** 2 / exp))
  return float(jax.scipy.stats.chi2.sf(stat, len(exp) - 1))


@pytest.fixture(scope="module")
def sampled_runs(qwen_f32, qwen_draft, exact_joint):
  """(mode, chain rule, proposer) -> [N_SAMPLES, N_TOKENS] sampled tokens (`_sample_many`),
  computed once per module."""
  prompt, _, tables = exact_joint
  runs = {}

  def get(mode, rule, proposer):
    if (mode, rule, proposer) not in runs:
      block = 4 if proposer else None
      dec = dj.api.resolve_config(qwen_draft if proposer is None else None,
                                  dj.DecodeConfig(mode=mode, chain_rule=rule or "rejection",
                                                  budget=6, block_size=block, **SMALL_CTX),
                                  has_proposer=proposer is not None)
      prop = _proposer(proposer, qwen_f32.config.n_vocab) if proposer else None
      runs[mode, rule, proposer] = _sample_many(qwen_f32, qwen_draft, prompt, dec, CFG,
                                                N_SAMPLES, prop, tables if proposer else None)
    return runs[mode, rule, proposer]

  return get


@pytest.mark.parametrize("mode,rule,proposer", [
    # DDTree with the fixture draft: its trees sample by matching like the proposer's ("wrong")
    ("ar", None, None), ("chain", "rejection", None),
    ("chain", "rejection", "wrong"), ("chain", "match", "wrong"),
    ("ddtree", None, "wrong")])
def test_sampled_sequences_match_autoregressive(exact_joint, sampled_runs, mode, rule, proposer):
  assert _chi_square_p(sampled_runs(mode, rule, proposer), exact_joint[1]) > 1e-4


def test_seeded_draws_are_the_same_in_every_matching_mode(sampled_runs):
  """The target's token at a position is drawn with a key fixed by the row's seed and that
  position (decode.accept), so AR, a chain under the match rule and DDTree (both with the
  adversarial proposer, whose drafts are accepted whenever the target draws its second choice)
  give each seed the same tokens, run for run; the rejection rule draws differently (a
  different, equally exact sample)."""
  ar = sampled_runs("ar", None, None)
  for key in (("chain", "match", "wrong"), ("ddtree", None, "wrong")):
    np.testing.assert_array_equal(sampled_runs(*key), ar, err_msg=str(key))
  assert (sampled_runs("chain", "rejection", "wrong") != ar).any()


def test_sampled_table_mix_matches_autoregressive(qwen_f32, qwen_draft, exact_joint):
  """Draft rows mixed with an adversarial n-gram table (`DecodeConfig.table_mix`: after every
  token the table's next token is the target's second choice, share 1, weight 4, so the mixed
  chain is mostly that token): the sampled sequences still follow the exact autoregressive
  distribution (the rejection rule draws from and verifies against the mixed rows). A sampled
  DDTree verifies by matching the target's own draws, whatever the rows (its mixed greedy run:
  test_ngram.test_table_modes_lossless)."""
  from dflash_jax import ngram
  prompt, joint, tables = exact_joint
  V = qwen_f32.config.n_vocab
  second = np.asarray(tables["second"])
  table = ngram.build([(np.asarray([a, second[a]]), 1) for a in range(V)], V, n_min=1, n_max=1,
                      min_count=1)
  dec = dj.api.resolve_config(qwen_draft, dj.DecodeConfig(
      mode="chain", chain_rule="rejection", lookup_table="in-memory", table_mix=4.0, **SMALL_CTX))
  samples = _sample_many(qwen_f32, qwen_draft, prompt, dec, CFG, N_SAMPLES, table=table)
  assert _chi_square_p(samples, joint) > 1e-4


# Sampling over a quantized KV cache: with invariant_rows a chain row's logits are the bits an
# autoregressive step computes (tests/test_invariant.py, bitwise and exact tokens), so its sampled
# rule is the float32 rule above over those logits. (A two-sample test of chain vs AR sampling
# over a q4_0 cache, 400 runs a side, was dropped from CI: 5 minutes for an omnibus test that
# caught only gross differences.)


def test_chi_square_catches_a_wrong_rule(qwen_f32, exact_joint, monkeypatch):
  """The classic bug (after a rejection, draw from p instead of normalize(max(p - q, 0))) with a
  proposer that is confidently the target's second choice must fail the same check."""
  prompt, joint, tables = exact_joint
  jax.clear_caches()   # the jitted decode functions must retrace with the patched rule
  monkeypatch.setattr(sampling, "residual", lambda p, q: jnp.log(p))
  dec = dj.api.resolve_config(None, dj.DecodeConfig(mode="chain", block_size=4, **SMALL_CTX),
                              has_proposer=True)
  samples = _sample_many(qwen_f32, None, prompt, dec, CFG, N_SAMPLES,
                         _proposer("wrong", qwen_f32.config.n_vocab), tables)
  jax.clear_caches()
  assert _chi_square_p(samples, joint) < 1e-6


def test_sampling_settings_do_not_recompile(qwen_f32, qwen_draft, draft_ref):
  p = draft_ref["prompt_ids"]
  dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=8, max_ctx=256, temperature=0.7, seed=1,
              mode="chain")
  before = (decode.prefill_chunk._cache_size(), decode.decode_loop._cache_size())
  for t, k, tp, mp, seed in [(1.0, 0, 0.9, 0.0, 2), (0.3, 5, 1.0, 0.1, 3)]:
    dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=8, max_ctx=256, temperature=t, top_k=k,
                top_p=tp, min_p=mp, seed=seed, mode="chain")
  assert (decode.prefill_chunk._cache_size(), decode.decode_loop._cache_size()) == before


def test_same_seed_same_output_and_bad_settings(qwen_f32, qwen_draft, draft_ref):
  p = draft_ref["prompt_ids"]
  a = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=12, max_ctx=256, temperature=0.9, seed=5,
                  mode="chain")
  b = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=12, max_ctx=256, temperature=0.9, seed=5,
                  mode="chain")
  assert a.tokens == b.tokens and a.sampling.seed == 5
  for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(min_p=1.5),
              dict(temperature=float("nan"))):
    with pytest.raises(ValueError, match="SamplingConfig"):
      dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=4, max_ctx=256, **bad)
  with pytest.raises(ValueError, match="chain_rule"):
    dj.DecodeConfig(chain_rule="typical")


def test_gguf_recommended_sampling_and_flag_defaults():
  from absl import flags
  from dflash_jax import api, decode_flags
  assert api._recommended_sampling({"general.name": "x"}, "m.gguf") is None
  rec = api._recommended_sampling({"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                   "general.sampling.top_p": 0.95}, "m.gguf")
  assert rec == SamplingConfig(temperature=0.6, top_k=20, top_p=0.95)
  with pytest.raises(ValueError, match="m.gguf: bad recommended sampling"):
    api._recommended_sampling({"general.sampling.top_p": 2.0}, "m.gguf")
  fv = flags.FlagValues()
  holders = decode_flags.define(fv)
  fv(["prog"])
  assert decode_flags.sampling(holders, rec) == rec            # unset flags: the GGUF's values
  assert decode_flags.sampling(holders, None).greedy           # no recommendation: greedy
  fv(["prog", "--temperature=0", "--top_k=5"])
  got = decode_flags.sampling(holders, rec)
  assert got.greedy and got.top_k == 5 and got.top_p == 0.95   # a given flag wins
  fv(["prog", "--min_p=3"])
  with pytest.raises(ValueError, match="--min_p=3.0"):
    decode_flags.sampling(holders, rec)


# --- logit_bias and penalties (sampling.apply_rules) ------------------------------------------


def ref_rules(logits, bias, repeat, presence, frequency, history):
  """float64 numpy reference of llama.cpp's logit_bias then penalties
  (llama_sampler_penalties_apply) for one position: `history` the tokens in the window."""
  x = np.asarray(logits, np.float64).copy()
  for t, b in bias:
    x[t] += b
  counts = {}
  for t in history:
    counts[t] = counts.get(t, 0) + 1
  for t, c in counts.items():
    x[t] = x[t] * repeat if x[t] <= 0 else x[t] / repeat
    x[t] -= c * frequency + presence
  return x


def test_apply_rules_match_numpy_reference():
  """Random trees (each node's window: the committed tokens in (end - last_n, end] and its own
  path) against `ref_rules` per node; max error relative to max(1, |logit|) <= 1e-6."""
  from dflash_jax import tree as tree_lib
  rng = np.random.default_rng(0)
  v, w = 40, sampling.PENALTY_WINDOW
  for trial in range(6):
    n = 7
    parents = np.array([-1, 0, 0, 1, 1, 2, 4])
    depths = np.array([0, 1, 1, 2, 2, 2, 3])
    tokens = rng.integers(0, 8, n).astype(np.int32)       # a small range: repeats are common
    pos = 30 if trial % 2 else 300                          # short and long committed histories
    recent_pos = np.arange(pos - w, pos)
    recent = np.where(recent_pos >= 0, rng.integers(0, 8, w), 0).astype(np.int32)
    last_n = [1, 5, 16, 64, 256, 0][trial]
    bias = ((3, -100.0), (5, 2.5)) if trial < 4 else ()
    cfg = SamplingConfig(logit_bias=bias, repeat_penalty=1.3, presence_penalty=0.7,
                         frequency_penalty=0.2 * trial, penalty_last_n=last_n)
    logits = rng.normal(size=(n, v)).astype(np.float32) * 3
    anc = np.asarray(tree_lib.ancestor_matrix(jnp.asarray(parents, jnp.int32), 3))
    node_pos = pos + depths
    got = np.asarray(sampling.apply_rules(
        jnp.asarray(logits), cfg.params(), jnp.asarray(recent), jnp.asarray(recent_pos, jnp.int32),
        jnp.asarray(tokens), jnp.asarray(node_pos, jnp.int32), jnp.asarray(anc),
        jnp.asarray(node_pos, jnp.int32)))
    for i in range(n):
      end = node_pos[i]
      seq = [(int(t), int(p)) for t, p in zip(recent, recent_pos) if p >= 0] + \
            [(int(tokens[j]), int(node_pos[j])) for j in range(n) if anc[i, j]]
      hist = [t for t, p in seq if end - last_n < p <= end]
      want = ref_rules(logits[i], bias, 1.3, 0.7, 0.2 * trial, hist)
      assert np.max(np.abs(got[i] - want) / np.maximum(1.0, np.abs(want))) <= 1e-6, (trial, i)


def test_rules_are_lossless_and_match_reference(qwen_f32, qwen_draft, draft_ref):
  """Greedy decoding under logit_bias and penalties: AR equals the float64 reference loop
  (forward_logits of each prefix, ref_rules over its last penalty_last_n tokens, argmax), and
  chain / DDTree (each node verified under its own path's penalties) equal AR token for token.
  The rules are live: the output differs from plain greedy decoding's."""
  p = [int(x) for x in draft_ref["prompt_ids"]]
  plain = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=16, mode="ar", max_ctx=256).tokens
  cfg = SamplingConfig(logit_bias=((plain[0], -100.0), (plain[3], 1.5)), repeat_penalty=1.5,
                       presence_penalty=0.8, frequency_penalty=0.6, penalty_last_n=12)
  ar = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=16, mode="ar", max_ctx=256,
                   sampling=cfg, eog_ids=()).tokens
  assert ar != plain and ar[0] != plain[0]
  seq = list(p)
  for t in ar:
    lg = np.asarray(dj.forward_logits(qwen_f32, seq))[-1]
    x = ref_rules(lg, cfg.logit_bias, 1.5, 0.8, 0.6, seq[-12:])
    assert int(np.argmax(x)) == t
    seq.append(t)
  for mode in ("chain", "ddtree"):
    r = dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=16, mode=mode, max_ctx=256,
                    budget=8, sampling=cfg, eog_ids=())
    assert r.tokens == ar, mode
  # Drafts that are always right (an oracle of the AR output under the rules): whole blocks are
  # accepted, so a node deep in a block must count its own path's tokens (fails when a node
  # sees only the committed tokens and itself).
  from test_draft_and_decode import _oracle_run
  strong = dataclasses.replace(cfg, presence_penalty=2.0, frequency_penalty=2.0,
                               repeat_penalty=2.0)
  truth = dj.generate(qwen_f32, None, p, max_new_tokens=40, mode="ar", max_ctx=256,
                      sampling=strong, eog_ids=()).tokens
  for mode in ("chain", "ddtree"):
    r = _oracle_run(qwen_f32, p, np.asarray(truth), [99], 256, block_size=8, mode=mode,
                    second=mode == "ddtree", budget=8, sampling=strong)
    assert r.tokens == truth and max(r.accept_lens) == 8, mode
  with pytest.raises(ValueError, match="logit_bias"):
    dj.generate(qwen_f32, qwen_draft, p, max_new_tokens=2, max_ctx=256,
                logit_bias=((qwen_f32.config.n_vocab, 1.0),))
  for bad in (dict(presence_penalty=3.0), dict(repeat_penalty=0.0), dict(penalty_last_n=300),
              dict(logit_bias=((1, 101.0),)), dict(logit_bias=((1, 1.0), (1, 2.0)))):
    with pytest.raises(ValueError, match="SamplingConfig"):
      SamplingConfig(**bad)
