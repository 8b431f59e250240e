"""The target's own multi-token-prediction (MTP / NextN) block as a built-in draft.

Qwen3.5 and Qwen3.5-MoE checkpoints carry one MTP block (`mtp.*`, trained with the model;
arXiv:2412.19437 section 2.2 describes the scheme), which llama.cpp's converter stores after the
trunk as block `n_layer` (`{arch}.nextn_predict_layers` = 1; `blk.N.nextn.{eh_proj, enorm, hnorm,
shared_head_norm}` plus a full-attention block's `attn_*` / `ffn_*` tensors). Its math, as
llama.cpp's `graph_mtp` (src/models/qwen35.cpp, qwen35moe.cpp) and vLLM's `Qwen3_5MultiTokenPredictor`
compute it, for the token x_q at position q and the target's hidden state h_{q-1} of the position
before (the final residual stream after `output_norm`, llama.cpp's `h_nextn`):

    z_q   = eh_proj([rms(embed(x_q)) * enorm ; rms(h_{q-1}) * hnorm])      # [2D] -> [D]
    o_q   = shared_head_norm(block(z_q))    # one gated-attention decoder block with its own KV
    logits of x_{q+1} = lm_head(o_q)        # nextn.shared_head_head when present

The block's KV cache row q holds the pair (x_q, h_{q-1}) (llama.cpp: "pair (h_p, x_{p+1}) at MTP
pos p+1"; the first token pairs with a zero h). It is kept in a `draft.DraftCache` of one layer
whose rows follow the target's positions, so the decode loop writes it exactly like a DFlash
draft's context rows: at a commit of the path [bonus, d_1..d_n] at `pos`, rows pos..pos+n get
(path tokens, [pending h, h of the path's first n nodes]) (`ingest_rows`), and the h of the last
kept node becomes the row's pending h (`DecodeState.mtp_h`).

A step drafts D tokens by running the block D times (`propose`, llama.cpp's draft loop): step j
feeds (t_j, g_j) at position pos+j, with t_0 = the bonus token, g_0 = the pending h, then t_j =
the argmax of step j-1 and g_j = its o; each step attends to the cache's committed rows and the
step rows before it. The rows' logits [D, V] go to the same chain / DDTree construction as a
DFlash draft's (`decode.build_verify_tree`), so MTP drafting is lossless like every proposal.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from dflash_jax import kv_cache, layers
from dflash_jax import target as target_lib
from dflash_jax.config import HYBRID_ARCHS, TargetConfig
from dflash_jax.draft import DraftCache
from dflash_jax.gguf_io import GGUFFile
from dflash_jax.quants import QuantWeight, take_rows
from dflash_jax.runtime import Runtime
from dflash_jax.target_params import AttnParams, TargetParams, attn_layer_params, matrix, vector

DEFAULT_STEPS = 3     # draft tokens per step: llama.cpp's and vLLM's usual 2-3 for one MTP block
MAX_STEPS = 15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPParams:
  """One MTP block (GGUF `blk.{n_layer}.*`).

  Attributes:
    eh_proj: [D, 2D] nextn.eh_proj (HF mtp.fc): [normed embedding ; normed hidden] -> D.
    enorm, hnorm: [D] float32 nextn.enorm / nextn.hnorm (HF pre_fc_norm_embedding / _hidden).
    head_norm: [D] float32 nextn.shared_head_norm (HF mtp.norm), else the target's output_norm.
    layer: the block's gated attention + FFN (dense, or routed experts for qwen35moe).
    head: [V, D] nextn.shared_head_head, or None: the target's lm_head.
    embed: [V, D] nextn.embed_tokens, or None: the target's token_embd.
  """

  eh_proj: QuantWeight
  enorm: jax.Array
  hnorm: jax.Array
  head_norm: jax.Array
  layer: AttnParams
  head: Optional[QuantWeight] = None
  embed: Optional[QuantWeight] = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MTPConfig:
  """The MTP draft's static description, in the place of a DFlash `DraftConfig` (decode.Plan.dcfg):
  the fields the decode loop reads from a draft config, derived from the target's.

  Attributes:
    tcfg: the target's TargetConfig (the block uses its attention shapes, norms and RoPE).
    block_size: 1 + draft steps per decode step (the default a DecodeConfig without block_size
      gets; any block size works, the block runs once per draft token).
  """

  tcfg: TargetConfig
  block_size: int = DEFAULT_STEPS + 1
  dflash2 = None                           # never a DFlash-2 selector
  dspark = None                            # nor a DSpark Markov head
  sliding_window = 0
  sliding = (False,)
  n_layer = 1                              # one context layer: the block's own K/V

  @property
  def target_layer_ids(self) -> tuple[int, ...]:
    """The target feature the block reads: the last layer's output (the final residual stream,
    normed with output_norm here)."""
    return (self.tcfg.n_layer - 1,)

  @property
  def d_model(self) -> int:
    """Width of the pending hidden state (DecodeState.mtp_h): the target's."""
    return self.tcfg.d_model

  @property
  def n_kv_head(self) -> int:
    return self.tcfg.n_kv_head

  @property
  def head_dim(self) -> int:
    return self.tcfg.head_dim


def check_target(cfg: TargetConfig, path: str):
  """Raises ValueError naming the file when it has no MTP block this module runs."""
  if cfg.arch not in HYBRID_ARCHS:
    raise ValueError(f"{path}: MTP drafting runs the multi-token-prediction block of Qwen3.5 "
                     f"files ({', '.join(HYBRID_ARCHS)}); a {cfg.arch!r} model has none: use a "
                     f"DFlash draft directory instead")
  if cfg.n_nextn == 0:
    raise ValueError(f"{path}: no multi-token-prediction block ({cfg.arch}.nextn_predict_layers "
                     f"is absent or 0): the file was converted without it (llama.cpp's "
                     f"convert_hf_to_gguf.py --no-mtp, or a converter older than its MTP export); "
                     f"use a DFlash draft directory instead")
  if cfg.n_nextn != 1:
    raise ValueError(f"{path}: {cfg.arch}.nextn_predict_layers={cfg.n_nextn}; one MTP block is "
                     f"supported (as llama.cpp's qwen35 graph_mtp)")
  if cfg.v_head_dim != cfg.head_dim:
    raise ValueError(f"{path}: MTP drafting needs attention.value_length == key_length "
                     f"({cfg.v_head_dim} != {cfg.head_dim})")


def load_params(f: GGUFFile, cfg: TargetConfig, *, weights: str = "quantized",
                fuse: bool = True) -> MTPParams:
  """Read the MTP block `blk.{cfg.n_layer}.*` of an open GGUF (host arrays; device_put them).
  weights / fuse as `target_params.load_params`. Raises ValueError naming the file (no MTP block,
  an unsupported architecture) or the tensor (missing, wrong shape)."""
  check_target(cfg, f.path)
  d, v = cfg.d_model, cfg.n_vocab
  p = f"blk.{cfg.n_layer}."
  opt = lambda name: (matrix(f, p + name, (v, d), weights) if p + name in f.tensors else None)
  return MTPParams(
      eh_proj=matrix(f, p + "nextn.eh_proj.weight", (d, 2 * d), weights),
      enorm=vector(f, p + "nextn.enorm.weight", d), hnorm=vector(f, p + "nextn.hnorm.weight", d),
      head_norm=(vector(f, p + "nextn.shared_head_norm.weight", d)
                 if p + "nextn.shared_head_norm.weight" in f.tensors
                 else vector(f, "output_norm.weight", d)),
      layer=attn_layer_params(f, cfg, p, weights, fuse),
      head=opt("nextn.shared_head_head.weight"), embed=opt("nextn.embed_tokens.weight"))


def target_hidden(tparams: TargetParams, cfg: TargetConfig, feats: jax.Array) -> jax.Array:
  """The target's hidden state the block reads (llama.cpp's h_nextn): feats [T, D] the final
  residual stream (MTPConfig.target_layer_ids) -> rms(feats) * output_norm, [T, D] float32."""
  return layers.rms_norm(feats.astype(jnp.float32), tparams.out_norm, cfg.rms_eps)


def _fuse(mp: MTPParams, cfg: TargetConfig, embed: QuantWeight, tokens: jax.Array, h: jax.Array,
          rt: Runtime) -> jax.Array:
  """z = eh_proj([rms(embed(tokens)) * enorm ; rms(h) * hnorm]): tokens [T] int32, h [T, D]
  -> [T, D] float32."""
  e = take_rows(mp.embed if mp.embed is not None else embed, tokens).astype(jnp.float32)
  x = jnp.concatenate([layers.rms_norm(e, mp.enorm, cfg.rms_eps),
                       layers.rms_norm(h.astype(jnp.float32), mp.hnorm, cfg.rms_eps)], axis=-1)
  return layers.linear(x, mp.eh_proj, rt)


def ingest_rows(mp: MTPParams, tparams: TargetParams, cfg: TargetConfig, tokens: jax.Array,
                h_prev: jax.Array, start: jax.Array, rt: Runtime) -> tuple[jax.Array, jax.Array]:
  """The block's K/V rows of positions start..start+T-1, not yet written: row q from the pair
  (tokens[q - start], h_prev[q - start]) (h_prev: the normed target hidden state of position
  q - 1, `target_hidden`; zeros before position 0). tokens: [T] int32; h_prev: [T, D].
  Returns (k, v): [1, T, Hkv, Dh] float32 post-RoPE (the DraftCache.write layout)."""
  z = _fuse(mp, cfg, tparams.embed, tokens, h_prev, rt)
  pos = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
  _, k, v, _ = target_lib.attn_qkv(z, mp.layer, cfg, pos, tparams.rope_freqs, rt)
  return k[None], v[None]


def commit_rows(mp: MTPParams, tparams: TargetParams, cfg: TargetConfig, tokens: jax.Array,
                feats: jax.Array, h_pending: jax.Array, start: jax.Array, n_keep: jax.Array,
                rt: Runtime) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The block's rows of T committed tokens at positions start..start+T-1 (a prefill chunk, or a
  verify's accepted path) and the row's next pending state: row q pairs tokens[q - start] with
  the normed target hidden state of position q - 1 (h_pending [D] for the first row, then the
  tokens' own, from feats [T, D], their final residual stream). n_keep: [] int32 tokens kept
  (the rest is padding or rejected). Returns (k, v [1, T, Hkv, Dh] as `ingest_rows`, the normed
  hidden state of the last kept token [D]: the pending state of the next position)."""
  h = target_hidden(tparams, cfg, feats)
  k, v = ingest_rows(mp, tparams, cfg, tokens, jnp.concatenate([h_pending[None], h[:-1]]), start,
                     rt)
  return k, v, h[n_keep - 1]


def attend_step(q: jax.Array, k: jax.Array, v: jax.Array, j: jax.Array, start: jax.Array,
                cache: DraftCache, bk: jax.Array, bv: jax.Array, rt: Runtime, mask=None):
  """The attention of draft step j of an autoregressive draft (`step` here, `eagle3.step`): q [1,
  H, Dh] over the cache rows < start (and `mask` [1, S] bool, None: all of them) and the step
  rows of slots <= j, after writing this step's k, v [1, Hkv, Dh] at slot j of bk / bv [n, Hkv,
  Dh] as the cache would return them. Returns (o [1, H, Dh] float32, bk, bv)."""
  bk = jax.lax.dynamic_update_index_in_dim(bk, kv_cache.roundtrip(cache.k.fmt, k)[0], j, 0)
  bv = jax.lax.dynamic_update_index_in_dim(bv, kv_cache.roundtrip(cache.v.fmt, v)[0], j, 0)
  slots = jnp.arange(bk.shape[0], dtype=jnp.int32)
  o = layers.attention_live(q, cache.k, cache.v, 0, mask, start,
                            local=(bk, bv, (slots <= j)[None]), dense=rt.dense)
  return o, bk, bv


def step(mp: MTPParams, tparams: TargetParams, cfg: TargetConfig, token: jax.Array,
         h: jax.Array, j: jax.Array, start: jax.Array, cache: DraftCache, bk: jax.Array,
         bv: jax.Array, rt: Runtime):
  """One block step: feed (token [] int32, h [D]) at position start + j, attending to the cache
  rows < start and the step rows bk / bv [n, Hkv, Dh] of slots < j (this step's own K/V is
  written at slot j). Returns (logits [V] float32; the block's output after head_norm [D], the h
  the next step feeds; bk, bv with slot j written)."""
  p = mp.layer
  head = mp.head if mp.head is not None else tparams.lm_head
  x = _fuse(mp, cfg, tparams.embed, token[None], h[None], rt)                  # [1, D]
  q, k, v, gate = target_lib.attn_qkv(x, p, cfg, (start + j)[None], tparams.rope_freqs, rt)
  o, bk, bv = attend_step(q, k, v, j, start, cache, bk, bv, rt)
  x = x + target_lib.attn_out(o, gate, p, rt)
  x = x + target_lib.ffn(layers.rms_norm(x, p.ffn.norm, cfg.rms_eps), p.ffn, cfg, rt)
  out = layers.rms_norm(x, mp.head_norm, cfg.rms_eps)
  return layers.linear(out, head, rt)[0].astype(jnp.float32), out[0], bk, bv


def propose(mp: MTPParams, tparams: TargetParams, cfg: TargetConfig, bonus: jax.Array,
            start: jax.Array, h_pending: jax.Array, cache: DraftCache, rt: Runtime,
            n: int, draw=None):
  """n draft rows after the bonus token at position `start` (the committed length): step j
  (`step`) feeds (t_j, g_j) at position start + j, with t_0 = bonus, g_0 = h_pending [D], the
  normed target hidden state of position start - 1; then t_j = the token step j-1 chose, g_j =
  its output after head_norm), attending to the cache rows < start and steps 0..j. The cache is
  only read.

  draw: None: each step chooses its argmax; returns logits [n, V] float32 (row j: the
  distribution of position start + j + 1), the rows a chain or DDTree is built from. Or a
  function (logits [V] float32, step j [] int32) -> (token [] int32, q [V] float32) choosing each
  step's token, e.g. a draw from the processed distribution q (ancestral sampling: later steps
  condition on the drawn tokens); returns (tokens [n] int32, q [n, V] float32).
  """
  return chain_steps(lambda tok, h, j, bk, bv: step(mp, tparams, cfg, tok, h, j, start, cache,
                                                    bk, bv, rt),
                     bonus, h_pending, (n, cfg.n_kv_head, cfg.head_dim), draw)


def chain_steps(step_fn, bonus: jax.Array, h: jax.Array, kv_shape: tuple[int, int, int],
                draw=None):
  """n = kv_shape[0] chained steps of an autoregressive draft (`step` here, `eagle3.step`):
  step_fn(token [] int32, h [D], j [] int32, bk, bv [n, Hkv, Dh]) -> (logits [V] float32, the
  h the next step feeds, bk, bv with slot j written); step 0 feeds (bonus, h), step j the token
  step j-1 chose (its argmax, or `draw`'s) and its h. Returns what `propose` returns."""
  def body(carry, j):
    tok, g, bk, bv = carry
    logits, g, bk, bv = step_fn(tok, g, j, bk, bv)
    if draw is None:
      return (jnp.argmax(logits).astype(jnp.int32), g, bk, bv), logits
    nxt, q = draw(logits, j)
    return (nxt, g, bk, bv), (nxt, q)

  init = (jnp.asarray(bonus, jnp.int32), h.astype(jnp.float32),
          jnp.zeros(kv_shape, jnp.float32), jnp.zeros(kv_shape, jnp.float32))
  _, rows = jax.lax.scan(body, init, jnp.arange(kv_shape[0], dtype=jnp.int32))
  return rows
