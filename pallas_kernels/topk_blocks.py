"""Exact top-k for a few query rows (decode): the scores once, then a top-k of block maxima.

A decode step's scores are small ([B, H, T] fp32: 1/16 of K's bytes at d 128), so they are
computed by one matrix product and kept, and the selection needs no running set: the key axis
is cut into blocks, each block's per-row maximum is taken, and only the k best blocks are read
again. The fused kernel (topk.py) instead keeps a running set in registers, whose updates cost
rounds at the start of every key split. On an H200 this graph selected faster than the fused
kernel in ReAttention's decode at 32K-1M (BENCHMARKS.md "ReAttention"); the same scheme as two
Triton kernels (block maxima; the chosen blocks scored again) measured slower, so it stays jnp.

Exact, ties included: order keys by (score desc, index asc) and blocks by (their maximum desc,
block asc), which `lax.top_k` gives (it keeps the lower index first among equals). A key x of
the true top-k lies in one of the k first blocks: otherwise each of those k blocks holds a key
(its first maximum) with a higher score than x, or the same score at a lower index (an earlier
block), so k keys would precede x. The chosen blocks are sorted by position before their scores
are joined, so among equal scores the final `lax.top_k` again keeps the lowest index.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import layout, reference

NEG_INF = float("-inf")
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


def top_k_by_blocks(x, k: int, block: int, *, direct_max: int = 0):
  """`lax.top_k(x, k)` over the last axis through block maxima: the same entries, best first,
  equal values by lower index. The key axis is cut into blocks of `block` (the last padded with
  the dtype's lowest value, so a pad is chosen only when the row holds fewer than k entries:
  its index is then >= the axis length); the k best blocks by their maxima are read again.
  Rows of at most `direct_max` entries (and the block maxima, recursively, when there are more
  than that) go to `lax.top_k` directly: its sort is one kernel for short rows."""
  low = NEG_INF if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
  if x.shape[-1] < k:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, k - x.shape[-1])], constant_values=low)
  t = x.shape[-1]
  if t <= max(direct_max, block):
    return lax.top_k(x, k)
  n_blocks = -(-t // block)
  if n_blocks * block != t:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_blocks * block - t)], constant_values=low)
  xb = x.reshape(*x.shape[:-1], n_blocks, block)
  kb = min(k, n_blocks)
  maxima = jnp.max(xb, axis=-1)
  if direct_max and n_blocks > direct_max:
    _, blocks = top_k_by_blocks(maxima, kb, block, direct_max=direct_max)
  else:
    _, blocks = lax.top_k(maxima, kb)
  blocks = _sort_few(blocks)  # position order, so equal values keep the lower index
  cand = jnp.take_along_axis(xb, blocks[..., None], axis=-2)  # [..., kb, block]
  v, pos = lax.top_k(cand.reshape(*cand.shape[:-2], kb * block), k)
  return v, jnp.take_along_axis(blocks, pos // block, axis=-1) * block + pos % block


def topk_scores(q, k, top_k: int, lo, hi, *, scale=None, kv_layout: str = "BTHD",
                block: int | None = None):
  """topk.topk_scores for few rows: (scores fp32, indices int32) [B, Lq, H, top_k], best first,
  ties to the lowest index, unfilled (-inf, -1); candidates lo[b] <= t < hi[b]."""
  b, lq, h, _ = q.shape
  s = reference.grouped_scores(q, k, kv_layout, scale)  # [B, Lq, KV, G, T] fp32
  t = s.shape[-1]
  key = jnp.arange(t, dtype=jnp.int32)
  ok = (key >= lo[:, None]) & (key < hi[:, None])  # [B, T]
  s = jnp.where(ok[:, None, None, None, :], s, NEG_INF)
  block = min(block or block_size(top_k), layout.next_pow2(t))
  v, i = top_k_by_blocks(s, top_k, block)
  i = jnp.where(v == NEG_INF, -1, i)
  return v.reshape(b, lq, h, top_k), i.reshape(b, lq, h, top_k).astype(jnp.int32)
