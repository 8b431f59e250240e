"""GPU kernel benchmark: copy bandwidth, Pallas dequantizing matmul vs XLA dequantize-then-dot,
tree Gated DeltaNet, a Qwen3.5-35B-A3B-shaped MoE FFN, and an end-to-end Qwen3.5-27B-shaped
random model (Q4_K_M type mix).

Prints one JSON object and a table. Times are medians over --repeats calls of compiled
functions (block_until_ready). GB/s = bytes of the packed weight / kernel time; ratio = that /
measured copy bandwidth (a read+write copy: 2 * bytes / time).

  python scripts/bench_kernels.py --json_out bench_out/kernels.json         # on a GPU
  python scripts/bench_kernels.py --sizes=small --interpret --repeats=2     # CPU smoke run

Shapes (numpy [N, K] = GGUF [out, in]) at --sizes=qwen27b: ffn_gate/up 17408x5120, ffn_down
5120x17408, GDN attn_qkv 10240x5120, ssm_out / attn_output 5120x6144, attn_q 12288x5120,
output 248320x5120, and the loader's fused projections gate|up 34816x5120 and GDN attn_qkv|attn_gate
16384x5120; M = 1 (decode), 16 (chain verify), 23 (tree verify, budget 22), 32.
"""

import json
import os
import statistics
import time

from absl import app, flags

_SIZES = flags.DEFINE_enum("sizes", "qwen27b", ["qwen27b", "small"], "Real Qwen3.5-27B shapes, or "
                           "small ones for a CPU smoke run.")
_FORMATS = flags.DEFINE_list("formats", ["q4_k", "q6_k", "q8_0"], "Quant types for the matmul table.")
_MS = flags.DEFINE_list("ms", ["1", "16", "23", "32"], "Rows of x (tokens per call).")
_ROTATE_MB = flags.DEFINE_integer("rotate_mb", 512, "Distinct weight copies per timed matmul "
                                  "call add up to at least this many MiB (defeats L2 reuse).")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls per configuration (median).")
_INTERPRET = flags.DEFINE_boolean("interpret", False, "Pallas interpreter (CPU smoke runs).")
_E2E = flags.DEFINE_list("e2e", ["pallas", "pallas_unfused", "reference"],
                        "End-to-end variants of the 27B-shaped random model (~17 GB each) to time: "
                        "pallas (fused projections), pallas_unfused, pallas_replay (fused, "
                        "Runtime.gdn_commit='replay': no per-node SSM states), pallas_dense (fused, "
                        "Runtime.attention='dense': no data-dependent loop per attention layer), "
                        "mosaic (fused, Q4_K "
                        "weights through the Mosaic GPU kernel), reference (XLA dequantize + dot), "
                        "pallas_mtp (fused, with an MTP block: its 3-step draft and a chain-4 "
                        "verify timed too); "
                        "empty for none.")
_E2E_BATCHES = flags.DEFINE_list("e2e_batches", [], "Each --e2e variant also times one AR step of "
                                  "B rows (the batched decode loop's form: one row's step vmapped "
                                  "over B caches of 576 rows each) for each B here, and its "
                                  "aggregate tok/s; ~0.23 GB of cache a row at Qwen3.5-27B shapes "
                                  "(twice that while a step runs).")
_TABLES = flags.DEFINE_list("tables", ["matmul", "tree_gdn"], "Kernel tables to run: matmul, "
                            "tree_gdn, tiles (a TileConfig sweep over --sweep), variants (kernel "
                            "variants at default tiles over --sweep), mgpu (the Mosaic GPU kernel "
                            "vs the Triton kernel vs XLA, the K-quant entries of --formats x "
                            "the shapes x --ms), moe (one "
                            "Qwen3.5-35B-A3B-shaped MoE FFN, Q4_K experts, x --ms, both expert "
                            "paths, Pallas vs reference kernels).")
_MGPU_STAGES = flags.DEFINE_list("mgpu_stages", [], "mgpu table: pipeline depths to time besides "
                                 "the default (each a row).")
_MGPU_OPERANDS = flags.DEFINE_list("mgpu_operands", ["registers"], "mgpu table: WGMMA operand "
                                   "placements of the dequantized weight tile (registers, smem), "
                                   "each a row at the default depth; --mgpu_stages vary the first. "
                                   "--interpret runs smem only.")
_SWEEP = flags.DEFINE_list("sweep", ["q4_k:17408:5120", "q6_k:5120:17408"],
                           "fmt:N:K matrices for the tiles table.")
_SWEEP_MS = flags.DEFINE_list("sweep_ms", ["1", "23"], "Rows of x for the tiles table.")
_JSON = flags.DEFINE_string("json_out", None, "Write the JSON here as well.")

QWEN27B = dict(shapes=[("ffn_gate/up", 17408, 5120), ("ffn_down", 5120, 17408),
                       ("gdn_qkv", 10240, 5120), ("ssm_out", 5120, 6144), ("attn_q", 12288, 5120),
                       ("output", 248320, 5120), ("fused gate|up", 34816, 5120),
                       ("fused gdn qkv|z", 16384, 5120)],
               gdn=dict(hv=48, dk=128, dv=128), n_layer=64, d=5120, d_ff=17408, vocab=248320,
               n_head=24, n_kv=4, head_dim=256, n_k=16, copy_mb=2048,
               moe=dict(d=2048, e=256, k=8, f=512, fs=512))   # Qwen3.5-35B-A3B's FFN
SMALL = dict(shapes=[("ffn_gate/up", 512, 256), ("ffn_down", 256, 512), ("output", 1024, 256)],
             gdn=dict(hv=8, dk=32, dv=32), n_layer=4, d=256, d_ff=512, vocab=1024, n_head=4,
             n_kv=2, head_dim=64, n_k=2, copy_mb=16, moe=dict(d=256, e=8, k=2, f=256, fs=256))


def _dump(res):
  """Write the results so far to --json_out (partial results survive a run cut off later)."""
  if _JSON.value:
    os.makedirs(os.path.dirname(os.path.abspath(_JSON.value)), exist_ok=True)
    with open(_JSON.value, "w") as fh:
      json.dump(res, fh, indent=1)


def _gdn_inputs(rng, n: int, hv: int, dk: int, dv: int):
  """Tree-GDN inputs of the model's form (device arrays): q, k unit-norm (q / sqrt(Dk)), log
  decay g < 0, beta in (0, 1), a committed state of small norm."""
  import jax.numpy as jnp
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jnp.asarray(rng.standard_normal((n, hv, dk)), jnp.float32)) * dk ** -0.5
  k = unit(jnp.asarray(rng.standard_normal((n, hv, dk)), jnp.float32))
  v = jnp.asarray(rng.standard_normal((n, hv, dv)), jnp.float32)
  g = -0.3 * jnp.abs(jnp.asarray(rng.standard_normal((n, hv)), jnp.float32))
  beta = jnp.asarray(rng.uniform(0, 1, (n, hv)), jnp.float32)
  return q, k, v, g, beta, 0.2 * jnp.asarray(rng.standard_normal((hv, dk, dv)), jnp.float32)


def _log(msg):
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _median_ms(fn, *args, repeats):
  import jax
  jax.block_until_ready(fn(*args))          # compile + warm
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(ts)


def _random_blocks(rng, fmt, n, k):
  """Random GGUF block bytes [N, row_bytes] with finite, small f16 scale fields."""
  import numpy as np
  from dflash_jax.quants import BLOCK_FORMATS
  blk, size = BLOCK_FORMATS[fmt]
  b = np.frombuffer(rng.bytes(n * (k // blk) * size), np.uint8).reshape(n, k // blk, size).copy()
  f16 = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0], "q4_k": [0, 2],
         "q5_k": [0, 2], "q6_k": [208]}[fmt]
  for off in f16:
    h = (rng.standard_normal((n, k // blk)) * 0.01).astype(np.float16)
    b[..., off:off + 2] = h.view(np.uint8).reshape(n, k // blk, 2)
  return b.reshape(n, -1)


def _copy_bandwidth(mb, repeats):
  import jax
  import jax.numpy as jnp
  x = jnp.ones((mb * 2**20 // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0 + 0.0)
  ms = _median_ms(f, x, repeats=repeats)
  return 2 * x.nbytes / (ms * 1e-3) / 1e9


def _random_qwen35(sz, mtp: bool = False):
  """(TargetConfig, GGUFFile) of a Qwen3.5-27B-shaped random model in the real Q4_K_M mix: Q6_K
  output and about half of ffn_down / attn_qkv / attn_v (llama.cpp's use_more_bits layers), Q4_K
  elsewhere, F32 norms. mtp: with a multi-token-prediction block after the trunk (block n_layer:
  nextn.eh_proj Q4_K, its norms, a full-attention block; `nextn_predict_layers` 1)."""
  import numpy as np
  from dflash_jax.config import TargetConfig
  from dflash_jax.gguf_io import GGUFFile, GGUFTensor

  n_layer, d = sz["n_layer"], sz["d"]
  g = sz["gdn"]
  cfg = TargetConfig(arch="qwen35", n_layer=n_layer, d_model=d, d_ff=sz["d_ff"], n_vocab=sz["vocab"],
                     n_head=sz["n_head"], n_kv_head=sz["n_kv"], head_dim=sz["head_dim"],
                     v_head_dim=sz["head_dim"], rope_dim=64, rope_theta=1e7, rope_style="neox",
                     rms_eps=1e-6, qk_norm=True, attn_gate=True,
                     recurrent=tuple((i + 1) % 4 != 0 for i in range(n_layer)),
                     gdn_n_k_head=sz["n_k"], gdn_n_v_head=g["hv"], gdn_d_k=g["dk"], gdn_d_v=g["dv"],
                     conv_kernel=4, n_nextn=int(mtp))
  rng = np.random.default_rng(0)

  def more_bits(i):  # llama.cpp use_more_bits(i, n): first/last eighth and every third layer
    return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2

  tensors = {}

  def mat(name, n, k, fmt):
    data = _random_blocks(rng, fmt, n, k)
    tensors[name] = GGUFTensor(name, fmt, (n, k), data, data.nbytes)

  def vec(name, n, value=1.0):
    tensors[name] = GGUFTensor(name, "f32", (n,), np.full((n,), value, np.float32), 4 * n)

  mat("token_embd.weight", sz["vocab"], d, "q4_k")
  mat("output.weight", sz["vocab"], d, "q6_k")
  vec("output_norm.weight", d)
  hv, dk, dv = g["hv"], g["dk"], g["dv"]
  for i in range(n_layer + int(mtp)):
    p = f"blk.{i}."
    hi = "q6_k" if more_bits(i) else "q4_k"
    if i == n_layer:                                # the MTP block's own tensors
      mat(p + "nextn.eh_proj.weight", d, 2 * d, "q4_k")
      for name in ("enorm", "hnorm", "shared_head_norm"):
        vec(p + f"nextn.{name}.weight", d)
    vec(p + "attn_norm.weight", d)
    vec(p + "post_attention_norm.weight", d)
    mat(p + "ffn_gate.weight", sz["d_ff"], d, "q4_k")
    mat(p + "ffn_up.weight", sz["d_ff"], d, "q4_k")
    mat(p + "ffn_down.weight", d, sz["d_ff"], hi)
    if i < n_layer and cfg.recurrent[i]:
      c = 2 * cfg.gdn_n_k_head * dk + hv * dv
      mat(p + "attn_qkv.weight", c, d, hi)
      mat(p + "attn_gate.weight", hv * dv, d, "q4_k")
      mat(p + "ssm_beta.weight", hv, d, "q4_k")
      mat(p + "ssm_alpha.weight", hv, d, "q4_k")
      tensors[p + "ssm_conv1d.weight"] = GGUFTensor(
          p + "ssm_conv1d.weight", "f32", (c, 4), (rng.standard_normal((c, 4)) * 0.1).astype(np.float32), 16 * c)
      vec(p + "ssm_dt.bias", hv, 0.0)
      vec(p + "ssm_a", hv, -1.0)
      vec(p + "ssm_norm.weight", dv)
      mat(p + "ssm_out.weight", d, hv * dv, "q4_k")
    else:
      h, hkv, dh = cfg.n_head, cfg.n_kv_head, cfg.head_dim
      mat(p + "attn_q.weight", 2 * h * dh, d, "q4_k")
      mat(p + "attn_k.weight", hkv * dh, d, "q4_k")
      mat(p + "attn_v.weight", hkv * dh, d, hi)
      mat(p + "attn_output.weight", d, h * dh, "q4_k")
      vec(p + "attn_q_norm.weight", dh)
      vec(p + "attn_k_norm.weight", dh)
  return cfg, GGUFFile("random-qwen35-27b-shaped", {}, tensors)


def _e2e(sz, copy_gbs, repeats, kernels, fuse=True, gdn_commit="states", attention="live",
         mtp=False, batches=()):
  """AR step and 23-node tree verify of the `_random_qwen35` model (bf16 compute). fuse: load
  with fused projections (the default) or one matmul per GGUF tensor; gdn_commit: the
  Runtime's (per-node SSM states written by the verify, or replayed at commit); attention: the
  Runtime's ("live": a data-dependent chunk loop per attention layer, "dense": none). mtp: also
  the model's MTP block (`--draft mtp`): 3 chained block steps (`mtp.propose`, its draft per
  decode step) and a 4-token chain verify, and the acceptance length at which such a step
  costs what as many AR steps cost (random weights: the block's acceptance itself is not
  measured). batches: row counts B for a batched AR step (`step` vmapped over B caches, as
  `decode.decode_loop` vmaps a row's step; the caches donated from call to call, as the loop
  carries them): ms a step, aggregate tok/s (B / ms) and its ratio to one row's (the batched
  B = 1 step when 1 is in batches and comes first, else the AR step above)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dflash_jax import target as target_lib
  from dflash_jax import layers, target_params
  from dflash_jax import tree as tree_lib
  from dflash_jax.runtime import Runtime
  cfg, f = _random_qwen35(sz, mtp=mtp)
  # bytes read per token: every matrix except the embedding (one row is gathered) and the MTP block
  mtp_names = [n for n in f.tensors if n.startswith(f"blk.{cfg.n_layer}.")]
  model_bytes = (f.n_tensor_bytes - f.tensors["token_embd.weight"].n_bytes
                 - sum(f.tensors[n].n_bytes for n in mtp_names))
  rt = Runtime(kernels=kernels, compute_dtype="bfloat16", gdn_commit=gdn_commit,
               attention=attention)
  params = target_params.load_params(f, cfg, fuse=fuse)
  mparams = None
  if mtp:
    from dflash_jax import mtp as mtp_lib
    mparams = jax.device_put(mtp_lib.load_params(f, cfg, fuse=fuse))
  if rt.mosaic:                                    # K-quant weights for the Mosaic GPU kernel
    params = target_params.tile_kquants(params, rows_multiple=layers.mosaic_rows_multiple(rt))
  params = jax.device_put(params)
  del f
  ctx, n_tree = 512, 23
  cache = target_lib.init_cache(cfg, ctx + 64, rt)
  parents = np.asarray([-1] + [max(0, (i - 1) // 2) for i in range(1, n_tree)], np.int32)
  depths = np.zeros(n_tree, np.int32)
  for i in range(1, n_tree):
    depths[i] = depths[parents[i]] + 1

  def step(params, cache, tree):
    ver = target_lib.verify(params, cfg, tree, jnp.int32(ctx), cache, rt)
    path = jnp.arange(tree.n, dtype=jnp.int32)
    return jnp.argmax(ver.logits, -1), target_lib.commit_path(
        cache, ver, jnp.int32(ctx), path, jnp.int32(min(3, tree.n)), rows_in_place=tree.is_path)

  ar_step = jax.jit(lambda params, cache, tok: step(params, cache, tree_lib.path_tree(tok)))
  tree_step = jax.jit(lambda params, cache, toks: step(params, cache, tree_lib.Tree(
      tokens=toks, parents=jnp.asarray(parents), depths=jnp.asarray(depths),
      valid=jnp.ones((n_tree,), bool), scores=jnp.zeros((n_tree,), jnp.float32),
      max_depth=int(depths.max()))))

  _log(f"e2e {kernels} fuse={fuse} gdn_commit={gdn_commit} attention={attention}: params on device ({model_bytes / 1e9:.2f} GB read per token)")
  t0 = time.perf_counter()
  jax.block_until_ready(ar_step(params, cache, jnp.zeros((1,), jnp.int32)))
  ar_compile_s = time.perf_counter() - t0
  ar_ms = _median_ms(ar_step, params, cache, jnp.zeros((1,), jnp.int32), repeats=repeats)
  _log(f"e2e AR {ar_ms:.2f} ms (first call incl. compile {ar_compile_s:.0f} s)")
  tree_ms = _median_ms(tree_step, params, cache, jnp.zeros((n_tree,), jnp.int32), repeats=repeats)
  _log(f"e2e tree-23 verify {tree_ms:.2f} ms")
  floor_ms = model_bytes / (copy_gbs * 1e9) * 1e3
  extra = {}
  if batches:
    # the caches donated and threaded from call to call, as the decode loop carries them (a
    # step that returned fresh caches would copy all B of them, ~0.23 GB a row at 27B shapes)
    rows_step = jax.jit(jax.vmap(lambda params, cache, tok: step(params, cache, tree_lib.path_tree(tok)),
                                 in_axes=(None, 0, 0)), donate_argnums=(1,))
    extra["batched_ar"] = []
    one_row_ms = None
    for b in batches:
      caches = jax.vmap(lambda _: target_lib.init_cache(cfg, ctx + 64, rt))(jnp.arange(b))
      toks = jnp.zeros((b, 1), jnp.int32)
      _, caches = jax.block_until_ready(rows_step(params, caches, toks))      # compile + warm
      ts = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        _, caches = jax.block_until_ready(rows_step(params, caches, toks))
        ts.append((time.perf_counter() - t0) * 1e3)
      del caches
      ms = statistics.median(ts)
      one_row_ms = one_row_ms or (ms if b == 1 else ar_ms)
      extra["batched_ar"].append({"B": b, "step_ms": ms, "tok_s": b / ms * 1e3,
                                  "x_one_row_tok_s": b * one_row_ms / ms})
      _log(f"e2e batched AR B={b}: {ms:.2f} ms a step, {b / ms * 1e3:.0f} tok/s "
           f"({b * one_row_ms / ms:.2f}x one row)")
  if mtp:
    from dflash_jax import draft as draft_lib
    from dflash_jax import mtp as mtp_lib
    mcfg = mtp_lib.MTPConfig(cfg)
    mcache = draft_lib.init_cache(mcfg, ctx + 64, rt)
    propose = jax.jit(lambda mp, params, mc, h: mtp_lib.propose(
        mp, params, cfg, jnp.int32(0), jnp.int32(ctx), h, mc, rt, n=3))
    h0 = jnp.ones((cfg.d_model,), jnp.float32)
    jax.block_until_ready(propose(mparams, params, mcache, h0))
    mtp_ms = _median_ms(propose, mparams, params, mcache, h0, repeats=repeats)
    chain_ms = _median_ms(ar_step, params, cache, jnp.zeros((4,), jnp.int32), repeats=repeats)
    _log(f"e2e MTP 3 block steps {mtp_ms:.2f} ms, chain-4 verify {chain_ms:.2f} ms")
    extra = {"mtp3_propose_ms": mtp_ms, "chain4_verify_ms": chain_ms,
             "mtp3_step_ms": mtp_ms + chain_ms,
             "mtp3_break_even_acceptance": (mtp_ms + chain_ms) / ar_ms}
  return {**extra, "model_bytes": model_bytes, "floor_ms": floor_ms, "ar_ms": ar_ms,
          "ar_first_call_s": ar_compile_s,
          "ar_fraction_of_floor": floor_ms / ar_ms, "tree23_verify_ms": tree_ms,
          "tree23_over_ar": tree_ms / ar_ms}


def _weight_copies(rng, fmt, n, k):
  """(bytes of one weight, distinct random QuantWeight copies adding up to >= --rotate_mb MiB,
  at most 16): timed calls rotate over them so the L2 cannot serve a re-read."""
  import jax.numpy as jnp
  from dflash_jax.quants import QuantWeight
  nbytes = _random_blocks(rng, fmt, 1, k).nbytes * n
  r_w = max(1, min(16, -(-_ROTATE_MB.value * 2**20 // nbytes)))
  return nbytes, [QuantWeight(jnp.asarray(_random_blocks(rng, fmt, n, k)), fmt, (n, k))
                  for _ in range(r_w)]


def _sweep_cases(rng):
  """Yields (fmt, N, K, bytes of one weight, weight copies, M, 2 distinct x [M, K] bf16) for each
  --sweep matrix and --sweep_ms row count."""
  import jax.numpy as jnp
  for spec in _SWEEP.value:
    fmt, n, k = spec.split(":")
    n, k = int(n), int(k)
    nbytes, ws = _weight_copies(rng, fmt, n, k)
    for m in (int(v) for v in _SWEEP_MS.value):
      xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(2)]
      yield fmt, n, k, nbytes, ws, m, xs


def _tile_sweep(res, rng, copy_gbs, reps):
  """Time every TileConfig in a small grid for each --sweep matrix and --sweep_ms row count."""
  import itertools
  import jax
  from pallas_kernels import dequant_matmul as dm
  out = []
  for fmt, n, k, nbytes, ws, m, xs in _sweep_cases(rng):
    r_w = len(ws)
    bm = dm.default_tiles(m, n, k, fmt).bm
    for bn, splits, warps, stages in itertools.product((16, 32, 64), (1, 2, 4, 8), (4,), (1, 3)):
      t = dm.TileConfig(bm=bm, bn=bn, k_splits=splits, num_warps=warps, num_stages=stages)
      f = jax.jit(lambda xs, ws, t=t: [dm.dequant_matmul(x, w, tiles=t, interpret=_INTERPRET.value)
                                                      for x in xs for w in ws])
      try:
        ms = _median_ms(f, xs, ws, repeats=reps) / (r_w * len(xs))
      except Exception as e:  # noqa: BLE001  (a config that does not compile is reported)
        _log(f"tiles {fmt} {n}x{k} M={m} {t}: failed {type(e).__name__}: {str(e)[:200]}")
        continue
      gbs = nbytes / (ms * 1e-3) / 1e9
      out.append({"fmt": fmt, "N": n, "K": k, "M": m, "bm": bm, "bn": bn, "k_splits": splits,
                  "num_warps": warps, "num_stages": stages, "ms": ms, "gbs": gbs,
                  "fraction_of_copy": gbs / copy_gbs})
      _dump(res | {"tiles": out})
      _log(f"tiles {fmt} {n}x{k} M={m} bn={bn} splits={splits} warps={warps} "
           f"stages={stages}: {ms:.4f} ms {gbs:.0f} GB/s ({gbs / copy_gbs:.2f})")
  for spec in _SWEEP.value:
    fmt = spec.split(":")[0]
    for m in (int(v) for v in _SWEEP_MS.value):
      best = sorted((r for r in out if r["fmt"] == fmt and r["M"] == m), key=lambda r: r["ms"])[:3]
      for r in best:
        _log(f"best {fmt} M={m}: bn={r['bn']} splits={r['k_splits']} stages={r['num_stages']} "
             f"{r['ms']:.4f} ms ({r['fraction_of_copy']:.2f} of copy)")
  return out


def _variants(base, fmt: str):
  """(label, TileConfig) kernel variants compared by the variants table: the
  default tiles and 8 warps; for Q4_K (the only format that reads 32-bit words) each of them
  also with words off ("bytes")."""
  import dataclasses
  r = dataclasses.replace
  out = [("default", base), ("warps8", r(base, num_warps=8))]
  if fmt == "q4_k":
    out += [(f"{label}_bytes", r(t, words=False)) for label, t in out]
  return out


def _variant_table(res, rng, copy_gbs, reps):
  """Time the kernel variants of `_variants` for each --sweep matrix and --sweep_ms row count,
  with the relative error of each against XLA's bf16 dequantize-then-dot."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels import dequant_matmul as dm
  out = []
  for fmt, n, k, nbytes, ws, m, xs in _sweep_cases(rng):
    r_w = len(ws)
    y_ref = np.asarray(dm.dequant_matmul_reference(xs[0], ws[0], jnp.bfloat16), np.float64)
    for label, t in _variants(dm.default_tiles(m, n, k, fmt), fmt):
      f = jax.jit(lambda xs, ws, t=t: [dm.dequant_matmul(x, w, tiles=t, interpret=_INTERPRET.value)
                                       for x in xs for w in ws])
      try:
        ms = _median_ms(f, xs, ws, repeats=reps) / (r_w * len(xs))
        y = np.asarray(f(xs[:1], ws[:1])[0], np.float64)
      except Exception as e:  # noqa: BLE001  (a variant that does not compile is reported)
        _log(f"variant {label} {fmt} {n}x{k} M={m}: failed {type(e).__name__}: {str(e)[:300]}")
        continue
      err = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
      gbs = nbytes / (ms * 1e-3) / 1e9
      out.append({"variant": label, "fmt": fmt, "N": n, "K": k, "M": m, "tiles": str(t),
                  "ms": ms, "gbs": gbs, "fraction_of_copy": gbs / copy_gbs, "rel_err_vs_xla": err})
      _dump(res | {"variants": out})
      _log(f"variant {label:16} {fmt} {n}x{k} M={m}: {ms * 1e3:.1f} us {gbs:.0f} GB/s "
           f"({gbs / copy_gbs:.2f} of copy), rel err vs XLA {err:.1e}")
  return out


def _matmul_table(res, sz, rng, copy_gbs, reps):
  """Kernel vs XLA dequantize-then-dot for --formats x the size set's shapes x --ms.

  Each timed call runs the kernel on R distinct weight copies (R * bytes >= --rotate_mb, so the
  50 MB L2 cannot serve a re-read) times T distinct x, all in one jitted function: the time per
  kernel is the call's median / (R * T), which also amortizes the host dispatch."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels import dequant_matmul as dm
  rows = []
  for fmt in _FORMATS.value:
    for name, n, k in sz["shapes"]:
      nbytes, ws = _weight_copies(rng, fmt, n, k)
      r_w, n_x = len(ws), 4
      kern = jax.jit(lambda xs, ws: [dm.dequant_matmul(x, w, compute_dtype=jnp.bfloat16,
                                                       interpret=_INTERPRET.value)
                                     for x in xs for w in ws])
      xla = jax.jit(lambda xs, ws: [dm.dequant_matmul_reference(x, w, jnp.bfloat16)
                                    for x in xs for w in ws])
      for m in (int(v) for v in _MS.value):
        xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(n_x)]
        ms = _median_ms(kern, xs, ws, repeats=reps) / (r_w * n_x)
        ms_xla = _median_ms(xla, xs, ws, repeats=reps) / (r_w * n_x)
        y = np.asarray(kern(xs[:1], ws[:1])[0], np.float64)
        y_ref = np.asarray(xla(xs[:1], ws[:1])[0], np.float64)
        err = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append({"fmt": fmt, "matrix": name, "N": n, "K": k, "M": m,
                     "tiles": str(dm.default_tiles(m, n, k, fmt)), "weight_copies": r_w,
                     "kernel_ms": ms, "kernel_gbs": gbs, "fraction_of_copy": gbs / copy_gbs,
                     "xla_ms": ms_xla, "speedup_vs_xla": ms_xla / ms, "rel_err_vs_xla": err})
        _dump(res | {"matmul": rows})
        _log(f"{fmt} {name} M={m}: {ms:.4f} ms {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy), "
             f"XLA {ms_xla:.4f} ms, rel err {err:.1e}")
      del ws
  return rows


def _mgpu_table(res, sz, rng, copy_gbs, reps):
  """pallas_kernels.mgpu_matmul (Mosaic GPU, K-quant tiles) vs the Triton kernel and XLA's
  dequantize + dot on the same weights, for the Q4_K / Q5_K / Q6_K entries of --formats, the size set's
  shapes x --ms, weight copies rotated as in the matmul table. With --interpret: GPU interpret
  mode on the CPU (a_operand="smem", compute_wgs=1), a smoke run of this table, not a timing.
  A configuration that fails to compile or run is a row with its error (the table goes on: one
  device call should not lose the other rows to one bad configuration)."""
  import contextlib
  import dataclasses
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from pallas_kernels import dequant_matmul as dm
  from pallas_kernels import mgpu_matmul as mm
  from pallas_kernels import repack
  interp = _INTERPRET.value
  kw = dict(a_operand="smem", compute_wgs=1) if interp else {}
  operands = ["smem"] if interp else _MGPU_OPERANDS.value
  ctx = plgpu.force_gpu_interpret_mode if interp else contextlib.nullcontext
  rows = []
  shapes = [(fmt, name, n, k) for fmt in _FORMATS.value if fmt in mm.TILE_FORMATS
            for name, n, k in sz["shapes"] if n % 128 == 0 and "fused" not in name]
  for fmt, name, n, k in shapes:
    _, ws = _weight_copies(rng, fmt, n, k)
    ts = [jax.tree.map(jnp.asarray, mm.to_tiles(repack.repack(np.asarray(w.data), fmt, (n, k))))
          for w in ws]
    r_w, n_x = len(ws), 2
    for m in (int(v) for v in _MS.value):
      base = mm.default_config(m, n, k, dm.device_sm_count(), fmt, **kw)
      cfgs = ([dataclasses.replace(base, a_operand=operands[0])]
              + [dataclasses.replace(base, a_operand=operands[0], stages=int(st))
                 for st in _MGPU_STAGES.value if int(st) != base.stages]
              + [dataclasses.replace(base, a_operand=op) for op in operands[1:]])
      xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(n_x)]
      tri = jax.jit(lambda xs, ws: [dm.dequant_matmul(x, w, compute_dtype=jnp.bfloat16,
                                                      interpret=interp) for x in xs for w in ws])
      xla = jax.jit(lambda xs, ws: [dm.dequant_matmul_reference(x, w, jnp.bfloat16)
                                    for x in xs for w in ws])
      ms_tri = _median_ms(tri, xs, ws, repeats=reps) / (r_w * n_x)
      ms_xla = _median_ms(xla, xs, ws, repeats=reps) / (r_w * n_x)
      y_ref = np.asarray(xla(xs[:1], ws[:1])[0], np.float64)
      for cfg in cfgs:
        if mm.smem_bytes(cfg, m, fmt) > mm.SMEM_LIMIT:
          continue
        try:
          with ctx():
            kern = jax.jit(lambda xs, ts, cfg=cfg: [mm.kquant_matmul(x, t, cfg)
                                                    for x in xs for t in ts])
            ms = _median_ms(kern, xs, ts, repeats=reps) / (r_w * n_x)
            y = np.asarray(kern(xs[:1], ts[:1])[0], np.float64)
        except Exception as e:                     # noqa: BLE001 (recorded, the table goes on)
          rows.append({"fmt": fmt, "matrix": name, "N": n, "K": k, "M": m, "config": str(cfg),
                       "error": f"{type(e).__name__}: {e}"[:2000]})
          _dump(res | {"mgpu": rows})
          _log(f"mgpu {fmt} {name} M={m} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
          continue
        err = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
        gbs = ts[0].nbytes / (ms * 1e-3) / 1e9
        rows.append({"fmt": fmt, "matrix": name, "N": n, "K": k, "M": m, "config": str(cfg),
                     "weight_copies": r_w, "mgpu_ms": ms, "mgpu_gbs": gbs,
                     "fraction_of_copy": gbs / copy_gbs, "triton_ms": ms_tri, "xla_ms": ms_xla,
                     "speedup_vs_triton": ms_tri / ms, "speedup_vs_xla": ms_xla / ms,
                     "rel_err_vs_xla": err})
        _dump(res | {"mgpu": rows})
        _log(f"mgpu {fmt} {name} M={m} stages={cfg.stages} {cfg.a_operand}: {ms:.4f} ms {gbs:.0f} GB/s "
             f"({gbs / copy_gbs:.2f} of copy), Triton {ms_tri:.4f} ms, XLA {ms_xla:.4f} ms, "
             f"rel err {err:.1e}")
    del ws, ts
  return rows


def _moe_table(res, sz, rng, copy_gbs, reps):
  """One MoE FFN layer (`layers.moe_ffn`: E experts, top k, a shared expert; Q4_K experts, random
  router) for T = --ms tokens: the automatic path and both forced ones, Pallas vs reference
  kernels. GB/s = packed bytes of the experts the T tokens chose (each once) / time."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dflash_jax import layers
  from dflash_jax.quants import QuantWeight
  from dflash_jax.runtime import Runtime
  from dflash_jax.target_params import MoEParams
  c = sz["moe"]
  d, e, k, f, fs = c["d"], c["e"], c["k"], c["f"], c["fs"]
  q = lambda n, kk: QuantWeight(jnp.asarray(_random_blocks(rng, "q4_k", n, kk)), "q4_k", (n, kk))
  p = MoEParams(norm=jnp.ones((d,), jnp.float32),
                router=QuantWeight(jnp.asarray(rng.standard_normal((e, d)), jnp.float32) * 0.05,
                                   "f32", (e, d)),
                gate_up_exps=q(e * 2 * f, d), up_exps=None, down_exps=q(e * d, f),
                shared_gate_up=layers.Projections.separate([q(fs, d), q(fs, d)]),
                shared_down=q(d, fs), shared_gate=jnp.zeros((d,), jnp.float32))
  expert_bytes = (p.gate_up_exps.nbytes + p.down_exps.nbytes) // e
  pallas = "pallas_interpret" if _INTERPRET.value else "pallas"
  rows = []
  for t in (int(v) for v in _MS.value):
    y = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    ids = np.asarray(jax.lax.top_k(y @ p.router.data.T, k)[1])
    n_read = len(np.unique(ids))
    for kernels in (pallas, "reference"):
      rt = Runtime(kernels=kernels, compute_dtype="bfloat16")
      for path in layers.MOE_PATHS:
        fn = jax.jit(lambda y, p, rt=rt, path=path: layers.moe_ffn(
            y, p, n_used=k, weights_scale=0.0, rt=rt, path=path))
        ms = _median_ms(fn, y, p, repeats=reps)
        gbs = n_read * expert_bytes / (ms * 1e-3) / 1e9
        rows.append({"T": t, "kernels": kernels, "path": path, "experts_chosen": n_read,
                     "ms": ms, "gbs": gbs, "fraction_of_copy": gbs / copy_gbs,
                     "shape": c})
        _dump(res | {"moe": rows})
        _log(f"MoE T={t} {kernels} {path}: {ms:.3f} ms, {n_read} experts, {gbs:.0f} GB/s")
  return rows


def _tree_gdn_table(res, sz, rng, reps):
  """Tree GDN kernel vs reference, us per layer, at 16 and 23 nodes (8 layers' inputs per call)."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels import tree_gdn as tg
  g, rows, n_layers = sz["gdn"], [], 8
  for n_nodes in (16, 23):
    parents = jnp.asarray([-1] + [max(0, (i - 1) // 2) for i in range(1, n_nodes)], jnp.int32)
    inputs = [_gdn_inputs(rng, n_nodes, g["hv"], g["dk"], g["dv"]) for _ in range(n_layers)]
    kern = jax.jit(lambda ins: [tg.tree_gdn(*a, parents, interpret=_INTERPRET.value) for a in ins])
    ref = jax.jit(lambda ins: [tg.tree_gdn_reference(*a, parents) for a in ins])
    us = _median_ms(kern, inputs, repeats=reps) * 1e3 / n_layers
    us_ref = _median_ms(ref, inputs, repeats=reps) * 1e3 / n_layers
    (o, st), (o_r, st_r) = kern(inputs[:1])[0], ref(inputs[:1])[0]
    err = max(float(jnp.linalg.norm(o - o_r) / jnp.linalg.norm(o_r)),
              float(jnp.linalg.norm(st - st_r) / jnp.linalg.norm(st_r)))
    rows.append({"nodes": n_nodes, "kernel_us_per_layer": us, "reference_us_per_layer": us_ref,
                 "rel_err_vs_reference": err})
    _dump(res | {"tree_gdn": rows})
    _log(f"tree GDN {n_nodes} nodes: {us:.1f} us/layer, reference {us_ref:.1f}, rel err {err:.1e}")
  return rows


def _print_tables(res):
  print(json.dumps(res, indent=1))
  print(f"\ndevice {res['device']} ({res['backend']}), copy bandwidth {res['copy_gbs']:.0f} GB/s")
  print(f"{'fmt':5} {'matrix':12} {'N':>7} {'K':>6} {'M':>3} {'kernel ms':>10} {'GB/s':>7} "
        f"{'of copy':>8} {'XLA ms':>8} {'x XLA':>6} {'rel err':>8}")
  for r in res.get("matmul", []):
    print(f"{r['fmt']:5} {r['matrix']:12} {r['N']:7d} {r['K']:6d} {r['M']:3d} {r['kernel_ms']:10.3f} "
          f"{r['kernel_gbs']:7.0f} {r['fraction_of_copy']:8.2f} {r['xla_ms']:8.3f} "
          f"{r['speedup_vs_xla']:6.2f} {r['rel_err_vs_xla']:8.1e}")
  if res.get("mgpu"):
    print(f"\n{'fmt':5} {'matrix':12} {'N':>7} {'K':>6} {'M':>3} {'mgpu ms':>9} {'of copy':>8} "
          f"{'Triton ms':>10} {'XLA ms':>8} {'x Triton':>9} {'rel err':>8}  config")
  for r in res.get("mgpu", []):
    if "error" in r:
      print(f"{r['fmt']:5} {r['matrix']:12} {r['N']:7d} {r['K']:6d} {r['M']:3d} FAILED  "
            f"{r['config']}: {r['error'][:200]}")
      continue
    print(f"{r.get('fmt', 'q4_k'):5} {r['matrix']:12} {r['N']:7d} {r['K']:6d} {r['M']:3d} "
          f"{r['mgpu_ms']:9.4f} {r['fraction_of_copy']:8.2f} {r['triton_ms']:10.4f} {r['xla_ms']:8.4f} "
          f"{r['speedup_vs_triton']:9.2f} {r['rel_err_vs_xla']:8.1e}  {r['config']}")
  if res.get("moe"):
    print(f"\nMoE FFN {res['moe'][0]['shape']}\n{'T':>3} {'kernels':16} {'path':6} {'ms':>8} "
          f"{'experts':>7} {'GB/s':>7} {'of copy':>8}")
  for r in res.get("moe", []):
    print(f"{r['T']:3d} {r['kernels']:16} {r['path']:6} {r['ms']:8.3f} {r['experts_chosen']:7d} "
          f"{r['gbs']:7.0f} {r['fraction_of_copy']:8.2f}")
  for r in res.get("tree_gdn", []):
    print(f"tree GDN {r['nodes']} nodes: kernel {r['kernel_us_per_layer']:.1f} us/layer, "
          f"reference {r['reference_us_per_layer']:.1f} us/layer")
  for key in ("e2e", "e2e_unfused", "e2e_replay", "e2e_dense", "e2e_mosaic", "e2e_reference_kernels",
              "e2e_mtp"):
    if key in res:
      e = res[key]
      print(f"{key}: AR {e['ar_ms']:.2f} ms/token (floor {e['floor_ms']:.2f} ms, "
            f"{e['ar_fraction_of_floor']:.2f} of floor); 23-node tree verify {e['tree23_verify_ms']:.2f} ms "
            f"({e['tree23_over_ar']:.2f}x AR)")
      for r in e.get("batched_ar", []):
        print(f"  batched AR B={r['B']}: {r['step_ms']:.2f} ms a step, {r['tok_s']:.0f} tok/s "
              f"({r['x_one_row_tok_s']:.2f}x one row)")
      if "mtp3_propose_ms" in e:
        print(f"  MTP: 3 block steps {e['mtp3_propose_ms']:.2f} ms + chain-4 verify "
              f"{e['chain4_verify_ms']:.2f} ms = {e['mtp3_step_ms']:.2f} ms a step: faster than AR "
              f"above an acceptance length of {e['mtp3_break_even_acceptance']:.2f}")


def main(argv):
  del argv
  import jax
  import numpy as np
  sz = QWEN27B if _SIZES.value == "qwen27b" else SMALL
  reps = _REPEATS.value
  res = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
         "sizes": _SIZES.value, "interpret": _INTERPRET.value, "repeats": reps}
  res["copy_gbs"] = copy_gbs = _copy_bandwidth(sz["copy_mb"], reps)
  rng = np.random.default_rng(0)
  _log(f"{res['device']}: copy bandwidth {copy_gbs:.0f} GB/s")
  tables = {"matmul": lambda: _matmul_table(res, sz, rng, copy_gbs, reps),
            "tiles": lambda: _tile_sweep(res, rng, copy_gbs, reps),
            "variants": lambda: _variant_table(res, rng, copy_gbs, reps),
            "tree_gdn": lambda: _tree_gdn_table(res, sz, rng, reps),
            "mgpu": lambda: _mgpu_table(res, sz, rng, copy_gbs, reps),
            "moe": lambda: _moe_table(res, sz, rng, copy_gbs, reps)}
  for name in _TABLES.value:
    if name not in tables:
      raise app.UsageError(f"--tables: unknown table {name!r}; expected some of {list(tables)}")
    res[name] = tables[name]()
  pallas = "pallas_interpret" if _INTERPRET.value else "pallas"
  variants = {"pallas": ("e2e", pallas, True, "states", "live"),
              "pallas_unfused": ("e2e_unfused", pallas, False, "states", "live"),
              "pallas_replay": ("e2e_replay", pallas, True, "replay", "live"),
              "pallas_dense": ("e2e_dense", pallas, True, "states", "dense"),
              "mosaic": ("e2e_mosaic", "mosaic_interpret" if _INTERPRET.value else "mosaic",
                         True, "states", "live"),
              "reference": ("e2e_reference_kernels", "reference", True, "states", "live"),
              "pallas_mtp": ("e2e_mtp", pallas, True, "states", "live")}
  for v in _E2E.value:
    if v not in variants:
      raise app.UsageError(f"--e2e: unknown variant {v!r}; expected some of {list(variants)}")
    key, kernels, fuse, gdn_commit, attention = variants[v]
    res[key] = _e2e(sz, copy_gbs, reps, kernels, fuse=fuse, gdn_commit=gdn_commit,
                    attention=attention, mtp=v == "pallas_mtp",
                    batches=[int(b) for b in _E2E_BATCHES.value])
    _dump(res)
  _print_tables(res)
  _dump(res)


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  app.run(main)
