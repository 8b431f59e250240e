"""Constrained decoding (grammar.py): the token-class automaton against outlines-core's own index
(the independent reference), the device tables against the host automaton, per-node path states
against a Python walk of random trees, and losslessness: constrained chain / DDTree output equals
constrained autoregressive output token for token (SmolLM2 with its draft; the tiny hybrid Qwen3.5
with its tiny draft), sampled output stays inside the language, and an unconstrained row decodes
the same beside a constrained one."""

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

import dflash_jax as dj
from dflash_jax import api, cli, grammar

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "pet": {"enum": ["cat", "dog", "none"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol_grammar(smol):
  return api.grammar_compiler(smol).compile(grammar.json_schema_regex(SCHEMA))


@pytest.fixture(scope="module")
def smol_draft(smol):
  return dj.load_draft(cli.find_draft_dir(smol), smol)


def test_token_classes_equal_outlines_index(smol, smol_grammar):
  """Every state's allowed tokens and next states, as the class tables give them, equal
  outlines-core's index over the same vocabulary (end-of-generation: only in final states)."""
  from outlines_core import Index
  g = smol_grammar
  comp = api.grammar_compiler(smol)
  index = Index(g.regex, comp._vocab)
  trans = index.get_transitions()
  states = sorted(set(trans) | set(index.get_final_states()))
  assert len(states) == g.n_states
  eos = comp.eog_ids[0]
  for k, s in enumerate(states):
    d = {t: states.index(n) for t, n in trans.get(s, {}).items() if t != eos}
    allowed = g.allowed(k)
    want = np.zeros_like(allowed)
    want[list(d)] = True
    want[list(comp.eog_ids)] = s in index.get_final_states()
    np.testing.assert_array_equal(allowed, want)
    for t, n in list(d.items())[:200]:
      assert g.advance(k, t) == n
  assert not g.allowed(g.initial)[sorted(smol.tokenizer.control_ids)].any()


def test_device_tables_match_host(smol, smol_grammar):
  """Two grammars side by side in one bank: jax `allowed` / `advance` equal each host automaton."""
  other = api.grammar_compiler(smol).compile(r"(yes|no)\.")
  bank = grammar.GrammarBank(smol.config.n_vocab, max_states=512, max_classes=256, max_grammars=4)
  s0 = bank.place(0, smol_grammar)
  s1 = bank.place(1, other)
  assert bank.place(2, other) == s1                       # shared, not placed twice
  t = bank.tables()
  rng = np.random.default_rng(0)
  for g, base in ((smol_grammar, s0 - smol_grammar.initial), (other, s1 - other.initial)):
    st = rng.integers(0, g.n_states, 16)
    got = np.asarray(grammar.allowed(t, jnp.asarray(st + base, jnp.int32)))
    np.testing.assert_array_equal(got, np.stack([g.allowed(int(s)) for s in st]))
    toks = np.asarray([rng.choice(np.flatnonzero(g.allowed(int(s)))) for s in st])
    nxt = np.asarray(grammar.advance(t, jnp.asarray(st + base, jnp.int32), jnp.asarray(toks)))
    np.testing.assert_array_equal(nxt, [g.advance(int(s), int(x)) + base for s, x in zip(st, toks)])
  # no grammar: every token allowed, the state stays -1
  assert bool(grammar.allowed(t, jnp.asarray([-1]))[0].all())
  assert int(grammar.advance(t, jnp.int32(-1), jnp.int32(5))) == -1
  bank.release(0)
  assert bank.place(3, smol_grammar) is not None


def test_node_states_follow_each_path(smol, smol_grammar):
  """node_states on random trees (parents before children, tokens allowed or not) equals a
  Python walk of each node's own path; a refused token kills the node and its subtree."""
  g = smol_grammar
  bank = grammar.GrammarBank(smol.config.n_vocab, max_states=256, max_classes=256, max_grammars=2)
  base = bank.place(0, g) - g.initial
  t = bank.tables()
  rng = np.random.default_rng(1)
  for trial in range(6):
    n = 23
    parents = np.full(n, -1)
    depths = np.zeros(n, int)
    tokens = np.zeros(n, int)
    root = int(rng.integers(0, g.n_states))
    state = {0: root}
    for i in range(1, n):
      p = int(rng.integers(0, i))
      parents[i], depths[i] = p, depths[p] + 1
      ps = state[p]
      ok = np.flatnonzero(g.allowed(ps)) if ps >= 0 else np.arange(10)
      tokens[i] = rng.choice(ok) if (ps >= 0 and rng.random() < 0.85) else rng.integers(0, 49152)
      state[i] = g.advance(ps, int(tokens[i])) if ps >= 0 else -1
      state[i] = state[i] if state[i] >= 0 else -1
    got = np.asarray(grammar.node_states(
        t, jnp.int32(root + base), jnp.asarray(parents, jnp.int32), jnp.asarray(depths, jnp.int32),
        jnp.asarray(tokens, jnp.int32), int(depths.max())))
    want = np.asarray([state[i] + base if state[i] >= 0 else grammar.DEAD for i in range(n)])
    np.testing.assert_array_equal(got, want)


def _check_output(g, tokens, eog, schema=None):
  """The tokens are a prefix the automaton accepts; a finished output parses and validates."""
  s = g.initial
  for x in tokens:
    s = g.advance(s, x)
    assert s >= 0, "a token outside the grammar"
  if tokens and tokens[-1] in eog:
    assert g.final[s]


@pytest.mark.slow
def test_constrained_speculative_equals_constrained_ar(smol, smol_draft, smol_grammar):
  ids = cli.build_prompt(smol, "Tell me about a person: their name, age and pet.", chat=True)
  eog = set(smol.tokenizer.eog_ids)
  outs = {}
  for mode in ("ar", "chain", "ddtree"):
    r = dj.generate(smol, smol_draft, ids, max_new_tokens=48, mode=mode, grammar=smol_grammar,
                    max_ctx=192)
    outs[mode] = r
  assert outs["chain"].tokens == outs["ar"].tokens
  assert outs["ddtree"].tokens == outs["ar"].tokens
  toks = outs["ar"].tokens
  _check_output(smol_grammar, toks, eog)
  assert toks[-1] in eog, smol.tokenizer.decode(toks)
  jsonschema.validate(json.loads(smol.tokenizer.decode(toks)), SCHEMA)
  # the grammar changed the answer (the unconstrained model answers in prose), and the draft
  # still helps under it
  free = dj.generate(smol, smol_draft, ids, max_new_tokens=8, mode="ar", max_ctx=192)
  assert free.tokens[:8] != toks[:8]
  assert outs["chain"].mean_accept_len > 1.0


@pytest.mark.slow
def test_constrained_sampling_and_mixed_batch(smol, smol_draft, smol_grammar):
  """A sampled chain's (rejection rule) output stays inside the language (DDTree's masked tree:
  test_constrained_speculative_equals_constrained_ar); in a batch, an unconstrained row decodes
  exactly as it does alone."""
  ids = cli.build_prompt(smol, "Describe someone as JSON.", chat=True)
  eog = set(smol.tokenizer.eog_ids)
  r = dj.generate(smol, smol_draft, ids, max_new_tokens=32, mode="chain", grammar=smol_grammar,
                  max_ctx=160, temperature=1.0, seed=1)
  _check_output(smol_grammar, r.tokens, eog)
  plain = cli.build_prompt(smol, "Name a colour.", chat=True)
  alone = dj.generate(smol, smol_draft, plain, max_new_tokens=16, mode="chain", max_ctx=160)
  both = dj.generate_batch(smol, smol_draft, [ids, plain], max_new_tokens=16, mode="chain",
                           max_ctx=160, grammar=[smol_grammar, None], batch_size=2)
  assert both[1].tokens == alone.tokens
  _check_output(smol_grammar, both[0].tokens, eog)


def test_constrained_hybrid_target(qwen_f32, qwen_draft):
  """The tiny Qwen3.5 hybrid (Gated DeltaNet rollback) under a grammar: chain and DDTree equal
  AR, and the output is in the language."""
  # the tiny GGUF names no end-of-generation token: use id 0
  comp = grammar.GrammarCompiler(qwen_f32.tokenizer, [0], qwen_f32.config.n_vocab)
  g = comp.compile(grammar.json_schema_regex({"type": "object", "properties": {
      "k": {"enum": ["aa", "bb", "ab"]}, "v": {"type": "integer"}}, "required": ["k", "v"]}))
  ids = list(range(3, 27))
  outs = [dj.generate(qwen_f32, qwen_draft, ids, max_new_tokens=24, mode=m, grammar=g,
                      max_ctx=64, prefill_chunk=32, eog_ids=[0]).tokens
          for m in ("ar", "chain", "ddtree")]
  assert outs[1] == outs[0] and outs[2] == outs[0]
  _check_output(g, outs[0], {0})
  assert len(outs[0]) > 3


def test_grammar_errors(smol):
  with pytest.raises(ValueError, match="response_format"):
    grammar.json_schema_regex({"type": "nonsense"})
  comp = api.grammar_compiler(smol)
  g = comp.compile(r"(a|b)+")
  bank = grammar.GrammarBank(smol.config.n_vocab, max_states=1, max_classes=2)
  with pytest.raises(ValueError, match="capacity"):
    bank.check(g, param="tools")
  assert comp.compile(r"(a|b)+") is g                     # cached


@pytest.mark.parametrize("pattern,good,bad", [
    ("^a+$", "aaa", "ab"), ("(a+)+$", "aaa", "ab"), ("^(a+)+", "aa", "ba"), ("a+", "a", "b"),
    (r"cost\$", "cost$", "cost"), (r"^[$^]x$", "$x", "x"), (r"^(?<n>ab)+$", "abab", "aba")])
def test_schema_patterns_match_the_whole_string_with_optional_anchors(smol, pattern, good, bad):
  """A JSON-Schema `pattern` is a whole-string match whose leading `^` and trailing `$` are
  optional (so `(a+)+$` works as `^a+$` does), an escaped `\\$` stays a character: the grammar
  accepts `good` and refuses `bad` as the property's value."""
  schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}},
            "required": ["s"], "additionalProperties": False}
  g = api.grammar_compiler(smol).compile(grammar.json_schema_regex(schema))
  tok = smol.tokenizer
  assert g.accepts(tok.encode(json.dumps({"s": good}), add_bos=False)), good
  assert not g.accepts(tok.encode(json.dumps({"s": bad}), add_bos=False)), bad


@pytest.mark.parametrize("pattern,reason", [
    ("(?=a)b", "look-around"), ("(?<!a)b", "look-around"), (r"(a)\1", "back-reference"),
    (r"\bword", "word boundary"), ("a$b", "anchor '\\$' inside"), ("a^b", "anchor '\\^' inside")])
def test_inexpressible_patterns_are_refused_with_the_reason(pattern, reason):
  schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
  with pytest.raises(ValueError, match=reason) as e:
    grammar.json_schema_regex(schema, param="response_format.json_schema.schema")
  assert "response_format.json_schema.schema.properties.s.pattern" in str(e.value)
