"""Dequantizing matmul over packed GGUF rows.

Contract: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T, float32 accumulation, with W a
`dflash_jax.quants.QuantWeight` holding raw GGUF blocks `[N, K // block * type_size] uint8`.
This file holds the pure-JAX reference; the Pallas (Triton lowering) kernel that must match it
is the subject of the kernels issue and is not written yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.quants import QuantWeight, dequantize


def dequant_matmul_reference(x: jax.Array, w: QuantWeight, compute_dtype=jnp.float32) -> jax.Array:
  """x: [M, K] float; w: logical [N, K] packed; returns [M, N] float32.

  Dequantizes W to `compute_dtype` (exact for float32), then one matmul with float32 accumulation
  (HIGHEST precision for float32 operands).
  """
  wd = dequantize(w, compute_dtype)
  prec = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
  return jnp.dot(x.astype(compute_dtype), wd.T, precision=prec, preferred_element_type=jnp.float32)
