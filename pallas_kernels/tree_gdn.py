"""Tree Gated DeltaNet (DDTree verify) as a Pallas (Triton lowering) kernel, and its reference.

Math (Yang et al. 2024, arXiv:2412.06464; tree form as in SGLang's
`fused_sigmoid_gating_recurrent.py` tree-verify path): nodes are in topological order
(parents[i] < i); node i starts from its parent's state (the root, parents[i] < 0, from the
committed state), then
    S = e^{g_i} S;   S += k_i (beta_i (v_i - S^T k_i))^T;   o_i = S^T q_i.
The chain is the special case parents = [-1, 0, 1, ...].

Kernel: grid (Hv, Dv / bv). Each program keeps one [Dk, bv] float32 state slice of one head in
registers and walks the nodes with a fori_loop; a node's starting state is its parent's state,
re-read from the per-node state output that the same program wrote earlier (a CTA barrier
orders the store and the re-read on GPU). Outputs o [N, Hv, Dv] and the per-node states
[N, Hv, Dk, Dv], both float32.

Why float32 states for every node: the decode loop commits the accepted node's state with no
replay, and greedy DDTree must stay token-identical to autoregressive decoding, which runs the
same recurrence in float32; bf16 snapshots would make the committed state drift from the chain
recurrence. The cost is N*Hv*Dk*Dv*4 bytes written per GDN layer (23 nodes at Qwen3.5-27B
shapes: 72 MB); the alternative that avoids it (outputs only, then a commit pass over the
accepted path) is noted in the README's limitations.

`tree_gdn_reference` (a scan over nodes with a parent gather) is what the model runs off GPU;
the tests check it against the chain recurrence along every root path.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")

__all__ = ["tree_gdn", "tree_gdn_reference", "supports"]


def tree_gdn_reference(q, k, v, g, beta, state, parents):
  """Pure-JAX tree gated delta rule, float32 (HIGHEST-precision einsums).

  q, k: [N, Hv, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]; state: [Hv, Dk, Dv]; parents: [N] int32,
  parents[i] < i, -1 = root. Returns (o: [N, Hv, Dv], states: [N, Hv, Dk, Dv]).
  """
  n = q.shape[0]
  hp = jax.lax.Precision.HIGHEST
  state = state.astype(jnp.float32)

  def step(buf, inp):
    i, qt, kt, vt, gt, bt = inp
    p = parents[i]
    s = jnp.where(p >= 0, buf[jnp.maximum(p, 0)], state)
    s = s * jnp.exp(gt)[:, None, None]
    delta = (vt - jnp.einsum("hk,hkv->hv", kt, s, precision=hp)) * bt[:, None]
    s = s + kt[:, :, None] * delta[:, None, :]
    o = jnp.einsum("hk,hkv->hv", qt, s, precision=hp)
    return buf.at[i].set(s), o

  buf = jnp.zeros((n,) + state.shape, jnp.float32)
  buf, o = jax.lax.scan(step, buf, (jnp.arange(n), q.astype(jnp.float32), k.astype(jnp.float32),
                                    v.astype(jnp.float32), g.astype(jnp.float32),
                                    beta.astype(jnp.float32)))
  return o, buf


def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def supports(dk: int, dv: int) -> bool:
  """True when the kernel tiles these head sizes (Dk a power of 2 >= 16, Dv a multiple of 16)."""
  return _is_pow2(dk) and dk >= 16 and dv % 16 == 0


def _kernel(parents_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, st_ref, *,
            n_nodes: int, interpret: bool):
  h0 = s0_ref[...].astype(jnp.float32)                        # [Dk, bv]

  def body(t, carry):
    p = parents_ref[t]
    sp = st_ref[jnp.maximum(p, 0)]
    s = jnp.where(p >= 0, sp, h0)
    s = s * jnp.exp(g_ref[t])
    kt = k_ref[t].astype(jnp.float32)                          # [Dk]
    kv = jnp.sum(s * kt[:, None], axis=0)                      # [bv]
    delta = (v_ref[t].astype(jnp.float32) - kv) * b_ref[t]
    s = s + kt[:, None] * delta[None, :]
    o_ref[t] = jnp.sum(s * q_ref[t].astype(jnp.float32)[:, None], axis=0)
    st_ref[t] = s
    if not interpret:
      from jax.experimental.pallas import triton as plgpu_triton
      plgpu_triton.debug_barrier()   # children re-read this state (no CPU rule: GPU only)
    return carry

  jax.lax.fori_loop(0, n_nodes, body, 0)


@functools.partial(jax.jit, static_argnames=("bv", "num_warps", "interpret"))
def _tree_gdn(q, k, v, g, beta, state, parents, *, bv, num_warps, interpret):
  from jax.experimental.pallas import triton as plgpu_triton
  n, hv, dk = q.shape
  dv = v.shape[-1]
  out_shape = (jax.ShapeDtypeStruct((n, hv, dv), jnp.float32),
               jax.ShapeDtypeStruct((n, hv, dk, dv), jnp.float32))
  node = lambda h, j: (0, h, 0)
  in_specs = [
      pl.BlockSpec((n,), lambda h, j: (0,)),                            # parents
      pl.BlockSpec((n, None, dk), node),                                # q
      pl.BlockSpec((n, None, dk), node),                                # k
      pl.BlockSpec((n, None, bv), lambda h, j: (0, h, j)),              # v
      pl.BlockSpec((n, None), lambda h, j: (0, h)),                     # g
      pl.BlockSpec((n, None), lambda h, j: (0, h)),                     # beta
      pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j)),             # committed state
  ]
  out_specs = (pl.BlockSpec((n, None, bv), lambda h, j: (0, h, j)),
               pl.BlockSpec((n, None, dk, bv), lambda h, j: (0, h, 0, j)))
  return pl.pallas_call(
      functools.partial(_kernel, n_nodes=n, interpret=interpret),
      out_shape=out_shape, grid=(hv, dv // bv), in_specs=in_specs, out_specs=out_specs,
      compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="tree_gated_delta_rule",
  )(parents.astype(jnp.int32), q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
    state.astype(jnp.float32))


def tree_gdn(q, k, v, g, beta, state, parents, *, bv: int | None = None, num_warps: int = 4,
             interpret: bool = False):
  """Tree gated delta rule (Pallas). Same contract as `tree_gdn_reference`:

  q, k: [N, Hv, Dk] (L2-normalized, q pre-scaled by Dk**-0.5); v: [N, Hv, Dv]; g: [N, Hv] log
  decay; beta: [N, Hv]; state: [Hv, Dk, Dv] committed state; parents: [N] int32 with
  parents[i] < i (-1 = root). Returns (o: [N, Hv, Dv] float32, states: [N, Hv, Dk, Dv] float32).
  bv: Dv tile (default min(Dv, 32), power of 2). interpret: Pallas interpreter (CPU tests; it
  starts outputs as NaN, so an element the kernel never writes shows up in the result).
  Raises ValueError for head sizes the kernel does not tile.
  """
  n, hv, dk = q.shape
  dv = v.shape[-1]
  if not supports(dk, dv):
    raise ValueError(f"tree_gdn: head sizes Dk={dk}, Dv={dv} do not tile (Dk power of 2 >= 16, "
                     f"Dv multiple of 16)")
  bv = bv or min(32, _pow2_floor(dv))
  if dv % bv or not _is_pow2(bv):
    raise ValueError(f"tree_gdn: bv={bv} must be a power of 2 dividing Dv={dv}")
  return _tree_gdn(q, k, v, g, beta, state, parents, bv=bv, num_warps=num_warps,
                   interpret=interpret)


def _pow2_floor(n: int) -> int:
  b = 1
  while b * 2 <= n and n % (b * 2) == 0:
    b *= 2
  return b
