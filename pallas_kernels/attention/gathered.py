"""Attention over selected keys: each query head attends to the keys at indices[b, kv_head, :]
of its KV group (sparse decoding: Quest, top-k, ReAttention, RESA), without first copying the
selected K/V to a new buffer in HBM. Quantized K/V (quant.Quantized) are read as their
8-bit values and scales, converted in the kernel: scales multiply scores and probabilities
(online_softmax), except that keys to rotate are dequantized to q's dtype first, as the
reference rotates them.

GPU: one program per (batch x kv head, row block, index split); each tile of indices is gathered
straight from the cache into registers by pointer loads, scored, and folded into an online
softmax; splits merge exactly through their LSE. TPU: indices are scalar-prefetched into SMEM and
each selected row is DMA'd from HBM into a VMEM tile (the paged-attention pattern).

With `key_rope_freqs` the keys are taken as cached before RoPE and each is rotated inside the
kernel at its place in the index list (entry j at position j), or at the position given for it
(`key_positions`: one device's part of a scope split over a mesh, whose entries are not
contiguous in it): a list of keys attended at their scope positions (ReAttention) without a
rotated copy of them in HBM. 8-bit keys that hold an offset (quant.Quantized.offset: a cache
of pre-RoPE keys stored less their calibrated mean, model/decoder.py) get it added back to each
such key before its rotation, in the same registers. Keys are rotated in their own
dtype, as the models rotate them (jax_longctx.core.rope.rotate, like transformers), and on the
GPU in 64-key tiles: on an H200
(8K scope entries of a 32K cache, 32 query / 8 kv heads, bf16) that kernel took 12.2 us where
the rotation in fp32 took 19.1 with 128-key tiles and 17.8 with 64 (BENCHMARKS.md, ReAttention).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant, tpu
from pallas_kernels.decode import split_merge
from pallas_kernels import online_softmax as osm
from pallas_kernels import read, reference
from pallas_kernels.route import Route

SQ = gpu.SQ


def gathered_attention(q, k, v, indices, valid=None, *, scale: float | None = None,
                       kv_layout: str = "BTHD", key_rope_freqs=None, key_positions=None,
                       extent=None, route: Route,
                       tiling: gpu.Tiling | None = None):
  """q [B, Lq, H, d] over k, v (BTHD or BHTD) at indices [B, KV, n] (int, into the key axis).

  valid: bool [B, KV, n] (default: all); indices outside [0, T) count as invalid. Every query row
  sees the same selected keys (no causal mask: select accordingly). key_rope_freqs: None, or the
  RoPE inverse frequencies [d / 2] with which the key of entry j is rotated at position j (q comes
  rotated already), or at key_positions[b, j] (int [B, n], shared by a sequence's kv heads) when
  given. Quantized keys holding an offset: added to each key (dequantized) before it is rotated;
  needs key_rope_freqs. extent: None, or [B, KV] int: entries at and past it count as invalid and the GPU
  kernel does not read them (0: the group costs no reads). route: the run's kernel route (its
  variant; decode_q_in_kernel, decode_merge_kernel as for flash_attention's decode). Returns (out
  [B, Lq, H, d], lse [B, Lq, H] fp32); a row with no valid key gives (0, -inf).
  """
  if (q_kernel := read.kernel_queries(q, k, route.variant())) is not q:
    out, lse = gathered_attention(q_kernel, k, v, indices, valid, scale=scale, kv_layout=kv_layout,
                                  key_rope_freqs=key_rope_freqs, key_positions=key_positions,
                                  extent=extent, route=route, tiling=tiling)
    return out.astype(q.dtype), lse
  k, v, indices, valid = read.four_bit_gathered(k, v, indices, valid, q.dtype, kv_layout)
  b, lq, h, kvh, t, d = layout.check_qk(q, k, kv_layout)
  quantized = layout.check_kv(k, v)
  if indices.ndim != 3 or indices.shape[:2] != (b, kvh):
    raise ValueError(f"indices must be [batch={b}, kv_heads={kvh}, n], got {indices.shape}")
  n = indices.shape[2]
  valid = jnp.ones(indices.shape, bool) if valid is None else valid
  if valid.shape != indices.shape:
    raise ValueError(f"valid {valid.shape} must match indices {indices.shape}")
  if extent is not None:  # every variant: entries past it are invalid (the GPU's skip no reads)
    if extent.shape != (b, kvh):
      raise ValueError(f"extent must be [batch={b}, kv_heads={kvh}], got {extent.shape}")
    extent = extent.astype(jnp.int32)
    valid = valid & (jnp.arange(n, dtype=jnp.int32) < extent[..., None])
  if key_rope_freqs is not None:
    if d % 2 or key_rope_freqs.shape != (d // 2,):
      raise ValueError(f"key_rope_freqs must be [head_dim / 2 = {d // 2}] for an even head_dim "
                       f"{d}, got {key_rope_freqs.shape}")
    key_rope_freqs = key_rope_freqs.astype(jnp.float32)
  if key_positions is not None:
    if key_rope_freqs is None:
      raise ValueError("key_positions places keys for RoPE: give key_rope_freqs too")
    if key_positions.shape != (b, n):
      raise ValueError(f"key_positions must be [batch={b}, n={n}], got {key_positions.shape}")
    key_positions = key_positions.astype(jnp.int32)
  else:
    key_positions = jnp.arange(n, dtype=jnp.int32)[None, :]
  k, key_offset = quant.split_offset(k)
  if key_offset is not None and key_rope_freqs is None:
    raise ValueError("keys holding an offset are read here only to be rotated (the offset is "
                     "added before the rotation): give key_rope_freqs")
  scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
  indices = indices.astype(jnp.int32)
  variant, options = route.variant(), route.kernels
  if variant.kind == "tpu":
    tpu.check_kv_dtype(k)
  if variant.kind == "gpu" and not gpu.triton_indexable(k, v):
    # The Triton kernel cannot index this cache (gpu.triton_indexable): XLA gathers the rows
    # (64-bit indexing) and the kernel reads them (the whole cache dequantized by the
    # reference took 372 ms a step of 4 layers at 2M tokens on an H200).
    within = (indices >= 0) & (indices < t)
    picked = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), indices.shape)
    k_rows, v_rows = (_rows(x, jnp.where(within, indices, 0), kv_layout) for x in (k, v))
    if key_offset is not None:  # [KV, d], stored in BHTD as [1, KV, 1, d]
      k_rows = dataclasses.replace(k_rows, offset=key_offset[None, :, None, :])
    return gathered_attention(q, k_rows, v_rows, picked, valid & within, scale=scale,
                              kv_layout="BHTD", key_rope_freqs=key_rope_freqs,
                              key_positions=None if key_rope_freqs is None else key_positions,
                              route=route, tiling=tiling)
  if variant.kind == "reference":
    return reference.gathered_attention(q, k, v, indices, valid, scale=scale, kv_layout=kv_layout,
                                        key_rope_freqs=key_rope_freqs,
                                        key_positions=key_positions, key_offset=key_offset)

  rows = lq * (h // kvh)
  bm = min(max(16, layout.next_pow2(rows)), 128)
  rotating_gpu = key_rope_freqs is not None and variant.kind == "gpu"  # TPU tiles: 128 lanes
  bn = gpu.fitting_block_keys(64 if rotating_gpu else 128, block_rows=bm, d=d,
                              itemsize=q.dtype.itemsize, num_stages=2)
  tl = (tiling or gpu.Tiling()).pick(block_rows=bm, block_keys=bn, num_warps=4, num_stages=2,
                                     prefetch=False)
  bm, bn = tl.block_rows, tl.block_keys
  rows_padded = layout.round_up(rows, bm)
  q_in_kernel = options.decode_q_in_kernel and variant.kind == "gpu" and lq == 1 and rows < bm
  qr = layout.q_rows(q, kvh, rows if q_in_kernel else rows_padded)
  ok = valid & (indices >= 0) & (indices < t)
  safe = jnp.clip(indices, 0, t - 1)
  key_dtype = q.dtype if quantized else k.dtype  # the dtype keys are rotated in
  offset = None if key_offset is None else key_offset.astype(key_dtype)
  if variant.kind == "gpu":
    span, splits = gpu.split_plan(b * kvh * (rows_padded // bm), max(n, bn), bn, tl.key_splits)
    pad = ((0, 0), (0, 0), (0, span * splits - n))
    table = _rope_table(key_rope_freqs, jnp.pad(key_positions, pad[1:]), key_dtype)
    if extent is None:
      extent = jnp.full((b, kvh), n, jnp.int32)
    merge_kernel = options.decode_merge_kernel and lq == 1
    (kk, ks), (vv, vs) = layout.parts(k), layout.parts(v)
    outs, lses = _gpu(qr, kk, vv, jnp.pad(safe, pad), jnp.pad(ok, pad).astype(jnp.int32),
                      extent[..., None], table, ks, vs, offset, span=span, splits=splits,
                      parts=split_merge.parts(splits, merge_kernel), scale=scale,
                      kv_layout=kv_layout, tiling=tl, interpret=variant.interpret_arg())
    out, lse = split_merge.merge(outs, lses, splits=splits, rows=rows, dtype=q.dtype,
                                 kernel=merge_kernel, interpret=variant.interpret_arg())
  else:
    pad = ((0, 0), (0, 0), (0, layout.round_up(n, bn) - n))
    table = _rope_table(key_rope_freqs, jnp.pad(key_positions, pad[1:]), key_dtype)
    safe = jnp.pad(safe, pad)
    (kh, ks), (vh, vs) = (layout.parts(layout.heads_first(x, kv_layout)) for x in (k, v))
    # The selected rows' scales, gathered here (4 bytes a row): a DMA per scale would be as many
    # DMAs again as the rows', each too small to be worth one.
    picked = tuple(None if x is None else jnp.take_along_axis(x, safe, axis=2) for x in (ks, vs))
    out, lse = _tpu(qr, kh, vh, safe, jnp.pad(ok, pad).astype(jnp.int32), table,
                    *tpu.scale_rows(*picked), None if offset is None else offset[:, None, :],
                    bm=bm, bn=bn, scale=scale,
                    interpret=variant.interpret_arg())
    lse = lse[..., 0]
  out = layout.from_rows(out, lq, h).astype(q.dtype)
  return out, layout.from_rows(lse, lq, h)


def _rows(x, indices, kv_layout: str):
  """x's rows (keys or values, 8-bit with their scales) at indices [B, KV, n] as BHTD [B, KV, n,
  w], by XLA's gather."""
  if quant.is_quantized(x):
    return quant.Quantized(_rows(x.values, indices, kv_layout), _rows(x.scale, indices, kv_layout))
  b, kvh, _ = indices.shape
  bi, hi = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]
  return x[bi, indices, hi] if kv_layout == "BTHD" else x[bi, hi, indices]


def _rope_table(freqs, positions, dtype):
  """None, or [B or 1, 2, n, d / 2] in the keys' dtype, in which osm.rope_scores then rotates
  (as the models do): cos and sin of entry j's angles at positions [B or 1, n], computed in fp32
  once per call here (each kernel program would otherwise repeat them for its kv head)."""
  if freqs is None:
    return None
  angles = positions.astype(jnp.float32)[..., None] * freqs
  return jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1).astype(dtype)


def _table_row(rope_table, bh, kvh: int):
  """The rope table's row for program row bh (batch x kv head): its sequence's, or the one.
  (lax.div: bh >= 0, and `//` of a grid index does not lower for TPU.)"""
  return jax.lax.div(bh, kvh) if rope_table.shape[0] > 1 else 0


@functools.partial(jax.jit, static_argnames=("span", "splits", "parts", "scale", "kv_layout",
                                             "tiling", "interpret"))
def _gpu(qr, k, v, indices, ok, extent, rope_table, k_scale=None, v_scale=None, offset=None, *,
         span, splits, parts, scale, kv_layout, tiling, interpret):
  """extent [B, KV, 1]: entries at and past it are not visited. Per-split (out, lse) as
  flash._gpu's: parts >= splits entries, qr of fewer rows than a block repeated to fill it.
  k_scale, v_scale: with 8-bit k, v, their scales, gathered with the rows. offset: None, or
  [KV, d] in the dtype keys rotate in, added to them first."""
  b, kvh, rq, d = qr.shape
  bm, bn = tiling.block_rows, tiling.block_keys
  rp = layout.round_up(rq, bm)
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  rope, half = rope_table is not None, d // 2
  quantized, shifted = k_scale is not None, offset is not None

  def kernel(idx_ref, ok_ref, ext_ref, q_ref, k_ref, v_ref, *refs):
    ks_ref, vs_ref, *refs = refs if quantized else (None, None, *refs)
    r_ref, *refs = refs if rope else (None, *refs)
    c_ref, o_ref, lse_ref = refs if shifted else (None, *refs)
    start0 = pl.program_id(2) * span
    n_tiles = jnp.clip(pl.cdiv(ext_ref[0] - start0, bn), 0, span // bn)
    rows = (slice(None) if rq >= bm
            else lax.broadcasted_iota(jnp.int32, (bm,), 0) % rq)  # the real rows, repeated
    q = (q_ref[rows, :half], q_ref[rows, half:]) if rope else q_ref[rows, :]
    c = (c_ref[:half][None, :], c_ref[half:][None, :]) if shifted else None

    def load(j):
      tile = pl.ds(start0 + j * bn, bn)
      rows = idx_ref[tile]  # [bn] key indices: a gather, not a contiguous tile
      kt = (k_ref[rows, :half], k_ref[rows, half:]) if rope else (k_ref[rows, :],)
      scales = (ks_ref[rows], vs_ref[rows]) if quantized else (None, None)
      table = (r_ref[0, tile, :], r_ref[1, tile, :]) if rope else ()
      return ok_ref[tile], kt, v_ref[rows, :], scales, table

    def step(j, tile, carry):
      ok, kt, vt, (ks, vs), table = tile
      vt, vs = osm.converted(vt, vs, qr.dtype)
      if rope:
        if quantized:
          kt = tuple(osm.dequantized(x, ks[:, None], qr.dtype) for x in kt)
        if shifted:
          kt = tuple(x + o for x, o in zip(kt, c))
        s = osm.rope_scores(*q, *kt, *table, scale)
      else:
        kt, ks = osm.converted(kt[0], ks, qr.dtype)
        s = osm.scores(q, kt, scale, ks)
      return osm.update(*carry, jnp.where(ok[None, :] > 0, s, osm.NEG_INF), vt, vs)

    out, lse = osm.finish(*gpu.tile_loop(0, n_tiles, load, step, osm.init(bm, d),
                                         tiling.prefetch))
    o_ref[...] = out
    lse_ref[...] = lse

  keys = gpu.whole_keys_spec(kv_layout, t, d, kvh)
  scales = [gpu.whole_scales_spec(kv_layout, t, kvh)] * 2 if quantized else []
  index_spec = pl.BlockSpec((SQ, SQ, span * splits), lambda bh, r, s: (bh // kvh, bh % kvh, 0))
  index = lambda bh, r, s: (bh // kvh, bh % kvh, s, r, 0)  # noqa: E731
  return gpu.pallas_call(
      kernel, interpret, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
      grid=(b * kvh, rp // bm, splits),
      in_specs=[index_spec, index_spec,
                pl.BlockSpec((SQ, SQ, 1), lambda bh, r, s: (bh // kvh, bh % kvh, 0)),
                gpu.row_spec(kvh, min(bm, rq), d), keys, keys, *scales] + (
          [pl.BlockSpec((SQ, 2, span * splits, half),
                        lambda bh, r, s: (_table_row(rope_table, bh, kvh), 0, 0, 0))]
          if rope else []) + (
          [pl.BlockSpec((SQ, d), lambda bh, r, s: (bh % kvh, 0))] if shifted else []),
      out_specs=[pl.BlockSpec((SQ, SQ, SQ, bm, d), index), pl.BlockSpec((SQ, SQ, SQ, bm, 1), index)],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, parts, rp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, parts, rp, 1), jnp.float32)],
  )(indices, ok, extent, qr, k, v, *([k_scale, v_scale] if quantized else []),
    *([rope_table] if rope else []), *([offset] if shifted else []))


@functools.partial(jax.jit, static_argnames=("bm", "bn", "scale", "interpret"))
def _tpu(qr, k, v, indices, ok, rope_table, k_scale=None, v_scale=None, offset=None, *, bm, bn,
         scale, interpret):
  """k, v [B, KV, T, d]; with 8-bit k, v the scales of the selected rows [B, KV, 1, n]; offset:
  None, or [KV, 1, d] added to the keys before their rotation."""
  from jax.experimental.pallas import tpu as pltpu
  b, kvh, rp, d = qr.shape
  n = indices.shape[2]
  nt = n // bn
  rope, half = rope_table is not None, d // 2
  quantized, shifted = k_scale is not None, offset is not None

  def kernel(idx_ref, ok_ref, q_ref, k_hbm, v_hbm, *refs):
    ks_ref, vs_ref, *refs = refs if quantized else (None, None, *refs)
    r_ref, *refs = refs if rope else (None, *refs)
    c_ref, *refs = refs if shifted else (None, *refs)
    o_ref, lse_ref, k_buf, v_buf, sem, m_s, l_s, acc_s = refs
    bh, j = pl.program_id(0), pl.program_id(2)
    base = (bh * nt + j) * bn

    def copies(i):
      row = idx_ref[base + i]
      src = (*tpu.batch_head(bh, kvh), pl.ds(row, 1))
      return (pltpu.make_async_copy(k_hbm.at[src], k_buf.at[pl.ds(i, 1)], sem.at[0]),
              pltpu.make_async_copy(v_hbm.at[src], v_buf.at[pl.ds(i, 1)], sem.at[1]))

    @pl.loop(0, bn)
    def _(i):
      for c in copies(i):
        c.start()

    @pl.when(j == 0)
    def _():
      m_s[...], l_s[...], acc_s[...] = osm.init(bm, d)

    @pl.loop(0, bn)
    def _(i):
      for c in copies(i):
        c.wait()

    ks, vs = (ks_ref[...], vs_ref[...]) if quantized else (None, None)
    vt, vs = osm.converted(v_buf[...], vs, qr.dtype)
    if rope:
      k1, k2 = k_buf[:, :half], k_buf[:, half:]
      if quantized:
        col = tpu.column(ks)
        k1, k2 = (osm.dequantized(x, col, qr.dtype) for x in (k1, k2))
      if shifted:
        k1, k2 = k1 + c_ref[:, :half], k2 + c_ref[:, half:]
      s = osm.rope_scores(q_ref[:, :half], q_ref[:, half:], k1, k2, r_ref[0], r_ref[1], scale)
    else:
      kt, ks = osm.converted(k_buf[...], ks, qr.dtype)
      s = osm.scores(q_ref[...], kt, scale, ks)
    s = jnp.where(ok_ref[...] > 0, s, osm.NEG_INF)
    m_s[...], l_s[...], acc_s[...] = osm.update(m_s[...], l_s[...], acc_s[...], s, vt, vs)

    @pl.when(j == nt - 1)
    def _():
      o_ref[...], lse_ref[...] = osm.finish(m_s[...], l_s[...], acc_s[...])

  row = lambda bh, r, j, idx: (*tpu.batch_head(bh, kvh), r, 0)  # noqa: E731
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  entries = lambda bh, r, j, idx: (*tpu.batch_head(bh, kvh), 0, j)  # noqa: E731
  scales = [pl.BlockSpec((SQ, SQ, 1, bn), entries)] * 2 if quantized else []
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b * kvh, rp // bm, nt),
      in_specs=[pl.BlockSpec((SQ, SQ, 1, bn), entries),
                pl.BlockSpec((SQ, SQ, bm, d), row), any_spec, any_spec, *scales] + (
                    [pl.BlockSpec((SQ, 2, bn, half),
                                  lambda bh, r, j, idx: (_table_row(rope_table, bh, kvh), 0, j, 0))]
                    if rope else []) + (
                    [pl.BlockSpec((SQ, 1, d), lambda bh, r, j, idx: (tpu.batch_head(bh, kvh)[1],
                                                                     0, 0))]
                    if shifted else []),
      out_specs=[pl.BlockSpec((SQ, SQ, bm, d), row), pl.BlockSpec((SQ, SQ, bm, 1), row)],
      scratch_shapes=[pltpu.VMEM((bn, d), k.dtype), pltpu.VMEM((bn, d), v.dtype),
                      pltpu.SemaphoreType.DMA((2,)), *tpu.softmax_scratch(bm, d)])
  return tpu.attention_call(kernel, grid_spec, qr.shape, interpret)(
      indices.reshape(-1), ok[:, :, None, :], qr, k, v,
      *([k_scale, v_scale] if quantized else []), *([rope_table] if rope else []),
      *([offset] if shifted else []))
