"""KV cache formats and long context (--kv_dtype): quality, memory and decode-step cost, side by
side in one run. Prints JSON and tables.

  * quality: SmolLM2 (or --target) teacher-forced over a long real text (Python standard-library
    sources and docs concatenated, --text_tokens tokens), prefilled chunk by chunk into a cache of
    each format: KL divergence of the next-token distribution vs the float32 cache (mean and
    99th percentile, nats, as llama.cpp's `perplexity --kl-divergence`), top-1 agreement with the
    float32 cache, and perplexity of the text.
  * memory: bytes per token of context (target KV + the draft's context up to its window) per
    format from `api.state_bytes`, and the largest max_ctx whose decode state fits beside the
    weights in 24 GB / 80 GB, for the loaded target and for Qwen3.5-27B's shapes (16 attention
    layers x 4 KV heads x 256 dims; weights 26.9 B params at 4.89 bits (Q4_K_M); the 5-layer
    bf16 z-lab draft).
  * prefill: a --prefill_tokens prompt (the same text) prefilled chunk by chunk (generate with one
    new token): seconds, tokens/s and the process's peak resident memory.
  * window: chain and DDTree acceptance length with the shipped draft continuing a
    --window_prompt_tokens prompt, per --draft_window (0 = the draft sees every position) and
    --window_positions (absolute or window-relative RoPE positions), and whether every variant
    produced the same tokens (it must: the window only changes proposals).
  * step: the target's verify forward (AR: 1 token; chain: 16) at --step_contexts live tokens
    vs the first, per format (attention reads the live rows only, chunk by chunk).

  python scripts/bench_kv.py --json_out bench_out/kv_cpu/kv.json
"""

import glob
import json
import os
import statistics
import sys
import sysconfig
import time

from absl import app, flags

from dflash_jax import target_flags

_TF = target_flags.define()
flags.adopt_module_key_flags(target_flags)
_PARTS = flags.DEFINE_list("parts", ["quality", "memory", "prefill", "window", "step"],
                           "What to measure.")
_FORMATS = flags.DEFINE_list("formats", ["float32", "bfloat16", "float16", "q8_0", "q4_0"],
                             "KV formats (--kv_dtype values) to compare; the quality part's "
                             "KL divergence and top-1 agreement are against the first.")
_TEXT_TOKENS = flags.DEFINE_integer("text_tokens", 8192, "Tokens of the quality text.")
_CHUNK = flags.DEFINE_integer("chunk", 512, "Prefill chunk of the quality run.")
_STEP_CTX = flags.DEFINE_list("step_contexts", ["1024", "16384", "65536"],
                              "Live tokens at which the verify step is timed.")
_STEP_T = flags.DEFINE_list("step_tokens", ["1", "16"], "Tokens per timed verify (1 = AR).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (median).")
_PREFILL_TOKENS = flags.DEFINE_integer("prefill_tokens", 32768, "Prompt length of the long "
                                       "prefill part.")
_PREFILL_FORMATS = flags.DEFINE_list("prefill_formats", ["float32", "q4_0"],
                                     "KV formats of the long prefill part.")
_WINDOWS = flags.DEFINE_list("windows", ["0", "4096", "1024", "256"],
                             "Draft windows of the window part (0 = every position).")
_WINDOW_PROMPT = flags.DEFINE_integer("window_prompt_tokens", 6144, "Prompt length of the window "
                                      "part (the same text: code to continue).")
_WINDOW_MODES = flags.DEFINE_list("window_modes", ["chain", "ddtree"], "Modes of the window part.")
_WINDOW_POSITIONS = flags.DEFINE_list("window_positions", ["absolute"], "Window part: the draft's "
                                      "RoPE positions to compare (DecodeConfig.draft_positions: "
                                      "absolute, window).")
_JSON = flags.DEFINE_string("json_out", None, "Write the results here too.")

GIB = 2 ** 30


def _log(msg):
  print(msg, file=sys.stderr, flush=True)


def long_text(tokenizer, n_tokens: int) -> list[int]:
  """Token ids of standard-library sources and docs concatenated (sorted file order), first
  n_tokens. Raises ValueError when they hold fewer tokens."""
  lib = sysconfig.get_paths()["stdlib"]
  ids = []
  for path in sorted(glob.glob(os.path.join(lib, "json", "*.py")) +
                     glob.glob(os.path.join(lib, "textwrap.py")) +
                     glob.glob(os.path.join(lib, "argparse.py")) +
                     glob.glob(os.path.join(lib, "dataclasses.py")) +
                     glob.glob(os.path.join(lib, "typing.py")) +
                     glob.glob(os.path.join(lib, "inspect.py"))):
    with open(path, encoding="utf-8") as fh:
      ids += tokenizer.encode(fh.read())
    if len(ids) >= n_tokens:
      return ids[:n_tokens]
  raise ValueError(f"the text holds {len(ids)} tokens < --text_tokens={n_tokens}")


def quality(target, formats, n_tokens, chunk):
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from dflash_jax import target as target_lib
  from dflash_jax.runtime import Runtime

  ids = np.asarray(long_text(target.tokenizer, n_tokens + 1), np.int32)
  x, y = ids[:-1], ids[1:]
  cap = -(-n_tokens // chunk) * chunk

  @functools.partial(jax.jit, static_argnames=("rt",), donate_argnames=("cache",))
  def run(params, toks, start, cache, *, rt):
    pre = target_lib.prefill(params, target.config, toks, start, jnp.int32(toks.shape[0]), cache, rt)
    return jax.nn.log_softmax(target_lib.logits(params, target.config, pre.hidden, rt)), pre.cache

  caches = {f: target_lib.init_cache(target.config, cap, Runtime(kv_dtype=f)) for f in formats}
  kl = {f: [] for f in formats}
  top1 = {f: [] for f in formats}
  nll = {f: [] for f in formats}
  t0 = time.time()
  for c0 in range(0, n_tokens, chunk):
    toks = jnp.asarray(x[c0:c0 + chunk])
    if toks.shape[0] < chunk:
      toks = jnp.pad(toks, (0, chunk - toks.shape[0]))
    n = min(chunk, n_tokens - c0)
    ref = None
    for f in formats:
      lp, caches[f] = run(target.params, toks, jnp.int32(c0), caches[f], rt=Runtime(kv_dtype=f))
      lp = lp[:n]
      if ref is None:
        ref = lp
      kl[f].append(np.asarray(jnp.sum(jnp.exp(ref) * (ref - lp), -1), np.float64))
      top1[f].append(np.asarray(jnp.argmax(lp, -1) == jnp.argmax(ref, -1)))
      nll[f].append(-np.asarray(jnp.take_along_axis(lp, jnp.asarray(y[c0:c0 + n])[:, None], 1)[:, 0],
                                np.float64))
    _log(f"quality: {c0 + n}/{n_tokens} tokens ({time.time() - t0:.0f} s)")
  out = {}
  for f in formats:
    k, t1, l = np.concatenate(kl[f]), np.concatenate(top1[f]), np.concatenate(nll[f])
    out[f] = dict(kld_mean=float(k.mean()), kld_p99=float(np.percentile(k, 99)),
                  kld_max=float(k.max()), top1_agree=float(t1.mean()),
                  ppl=float(np.exp(l.mean())), tokens=int(k.size))
  return out


def _bytes_per_token(tcfg, dcfg, rt, dec_kw):
  """(bytes per context token, bytes at max_ctx 0) of the decode state, from two sizes."""
  from dflash_jax import api
  from dflash_jax.config import DecodeConfig
  small, big = (DecodeConfig(max_ctx=ctx, **dec_kw) for ctx in (8192, 16384))
  sizes = [api._state_bytes(tcfg, dcfg, dec, rt) for dec in (small, big)]
  per = (sizes[1] - sizes[0]) / (big.capacity - small.capacity)
  return per, sizes[0] - per * small.capacity


def qwen27b_configs():
  """TargetConfig / DraftConfig of Qwen3.5-27B's shapes (../shared notes: 64 layers, 16 gated
  attention, 24 / 4 heads x 256, GDN 16 / 48 heads x 128, conv 4; the z-lab draft: 5 layers,
  5120 hidden, 32 / 8 heads x 128, FFN 17408, block 16, 5 target layers)."""
  from dflash_jax.config import DraftConfig, TargetConfig
  n = 64
  t = TargetConfig(arch="qwen35", n_layer=n, d_model=5120, d_ff=17408, n_vocab=248320,
                   n_head=24, n_kv_head=4, head_dim=256, v_head_dim=256, rope_dim=64,
                   rope_theta=1e7, rope_style="neox", rms_eps=1e-6, qk_norm=True, attn_gate=True,
                   recurrent=tuple((i + 1) % 4 != 0 for i in range(n)), gdn_n_k_head=16,
                   gdn_n_v_head=48, gdn_d_k=128, gdn_d_v=128, conv_kernel=4)
  d = DraftConfig(n_layer=5, d_model=5120, d_ff=17408, n_head=32, n_kv_head=8, head_dim=128,
                  n_vocab=248320, block_size=16, mask_token_id=248070,
                  target_layer_ids=(1, 16, 31, 46, 61), rope_theta=1e7, rms_eps=1e-6,
                  sliding=(False,) * 5)
  return t, d


def memory(target, draft, formats):
  import jax

  from dflash_jax.runtime import Runtime
  t27, d27 = qwen27b_configs()
  w27 = 26.9e9 * 4.89 / 8
  d27_bytes = 1.73e9 * 2
  rows = []
  models = [("Qwen3.5-27B shapes (Q4_K_M)", t27, d27, w27 + d27_bytes)]
  if target is not None:
    own = target.gguf_tensor_bytes + (0 if draft is None else sum(
        x.nbytes for x in jax.tree.leaves(draft.params)))
    models.insert(0, (target.general_name or target.path, target.config,
                      None if draft is None else draft.config, own))
  for name, tcfg, dcfg, weights in models:
    for f in formats:
      dec_kw = dict(mode="chain" if dcfg is not None else "ar", block_size=16, prefill_chunk=512,
                    draft_window=4096)
      per, fixed = _bytes_per_token(tcfg, dcfg, Runtime(kv_dtype=f), dec_kw)
      fits = {f"max_ctx_{gb}GB": int(max(0, (gb * 1e9 - weights - fixed) // per))
              for gb in (24, 80)}
      rows.append(dict(model=name, format=f, bytes_per_token=per, fixed_state_bytes=fixed,
                       weight_bytes=weights, **fits))
  return rows


def step(target, formats, contexts, tokens, repeats):
  import functools

  import jax
  import jax.numpy as jnp

  from dflash_jax import target as target_lib
  from dflash_jax import tree as tree_lib
  from dflash_jax.runtime import Runtime

  @functools.partial(jax.jit, static_argnames=("rt", "n"))
  def verify(params, cache, start, *, rt, n):
    tree = tree_lib.path_tree(jnp.zeros((n,), jnp.int32))
    return target_lib.verify(params, target.config, tree, start, cache, rt).logits

  out = []
  for f in formats:
    rt = Runtime(kv_dtype=f)
    for n in tokens:
      base = None
      for ctx in contexts:
        cache = target_lib.init_cache(target.config, ctx + 64, rt)
        verify(target.params, cache, jnp.int32(ctx), rt=rt, n=n).block_until_ready()
        ts = []
        for _ in range(repeats):
          t0 = time.perf_counter()
          verify(target.params, cache, jnp.int32(ctx), rt=rt, n=n).block_until_ready()
          ts.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(ts)
        base = base or ms
        out.append(dict(format=f, tokens=n, live=ctx, ms=ms, vs_first=ms / base))
        _log(f"step {f} T={n} live={ctx}: {ms:.1f} ms ({ms / base:.2f}x)")
        del cache
  return out


def prefill(target, formats, n_tokens):
  import dataclasses
  import resource

  import dflash_jax as dj
  from dflash_jax.runtime import Runtime

  ids = long_text(target.tokenizer, n_tokens)
  out = []
  for f in formats:
    t = dataclasses.replace(target, runtime=Runtime(kv_dtype=f))
    t0 = time.time()
    r = dj.generate(t, None, ids, max_new_tokens=1, mode="ar", max_ctx=n_tokens + 64,
                    prefill_chunk=512)
    wall = time.time() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.append(dict(format=f, tokens=n_tokens, prefill_s=r.prefill_s, wall_s=wall,
                    prefill_tok_s=n_tokens / r.prefill_s, peak_rss_bytes=rss,
                    state_bytes=dj.api.state_bytes(t, None, dj.api.resolve_config(
                        None, mode="ar", max_ctx=n_tokens + 64, prefill_chunk=512))))
    _log(f"prefill {f}: {n_tokens} tokens in {r.prefill_s:.1f} s, peak RSS {rss / GIB:.2f} GiB")
  return out


def window(target, draft, windows, n_prompt, modes, positions=("absolute",), n_gen=128):
  import dflash_jax as dj
  ids = long_text(target.tokenizer, n_prompt)
  out, tokens = [], {}
  for mode in modes:
    for w in windows:
      for p in (positions if w else positions[:1]):   # no ring buffer: positions are absolute
        t0 = time.time()
        r = dj.generate(target, draft, ids, max_new_tokens=n_gen, mode=mode, eog_ids=(),
                        max_ctx=n_prompt + n_gen + 64, prefill_chunk=512, draft_window=w,
                        draft_positions=p)
        tokens[(mode, w, p)] = r.tokens
        acc = sum(r.accept_lens) / len(r.accept_lens)
        out.append(dict(mode=mode, draft_window=w, draft_positions=p, acceptance=acc,
                        decode_tok_s=r.decode_tok_s, prompt_tokens=n_prompt, n_gen=n_gen))
        _log(f"window {mode} {w} {p}: acceptance {acc:.3f} ({time.time() - t0:.0f} s)")
  same = len({tuple(t) for t in tokens.values()}) == 1
  return dict(rows=out, all_outputs_identical=same)


def main(argv):
  del argv
  import jax

  import dflash_jax as dj
  from dflash_jax import cli

  target = target_flags.load(_TF)
  draft_dir = cli.find_draft_dir(target)
  draft = dj.load_draft(draft_dir, target) if draft_dir else None
  formats = _FORMATS.value
  res = dict(target=target.path, device=str(jax.devices()[0]), formats=formats)
  if "memory" in _PARTS.value:
    res["memory"] = memory(target, draft, formats)
  if "quality" in _PARTS.value:
    res["quality"] = quality(target, formats, _TEXT_TOKENS.value, _CHUNK.value)
  if "prefill" in _PARTS.value:
    res["prefill"] = prefill(target, _PREFILL_FORMATS.value, _PREFILL_TOKENS.value)
  if "window" in _PARTS.value:
    res["window"] = window(target, draft, [int(w) for w in _WINDOWS.value], _WINDOW_PROMPT.value,
                           _WINDOW_MODES.value, tuple(_WINDOW_POSITIONS.value))
  if "step" in _PARTS.value:
    res["step"] = step(target, formats, [int(c) for c in _STEP_CTX.value],
                       [int(t) for t in _STEP_T.value], _REPEATS.value)
  print(json.dumps(res, indent=1))
  if _JSON.value:
    os.makedirs(os.path.dirname(_JSON.value) or ".", exist_ok=True)
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)
  tables = []
  if "quality" in res:
    tables.append((f"({res['quality'][formats[0]]['tokens']} tokens; KL vs {formats[0]})",
                   ["format", "KLD mean", "KLD p99", "top-1 agree", "PPL"],
                   [[f, f"{q['kld_mean']:.6f}", f"{q['kld_p99']:.5f}", f"{q['top1_agree']:.4f}",
                     f"{q['ppl']:.4f}"] for f, q in res["quality"].items()]))
  if "memory" in res:
    tables.append(("", ["model", "format", "bytes/token", "max_ctx in 24 GB", "in 80 GB"],
                   [[r["model"], r["format"], f"{r['bytes_per_token']:.0f}", r["max_ctx_24GB"],
                     r["max_ctx_80GB"]] for r in res["memory"]]))
  if "prefill" in res:
    tables.append(("", ["format", "prompt tokens", "prefill s", "tok/s", "decode state GiB",
                        "peak RSS GiB"],
                   [[r["format"], r["tokens"], f"{r['prefill_s']:.1f}", f"{r['prefill_tok_s']:.0f}",
                     f"{r['state_bytes'] / GIB:.2f}", f"{r['peak_rss_bytes'] / GIB:.2f}"]
                    for r in res["prefill"]]))
  if "window" in res:
    tables.append((f"(identical outputs: {res['window']['all_outputs_identical']})",
                   ["mode", "draft_window", "positions", "acceptance"],
                   [[r["mode"], r["draft_window"] or "all", r["draft_positions"],
                     f"{r['acceptance']:.3f}"]
                    for r in res["window"]["rows"]]))
  if "step" in res:
    tables.append(("", ["format", "tokens", "live", "ms", "vs first"],
                   [[r["format"], r["tokens"], r["live"], f"{r['ms']:.1f}", f"{r['vs_first']:.2f}"]
                    for r in res["step"]]))
  for note, header, rows in tables:
    print(f"\n| {' | '.join(header)} |  {note}".rstrip())
    print("|" + "---|" * len(header))
    for row in rows:
      print(f"| {' | '.join(str(x) for x in row)} |")

if __name__ == "__main__":
  app.run(main)
