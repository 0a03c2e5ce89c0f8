"""Exact top-k for a few query rows (decode): the scores once, then a top-k of block maxima.

A decode step's scores are small ([B, H, T] fp32: 1/16 of K's bytes at d 128), so they are
computed by one matrix product (XLA's) and kept, and the selection needs no running set: the
key axis is cut into blocks, each block's per-row maximum is taken (an XLA reduction), and only
the k best blocks are read again. What follows runs in one small Pallas kernel
(`pick_from_blocks`, the GPU default) or as jnp (`top_k_by_blocks`: a sort, a gather and a CUB
top-k, each its own kernel); on an H200 the kernel made ReAttention's decode step at 32K 5.99
against 6.34 ms (BENCHMARKS.md "ReAttention"). The fused kernel (topk.py) instead keeps a
running set in registers, whose updates cost rounds at the start of every key split; the block
maxima and the rescoring as two Triton kernels around `lax.top_k` measured slower than XLA's
product and reduction.

Exact, ties included: order keys by (score desc, index asc) and blocks by (their maximum desc,
block asc), which `lax.top_k` gives (it keeps the lower index first among equals) and the
kernel's passes give (a max, then the lowest index holding it). A key x of the true top-k lies
in one of the k first blocks: otherwise each of those k blocks holds a key (its first maximum)
with a higher score than x, or the same score at a lower index (an earlier block), so k keys
would precede x. Among the chosen blocks' keys equal scores again go to the lowest index (jnp:
the blocks sorted by position before `lax.top_k`; the kernel: the min index).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant4, reference
from pallas_kernels.topk import int4_scores, int4_scores_tpu

NEG_INF = float("-inf")
BIG_INDEX = 2**31 - 1
MAX_ROWS = 16  # query rows per kv head served here; more (prefill chunks) would store big scores
# Warps of pick_from_blocks' one-row programs: on an H200 (32 rows, top-4) 4 warps took 5.5 us
# at 1M keys against 10.5 with 1, and the same 3.2-3.6 us at 32K and 128K.
PICK_WARPS = 4
# The kernel's passes are unrolled (k + k_blocks of them) over k_blocks * block candidates held
# in registers: larger k take the jnp pick.
PICK_MAX_K = 16


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
                block: int | None = None, pick: str = "jnp", interpret=False):
  """topk.topk_scores for few rows: (scores fp32, indices int32) [B, Lq, H, top_k], best first,
  ties to the lowest index, unfilled (-inf, -1); candidates lo[b] <= t < hi[b]. pick: how the
  k best blocks and their keys are chosen from the block maxima, "jnp" (`top_k_by_blocks`) or
  "kernel" (`pick_from_blocks`: one small Pallas kernel, up to PICK_MAX_K; `interpret` for its
  pallas_call)."""
  b, lq, h, _ = q.shape
  if pick == "kernel" and top_k <= PICK_MAX_K:
    v, i = pick_from_blocks(q, k, top_k, lo, hi, scale=scale, kv_layout=kv_layout, block=block,
                            interpret=interpret)
  else:
    s = _jnp_pick_scores(q, k, kv_layout, scale, interpret)  # [B, Lq, KV, G, T] fp32
    t = s.shape[-1]
    key = jnp.arange(t, dtype=jnp.int32)
    ok = (key >= lo[:, None]) & (key < hi[:, None])  # [B, T]
    s = jnp.where(ok[:, None, None, None, :], s, NEG_INF)
    v, i = top_k_by_blocks(s, top_k, min(block or block_size(top_k), layout.next_pow2(t)))
  i = jnp.where(v == NEG_INF, -1, i)
  return v.reshape(b, lq, h, top_k), i.reshape(b, lq, h, top_k).astype(jnp.int32)


def _jnp_pick_scores(q, k, kv_layout: str, scale, interpret):
  """The jnp pick's scores [B, Lq, KV, G, T] fp32: 4-bit keys (quant4.GroupedKeys, which reach
  it on the TPU variant: read.four_bit_scores) by int4_scores_tpu's kernel from their codes,
  others by XLA's product."""
  if not isinstance(k, quant4.GroupedKeys):
    return reference.key_scores(q, k, kv_layout, scale)
  b, lq, h, _ = q.shape
  kvh, t = k.shape[1], k.shape[2]
  s = int4_scores_tpu.scores(q, k, scale=scale, interpret=interpret)  # [B, KV, Lq x G, T]
  return s.reshape(b, kvh, lq, h // kvh, t).transpose(0, 2, 1, 3, 4)


def pick_from_blocks(q, k, top_k: int, lo, hi, *, scale=None, kv_layout: str = "BTHD",
                     block: int | None = None, interpret=False):
  """topk_scores' selection after XLA's product and block maxima in one Pallas kernel: each
  program takes one row's k best blocks by (maximum desc, block asc), gathers their scores and
  picks the k best by (score desc, index asc), each by k passes of a max and a min index in
  registers, where the jnp graph runs a sort, a gather and a CUB top-k as separate kernels. The
  candidate bounds are applied in the maxima's reduction and in the kernel, so the scores are
  read as the product wrote them; 4-bit keys (quant4.GroupedKeys, kv_layout "BHTD") are scored
  by int4_scores' kernel from their codes. Returns (values fp32, indices int32) [B, Lq, KV, G,
  top_k]; a hole (fewer than top_k candidates) is -inf with an arbitrary index."""
  b, lq, h, d = q.shape
  if isinstance(k, quant4.GroupedKeys):  # 4-bit keys: scored from their codes as stored
    kvh, t = k.shape[1], k.shape[2]
    s = int4_scores.scores(q, k, scale=scale, interpret=interpret)
  else:
    kh, key_scale = reference.key_parts(k, q.dtype, kv_layout)  # 8-bit: values and scales
    kvh, t = kh.shape[1], kh.shape[2]
    qg = q.reshape(b, lq, kvh, h // kvh, d)
    s = jnp.einsum("bqkgd,bktd->bkqgt", qg, kh, preferred_element_type=jnp.float32)
    if key_scale is not None:  # each key's scale on its column (XLA fuses it into the product)
      s = s * key_scale[:, :, None, None, :]
    s = (s if scale is None else s * scale).reshape(b, kvh, lq * (h // kvh), t)
  g = h // kvh
  rows = lq * g
  block = min(block or block_size(top_k), layout.next_pow2(t))
  top_k = min(top_k, t)
  n_blocks = -(-t // block)
  key = jnp.arange(n_blocks * block, dtype=jnp.int32)
  ok = (key >= lo[:, None]) & (key < hi[:, None])  # [B, T padded]
  padded = jnp.pad(s, ((0, 0), (0, 0), (0, 0), (0, n_blocks * block - t)))
  masked = jnp.where(ok[:, None, None, :], padded, NEG_INF)
  maxima = jnp.max(masked.reshape(b, kvh, rows, n_blocks, block), axis=4)
  nbp = layout.next_pow2(n_blocks)
  maxima = jnp.pad(maxima, ((0, 0), (0, 0), (0, 0), (0, nbp - n_blocks)),
                   constant_values=NEG_INF)
  bounds = jnp.stack([lo, hi], axis=1).astype(jnp.int32)  # [B, 2]
  v, i = _pick(s.reshape(b * kvh, rows * t), maxima.reshape(b * kvh, rows, nbp), bounds,
               k=top_k, kb=min(top_k, n_blocks), block=block, kvh=kvh, t=t,
               interpret=interpret)
  v, i = (x[..., :top_k].reshape(b, kvh, lq, g, top_k).transpose(0, 2, 1, 3, 4) for x in (v, i))
  return v, i


@functools.partial(jax.jit, static_argnames=("k", "kb", "block", "kvh", "t", "interpret"))
def _pick(x, maxima, bounds, *, k: int, kb: int, block: int, kvh: int, t: int, interpret):
  """x [B*KV, rows * T] (a sequence's kv head: its [rows, T] scores), maxima [B*KV, rows, nbp],
  bounds [B, 2] -> (values, indices) [B*KV, rows, next_pow2(k)]."""
  bk, rows, nbp = maxima.shape
  width = layout.next_pow2(k)
  cands = layout.next_pow2(kb) * block

  def kernel(bounds_ref, m_ref, x_ref, v_out, i_out):
    lo, hi = bounds_ref[0], bounds_ref[1]
    row = pl.program_id(1)
    m = m_ref[...]  # [nbp]
    bid = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    taken = bid < 0
    chosen = []  # the kb best blocks (scalars); a block once taken is never taken again
    for _ in range(kb):
      best = jnp.max(jnp.where(taken, NEG_INF, m))
      at = jnp.min(jnp.where((m == best) & ~taken, bid, BIG_INDEX))
      chosen.append(at)
      taken = taken | (bid == at)
    slot = lax.broadcasted_iota(jnp.int32, (cands,), 0)
    which = slot // block
    first = jnp.zeros((cands,), jnp.int32)
    for j, at in enumerate(chosen):
      first = jnp.where(which == j, at * block, first)
    key = first + slot % block
    live = (which < kb) & (key >= lo) & (key < hi) & (key < t)
    safe = jnp.clip(key, 0, t - 1)
    s = x_ref[row * t + safe]  # a gather of kb blocks
    s = jnp.where(live, s, NEG_INF)
    out = lax.broadcasted_iota(jnp.int32, (width,), 0)
    vals, idx = jnp.full((width,), NEG_INF, jnp.float32), jnp.full((width,), -1, jnp.int32)
    for j in range(k):
      best = jnp.max(s)
      at = jnp.min(jnp.where(s == best, key, BIG_INDEX))
      vals = jnp.where(out == j, best, vals)
      idx = jnp.where(out == j, at, idx)
      s = jnp.where(key == at, NEG_INF, s)
    v_out[...] = vals
    i_out[...] = idx

  per_row = lambda n: pl.BlockSpec((gpu.SQ, gpu.SQ, n), lambda i, r: (i, r, 0))  # noqa: E731
  return gpu.pallas_call(
      kernel, interpret, num_warps=PICK_WARPS, num_stages=1, grid=(bk, rows),
      in_specs=[pl.BlockSpec((gpu.SQ, 2), lambda i, r: (i // kvh, 0)), per_row(nbp),
                pl.BlockSpec((gpu.SQ, x.shape[1]), lambda i, r: (i, 0))],
      out_specs=[per_row(width), per_row(width)],
      out_shape=[jax.ShapeDtypeStruct((bk, rows, width), jnp.float32),
                 jax.ShapeDtypeStruct((bk, rows, width), jnp.int32)],
  )(bounds, maxima, x)
