"""`Runtime`: how the model math runs (kernels, dtypes), as opposed to what the model is
(`TargetConfig`, read from the GGUF) and how the decode loop is shaped (`DecodeConfig`).

One static (hashable) value passed as one argument through the target, draft and decode code;
changing it recompiles. Later sharding options belong here too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax import kv_cache

KERNEL_CHOICES = ("reference", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret")
COMPUTE_DTYPES = ("float32", "bfloat16")
KV_DTYPES = kv_cache.FORMATS
GDN_COMMITS = ("states", "replay")
ATTENTION_WALKS = ("live", "dense")
MAX_ROUNDS = 256


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Runtime:
  """Execution options of the forward passes (static jit argument).

  Attributes:
    kernels: matmul / tree Gated DeltaNet implementation: "reference" (pure JAX: dequantize
      inside the traced function + one XLA dot), "pallas" (pallas_kernels on GPU, the reference
      for weights or shapes a kernel does not cover) or "pallas_interpret" (the same kernels
      through the Pallas interpreter; CPU tests); "mosaic" / "mosaic_interpret": as "pallas" /
      "pallas_interpret", except that Q4_K, Q5_K and Q6_K weights are tiled at load
      (`Q4KTiles` / `Q5KTiles` / `Q6KTiles`, `target_params.tile_kquants`) and multiplied by
      the Mosaic GPU kernel (`pallas_kernels.mgpu_matmul`, Hopper; bf16 operands whatever
      compute_dtype).
    compute_dtype: activation / matmul operand dtype, "float32" (what the references are
      compared in) or "bfloat16"; accumulation and norms stay float32.
    kv_dtype: KV cache storage format of the target's attention layers and the draft's context
      cache: "float32", "bfloat16", "float16", or llama.cpp's block formats "q8_0" / "q4_0"
      (`kv_cache`: quantized on write, dequantized chunk by chunk inside attention, which
      computes in float32).
    kv_dtype_v: the values' format when it differs from the keys' (llama.cpp's -ctk / -ctv);
      "" = kv_dtype.
    gdn_commit: how a verify's Gated DeltaNet layers let the accepted path be committed:
      "states" (the verify writes every node's float32 SSM state, [N, Hv, Dk, Dv] per layer,
      and the commit takes the accepted node's) or "replay" (the verify keeps only each node's
      recurrence inputs k, v, g, beta, and the commit replays the accepted path from the
      committed state, `pallas_kernels.tree_gdn.replay_path`: ~Dk x fewer bytes written per
      verify; the Pallas kernel then writes outputs only). Greedy output is the same either way.
    attention: how attention reads the KV cache (target and draft): "live" (the committed rows
      only, chunk by chunk in a loop whose trip count depends on the context length,
      `layers.attention_live`: work proportional to the context; on a GPU, XLA copies such a
      loop's predicate to the host every iteration, one round trip per chunk per layer) or
      "dense" (the whole capacity as one masked chunk: a static loop, no round trip, work
      proportional to max_ctx). Greedy output of every mode equals autoregressive decoding
      under either; the two differ from each other by float rounding only.
    rounds: 0 (default): `decode.decode_loop` is a while loop that stops when no row is active
      (on a GPU, a host round trip per decode round for its predicate). R > 0: each call runs
      exactly R rounds as a static loop, rounds after every row stopped (or past the call's
      max_steps) computed and discarded, and the round's data-dependent branches (mode
      lookup's "any match" AR fallback, the logit-bias / penalty switch) become selects, so
      with attention "dense" a round has no host round trip at all (`host_syncs.count`). Output
      is the same as with 0. A call asking for fewer rounds (`steps_per_call` < R) still
      computes R: pair it with steps_per_call = R (or a multiple).

  Raises ValueError naming the field for a value outside the choices above.
  """

  kernels: str = "reference"
  compute_dtype: str = "float32"
  kv_dtype: str = "float32"
  kv_dtype_v: str = ""
  gdn_commit: str = "states"
  attention: str = "live"
  rounds: int = 0

  def __post_init__(self):
    for name, choices in (("kernels", KERNEL_CHOICES), ("compute_dtype", COMPUTE_DTYPES),
                          ("kv_dtype", KV_DTYPES), ("kv_dtype_v", ("",) + KV_DTYPES),
                          ("gdn_commit", GDN_COMMITS), ("attention", ATTENTION_WALKS)):
      if getattr(self, name) not in choices:
        raise ValueError(f"Runtime.{name}={getattr(self, name)!r}: expected one of {choices}")
    if (not isinstance(self.rounds, int) or isinstance(self.rounds, bool)
        or not 0 <= self.rounds <= MAX_ROUNDS):
      raise ValueError(f"Runtime.rounds={self.rounds!r}: expected an int in 0..{MAX_ROUNDS} "
                       "(0 = a while loop)")

  @property
  def dense(self) -> bool:
    """True when attention reads the whole cache capacity (attention "dense")."""
    return self.attention == "dense"

  @property
  def pallas(self) -> bool:
    """True when the Pallas kernels run (compiled or interpreted)."""
    return self.kernels != "reference"

  @property
  def interpret(self) -> bool:
    """True when the kernels run through an interpreter (CPU tests)."""
    return self.kernels.endswith("_interpret")

  @property
  def mosaic(self) -> bool:
    """True when Q4_K / Q5_K / Q6_K weights run the Mosaic GPU kernel (compiled or interpreted)."""
    return self.kernels.startswith("mosaic")

  @property
  def cdt(self) -> jnp.dtype:
    """compute_dtype as a jnp dtype."""
    return jnp.dtype(self.compute_dtype)

  @property
  def k_format(self) -> str:
    """The keys' cache format (kv_cache.FORMATS)."""
    return self.kv_dtype

  @property
  def v_format(self) -> str:
    """The values' cache format."""
    return self.kv_dtype_v or self.kv_dtype

  @classmethod
  def for_backend(cls, kernels: str = "auto", **kw) -> "Runtime":
    """kernels="auto" picks "pallas" when JAX's default backend is a GPU, else "reference".
    Raises ValueError for an unknown choice, and for "pallas" / "mosaic" without a GPU (the
    kernels are Pallas GPU kernels; the tests run them in interpret mode)."""
    if kernels == "auto":
      kernels = "pallas" if jax.default_backend() == "gpu" else "reference"
    elif kernels not in KERNEL_CHOICES:
      raise ValueError(f"kernels={kernels!r}: expected 'auto' or one of {KERNEL_CHOICES}")
    elif kernels in ("pallas", "mosaic") and jax.default_backend() != "gpu":
      raise ValueError(f"kernels={kernels!r} (--kernels) needs a GPU; JAX's backend here is "
                       f"{jax.default_backend()!r}: use 'auto' or 'reference'")
    return cls(kernels=kernels, **kw)
