"""Exact top-k for a few query rows (decode): block maxima first, then only the k best blocks.

A decode step's selection costs kernel launches more than bytes (its K read is 16 us at 32K on
an H200), and the fused kernel (topk.py) keeps a running set whose updates cost rounds at the
start of every key split. Here the key axis is cut into blocks, each row's maximum per block is
taken, and only the k best blocks are read again. On the GPU (`gpu_topk_scores`): one Pallas
kernel for the block maxima (reads K once), `lax.top_k` over them, one kernel scoring the chosen
blocks again. `topk_scores` is the same in jnp (stores the scores [B, H, T] fp32, 1/16 of K's
bytes at d 128): the GPU's path for top_k above GPU_MAX_TOP_K.

Exact, ties included: order keys by (score desc, index asc) and blocks by (their maximum desc,
block asc), which `lax.top_k` gives (it keeps the lower index first among equals). A key x of
the true top-k lies in one of the k first blocks: otherwise each of those k blocks holds a key
(its first maximum) with a higher score than x, or the same score at a lower index (an earlier
block), so k keys would precede x. The final selection breaks ties by key index (jnp: the chosen
blocks are put in key order first; GPU: the lowest key holding the max).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, online_softmax, reference

NEG_INF = float("-inf")
BIG_INDEX = 2**31 - 1
SQ = gpu.SQ
MAX_ROWS = 16  # query rows per kv head served here; more (prefill chunks) would store big scores


def block_size(top_k: int) -> int:
  """Keys per block: large blocks make the maxima cheap, the k blocks read again small."""
  return 256 if top_k <= 8 else 64


def _sort_few(x):
  """Ascending along the last axis; for a few entries by compare-exchanges (odd-even
  transposition), which fuse with their neighbours where a sort would be its own kernel."""
  n = x.shape[-1]
  if n > 8:
    return jnp.sort(x, axis=-1)
  cols = [x[..., j] for j in range(n)]
  for r in range(n):
    for j in range(r % 2, n - 1, 2):
      cols[j], cols[j + 1] = jnp.minimum(cols[j], cols[j + 1]), jnp.maximum(cols[j], cols[j + 1])
  return jnp.stack(cols, axis=-1)


def topk_scores(q, k, top_k: int, lo, hi, *, scale=None, kv_layout: str = "BTHD",
                block: int | None = None):
  """topk.topk_scores for few rows: (scores fp32, indices int32) [B, Lq, H, top_k], best first,
  ties to the lowest index, unfilled (-inf, -1); candidates lo[b] <= t < hi[b]."""
  b, lq, h, _ = q.shape
  s = reference.grouped_scores(q, k, kv_layout, scale)  # [B, Lq, KV, G, T] fp32
  t = s.shape[-1]
  block = min(block or block_size(top_k), layout.next_pow2(t))
  key = jnp.arange(t, dtype=jnp.int32)
  ok = (key >= lo[:, None]) & (key < hi[:, None])  # [B, T]
  s = jnp.where(ok[:, None, None, None, :], s, NEG_INF)
  n_blocks = -(-t // block)
  if n_blocks * block != t:
    s = jnp.pad(s, [(0, 0)] * 4 + [(0, n_blocks * block - t)], constant_values=NEG_INF)
  s = s.reshape(*s.shape[:4], n_blocks, block)
  kb = min(top_k, n_blocks)
  _, blocks = lax.top_k(jnp.max(s, axis=-1), kb)  # [B, Lq, KV, G, kb]
  blocks = _sort_few(blocks)  # key order, so equal scores keep the lower index
  cand = jnp.take_along_axis(s, blocks[..., None], axis=-2)  # [B, Lq, KV, G, kb, block]
  v, pos = lax.top_k(cand.reshape(*cand.shape[:4], kb * block), top_k)
  i = jnp.take_along_axis(blocks, pos // block, axis=-1) * block + pos % block
  i = jnp.where(v == NEG_INF, -1, i)
  return v.reshape(b, lq, h, top_k), i.reshape(b, lq, h, top_k).astype(jnp.int32)


# The GPU variant: two Pallas (Triton) kernels around one lax.top_k, where the jnp graph above
# launches about six kernels (a decode step's selection costs launches more than bytes).
GPU_MAX_TOP_K = 8  # each kept block is scored again per row: few blocks only
GPU_BLOCK = 256


def gpu_topk_scores(q, k, top_k: int, lo, hi, *, scale=None, kv_layout: str = "BTHD",
                    interpret=False):
  """topk_scores on the GPU: block maxima by one kernel reading K once, the k best blocks by
  lax.top_k, then one kernel scoring those blocks again and selecting by k rounds of max.
  Its block maxima and its second scores come from the same product of the same tile, so the
  exactness argument above holds bit for bit."""
  b, lq, h, d = q.shape
  kvh = k.shape[2 if kv_layout == "BTHD" else 1]
  rows = lq * (h // kvh)
  rp = max(16, layout.next_pow2(rows))  # the product needs 16 rows
  kk = layout.pad_keys(k, kv_layout, GPU_BLOCK)
  bounds = jnp.stack([lo, hi], axis=1)
  qr = layout.q_rows(q, kvh, rp)
  maxima = _block_maxima(qr, kk, bounds, scale=scale, kv_layout=kv_layout, interpret=interpret)
  kp = layout.next_pow2(top_k)
  _, blocks = lax.top_k(maxima, min(kp, maxima.shape[-1]))  # [B, KV, rp, kb]
  if blocks.shape[-1] != layout.next_pow2(blocks.shape[-1]):
    blocks = jnp.pad(blocks, [(0, 0)] * 3 + [(0, layout.next_pow2(blocks.shape[-1])
                                               - blocks.shape[-1])])
  vals, idx = _rescore(qr, kk, bounds, blocks.astype(jnp.int32), top_k=top_k, rows=rows,
                       kb=min(kp, maxima.shape[-1]), scale=scale, kv_layout=kv_layout,
                       interpret=interpret)
  return (layout.from_rows(vals[..., :top_k], lq, h), layout.from_rows(idx[..., :top_k], lq, h))


def _heads_rows_spec(kvh: int, rp: int, n: int):
  """All rp rows of one (sequence, kv head), n columns, for grids (batch * kv head, ...)."""
  return pl.BlockSpec((SQ, SQ, rp, n), lambda bh, *_: (bh // kvh, bh % kvh, 0, 0))


@functools.partial(jax.jit, static_argnames=("scale", "kv_layout", "interpret"))
def _block_maxima(qr, k, bounds, *, scale, kv_layout, interpret):
  """[B, KV, rp, d] x keys -> per row and block of GPU_BLOCK keys the max candidate score
  [B, KV, rp, nb] fp32 (-inf: no candidate). One program per (sequence x kv head, block)."""
  b, kvh, rp, d = qr.shape
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  nb = -(-t // GPU_BLOCK)

  def kernel(bounds_ref, q_ref, k_ref, m_out):
    nominal = pl.program_id(1) * GPU_BLOCK
    tile, key = gpu.key_tile(nominal, GPU_BLOCK, t)
    s = online_softmax.scores(q_ref[...], k_ref[tile, :], scale)  # [rp, block]
    ok = (key >= nominal) & (key >= bounds_ref[0]) & (key < bounds_ref[1])
    m_out[...] = jnp.max(jnp.where(ok, s, NEG_INF), axis=1)

  return gpu.pallas_call(
      kernel, interpret, num_warps=4, num_stages=1, grid=(b * kvh, nb),
      in_specs=[gpu.per_batch_spec(kvh, 2), _heads_rows_spec(kvh, rp, d),
                gpu.whole_keys_spec(kv_layout, t, d, kvh)],
      out_specs=pl.BlockSpec((SQ, SQ, rp, SQ), lambda bh, j: (bh // kvh, bh % kvh, 0, j)),
      out_shape=jax.ShapeDtypeStruct((b, kvh, rp, nb), jnp.float32),
  )(bounds, qr, k)


@functools.partial(jax.jit, static_argnames=("top_k", "rows", "kb", "scale", "kv_layout",
                                             "interpret"))
def _rescore(qr, k, bounds, blocks, *, top_k, rows, kb, scale, kv_layout, interpret):
  """Each real row's kb blocks scored again, its top_k by rounds (max, then the lowest key
  holding it, then that key masked): (scores, keys) [B, KV, rp, kp], unfilled (-inf, -1).
  One program per (sequence x kv head)."""
  b, kvh, rp, d = qr.shape
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  kp = layout.next_pow2(top_k)

  def kernel(bounds_ref, q_ref, k_ref, blocks_ref, v_out, i_out):
    q = q_ref[...]
    row = lax.broadcasted_iota(jnp.int32, (rp, 1), 0)
    slot = lax.broadcasted_iota(jnp.int32, (1, kp), 1)
    for r in range(rows):
      cands = []
      for c in range(kb):
        nominal = blocks_ref[r, c] * GPU_BLOCK
        tile, key = gpu.key_tile(nominal, GPU_BLOCK, t)
        s = online_softmax.scores(q, k_ref[tile, :], scale)
        ok = (row == r) & (key >= nominal) & (key >= bounds_ref[0]) & (key < bounds_ref[1])
        cands.append((jnp.max(jnp.where(ok, s, NEG_INF), axis=0, keepdims=True), key))
      vals = jnp.full((1, kp), NEG_INF, jnp.float32)
      keys = jnp.full((1, kp), -1, jnp.int32)
      for j in range(top_k):
        best = functools.reduce(jnp.maximum, [jnp.max(s) for s, _ in cands])
        at = functools.reduce(jnp.minimum, [jnp.min(jnp.where(s == best, key, BIG_INDEX))
                                            for s, key in cands])
        vals = jnp.where(slot == j, best, vals)
        keys = jnp.where(slot == j, jnp.where(best == NEG_INF, -1, at), keys)
        cands = [(jnp.where(key == at, NEG_INF, s), key) for s, key in cands]
      v_out[pl.ds(r, 1), :] = vals
      i_out[pl.ds(r, 1), :] = keys

  out = jax.ShapeDtypeStruct((b, kvh, rp, kp), jnp.float32)
  return gpu.pallas_call(
      kernel, interpret, num_warps=4, num_stages=1, grid=(b * kvh,),
      in_specs=[gpu.per_batch_spec(kvh, 2), _heads_rows_spec(kvh, rp, d),
                gpu.whole_keys_spec(kv_layout, t, d, kvh),
                _heads_rows_spec(kvh, rp, blocks.shape[-1])],
      out_specs=[_heads_rows_spec(kvh, rp, kp)] * 2,
      out_shape=[out, out.update(dtype=jnp.int32)],
  )(bounds, qr, k, blocks)
