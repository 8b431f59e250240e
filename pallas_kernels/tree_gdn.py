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

Without per-node states (`states=False`, `Runtime.gdn_commit="replay"`): the kernel writes the
outputs only. Each program rebuilds node i's state in registers by replaying i's ancestor path from
the committed state (root first, `ancestor_path`: at most max_depth + 1 rank-1 updates per node,
N x (max_depth + 1) in all, no state store or re-read), and the commit rebuilds the accepted
node's state the same way (`replay_path`, with `gdn_step`'s operation order). Bytes written per
GDN layer drop from N*Hv*Dk*Dv*4 to the outputs' N*Hv*Dv*4.

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

__all__ = ["tree_gdn", "tree_gdn_reference", "supports", "gdn_step", "replay_path", "ancestors",
           "ancestor_path"]


def gdn_step(s, k, v, g, beta):
  """One gated delta rule step (float32, HIGHEST-precision contraction), the operation order
  every pure-JAX form here shares: S = e^g S; S += k (beta (v - S^T k))^T.

  s: [Hv, Dk, Dv]; k: [Hv, Dk]; v: [Hv, Dv]; g, beta: [Hv]. Returns the new s [Hv, Dk, Dv]."""
  hp = jax.lax.Precision.HIGHEST
  s = s * jnp.exp(g)[:, None, None]
  delta = (v - jnp.einsum("hk,hkv->hv", k, s, precision=hp)) * beta[:, None]
  return s + k[:, :, None] * delta[:, None, :]


def tree_gdn_reference(q, k, v, g, beta, state, parents, *, states: bool = True):
  """Pure-JAX tree gated delta rule, float32 (HIGHEST-precision einsums, `gdn_step`).

  q, k: [N, Hv, Dk]; v: [N, Hv, Dv]; g, beta: [N, Hv]; state: [Hv, Dk, Dv]; parents: [N] int32,
  parents[i] < i, -1 = root. Returns (o: [N, Hv, Dv], states: [N, Hv, Dk, Dv], or None when
  `states` (static) is False: the per-node states stay inside the scan).
  """
  n = q.shape[0]
  hp = jax.lax.Precision.HIGHEST
  state = state.astype(jnp.float32)

  def step(buf, inp):
    i, qt, kt, vt, gt, bt = inp
    p = parents[i]
    s = gdn_step(jnp.where(p >= 0, buf[jnp.maximum(p, 0)], state), kt, vt, gt, bt)
    o = jnp.einsum("hk,hkv->hv", qt, s, precision=hp)
    return buf.at[i].set(s), o

  buf = jnp.zeros((n,) + state.shape, jnp.float32)
  buf, o = jax.lax.scan(step, buf, (jnp.arange(n), q.astype(jnp.float32), k.astype(jnp.float32),
                                    v.astype(jnp.float32), g.astype(jnp.float32),
                                    beta.astype(jnp.float32)))
  return o, (buf if states else None)


def replay_path(state, k, v, g, beta, n_steps):
  """The state after the first n_steps nodes of a root path, replayed from the committed state
  with `gdn_step` (what a commit without per-node states runs; fixed trip count P, steps past
  n_steps leave the state as it is).

  state: [Hv, Dk, Dv]; k: [P, Hv, Dk]; v: [P, Hv, Dv]; g, beta: [P, Hv] the path's nodes, root
  first; n_steps: [] int32 in 0..P. Returns [Hv, Dk, Dv] float32."""
  def step(s, inp):
    m, kt, vt, gt, bt = inp
    return jnp.where(m < n_steps, gdn_step(s, kt, vt, gt, bt), s), None

  f32 = lambda a: a.astype(jnp.float32)
  s, _ = jax.lax.scan(step, f32(state), (jnp.arange(k.shape[0]), f32(k), f32(v), f32(g),
                                         f32(beta)))
  return s


def ancestors(parents, n_back: int):
  """[N, n_back + 1] int32: column j = the j-th ancestor of each node (column 0 = the node
  itself), -1 past the root. parents: [N] int32, parents[i] < i, -1 = root."""
  parents = parents.astype(jnp.int32)
  cols = [jnp.arange(parents.shape[0], dtype=jnp.int32)]
  for _ in range(n_back):
    prev = cols[-1]
    cols.append(jnp.where(prev >= 0, parents[jnp.maximum(prev, 0)], -1))
  return jnp.stack(cols, axis=1)


def ancestor_path(parents, width: int):
  """[N, width] int32: node i's root path, root first, right-aligned (column width-1 = i
  itself, column width-1-j = its j-th ancestor), -1 before the root. width >= max depth + 1."""
  return ancestors(parents, width - 1)[:, ::-1]


def _is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def supports(dk: int, dv: int) -> bool:
  """True when the kernel tiles these head sizes (Dk a power of 2 >= 16, Dv a multiple of 16)."""
  return _is_pow2(dk) and dk >= 16 and dv % 16 == 0


def _node_update(s, a, k_ref, v_ref, g_ref, b_ref):
  """Node a's delta-rule step on a [Dk, bv] float32 state slice, inside a kernel."""
  kt = k_ref[a].astype(jnp.float32)                          # [Dk]
  s = s * jnp.exp(g_ref[a])
  delta = (v_ref[a].astype(jnp.float32) - jnp.sum(s * kt[:, None], axis=0)) * b_ref[a]   # [bv]
  return s + kt[:, None] * delta[None, :]


def _kernel(parents_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, st_ref, *,
            n_nodes: int, interpret: bool):
  h0 = s0_ref[...].astype(jnp.float32)                        # [Dk, bv]

  def body(t, carry):
    p = parents_ref[t]
    s = _node_update(jnp.where(p >= 0, st_ref[jnp.maximum(p, 0)], h0), t, k_ref, v_ref, g_ref,
                     b_ref)
    o_ref[t] = jnp.sum(s * q_ref[t].astype(jnp.float32)[:, None], axis=0)
    st_ref[t] = s
    if not interpret:
      from jax.experimental.pallas import triton as plgpu_triton
      plgpu_triton.debug_barrier()   # children re-read this state (no CPU rule: GPU only)
    return carry

  jax.lax.fori_loop(0, n_nodes, body, 0)


def _node_specs(n: int, dk: int, bv: int) -> list:
  """Block specs of q, k [N, Hv, Dk], v [N, Hv, Dv], g, beta [N, Hv] and the committed state
  [Hv, Dk, Dv] for program (head h, Dv tile j): every node of head h, Dv columns of tile j."""
  node = lambda h, j: (0, h, 0)
  return [pl.BlockSpec((n, None, dk), node),                                # q
          pl.BlockSpec((n, None, dk), node),                                # k
          pl.BlockSpec((n, None, bv), lambda h, j: (0, h, j)),              # v
          pl.BlockSpec((n, None), lambda h, j: (0, h)),                     # g
          pl.BlockSpec((n, None), lambda h, j: (0, h)),                     # beta
          pl.BlockSpec((None, dk, bv), lambda h, j: (h, 0, j))]             # committed state


@functools.partial(jax.jit, static_argnames=("bv", "num_warps", "interpret"))
def _tree_gdn(q, k, v, g, beta, state, parents, *, bv, num_warps, interpret):
  from jax.experimental.pallas import triton as plgpu_triton
  n, hv, dk = q.shape
  dv = v.shape[-1]
  out_shape = (jax.ShapeDtypeStruct((n, hv, dv), jnp.float32),
               jax.ShapeDtypeStruct((n, hv, dk, dv), jnp.float32))
  in_specs = [pl.BlockSpec((n,), lambda h, j: (0,))] + _node_specs(n, dk, bv)   # parents first
  out_specs = (pl.BlockSpec((n, None, bv), lambda h, j: (0, h, j)),
               pl.BlockSpec((n, None, dk, bv), lambda h, j: (0, h, 0, j)))
  return pl.pallas_call(
      functools.partial(_kernel, n_nodes=n, interpret=interpret),
      out_shape=out_shape, grid=(hv, dv // bv), in_specs=in_specs, out_specs=out_specs,
      compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="tree_gated_delta_rule",
  )(parents.astype(jnp.int32), q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
    state.astype(jnp.float32))


def _kernel_replay(anc_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, *, n_nodes: int,
                   width: int, chain: bool):
  h0 = s0_ref[...].astype(jnp.float32)                        # [Dk, bv]

  update = lambda s, a: _node_update(s, a, k_ref, v_ref, g_ref, b_ref)

  def out(t, s):
    o_ref[t] = jnp.sum(s * q_ref[t].astype(jnp.float32)[:, None], axis=0)

  if chain:                        # a path tree: node t's parent is t - 1, one walk carries it
    def step(t, s):
      s = update(s, t)
      out(t, s)
      return s

    jax.lax.fori_loop(0, n_nodes, step, h0)
    return

  def node(t, carry):
    def up(j, s):                                              # root first; -1: before the root
      a = anc_ref[t, j]
      return jnp.where(a >= 0, update(s, jnp.maximum(a, 0)), s)

    out(t, jax.lax.fori_loop(0, width, up, h0))
    return carry

  jax.lax.fori_loop(0, n_nodes, node, 0)


@functools.partial(jax.jit, static_argnames=("bv", "num_warps", "interpret", "chain"))
def _tree_gdn_replay(q, k, v, g, beta, state, anc, *, bv, num_warps, interpret, chain):
  from jax.experimental.pallas import triton as plgpu_triton
  n, hv, dk = q.shape
  dv = v.shape[-1]
  width = anc.shape[1]
  in_specs = [pl.BlockSpec((n, width), lambda h, j: (0, 0))] + _node_specs(n, dk, bv)  # paths
  return pl.pallas_call(
      functools.partial(_kernel_replay, n_nodes=n, width=width, chain=chain),
      out_shape=jax.ShapeDtypeStruct((n, hv, dv), jnp.float32), grid=(hv, dv // bv),
      in_specs=in_specs, out_specs=pl.BlockSpec((n, None, bv), lambda h, j: (0, h, j)),
      compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="tree_gated_delta_rule_replay",
  )(anc.astype(jnp.int32), q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
    state.astype(jnp.float32))


def tree_gdn(q, k, v, g, beta, state, parents, *, bv: int | None = None, num_warps: int = 4,
             interpret: bool = False, states: bool = True, max_depth: int | None = None,
             is_path: bool = False):
  """Tree gated delta rule (Pallas). Same contract as `tree_gdn_reference`:

  q, k: [N, Hv, Dk] (L2-normalized, q pre-scaled by Dk**-0.5); v: [N, Hv, Dv]; g: [N, Hv] log
  decay; beta: [N, Hv]; state: [Hv, Dk, Dv] committed state; parents: [N] int32 with
  parents[i] < i (-1 = root). Returns (o: [N, Hv, Dv] float32, states: [N, Hv, Dk, Dv] float32,
  or None with states=False: the outputs-only kernel that replays each node's root path in
  registers, `ancestor_path`). max_depth: static bound of the nodes' depths for that kernel
  (default N - 1; a tree's `max_depth` saves work). is_path: static, parents are [-1, 0, 1, ...]
  (a chain): the outputs-only kernel then walks the nodes once, carrying the state.
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
  if not states:
    width = 1 if is_path else (n - 1 if max_depth is None else min(int(max_depth), n - 1)) + 1
    return _tree_gdn_replay(q, k, v, g, beta, state, ancestor_path(parents, width), bv=bv,
                            num_warps=num_warps, interpret=interpret, chain=is_path), None
  return _tree_gdn(q, k, v, g, beta, state, parents, bv=bv, num_warps=num_warps,
                   interpret=interpret)


def _pow2_floor(n: int) -> int:
  b = 1
  while b * 2 <= n and n % (b * 2) == 0:
    b *= 2
  return b
