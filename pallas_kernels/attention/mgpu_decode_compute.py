"""The compute warpgroup of the Mosaic GPU decode kernels (mgpu_decode.py over an 8-bit cache,
mgpu_int4_decode.py over a 4-bit one): the online softmax over a split's key tiles, S^T = K Q^T
and O^T += V^T P^T on WGMMA (mgpu_decode_ops.DecodeOps), then the split's (out^T, lse).

Each tile's chain is serial: its key product, the softmax of its [bk, ROWS] scores (a column max
across the warpgroup's four warps), P^T's store, the value product, each product waited for
where it is issued. Running the products beside the chain, as FlashAttention-3's
intra-warpgroup overlap does (the next tile's key product issued before this tile's softmax;
this tile's value product waited for only at the next tile's), measured no faster here
(BENCHMARKS.md, "The int8 decode kernel at two CTAs a core"): the chain is not the products'
latency. Its column max is a large part of it: a second cross-warp reduction a tile (the sum
kept as a vector) cost 15-21%, and the column max by warp shuffles and one exchange through
SMEM (DecodeOps.column_max), where Mosaic's reduction syncs the warpgroup twice, took the
kernel from 88 to 80 registers and 1.5-3.6% off its time.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention.mgpu_decode_ops import ROWS, DecodeOps, tile_start
from pallas_kernels.mgpu_common import LOG2E, NEG_INF, plgpu


def compute(refs, smem, barriers, *, whole, split, dims, cfg, native, dtype, scale, b, h,
             start0, end, tiles):
  """Compute warpgroup: the online softmax over the split's tiles, then its (out^T, lse)."""
  _, q_ref, c_ref, _, o_ref, lse_ref = refs
  plgpu.copy_gmem_to_smem(q_ref.at[b, h], smem.q, barriers.q.at[0])
  ops = DecodeOps(native, cfg.block_kv, dims.d)
  # Each column's factor, in the base-2 domain of the softmax: `scale`, times its row's scale
  # (read as a scalar) for 8-bit rows, 0 for their padding columns, whose scores are dropped
  # (c_ref None: rows in the tiles' 16-bit dtype, zero rows padding them).
  tile = (cfg.block_kv, ROWS)
  if c_ref is None:
    factors = ops.layout(jnp.full(tile, scale * LOG2E, jnp.float32), plgpu.Layout.WGMMA)
  else:
    column = ops.layout(lax.broadcasted_iota(jnp.int32, tile, 1), plgpu.Layout.WGMMA)
    factors = ops.layout(jnp.zeros(tile, jnp.float32), plgpu.Layout.WGMMA)
    for j in range(c_ref.shape[2]):
      factors = jnp.where(column == j, c_ref[b, h, j] * (scale * LOG2E), factors)
  plgpu.barrier_wait(barriers.q.at[0])
  step = functools.partial(_step, smem=smem, barriers=barriers, ops=ops, factors=factors,
                           cfg=cfg, t=dims.t, start0=start0, end=end, dtype=dtype)
  state = ops.init_state()
  state = lax.fori_loop(0, whole, functools.partial(step, masked=False), state)
  # The cond only skips an empty loop (as mgpu_flash's masked loop; see there).
  state = lax.cond(whole < tiles,
                   lambda: lax.fori_loop(whole, tiles, functools.partial(step, masked=True),
                                         state),
                   lambda: state)
  out_t, lse = ops.finish(*state)
  o_ref.at[b, h, split][...] = out_t
  lse_ref.at[b, h, split][...] = lse


def _step(i, state, *, masked: bool, smem, barriers, ops, factors, cfg, t, start0, end, dtype):
  """Key tile i of the split: S^T = K Q^T, the softmax update of [bk, ROWS], O^T += V^T P^T
  (the value tile converted by the TMA warpgroup, its scales multiplying p)."""
  acc, m, l = state  # acc [d, ROWS]; m [ROWS] (base 2); l [bk, ROWS]: p summed elementwise
  slot = lax.rem(i, jnp.int32(cfg.stages))
  plgpu.barrier_wait(barriers.k.at[slot])
  s = ops.scores(smem.k.at[slot], smem.q, after_issue=lambda: None)  # [bk, ROWS] fp32
  v_scale = None  # tiles in q's dtype (a 4-bit cache's, dequantized by the TMA warpgroup)
  if smem.k_scale is not None:
    plgpu.barrier_wait(barriers.k_scale.at[slot])
    plgpu.barrier_wait(barriers.v_scale.at[slot])
    s = s * ops.rows(ops.row_vector(smem.k_scale.at[slot]), s.shape)
    v_scale = ops.rows(ops.row_vector(smem.v_scale.at[slot]), s.shape)
  s = s * factors
  plgpu.barrier_arrive(barriers.k_free.at[slot])
  if masked:  # keys seen by the clamped tile's predecessor, or past `end`
    nominal = start0 + i * cfg.block_kv
    key = tile_start(start0, i, cfg.block_kv, t) + ops.iota()
    s = jnp.where((key >= nominal) & (key < end), s, NEG_INF)
  m_new = jnp.maximum(m, ops.column_max(s, smem.exchange.at[lax.rem(i, 2)]))
  # A column that has seen no key keeps m = -inf; subtract 0 then (its p are all 0), not -inf.
  m_sub = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m - m_sub)
  p = jnp.exp2(s - ops.columns(m_sub, s.shape))
  l = l * ops.columns(alpha, l.shape) + p
  plgpu.barrier_wait(barriers.v.at[slot])
  p = p if v_scale is None else p * v_scale
  acc = ops.accumulate(acc * ops.columns(alpha, acc.shape), p.astype(dtype), smem.v.at[slot],
                       smem.p)
  plgpu.barrier_arrive(barriers.v_free.at[slot])
  return acc, m_new, l
