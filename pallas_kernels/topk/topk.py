"""Fused score + exact top-k: q.k over a long key axis, tile by tile, without a score matrix in HBM.

GPU: one program per (batch x kv head, row block, key split); it loops over its split's key
tiles, scores every query head of the group against each K tile in one matrix product and keeps
a running top-k (topk_tile). Splitting the key axis keeps the GPU busy when there are few
queries (decode); the splits' candidates (kp per row each) are merged by a small sort after.
TPU: the key tiles are the innermost grid axis and the running set lives in VMEM scratch.
On Hopper, prefill chunks (at least MOSAIC_MIN_ROWS rows per kv head) can run the Mosaic GPU
kernel of mgpu_topk.py instead (KernelOptions.topk_impl, or tiling.impl="mosaic" per call); its
output has the Triton kernel's layout, so the splits are merged the same way. For top_k > 1 it
keeps each row's best segments of keys rather than keys, which topk_segments.py resolves
(KernelOptions.topk_many_rows: contiguous segments, or strided ones, a set for each of a row's
8 columns, whose update needs no shuffles). On the GPU, few
rows (decode; no tiling asked) go to topk_blocks.py unless KernelOptions.topk_few_rows is
"kernel": there the scores are stored, which a decode step can afford.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu, layout, online_softmax, quant, quant4, read, reference, tpu
from pallas_kernels.mgpu_common import SMEM_LIMIT
from pallas_kernels.topk import mgpu_select, mgpu_topk, topk_blocks, topk_segments, topk_tile
from pallas_kernels.options import DEFAULT, KernelOptions
from pallas_kernels.route import Route

SQ = gpu.SQ

# Mosaic (KernelOptions.topk_impl): on an H200 512 queries x 128K / 512K keys, top-4, ran 1.26x /
# 1.69x the Triton kernel with equal indices (benchmarks/results/mgpu_topk_h200.json).
MOSAIC_MIN_ROWS = 64  # query rows (queries x group) per kv head: fewer (decode) never run Mosaic


def topk_scores(q, k, top_k: int, *, scale: float | None = None, valid_len=None,
                exclude_prefix=0, exclude_suffix=0, kv_layout: str = "BTHD",
                route: Route, tiling: gpu.Tiling | None = None):
  """For each query row and query head, the exact top-k of q.k over the candidate keys.

  q: [B, Lq, H, d]; k: [B, T, KV, d] ("BTHD") or [B, KV, T, d] ("BHTD"), H a multiple of KV.
  Candidates of sequence b are keys exclude_prefix <= t < valid_len[b] - exclude_suffix.
  Returns (scores fp32, indices int32), both [B, Lq, H, top_k], best first, ties to the lowest
  index; when fewer candidates than top_k exist the rest is (-inf, -1).
  tiling overrides the tuned block sizes and launch options (tests, benchmarks); route is the
  run's kernel route (its variant; `KernelOptions.topk_impl`, `topk_selection` for the GPU / TPU
  kernels, the reference always selects exactly).
  """
  if (q_kernel := read.kernel_queries(q, k, route.variant())) is not q:
    return topk_scores(q_kernel, k, top_k, scale=scale, valid_len=valid_len,
                       exclude_prefix=exclude_prefix, exclude_suffix=exclude_suffix,
                       kv_layout=kv_layout, route=route, tiling=tiling)
  segment = read.four_bit_topk_segment(q, k, route.kernels, k.shape[2])
  if segment and route.variant().kind != "reference":  # the reference scores one whole copy
    if kv_layout != "BHTD":
      raise ValueError("a 4-bit cache is laid out [B, KV, T, d] (kv_layout='BHTD')")
    b, t = q.shape[0], k.shape[2]
    if not 1 <= top_k <= t:
      raise ValueError(f"top_k={top_k} must be between 1 and the number of keys ({t})")
    lo = layout.per_batch(exclude_prefix, b, 0)
    hi = layout.per_batch(valid_len, b, t) - layout.per_batch(exclude_suffix, b, 0)
    if read.four_bit_scores(q, k, route.variant(), route.kernels, top_k, tiled=tiling is not None,
                            max_rows=topk_blocks.MAX_ROWS, max_k=topk_blocks.PICK_MAX_K):
      # the TPU selects in jnp over its kernel's scores (pick_from_blocks is a Triton kernel)
      pick = "jnp" if route.variant().kind == "tpu" else "kernel"
      return topk_blocks.topk_scores(q, k, top_k, lo, hi, kv_layout=kv_layout, pick=pick,
                                     scale=None if scale is None or float(scale) == 1.0 else scale,
                                     interpret=route.variant().interpret_arg())
    if segment < t:
      return _segmented_copy(q, k, top_k, segment, lo, hi, scale=scale, kv_layout=kv_layout,
                             route=route, tiling=tiling)
  k, = read.four_bit_copies(q.dtype, k)
  b, lq, h, kvh, t, d = layout.check_qk(q, k, kv_layout)
  quantized = layout.check_kv(k, k)
  if scale is not None and float(scale) == 1.0:
    scale = None  # a multiply per score the kernels need not do (ReAttention scores raw q.k)
  if not 1 <= top_k <= t:
    raise ValueError(f"top_k={top_k} must be between 1 and the number of keys ({t})")
  valid_len = layout.per_batch(valid_len, b, t)
  lo = layout.per_batch(exclude_prefix, b, 0)
  hi = valid_len - layout.per_batch(exclude_suffix, b, 0)
  variant, options = route.variant(), route.kernels
  asked = options.topk_eight_bit if quantized else "dequantize"
  eight_bit_products = asked == "products"  # everywhere; "auto": in Hopper's Mosaic kernel only
  if variant.kind == "tpu":
    tpu.check_kv_dtype(k)
  if variant.kind == "reference":
    return reference.topk_scores(q, k, top_k, lo, hi, scale=scale, kv_layout=kv_layout,
                                 products=eight_bit_products)

  kp = max(4, layout.next_pow2(top_k))
  rows = lq * (h // kvh)
  if (variant.kind == "gpu" and tiling is None and rows <= topk_blocks.MAX_ROWS
      and options.topk_few_rows != "kernel" and options.topk_selection == "exact"):
    return topk_blocks.topk_scores(q, k, top_k, lo, hi, scale=scale, kv_layout=kv_layout,
                                   pick="jnp" if options.topk_few_rows == "blocks_jnp"
                                   else "kernel", interpret=variant.interpret_arg())
  bounds = jnp.stack([lo, hi], axis=1)  # [B, 2]
  # Many query rows over 8-bit keys on Hopper: the Mosaic kernel on the 8-bit tensor cores.
  if asked in ("products", "auto"):
    mosaic = _mosaic_config(variant, q, k, rows, top_k, tiling, keys=t, options=options)
    if mosaic is not None:
      return _finish_mosaic(q, k, bounds, top_k, mosaic, scale=scale, kv_layout=kv_layout,
                            tiling=tiling, options=options, variant=variant)
  # Many query rows (a prefill chunk) over 8-bit keys: their copy in q's dtype and the bf16
  # kernels within `topk_dequantize_bytes`, the whole copy or, where it does not fit, a segment
  # of keys at a time (options.py says why).
  segment = read.topk_copy_segment(q, k, variant, options, kv_layout, t)
  if segment >= t:
    k, quantized = quant.dequantize(k, q.dtype), False
  elif segment:
    return _segmented_copy(q, k, top_k, segment, lo, hi, scale=scale, kv_layout=kv_layout,
                           route=route, tiling=tiling)
  # Otherwise 8-bit keys take the Triton kernel (tiles converted in registers) on a GPU.
  mosaic = None if quantized else _mosaic_config(variant, q, k, rows, top_k, tiling, keys=t,
                                                 options=options)
  if mosaic is not None:
    return _finish_mosaic(q, k, bounds, top_k, mosaic, scale=scale, kv_layout=kv_layout,
                          tiling=tiling, options=options, variant=variant)
  # The running set is kp registers per row: fewer rows per program when k is large. GPU
  # defaults measured on an H200 (BENCHMARKS.md): 64 x 64 tiles for chunks, 256-key tiles for
  # decode, where a program has few rows and checks its set once per tile.
  bm = min(max(16, layout.next_pow2(rows)), 64 if kp <= 64 else 32)
  bk = 256 if variant.kind != "gpu" else gpu.fitting_block_keys(
      256 if bm <= 16 else 64, block_rows=bm, d=d, itemsize=q.dtype.itemsize, num_stages=3,
      tensors=1)
  tl = (tiling or gpu.Tiling()).pick(block_rows=bm, block_keys=bk, num_warps=4, num_stages=3,
                                     prefetch=False)
  bm, bk = tl.block_rows, tl.block_keys
  rows_padded = layout.round_up(rows, bm)
  qr = layout.q_rows(q, kvh, rows_padded)
  if variant.kind == "gpu":
    kk, ks = layout.parts(layout.pad_keys(k, kv_layout, bk))
    tk = kk.shape[1 if kv_layout == "BTHD" else 2]
    span, splits = gpu.split_plan(b * kvh * (rows_padded // bm), tk, bk, tl.key_splits)
    vals, idx = _gpu(qr, kk, bounds, ks, kp=kp, span=span, splits=splits, scale=scale,
                     kv_layout=kv_layout, tiling=tl, selection=options.topk_selection,
                     interpret=variant.interpret_arg())
  else:
    kh, ks = layout.parts(layout.heads_first(k, kv_layout))
    if eight_bit_products:  # int8 x int8 on the MXU: the rows' own factors after (mgpu_topk)
      qr, q_scale = layout.parts(quant.quantize(qr, kh.dtype))
    vals, idx = _tpu(qr, kh, bounds, *tpu.scale_rows(ks), kp=kp, bm=bm, bk=bk,
                     scale=None if eight_bit_products else scale,
                     selection=options.topk_selection, interpret=variant.interpret_arg())
    if eight_bit_products:
      vals = vals * (q_scale if scale is None else q_scale * scale)[:, :, None, :, None]
  return _finish(vals, idx, top_k, lq, h)


def _segmented_copy(q, k, top_k: int, segment: int, lo, hi, *, kv_layout: str, **kw):
  """topk_scores over 8-bit or 4-bit keys whose whole copy in q's dtype exceeds the cap: a loop
  over segments of `segment` keys (lax.scan: one copy alive at a time), each dequantized and
  scored alone (the bf16 kernels), its candidates merged into the running best. Exact: the
  segments hold disjoint keys (the last one starts early so it stays inside the cache, and its
  keys before its nominal start are excluded) and the merge orders by (score desc, index asc).
  4-bit keys: segments of whole key groups, each read with the residual where it falls."""
  axis = 1 if kv_layout == "BTHD" else 2
  t = k.shape[axis]
  shape = q.shape[:3] + (top_k,)

  def step(best, s):
    start = jnp.minimum(s * segment, t - segment)
    if isinstance(k, quant4.GroupedKeys):
      part = quant4.load(quant4.slice_grouped_keys(k, start, segment), q.dtype)
    else:
      part = quant.dequantize(quant.per_row(
          lambda x: lax.dynamic_slice_in_dim(x, start, segment, axis), k), q.dtype)
    seg_lo = jnp.clip(jnp.maximum(lo, s * segment) - start, 0, segment)
    seg_hi = jnp.clip(jnp.minimum(hi, (s + 1) * segment) - start, seg_lo, segment)
    vals, idx = topk_scores(q, part, min(top_k, segment),
                            valid_len=seg_hi, exclude_prefix=seg_lo, kv_layout=kv_layout, **kw)
    idx = jnp.where(idx >= 0, idx + start, -1)
    return topk_tile.finish(jnp.concatenate([best[0], vals], -1),
                            jnp.concatenate([best[1], idx], -1), top_k), None

  empty = (jnp.full(shape, topk_tile.NEG_INF, jnp.float32), jnp.full(shape, -1, jnp.int32))
  return lax.scan(step, empty, jnp.arange(pl.cdiv(t, segment)))[0]


def _finish(vals, idx, top_k: int, lq: int, h: int, ordered: bool = False):
  """[B, KV, S, R, kp] per split -> [B, KV, R, S * kp]: every split's candidates for a row, then
  the best top_k of them, back to [B, Lq, H, top_k]. ordered: one split already holding exactly
  that (best first, ties by index, holes (-inf, -1)), which is not sorted again (on an H200 the
  sort of 2,048 rows of 4 a kv head took 11 us)."""
  b, kvh, _, rows_padded, _ = vals.shape
  vals = jnp.moveaxis(vals, 2, 3).reshape(b, kvh, rows_padded, -1)
  idx = jnp.moveaxis(idx, 2, 3).reshape(b, kvh, rows_padded, -1)
  if not (ordered and vals.shape[-1] == top_k):
    vals, idx = topk_tile.finish(vals, idx, top_k)
  return layout.from_rows(vals, lq, h), layout.from_rows(idx, lq, h)


def _finish_mosaic(q, k, bounds, top_k, config, *, scale, kv_layout, tiling, options, variant):
  """topk_scores' result from the Mosaic kernel (bf16 keys, or 8-bit on its tensor cores)."""
  segments = _stage1(options, top_k)
  vals, idx, ordered = _mosaic(q, k, bounds, top_k, config, scale=scale, kv_layout=kv_layout,
                               key_splits=(tiling.key_splits if tiling else None)
                               or options.topk_key_splits or None,
                               selection=options.topk_selection, segments=segments,
                               window=options.topk_column_window,
                               balanced=options.topk_balanced_splits,
                               words=options.topk_rescore_words, variant=variant)
  return _finish(vals, idx, top_k, q.shape[1], q.shape[2], ordered)


def _stage1(options: KernelOptions, top_k: int) -> str | None:
  """The segments the Mosaic kernel keeps, as asked ("segments", "columns"; None: keys)."""
  return (options.topk_many_rows if options.topk_many_rows != "kernel"
          and options.topk_selection == "exact" and top_k > 1 else None)


def _selection(config, segments, keys: int, top_k: int, d: int, eight_bit: bool,
               window: int = 0):
  """(segments as they run, window): "columns" runs as "segments" where its sets do not fit
  (top_k, SMEM) or no window divides the tiles; "segments" as keys where its segments do not fit
  the key axis (padded to a tile at least). window: KernelOptions.topk_column_window."""
  tk = max(keys, config.block_kv)
  window = topk_segments.column_window(tk, config.block_kv, top_k, window)
  if segments == "columns" and not (
      window and mgpu_topk.smem_bytes(config, d, top_k, 1 if eight_bit else 2,
                                      width=mgpu_select.COLUMNS) <= SMEM_LIMIT):
    segments = "segments"
  if segments == "segments" and not topk_segments.fits(tk, config.block_kv):
    segments = None
  return segments, window


def _mosaic_config(variant, q, k, rows: int, top_k: int, tiling, keys: int | None = None,
                   options: KernelOptions = DEFAULT):
  """The Mosaic GPU kernel's Config when it serves this call, else None (the Triton kernel).
  Three compute warpgroups where asked (a call's Tiling.num_warps 12, else KernelOptions.
  topk_warpgroups, by default over 16-bit keys on the GPU) and "columns" runs; else two."""
  if not gpu.mosaic_asked(variant, tiling, options.topk_impl) or rows < MOSAIC_MIN_ROWS:
    return None
  eight_bit = quant.is_quantized(k)
  config = gpu.mosaic_tiling(mgpu_topk.EIGHT_BIT_CONFIG if eight_bit
                             else mgpu_topk.DEFAULT_CONFIG, tiling)
  # Interpreted (tests on a CPU), two unless asked: jax's interpreter runs each warpgroup as a
  # thread whose barrier waits hold one of the CPU client's workers, and a CTA of four starved
  # on one device of a 2-core machine (a top-8 case hung every time; tests/helpers/
  # mgpu_topk_three_checks.py runs them on 8 devices' workers).
  asked = (tiling.num_warps // 4 if tiling is not None and tiling.impl == "mosaic"
           and tiling.num_warps else options.topk_warpgroups
           or (2 if eight_bit or variant.interpret else 3))
  three = gpu.mosaic_tiling(mgpu_topk.THREE_WARPGROUPS[eight_bit], tiling)
  if asked == 3 and _selection(three, _stage1(options, top_k), keys or three.block_kv, top_k,
                               q.shape[3], eight_bit, options.topk_column_window)[0] == "columns":
    config = three
  return None if mgpu_topk.unsupported(q, k, top_k, config=config, keys=keys) else config


def _mosaic(q, k, bounds, top_k, config, *, scale, kv_layout, key_splits, selection, segments,
            window, balanced, words, variant):
  """The Mosaic kernel's candidates [B, KV, S, R, top_k] and whether they are already the
  final order; with `segments` ("segments" or "columns": KernelOptions.topk_many_rows; None)
  and keys that fit, its segments, resolved to keys by topk_segments (one part, best first).
  "columns" runs as "segments" where its sets do not fit (`_selection`); window: its
  KernelOptions.topk_column_window; balanced: KernelOptions.topk_balanced_splits; words:
  KernelOptions.topk_rescore_words."""
  b, _, h, _ = q.shape
  kvh = k.shape[2 if kv_layout == "BTHD" else 1]
  bk = config.block_kv
  kk = layout.pad_keys(k, kv_layout, bk)
  tk = kk.shape[1 if kv_layout == "BTHD" else 2]
  segments, window = _selection(config, segments, tk, top_k, q.shape[3], quant.is_quantized(k),
                                window)
  rows_padded = layout.round_up(q.shape[1] * (h // kvh), config.warpgroups * config.block_q)
  # One CTA per SM at a time (SMEM). Balanced splits share each sequence's candidate tiles
  # among as many CTAs as fill the cores' waves (gpu.wave_splits); else at most one wave of
  # them unless asked: key splits over the key axis that make a second, partial wave ran slower
  # on an H200 (512 queries x 32K-512K keys, 8 kv heads: 128 CTAs, 1 split 1.08-1.19x faster
  # than 2), and each split's set starts empty.
  programs = b * kvh * rows_padded // (config.warpgroups * config.block_q)
  if balanced:
    splits = key_splits or gpu.wave_splits(programs, tk, bk)
    span = layout.round_up(-(-tk // splits), bk)  # a split's keys at most (the kernel's check)
  else:
    span, splits = gpu.split_plan(programs, tk, bk,
                                  key_splits or max(1, backend_lib.num_cores() // programs),
                                  per_core=1)
  qr = layout.q_rows(q, kvh, rows_padded)
  vals, idx = mgpu_topk.mgpu_topk_scores(
      qr, kk, bounds, kp=top_k, span=span, splits=splits, scale=scale, kv_layout=kv_layout,
      config=config, selection=segments or selection,
      segment=window if segments == "columns" else topk_segments.SEGMENT, balanced=balanced,
      interpret=variant.interpret)
  if not segments:
    return vals, idx, False
  vals, idx = topk_segments.keys_of_segments(
      qr, kk, bounds, vals, idx, top_k, scale=scale, kv_layout=kv_layout,
      interpret=variant.interpret_arg(), window=window if segments == "columns" else None,
      words=words)
  return vals, idx, True


@functools.partial(jax.jit, static_argnames=("kp", "span", "splits", "scale", "kv_layout",
                                             "tiling", "selection", "interpret"))
def _gpu(qr, k, bounds, k_scale=None, *, kp, span, splits, scale, kv_layout, tiling, selection,
         interpret):
  """k_scale: with 8-bit k, its scales ([B, T, KV] or [B, KV, T] as the keys): each tile is
  converted to q's dtype in registers and its scales multiply its score columns."""
  b, kvh, rp, d = qr.shape
  bm, bk = tiling.block_rows, tiling.block_keys
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  merge = topk_tile.merger(selection)
  quantized = k_scale is not None

  def kernel(bounds_ref, q_ref, k_ref, *refs):
    ks_ref, v_out, i_out = refs if quantized else (None, *refs)
    lo, hi = bounds_ref[0], bounds_ref[1]
    start0 = pl.program_id(2) * span
    q = q_ref[...]
    first = jnp.maximum(lo - start0, 0) // bk
    last = jnp.clip(pl.cdiv(jnp.minimum(hi, start0 + span) - start0, bk), 0, span // bk)

    def load(j):
      tile = gpu.key_tile(start0 + j * bk, bk, t)[0]
      return k_ref[tile, :], (ks_ref[tile] if quantized else None)

    def step(j, kt, carry):
      nominal = start0 + j * bk
      idx = gpu.key_tile(nominal, bk, t)[1]
      ok = (idx >= nominal) & (idx >= lo) & (idx < hi)
      kt, ks = online_softmax.converted(*kt, qr.dtype)
      s = jnp.where(ok, online_softmax.scores(q, kt, scale, ks), topk_tile.NEG_INF)
      return merge(*carry, s, idx)

    run_v, run_i = gpu.tile_loop(first, last, load, step, topk_tile.empty(bm, kp), tiling.prefetch)
    v_out[...] = run_v
    i_out[...] = run_i

  out_spec = pl.BlockSpec((SQ, SQ, SQ, bm, kp), lambda bh, r, s: (bh // kvh, bh % kvh, s, r, 0))
  shape = (b, kvh, splits, rp, kp)
  return gpu.pallas_call(
      kernel, interpret, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
      grid=(b * kvh, rp // bm, splits),
      in_specs=[gpu.per_batch_spec(kvh, 2), gpu.row_spec(kvh, bm, d),
                gpu.whole_keys_spec(kv_layout, t, d, kvh),
                *([gpu.whole_scales_spec(kv_layout, t, kvh)] if quantized else [])],
      out_specs=[out_spec, out_spec],
      out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)],
  )(bounds, qr, k, *([k_scale] if quantized else []))


@functools.partial(jax.jit, static_argnames=("kp", "bm", "bk", "scale", "selection", "interpret"))
def _tpu(qr, k, bounds, k_scale=None, *, kp, bm, bk, scale, selection, interpret):
  """k [B, KV, T, d]; with 8-bit (int8) k its scales as rows [B, KV, 1, T] (tpu.scale_rows)."""
  from jax.experimental.pallas import tpu as pltpu
  b, kvh, rp, d = qr.shape
  t = k.shape[2]
  nk = pl.cdiv(t, bk)
  merge = topk_tile.merger(selection)
  quantized = k_scale is not None

  def kernel(bounds_ref, q_ref, k_ref, *refs):
    ks_ref, v_out, i_out, run_v, run_i = refs if quantized else (None, *refs)
    bi, j = tpu.div(pl.program_id(0), kvh), pl.program_id(2)
    lo, hi = bounds_ref[2 * bi], bounds_ref[2 * bi + 1]

    @pl.when(j == 0)
    def _():
      run_v[...], run_i[...] = topk_tile.empty(bm, kp)

    @pl.when((j * bk < hi) & ((j + 1) * bk > lo))
    def _():
      idx = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
      kt, ks = online_softmax.converted(k_ref[...], ks_ref[...] if quantized else None,
                                        q_ref.dtype)
      s = jnp.where((idx >= lo) & (idx < hi), online_softmax.scores(q_ref[...], kt, scale, ks),
                    topk_tile.NEG_INF)
      run_v[...], run_i[...] = merge(run_v[...], run_i[...], s, idx)

    @pl.when(j == nk - 1)
    def _():
      v_out[...] = run_v[...]
      i_out[...] = run_i[...]

  out_spec = pl.BlockSpec((SQ, SQ, SQ, bm, kp),
                          lambda bh, r, j, bnd: (*tpu.batch_head(bh, kvh), 0, r, 0))
  shape = (b, kvh, 1, rp, kp)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b * kvh, rp // bm, nk),
      in_specs=[pl.BlockSpec((SQ, SQ, bm, d),
                             lambda bh, r, j, bnd: (*tpu.batch_head(bh, kvh), r, 0)),
                pl.BlockSpec((SQ, SQ, bk, d),
                             lambda bh, r, j, bnd: (*tpu.batch_head(bh, kvh), j, 0)),
                *([pl.BlockSpec((SQ, SQ, 1, bk),
                                lambda bh, r, j, bnd: (*tpu.batch_head(bh, kvh), 0, j))]
                  if quantized else [])],
      out_specs=[out_spec, out_spec],
      scratch_shapes=[pltpu.VMEM((bm, kp), jnp.float32), pltpu.VMEM((bm, kp), jnp.int32)])
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, interpret=interpret,
      out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)],
      compiler_params=tpu.compiler_params(),
  )(bounds.reshape(-1), qr, k, *([k_scale] if quantized else []))
