"""Generate draft-training data with the target itself, batched, as token-id shards (resumable).

  python scripts/gen_data.py --data_dir data/smollm2-135m-instruct --temperature 0 --minutes 60
  python scripts/gen_data.py --data_dir data/smollm2-135m-instruct --temperature 0.8 --seed 1
  python scripts/gen_data.py --export_prompts /tmp/p.npz --start_prompt 5571  # for another machine
  python scripts/gen_data.py --data_dir D --prompts_file /tmp/p.npz --batch_size 256 ...
  python scripts/gen_data.py --data_dir data/smollm2-135m-instruct --self_queries 4096 --minutes 100

The prompt corpus (dflash_jax.train.corpus: standard-library and installed-package functions to
complete, chat about Python topics and functions, general-assistant templates; never HumanEval
or the benchmark chat prompts) is built in a fixed order from --corpus_seed; the target answers
it through the batched autoregressive loop (B = --batch_size rows at once), greedy or sampled,
each response up to --max_new_tokens (repetition loops kept: that is the target's behaviour),
and every --shard_prompts answers become one compressed shard listed in data_dir/manifest.json
with how it was made (command, seed, temperature, target sha256, tokens, minutes). A rerun with
the same --temperature / --seed continues after the last prompt answered. With --self_queries N
the prompts are instead user queries the target writes itself (dflash_jax.train.self_queries),
sampled once into a hashed prompt file in the data directory and answered like corpus prompts.
"""

import os
import sys
import time

from absl import app, flags, logging

from dflash_jax import target_flags

_TF = target_flags.define()
flags.adopt_module_key_flags(target_flags)
_DATA = flags.DEFINE_string("data_dir", None, "Shard directory (created; resumed).")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy; > 0 samples (with --top_p).")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Top-p of sampled responses.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (row of corpus index i uses seed + i).")
_CORPUS_SEED = flags.DEFINE_integer("corpus_seed", 0, "Corpus order.")
_N_GENERAL = flags.DEFINE_integer("n_general", 12000, "General-assistant chat prompts.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Rows decoded together.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 512, "Response tokens at most.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt", 256, "Skip prompts longer than this (tokens).")
_MAX_CTX = flags.DEFINE_integer("max_ctx", 800, "Context capacity (prompt + response).")
_SHARD = flags.DEFINE_integer("shard_prompts", 256, "Prompts per shard.")
_MINUTES = flags.DEFINE_float("minutes", None, "Stop starting new shards after this long.")
_MAX_TOKENS = flags.DEFINE_integer("max_response_tokens", None, "Stop once the directory holds "
                                   "this many response tokens.")
_PROMPTS_FILE = flags.DEFINE_string(
    "prompts_file", None, "Answer the encoded prompts in this file (written by --export_prompts) "
    "in place of building the corpus here: the corpus is built from the installed standard "
    "library and packages, so another machine (e.g. a GPU machine) answers the same prompts only "
    "through such a file.")
_EXPORT = flags.DEFINE_string("export_prompts", None, "Write the encoded corpus prompts from "
                              "--start_prompt on (at most --export_count) to this file and exit.")
_EXPORT_N = flags.DEFINE_integer("export_count", 20000, "Prompts written by --export_prompts.")
_START = flags.DEFINE_integer("start_prompt", 0, "Skip corpus prompts before this index (e.g. "
                              "sampled runs over another part of the corpus).")
_SELF_Q = flags.DEFINE_integer(
    "self_queries", 0, "Answer N user queries written by the target itself (Magpie, "
    "dflash_jax.train.self_queries: sampled from its chat template up to a user turn's text, "
    "decontaminated against HumanEval and the benchmark chat prompts) in place of the corpus. "
    "They are sampled once into --queries_file and read from it on a resumed run.")
_Q_FILE = flags.DEFINE_string("queries_file", None, "Prompt file of the self-written queries "
                              "(default: DATA_DIR/self_queries_seed{--query_seed}_n{N}.npz).")
_Q_SEED = flags.DEFINE_integer(
    "query_seed", 0, "First query number: queries --query_seed .. + N - 1 are sampled (query j "
    "draws with seed j and is corpus index SELF_QUERY_BASE + j), so a further set takes a seed "
    ">= an earlier file's seed + N (an overlapping range is refused).")
_Q_TEMP = flags.DEFINE_float("query_temperature", 1.0, "Temperature of the query sampling.")
_Q_TOKENS = flags.DEFINE_integer("query_tokens", 96, "Tokens per query at most (a query not "
                                 "ended by then is dropped).")
_Q_OPENERS = flags.DEFINE_list("query_openers", None, "Query openers, cycled (default "
                               "self_queries.DEFAULT_OPENERS; use '' for a free query).")


def _read_prompt_file(flag, path, target, meta):
  """`datagen.load_prompts` of `path` (the value of --flag), refused with a UsageError naming
  the flag when the file was made for another target than meta's."""
  from dflash_jax.train import datagen
  try:
    return datagen.load_prompts(path, target.config.n_vocab, meta["target_sha256"])
  except ValueError as e:
    raise app.UsageError(f"--{flag}={path}: {e}") from None


def _self_query_prompts(target, meta):
  """The self-written query prompts: read from --queries_file when it exists (checked against
  the target), else sampled, cleaned and written there. Updates meta with how they were made."""
  from dflash_jax.train import datagen, shards, self_queries as sq
  n = _SELF_Q.value
  if not _DATA.value and not _Q_FILE.value:
    raise app.UsageError("--self_queries needs --data_dir or --queries_file")
  path = _Q_FILE.value or os.path.join(_DATA.value, f"self_queries_seed{_Q_SEED.value}_n{n}.npz")
  if os.path.exists(path):
    prompts, _ = _read_prompt_file("queries_file", path, target, meta)
    logging.info("%s: %d self-written queries", path, len(prompts))
  else:
    try:
      earlier = sq.earlier_queries(os.path.dirname(os.path.abspath(path)), path, _Q_SEED.value,
                                   n, target.config.n_vocab, meta["target_sha256"])
    except ValueError as e:
      raise app.UsageError(f"--self_queries={n} --query_seed={_Q_SEED.value}: {e}") from None
    openers = sq.DEFAULT_OPENERS if _Q_OPENERS.value is None else tuple(_Q_OPENERS.value)
    t0 = time.time()
    seed = _Q_SEED.value
    texts = sq.sample_queries(target, n, seed=seed, temperature=_Q_TEMP.value,
                              openers=openers, max_query_tokens=_Q_TOKENS.value,
                              batch_size=_BATCH.value)
    keep = sq.clean_queries(texts, sq.eval_texts())
    kept = [texts[i] for i in keep]
    prompts = sq.query_prompts(target, kept, _MAX_PROMPT.value, indices=[seed + i for i in keep])
    fresh = [p for p in prompts if tuple(p[1]) not in earlier]
    qmeta = dict(meta, self_queries=n, query_seed=seed,
                 query_temperature=_Q_TEMP.value, query_tokens=_Q_TOKENS.value,
                 query_openers=list(openers), sampled=n,
                 unfinished=sum(t is None for t in texts),
                 in_earlier_files=len(prompts) - len(fresh), kept=len(fresh),
                 query_minutes=round((time.time() - t0) / 60, 2), max_prompt=_MAX_PROMPT.value)
    prompts = fresh
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    datagen.save_prompts(path, prompts, qmeta)
    logging.info("%s: %d of %d sampled queries kept (%d unfinished) in %.1f min", path,
                 len(prompts), n, qmeta["unfinished"], qmeta["query_minutes"])
  meta.update(queries_file=os.path.basename(path), prompts_sha256=shards.sha256_file(path))
  return [p for p in prompts if len(p[1]) <= _MAX_PROMPT.value]


def main(argv):
  del argv
  import jax
  from dflash_jax import cli, train
  from dflash_jax.train import datagen, shards
  if _MAX_CTX.value < _MAX_PROMPT.value + _MAX_NEW.value:
    raise app.UsageError(f"--max_ctx={_MAX_CTX.value} < --max_prompt + --max_new_tokens = "
                         f"{_MAX_PROMPT.value + _MAX_NEW.value}")
  deadline = time.time() + 60 * _MINUTES.value if _MINUTES.value else None
  target = target_flags.load(_TF)
  meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
          "target": os.path.basename(target.path),
          "target_sha256": shards.sha256_file(target.path),
          "corpus_seed": _CORPUS_SEED.value, "n_general": _N_GENERAL.value,
          "device": f"{jax.devices()[0].device_kind} (JAX {jax.__version__})"}
  if _SELF_Q.value:
    if _PROMPTS_FILE.value:
      raise app.UsageError("--self_queries and --prompts_file are two prompt sources: give one")
    prompts = _self_query_prompts(target, meta)
  elif _PROMPTS_FILE.value:
    prompts, pmeta = _read_prompt_file("prompts_file", _PROMPTS_FILE.value, target, meta)
    prompts = [p for p in prompts if p[0] >= _START.value and len(p[1]) <= _MAX_PROMPT.value]
    meta.update(corpus_seed=pmeta["corpus_seed"], n_general=pmeta["n_general"],
                prompts_file=os.path.basename(_PROMPTS_FILE.value),
                prompts_sha256=shards.sha256_file(_PROMPTS_FILE.value))
    logging.info("%s: %d prompts", _PROMPTS_FILE.value, len(prompts))
  else:
    words = train.topic_words(target.tokenizer.tokens)
    corpus = train.build_corpus(n_code=1900, n_chat=100_000, n_general=_N_GENERAL.value,
                                words=words, n_package_code=100_000, seed=_CORPUS_SEED.value)
    prompts = [p for p in datagen.encode_corpus(target, corpus, _MAX_PROMPT.value,
                                                exclude=cli.CHAT_PROMPTS)
               if p[0] >= _START.value]
    logging.info("corpus: %d prompts (%d within %d tokens)", len(corpus), len(prompts),
                 _MAX_PROMPT.value)
  if _EXPORT.value:
    digest = datagen.save_prompts(_EXPORT.value, prompts[:_EXPORT_N.value],
                                  dict(meta, max_prompt=_MAX_PROMPT.value))
    print(f"{_EXPORT.value}: {min(len(prompts), _EXPORT_N.value)} prompts from corpus index "
          f"{prompts[0][0] if prompts else None}, sha256 {digest}")
    return
  if not _DATA.value:
    raise app.UsageError("--data_dir is required (unless --export_prompts)")
  s = datagen.generate_shards(target, prompts, _DATA.value, max_new_tokens=_MAX_NEW.value,
                              temperature=_TEMP.value, seed=_SEED.value, batch_size=_BATCH.value,
                              max_ctx=_MAX_CTX.value, shard_prompts=_SHARD.value, meta=meta,
                              top_p=_TOP_P.value, deadline=deadline,
                              max_response_tokens=_MAX_TOKENS.value, log=logging.info)
  print(s)


if __name__ == "__main__":
  app.run(main)
