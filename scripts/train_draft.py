"""Train a DFlash (or EAGLE-3) draft for a GGUF target on token shards, with target features
computed online.

  python scripts/gen_data.py --data_dir checkpoints/train_data/smollm2-135m-instruct --minutes 60
  python scripts/train_draft.py --out_dir /tmp/draft_run --steps 2000
  python scripts/train_draft.py --variant eagle3 --out_dir /tmp/eagle3_run --steps 2000

--variant eagle3 trains a one-layer EAGLE-3 draft in the speculators format instead
(train/eagle3_objective.py: training-time test over --draft_tokens steps, cross-entropy over a
--draft_vocab_size vocabulary plus the same KL term, --gamma decaying the steps' weights); its
held-out figure is bench.py's chain acceptance length, decoded.

Data: token-id shards made by `scripts/gen_data.py` (the target's own responses, batched;
--data_dirs, several allowed). Each step draws --batch sequences (a function of --seed and the
step index only), runs the frozen target's prefill over them inside the jitted step to get the
features at the draft's target_layer_ids (no feature cache), and minimises DFlash's weighted
block cross-entropy plus --kl_weight x KL to the target's next-token distribution; AdamW with
linear warm-up and cosine decay, data parallel over all visible devices. The state (params,
optimizer moments, step) is saved to --out_dir/train_state.npz with every checkpoint, and a
rerun resumes from it. Held-out acceptance on HumanEval prompts and the benchmark chat prompts,
which the corpus never contains, is logged every --eval_every steps to --out_dir/train_log.json
together with the training tokens seen: the exact greedy chain acceptance length over the
target's greedy continuations (scripts/bench.py's settings: HumanEval x 64 tokens, chat x 128),
computed teacher-forced in one pass per prompt (`train.heldout`; equal to bench.py's
mean_accept_len for the same prompts), with the acceptance rate by block offset.
"""

import json
import os
import sys
import time

from absl import app, flags

_TARGET = flags.DEFINE_string("target", None, "Target GGUF (default: SmolLM2-135M-Instruct Q4_1).")
_OUT = flags.DEFINE_string("out_dir", None, "Checkpoint directory (z-lab format) and train state.",
                           required=True)
_DATA = flags.DEFINE_list("data_dirs", ["checkpoints/train_data/smollm2-135m-instruct"],
                          "Token-shard directories (scripts/gen_data.py).")
_INIT = flags.DEFINE_string("init_checkpoint", None, "Start from this z-lab draft (its architecture, "
                            "layer ids and mask token replace the draft flags below; the "
                            "optimizer starts fresh). A run with train_state.npz in --out_dir "
                            "resumes from that instead.")
_VARIANT = flags.DEFINE_enum("variant", "dflash1", ["dflash1", "dflash2", "eagle3"],
                             "Draft architecture: DFlash-1 (z-lab DFlashDraftModel), DFlash-2 "
                             "(DFlash2DraftModel: dynamic convolutions and a candidate selector) or "
                             "EAGLE-3 (a one-layer autoregressive draft in the speculators format, "
                             "trained with training-time test over --draft_tokens steps). With "
                             "--init_checkpoint of a DFlash-1 draft, dflash2 keeps its weights and "
                             "adds identity convolutions and a fresh selector; an EAGLE-3 "
                             "--init_checkpoint selects eagle3.")
_DRAFT_TOKENS = flags.DEFINE_integer("draft_tokens", 3, "EAGLE-3: draft tokens per decode step, the "
                                     "training-time-test steps trained (a fresh draft).",
                                     lower_bound=1)
_DRAFT_VOCAB = flags.DEFINE_integer("draft_vocab_size", 8192, "EAGLE-3: draft vocabulary, the ids "
                                    "most frequent in the training responses (a fresh draft).",
                                    lower_bound=1)
_DRAFT_FFN = flags.DEFINE_integer("draft_ffn", None, "EAGLE-3: the draft layer's MLP width (a fresh "
                                  "draft; default the target's).", lower_bound=1)
_AUX_IDS = flags.DEFINE_list("eagle_aux_ids", None, "EAGLE-3: eagle_aux_hidden_state_layer_ids (HF "
                             "convention, id i = the hidden state entering target layer i; a "
                             "fresh draft; default vLLM's 2, n/2, n-3).")
_CONV_K = flags.DEFINE_integer("conv_kernel", 3, "DFlash-2: convolution taps K.")
_CONV_G = flags.DEFINE_integer("conv_group", 64, "DFlash-2: channels per dynamic-tap group.")
_SEL_RANK = flags.DEFINE_integer("selector_rank", 32, "DFlash-2: selector codebook rank.")
_SEL_TOPK = flags.DEFINE_integer("selector_top_k", 8, "DFlash-2: selector candidates per row.")
_LAYERS = flags.DEFINE_integer("draft_layers", None, "Draft decoder layers (a fresh draft: default "
                                "2; with --init_checkpoint: keep its first N layers, or grow it "
                                "with identity-initialised copies of its last layer, "
                                "draft_io.resize_depth).", lower_bound=1)
_N_FEAT = flags.DEFINE_integer("n_features", 4, "Target layers feeding the draft (z-lab spacing).")
_LAYER_IDS = flags.DEFINE_list("target_layer_ids", None, "Target layers feeding the draft "
                               "(overrides --n_features).")
_BLOCK = flags.DEFINE_integer("block_size", 16, "Block size L.")
_MASK = flags.DEFINE_integer("mask_token_id", -1, "Mask token id (-1: an unused special token).")
_INIT_NORM = flags.DEFINE_float("init_norm_scale", 0.1, "Start the draft's final norm at this "
                                "multiple of the target's output_norm (0: all ones).")
_STEPS = flags.DEFINE_integer("steps", 2000, "Optimizer steps in all (a rerun continues).")
_BATCH = flags.DEFINE_integer("batch", 4, "Sequences per step (a multiple of the device count).")
_ANCHORS = flags.DEFINE_integer("anchors", 16, "Blocks (anchors) per sequence per step.")
_BUCKETS = flags.DEFINE_list("length_buckets", ["256", "512"], "Padded lengths a step may take "
                             "below --seq_len (a batch of short sequences is not padded to "
                             "--seq_len; one compiled step per length). Empty: always --seq_len.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 800, "Tokens per training sequence (padded; longer ones "
                                "windowed); with --pack, tokens per packed row.")
_PACK = flags.DEFINE_bool("pack", False, "Pack several sequences back to back in each row of "
                          "--seq_len tokens (each sees only itself): --batch is then rows per "
                          "step and --anchors blocks per row. Not with --length_buckets (their "
                          "default is dropped under --pack).")
_LR = flags.DEFINE_float("lr", 1e-3, "Peak learning rate.")
_WARMUP = flags.DEFINE_integer("warmup", 100, "Linear warm-up steps.")
_WD = flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
_CLIP = flags.DEFINE_float("clip", 1.0, "Global gradient-norm clip.")
_GAMMA = flags.DEFINE_float("gamma", 7.0, "Loss decay over block offsets: exp(-(k-1)/gamma).")
_KL = flags.DEFINE_float("kl_weight", 0.5, "Weight of the KL term to the target's distribution.")
_RESTRICT = flags.DEFINE_bool("restrict_vocab", False, "Run the loss's softmaxes over the token ids "
                              "that occur in the training data (every label is one) instead of "
                              "the whole vocabulary: the lm_head matmuls of a step shrink to that "
                              "fraction (DFlash-1; decoding always uses the whole lm_head).")
_OFFSETS = flags.DEFINE_integer("loss_offsets", 0, "Block offsets 1..K that carry the loss (0: all "
                                "block_size - 1); the draft still runs the whole block, only K "
                                "rows a block go through the lm_head.", lower_bound=0)
_DTYPE = flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_HEAD_CHUNK = flags.DEFINE_integer("head_chunk", None, "Label rows per pass of the fused lm_head + "
                                   "cross-entropy + KL (DFlash-1: the logits of the whole batch "
                                   "are never held; default TrainConfig's, 2048); 0: the "
                                   "materialized form. Memory only: the loss and its gradient are "
                                   "the same.", lower_bound=0)
_REMAT = flags.DEFINE_bool("remat_attention", False, "Recompute the draft's attention scores in "
                           "the backward pass instead of keeping them: about half the step's "
                           "memory with a fused loss, for one more attention forward.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 250, "Steps between held-out evaluations (0: "
                                   "only at the end).")
_N_EVAL = flags.DEFINE_integer("n_eval", 4, "Held-out prompts of each kind (HumanEval, chat).")
_SAVE_EVERY = flags.DEFINE_integer("save_every", 100, "Steps between checkpoints.")
_CACHE = flags.DEFINE_boolean("compile_cache", True, "Keep the compiled training step (and the "
                              "evaluation's decode programs) in a persistent cache on disk, so "
                              "the next run reads them back (--nocompile_cache: off).")
_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", None, "Directory of the compile cache "
                                 "(default ~/.cache/dflash_jax/xla, as the other scripts).")
_MINUTES = flags.DEFINE_float("minutes", None, "Stop (saving) after this long; rerun to continue.")
_FIT = flags.DEFINE_boolean(
    "fit_schedule", False,
    "With --minutes: after 20 steps past the first (compiling) ones, end the cosine schedule, and "
    "the run, at the step that the measured step time reaches by the deadline (at most --steps), "
    "so the learning rate decays before the time is up instead of being cut off at its peak. "
    "Resuming keeps the fitted end.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed (init, batches, anchors).")


def _draft_config(target):
  """The DraftConfig the flags describe, validated against the target."""
  import dataclasses
  from dflash_jax import draft_io
  tok = target.tokenizer
  mask_id = _MASK.value
  if mask_id < 0:
    unused = [i for i in sorted(tok.control_ids) if i not in tok.eog_ids and i != tok.bos_id]
    if not unused:
      raise app.UsageError("no unused special token for the mask; pass --mask_token_id")
    mask_id = unused[-1]
  cfg = draft_io.config_for_target(target.config, n_layer=_LAYERS.value or 2,
                                   n_features=_N_FEAT.value,
                                   block_size=_BLOCK.value, mask_token_id=mask_id)
  if _LAYER_IDS.value:
    cfg = dataclasses.replace(cfg, target_layer_ids=tuple(int(x) for x in _LAYER_IDS.value))
  draft_io.validate(cfg, target.config, path="--draft flags")
  return cfg


def _as_variant(cfg, params, seed: int):
  """(cfg, params) of --variant: a DFlash-1 draft upgraded to DFlash-2 when asked (params may
  be None: a fresh draft is initialised later). UsageError for a DFlash-2 draft asked to
  become DFlash-1."""
  import jax
  from dflash_jax import draft_io
  if _VARIANT.value == "dflash1":
    if cfg.dflash2 is not None:
      raise app.UsageError("--variant=dflash1 with a DFlash-2 --init_checkpoint")
    return cfg, params
  if cfg.dflash2 is not None:
    return cfg, params
  try:
    cfg2 = draft_io.dflash2_config(cfg, conv_kernel=_CONV_K.value, conv_group=_CONV_G.value,
                                   selector_rank=_SEL_RANK.value,
                                   selector_top_k=_SEL_TOPK.value)
  except ValueError as e:
    raise app.UsageError(f"--variant=dflash2: {e}") from None
  if params is not None:
    params = draft_io.upgrade_to_dflash2(jax.random.key(seed + 1), params, cfg2)
  return cfg2, params


def _held_out(target) -> dict:
  """{kind: [TokenSeq]}: HumanEval 0..n-1 (raw prompt, 64 tokens) and cli.CHAT_PROMPTS[:n]
  (chat template, 128 tokens) with the target's greedy continuations (no stop at EOG), as
  scripts/bench.py decodes them (`train.heldout.eval_prompts`, `greedy_continuations`)."""
  from dflash_jax.train import heldout
  n = _N_EVAL.value
  return {kind: heldout.greedy_continuations(target, prompts, heldout.EVAL_NEW_TOKENS[kind])
          for kind, prompts in heldout.eval_prompts(target, n, n).items()}


def _eval(target, cfg, params, held, vocab=None) -> dict:
  """Per prompt kind: the chain acceptance length (`train.heldout`, exact for greedy chain
  decoding) and, under kind + "_p_offset", the acceptance rate at block offsets 1..8. vocab: an
  EAGLE-3 draft's vocabulary (params its trainable weights): then, as for DFlash-2, the chain is
  decoded (`heldout.decoded_accept`)."""
  import dataclasses
  import dflash_jax as dj
  from dflash_jax.train import heldout, objective
  out: dict = {}
  if vocab is not None or cfg.dflash2 is not None:   # chains the teacher-forced pass does not model
    if vocab is not None:
      import jax.numpy as jnp
      params = dataclasses.replace(params, vocab=jnp.asarray(vocab))
    d = dj.Draft(cfg, params, "training")
    return {kind: heldout.decoded_accept(target, d, seqs) for kind, seqs in held.items()}
  lm = objective.frozen_target_tensors(target)[1]        # once for every set
  for kind, seqs in held.items():
    h = heldout.heldout_accept(params, cfg, target, seqs, lm_head_w=lm)
    out[kind] = h["chain_al"]
    out[kind + "_p_offset"] = [round(x, 4) for x in h["p_offset"][:8]]
  return out


def _eagle3_draft(target, seqs, path: str):
  """(raw config.json, Eagle3Config, trainable float32 Eagle3Params with vocab None, draft
  vocabulary [Vd] int32) of the EAGLE-3 draft to train: --init_checkpoint's, or a fresh one from
  the flags (`eagle3.config_json`, `eagle3.init_params`, the vocabulary from the data)."""
  import dataclasses
  import jax
  import numpy as np
  from dflash_jax import eagle3
  from dflash_jax.train import eagle3_objective
  tcfg = target.config
  if _INIT.value:
    raw = eagle3.read_config(_INIT.value)
    raw.pop("dflash_jax", None)
    cfg, ep = eagle3.load(_INIT.value, tcfg, raw, weight_fmt="f32")
    vocab = (np.asarray(ep.vocab) if ep.vocab is not None
             else np.arange(tcfg.n_vocab, dtype=np.int32))
    if ep.rope_freqs is not None:
      raise app.UsageError(f"--init_checkpoint {_INIT.value}: an EAGLE-3 draft with llama3 rope "
                           f"scaling is not trained here (its frequency table would be a "
                           f"trainable tensor)")
    return raw, cfg, dataclasses.replace(ep, vocab=None), vocab
  try:
    raw = eagle3.config_json(
        tcfg, d_ff=_DRAFT_FFN.value, draft_tokens=_DRAFT_TOKENS.value,
        aux_ids=tuple(int(x) for x in _AUX_IDS.value) if _AUX_IDS.value else None,
        draft_vocab_size=_DRAFT_VOCAB.value, verifier=os.path.basename(path))
  except ValueError as e:
    raise app.UsageError(f"--variant=eagle3 flags: {e}") from None
  cfg = eagle3.config_from_json(raw, tcfg)
  vocab = eagle3_objective.draft_vocab(seqs, tcfg.n_vocab, _DRAFT_VOCAB.value)
  ep = eagle3.init_params(jax.random.key(_SEED.value), cfg, target.params, vocab,
                          norm_scale=_INIT_NORM.value)
  return raw, cfg, ep, vocab


def main(argv):
  del argv
  import dataclasses
  import jax
  import numpy as np
  from tqdm import tqdm
  import dflash_jax as dj
  from dflash_jax import cli, draft_io, target_flags, train

  t_start = time.perf_counter()
  target_flags.setup_compile_cache_as(_CACHE.value, _CACHE_DIR.value)
  deadline = t_start + 60 * _MINUTES.value if _MINUTES.value else None
  path = _TARGET.value or cli.default_target_path()
  target = dj.load_target(path, weights="f32")
  for d in _DATA.value:
    if not os.path.exists(os.path.join(d, "manifest.json")):
      raise app.UsageError(f"--data_dirs: {d} holds no token shards (manifest.json); make them "
                           "with scripts/gen_data.py")
  seqs = train.read_shards(_DATA.value, target.config.n_vocab)
  from dflash_jax import eagle3
  init = None
  ttt = _VARIANT.value == "eagle3" or bool(_INIT.value and eagle3.read_config(_INIT.value))
  e3_raw = e3_vocab = None
  if ttt:
    if _VARIANT.value == "dflash2":
      raise app.UsageError(f"--variant=dflash2 with the EAGLE-3 --init_checkpoint {_INIT.value}")
    if _RESTRICT.value or _OFFSETS.value or _PACK.value:
      raise app.UsageError("--restrict_vocab, --loss_offsets and --pack are DFlash options; an "
                           "EAGLE-3 draft trains every step over its own draft vocabulary, one "
                           "sequence per row")
    e3_raw, cfg, init, e3_vocab = _eagle3_draft(target, seqs, path)
  elif _INIT.value:
    cfg, p0 = draft_io.load(_INIT.value, target.config, variants=dj.api.DRAFT_VARIANTS)
    if cfg.dspark is not None:
      raise app.UsageError(f"--init_checkpoint {_INIT.value} is a DSpark draft "
                           f"({cfg.variant}); this trainer trains z-lab DFlash-1 / DFlash-2 "
                           f"drafts (DSpark drafts are trained with DeepSpec)")
    init = draft_io.params_from_arrays(draft_io.params_to_arrays(p0), cfg, weight_fmt="f32")
    if _LAYERS.value and _LAYERS.value != cfg.n_layer:
      try:
        cfg, init = draft_io.resize_depth(init, cfg, _LAYERS.value)
      except ValueError as e:
        raise app.UsageError(f"--draft_layers with --init_checkpoint {_INIT.value}: {e}") from None
  else:
    cfg = _draft_config(target)
  if not ttt:
    cfg, init = _as_variant(cfg, init, _SEED.value)
  if _RESTRICT.value and cfg.dflash2 is not None:
    raise app.UsageError("--restrict_vocab is for DFlash-1 drafts (--variant=dflash1)")
  n_resp = sum(s.response.size for s in seqs)
  print(f"[train] {len(seqs)} sequences, {n_resp} response tokens from {_DATA.value}",
        file=sys.stderr)
  n_dev = jax.device_count()
  if _BATCH.value % n_dev:
    raise app.UsageError(f"--batch={_BATCH.value} must be a multiple of the {n_dev} devices")
  mesh = jax.make_mesh((n_dev,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  buckets = tuple(int(x) for x in _BUCKETS.value if int(x) < _SEQ_LEN.value)
  if _PACK.value:
    if flags.FLAGS["length_buckets"].present and buckets:
      raise app.UsageError("--pack packs rows of --seq_len tokens: pass --length_buckets= "
                           "(empty) with it")
    buckets = ()
  tc = train.TrainConfig(steps=_STEPS.value, batch=_BATCH.value, anchors=_ANCHORS.value,
                         seq_len=_SEQ_LEN.value, lr=_LR.value, warmup=_WARMUP.value,
                         weight_decay=_WD.value, clip=_CLIP.value, gamma=_GAMMA.value,
                         kl_weight=_KL.value, seed=_SEED.value, compute_dtype=_DTYPE.value,
                         restrict_vocab=_RESTRICT.value, loss_offsets=_OFFSETS.value,
                         length_buckets=buckets, pack=_PACK.value, remat_attention=_REMAT.value,
                         **({} if _HEAD_CHUNK.value is None else {"head_chunk": _HEAD_CHUNK.value}))
  out_norm = (_INIT_NORM.value * np.asarray(target.params.out_norm, np.float32)
              if _INIT_NORM.value > 0 else None)
  if init is None and not ttt:
    init = draft_io.init_params(jax.random.key(_SEED.value), cfg, target.config.d_model,
                                weight_fmt="f32", out_norm=out_norm)
  st = train.init_state(init, train.make_optimizer(tc))
  os.makedirs(_OUT.value, exist_ok=True)
  state_path = os.path.join(_OUT.value, "train_state.npz")
  log_path = os.path.join(_OUT.value, "train_log.json")
  log = {"config": dataclasses.asdict(tc), "metrics": [], "evals": []}
  if os.path.exists(state_path):
    st = train.TrainState.load(state_path, st)
    if os.path.exists(log_path):
      with open(log_path) as fh:
        log = json.load(fh)
    print(f"[train] resumed at step {st.step}", file=sys.stderr)
  log["config"] = dataclasses.asdict(tc)
  held_out = _held_out(target)
  log.setdefault("tokens_seen", st.step * tc.batch * tc.seq_len)   # real (unpadded) tokens
  extra = {"target_general_name": target.general_name, "target_file": os.path.basename(path),
           "trained_with": "scripts/train_draft.py (online target features)",
           "n_sequences": len(seqs), "n_response_tokens": int(n_resp)}

  def save():
    if ttt:
      eagle3.save(_OUT.value, st.params, e3_raw, e3_vocab, target.config.n_vocab,
                  extra=dict(extra, steps=st.step))
    else:
      draft_io.save(_OUT.value, st.params, cfg, extra=dict(extra, steps=st.step))
    st.save(state_path)
    with open(log_path + ".tmp", "w") as fh:
      json.dump(log, fh)
    os.replace(log_path + ".tmp", log_path)

  def evaluate():
    e = dict(_eval(target, cfg, st.params, held_out, e3_vocab), step=st.step,
             train_tokens=log["tokens_seen"])
    log["evals"].append(e)
    tqdm.write(f"[train] step {st.step}: held-out acceptance {e}", file=sys.stderr)

  if not log["evals"]:
    evaluate()                                  # the starting point of the curve
  bar = tqdm(total=tc.steps, initial=st.step, desc="training", unit="step", file=sys.stderr)
  ema = {}

  def on_metrics(step, m):
    log["tokens_seen"] += int(m.pop("tokens"))
    ema.update({k: m[k] if k not in ema else 0.9 * ema[k] + 0.1 * m[k] for k in m})
    if step % 10 == 0:
      log["metrics"].append({"step": step, **m})
    bar.update(1)
    bar.set_postfix(loss=f"{ema['loss']:.3f}", acc=f"{ema['acc']:.3f}", kl=f"{ema['kl']:.3f}")

  def on_step(s):
    if s.step % _SAVE_EVERY.value == 0:
      save()
    if _EVAL_EVERY.value and s.step % _EVAL_EVERY.value == 0:
      evaluate()

  if _FIT.value and deadline is None:
    raise app.UsageError("--fit_schedule needs --minutes")
  step_fn = train.make_step(target, cfg, tc, mesh)
  fit_from = None                       # (step, time) after the first, compiling, chunk
  while st.step < st.last_step(tc):
    st = train.train(target, cfg, seqs, tc, st, until=st.step + 10, mesh=mesh, step_fn=step_fn,
                     on_metrics=on_metrics, on_step=on_step, vocab_ids=e3_vocab)
    now = time.perf_counter()
    if deadline is not None and now > deadline:
      break
    if _FIT.value and st.total is None:
      if fit_from is None:
        fit_from = (st.step, now)
      elif st.step - fit_from[0] >= 20:
        per_step = (now - fit_from[1]) / (st.step - fit_from[0])
        # 5 % of the time left is kept for the last save and evaluation.
        fits = st.step + int(0.95 * (deadline - now) / per_step)
        st.total = max(st.step + 1, min(tc.steps, fits))
        log["fitted_total_steps"] = st.total
        bar.total = st.total
        tqdm.write(f"[train] {per_step:.3f} s/step: the schedule ends at step {st.total}",
                   file=sys.stderr)
  bar.close()
  save()
  if not log["evals"] or log["evals"][-1]["step"] != st.step:
    evaluate()
    save()
  summary = {"steps": st.step, "final_eval": log["evals"][-1], "n_sequences": len(seqs),
             "n_response_tokens": int(n_resp), "wall_s": time.perf_counter() - t_start,
             "devices": n_dev, "checkpoint": _OUT.value}
  print(json.dumps(summary))


if __name__ == "__main__":
  import jax
  jax.config.config_with_absl()
  app.run(main)
