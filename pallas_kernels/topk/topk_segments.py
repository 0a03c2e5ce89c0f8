"""Exact top-k for prefill chunks in two stages: each row's k best segments, then their keys.

The Mosaic kernel's running set of keys (mgpu_topk's rounds) costs passes over every score tile
whenever some row of a warpgroup gains a key, which on a short or fresh cache is nearly every
tile. Here stage 1 (mgpu_topk, selection "segments") keeps for each row its k best segments of
SEGMENT consecutive keys, ranked by the segment's max score: per tile, each segment's max is a
slice of one row reduction, and inserting it into a sorted set of k is row-vector work, not a
pass over the tile. Stage 2 (this module, `best_keys`: one Pallas kernel) scores the k
segments' k * SEGMENT keys again, gathered from the cache, and takes the top k among them.

Strided segments (stage 1's selection "columns", the default): a segment is the keys of one
window of 64 whose index is c mod 8, for one of the 8 columns c of WGMMA's accumulator blocks,
so that a thread holds all of its keys' scores: its max is elementwise maxima of the thread's own
registers, with no shuffles across lanes and no test across the warpgroup, and each (row,
column) keeps a set. Stage 2 then scores kp + 7 segments a row (`keys_of_segments` says why).

Exact, ties included (the argument of topk_blocks.py): order keys by (score desc, index asc) and
segments by (max desc, first key asc), which stage 1 keeps (a segment enters after the kept ones
it does not beat strictly, and of a tile's equal maxima the first enters first) and the merge of
key splits keeps (topk_tile.finish sorts by both). A key x of the true top-k lies in one of the
k first segments: otherwise each of them holds a key that precedes x (a higher score, or the
same score in an earlier segment), k keys in all. Stage 2 takes of equal scores the lowest
key. Its product runs in fp32 like the kernel's WGMMA but in another order: on scores equal to
the last bit (integer inputs, the tests) the result is the reference's; elsewhere it is exact
up to that summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant
from pallas_kernels.topk import mgpu_select, topk_tile

SQ = gpu.SQ
NEG_INF = float("-inf")
BIG_INDEX = 2**31 - 1
# Keys per segment: stage 2 reads top_k * SEGMENT keys per row. On an H200 (512 queries, top-4)
# 16 beat 8 at 128K keys and 32 at 32K keys; 32 was faster from 128K keys up.
SEGMENT = 16
# Stage 2's programs: one query row each, one warp (on an H200, benchmarks/topk_rescore.py:
# 0.070 / 0.090 / 0.092 ms at 8K / 32K / 128K keys against 0.087 / 0.107 / 0.112 with 8 rows
# and 4 warps, the fastest of 9 settings: more programs in flight hide the gathers' latency).
RESCORE_ROWS = 1
RESCORE_WARPS = 1


# Strided segments (stage 1's selection "columns"): windows of COLUMN_WINDOW keys, a segment the
# window's keys of one column mod 8 (COLUMN_WINDOW / 8 keys a segment), each row keeping its kp
# best of each column's; at most COLUMN_MAX_KP (its sets are 2 * kp register tiles a row).
# On an H200 (512 queries x 128K / 1M keys, top 4): windows of 64 beat 32 (int8 1.13 / 6.68 ms
# against 1.16 / 8.23). Windows of 128 halve the sets' upkeep (a quarter of the kernel at 1M
# keys) and double stage 2's candidates (176 a row, padded to 256: 0.24 ms int8, 0.33 bf16, on
# 8 warps): level at 128K keys, 12-14% faster at 512K and 1M (int8 2.91 / 5.57 ms against 3.31 /
# 6.42, bf16 3.72 / 7.28 against 4.11 / 8.47): COLUMN_WINDOW_LONG from COLUMN_LONG_KEYS keys.
COLUMN_WINDOW = 64
COLUMN_WINDOW_LONG = 128
COLUMN_LONG_KEYS = 1 << 19
COLUMN_MAX_KP = 8


def rescore_warps(candidates: int, eight_bit: bool) -> int:
  """best_keys' warps for `candidates` keys a row (on an H200, 2,048 rows a KV head: 64
  candidates on one warp 0.07-0.08 ms; 128 of 8-bit keys on four 0.12 (one: 0.28), of bf16 on
  eight 0.14 (one: 0.17); 256 on eight 0.24 / 0.33 (four: 0.26 / 0.42))."""
  if candidates <= 64:
    return RESCORE_WARPS
  return 4 if candidates <= 128 and eight_bit else 8


def fits(keys: int, block_kv: int, segment: int = SEGMENT) -> bool:
  """Whether stage 1 can cut these keys into segments (windows) of `segment` keys: its tiles
  (and the clamped last one) must start on segment boundaries."""
  return keys % segment == 0 and block_kv % segment == 0


def column_window(keys: int, block_kv: int, top_k: int, window: int = 0) -> int | None:
  """The window of strided segments for these keys, tiles and top_k (window: KernelOptions.
  topk_column_window, 0: COLUMN_WINDOW, or COLUMN_WINDOW_LONG from COLUMN_LONG_KEYS keys), or
  None where they do not fit (contiguous segments then)."""
  window = window or (COLUMN_WINDOW_LONG if keys >= COLUMN_LONG_KEYS else COLUMN_WINDOW)
  return window if top_k <= COLUMN_MAX_KP and fits(keys, block_kv, window) else None


def keys_of_segments(qr, k, bounds, seg_vals, seg_firsts, top_k: int, *, scale, kv_layout: str,
                     interpret, window: int | None = None, words: bool = False):
  """Stage 2. qr [B, KV, R, d]; k (kv_layout); bounds [B, 2] (lo, hi); seg_vals / seg_firsts
  [B, KV, S, R, kp]: stage 1's segments per key split (window: strided segments of that
  window, [B, KV, S, R, kp * 8], stage 1's "columns"). Returns (scores fp32, keys int32)
  [B, KV, 1, R, top_k] best first, unfilled (-inf, -1): one "split" for topk._finish. Keys of
  2^31 elements or more: best_keys over their int32 words where `words` (KernelOptions.
  topk_rescore_words) and `packable`, else best_keys_xla.

  Strided segments: their kp + 7 best by (max desc, first asc) over all columns and splits hold
  the top kp keys, ties included. A key x of the top kp lies in a segment X; of the segments
  ahead of X, each holds a key that precedes x (the argument above: a higher score, or the
  same score in an earlier window), at most kp - 1 in all, but for the segments of X's own
  window (another column, whose keys interleave with X's), at most 7. Each column's set kept
  X, by the same argument within one column, whose windows are in key order."""
  b, kvh, splits, rp, n = seg_vals.shape
  columns = window is not None
  kp = n // mgpu_select.COLUMNS if columns else n
  keep, length, stride = ((kp + mgpu_select.COLUMNS - 1, window // mgpu_select.COLUMNS,
                           mgpu_select.COLUMNS) if columns else (kp, SEGMENT, 1))
  firsts = jnp.moveaxis(seg_firsts, 2, 3).reshape(b, kvh, rp, splits * n)
  if firsts.shape[-1] > keep:  # the best of all splits' (and columns') segments
    vals = jnp.moveaxis(seg_vals, 2, 3).reshape(b, kvh, rp, splits * n)
    _, firsts = topk_tile.finish(vals, firsts, keep)
  offsets = stride * jnp.arange(length, dtype=jnp.int32)
  keys = (firsts[..., None] + offsets).reshape(b, kvh, rp, -1)
  lo, hi = bounds[:, 0, None, None, None], bounds[:, 1, None, None, None]
  ok = jnp.repeat(firsts >= 0, length, axis=-1) & (keys >= lo) & (keys < hi)
  keys = jnp.where(ok, keys, -1)
  pad = layout.next_pow2(keys.shape[-1]) - keys.shape[-1]  # Triton blocks: powers of two
  keys = jnp.pad(keys, ((0, 0),) * 3 + ((0, pad),), constant_values=-1)
  packed = not gpu.triton_indexable(k)  # 2^31 keys' elements or more
  if packed and not (words and packable(k)):  # gathered by XLA
    v, i = best_keys_xla(qr, k, keys, top_k, scale=scale, kv_layout=kv_layout)
    return v[:, :, None], i[:, :, None]
  v, i = best_keys(qr, k, keys, top_k, scale=scale, kv_layout=kv_layout, interpret=interpret,
                   warps=rescore_warps(keys.shape[-1], quant.is_quantized(k)), packed=packed)
  return v[:, :, None], i[:, :, None]


def packable(k) -> bool:
  """Whether best_keys(packed=True) reads these keys: int8 or bf16 whose int32 words a Triton
  kernel can index."""
  values = layout.parts(k)[0]
  per = 4 // values.dtype.itemsize
  return (values.dtype in (jnp.int8, jnp.bfloat16) and values.shape[-1] % per == 0
          and gpu.triton_indexable(jax.ShapeDtypeStruct((values.size // per,), jnp.int32),
                                   layout.parts(k)[1]))


@functools.partial(jax.jit, static_argnames=("top_k", "scale", "kv_layout"))
def best_keys_xla(qr, k, keys, top_k: int, *, scale, kv_layout: str):
  """best_keys by XLA (64-bit indexing: keys of 2^31 elements or more, which the Triton kernel
  cannot index): each (sequence, KV head) gathers its rows' candidates in turn (lax.map: one
  [R, n, d] gather alive at a time), scores them in fp32, and keeps the top_k (score desc, key
  asc)."""
  b, kvh, rp, _ = keys.shape
  values, k_scale = layout.parts(k)
  t = values.shape[1 if kv_layout == "BTHD" else 2]

  def head(bh):
    i, h = bh // kvh, bh % kvh
    idx = jnp.clip(keys[i, h], 0, t - 1)  # [R, n]
    kt = (values[i, idx, h] if kv_layout == "BTHD" else values[i, h, idx]).astype(jnp.float32)
    if k_scale is not None:
      kt = kt * (k_scale[i, idx, h] if kv_layout == "BTHD" else k_scale[i, h, idx])[..., None]
    s = jnp.einsum("rd,rnd->rn", qr[i, h].astype(jnp.float32), kt)
    s = jnp.where(keys[i, h] >= 0, s if scale is None else s * scale, NEG_INF)
    return topk_tile.finish(s, keys[i, h], top_k)

  v, i = lax.map(head, jnp.arange(b * kvh))
  return v.reshape(b, kvh, rp, top_k), i.reshape(b, kvh, rp, top_k)


@functools.partial(jax.jit, static_argnames=("top_k", "scale", "kv_layout", "interpret", "rows",
                                             "warps", "packed"))
def best_keys(qr, k, keys, top_k: int, *, scale, kv_layout: str, interpret,
              rows: int = RESCORE_ROWS, warps: int = RESCORE_WARPS, packed: bool = False):
  """The top_k of each row's own candidate keys by q.k (times scale): qr [B, KV, R, d], keys
  int32 [B, KV, R, n] (distinct; -1: no candidate) -> (scores fp32, keys int32) [B, KV, R,
  top_k], best first, equal scores by lower key, unfilled (-inf, -1). One program per `rows`
  rows (`warps` warps); each row's keys are gathered from the cache by pointer loads, reduced
  against its query in fp32 and selected in registers (top_k passes over n scores). 8-bit k
  (quant.Quantized): each gathered key times its scale, as the dequantize-first reference.
  packed (int8 or bf16 keys): the kernel takes the keys as int32 words (gpu.words), 4 / 2 times
  fewer elements, so caches of 2^31 elements or more stay within Triton's int32 offsets; the
  products are the same but summed in another order, the keys' scales applied after."""
  b, kvh, rp, d = qr.shape
  n = keys.shape[-1]
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  width = layout.next_pow2(top_k)  # Triton blocks: powers of 2
  k, k_scale = layout.parts(k)
  stored = k.dtype
  if packed:
    k, qr = gpu.words(k), gpu.in_word_order(qr, 4 // stored.itemsize)
  w = k.shape[-1]

  def scores(q_ref, k_ref, ks_ref, r, at):
    """Row r's q . k over the gathered keys `at` (clipped), fp32."""
    if not packed:
      kt = k_ref[at, :].astype(jnp.float32)  # [n, d]: a gather
      if ks_ref is not None:
        kt = kt * ks_ref[at][:, None]
      return jnp.sum(kt * q_ref[r, :].astype(jnp.float32)[None, :], axis=1)
    parts = gpu.from_words(k_ref[at, :], stored)  # [n, w] each: a gather of words
    s = sum(jnp.sum(p * q_ref[r, pl.ds(j * w, w)].astype(jnp.float32)[None, :], axis=1)
            for j, p in enumerate(parts))
    return s if ks_ref is None else s * ks_ref[at]

  def kernel(q_ref, keys_ref, k_ref, *refs):
    ks_ref, v_out, i_out = refs if k_scale is not None else (None, *refs)
    slot = lax.broadcasted_iota(jnp.int32, (width,), 0)
    for r in range(rows):
      key = keys_ref[r, :]
      s = scores(q_ref, k_ref, ks_ref, r, jnp.clip(key, 0, t - 1))
      s = jnp.where(key >= 0, s if scale is None else s * scale, NEG_INF)
      vals, idx = jnp.full((width,), NEG_INF, jnp.float32), jnp.full((width,), -1, jnp.int32)
      for j in range(top_k):
        best = jnp.max(s)
        at = jnp.min(jnp.where(s == best, key, BIG_INDEX))
        vals = jnp.where(slot == j, best, vals)
        idx = jnp.where(slot == j, jnp.where(best == NEG_INF, -1, at), idx)
        s = jnp.where(key == at, NEG_INF, s)
      v_out[r, :] = vals
      i_out[r, :] = idx

  block = lambda m: pl.BlockSpec((SQ, SQ, rows, m), lambda bh, r: (bh // kvh, bh % kvh, r, 0))  # noqa: E731
  v, i = gpu.pallas_call(
      kernel, interpret, num_warps=warps, num_stages=1, grid=(b * kvh, rp // rows),
      in_specs=[gpu.row_spec(kvh, rows, d), block(n), gpu.whole_keys_spec(kv_layout, t, w, kvh),
                *([gpu.whole_scales_spec(kv_layout, t, kvh)] if k_scale is not None else [])],
      out_specs=[block(width), block(width)],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, rp, width), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, rp, width), jnp.int32)],
  )(qr, keys, k, *([k_scale] if k_scale is not None else []))
  return v[..., :top_k], i[..., :top_k]
