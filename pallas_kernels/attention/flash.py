"""Online-softmax attention returning its log-sum-exp, for prefill chunks and decode.

Query i of sequence b sits at position q_offset[b] + i; keys t < kv_len[b] exist; causal masks
t > position. GQA rows as in layout.q_rows. GPU: one program per (batch x kv head, row block,
key split), looping over key tiles up to the causal edge of its rows; decode splits the key axis
(flash-decoding) and merges the splits' (out, lse) exactly. TPU: key tiles as the innermost grid
axis with the softmax state in VMEM. On GPU, "auto" hands prefill that cuDNN can express (no query
offset, BTHD layout, bf16/fp16) to cuDNN, which measured faster (BENCHMARKS.md). On Hopper,
prefill (bf16/fp16, d 64/128) runs the Mosaic GPU kernel of mgpu_flash.py instead of the
Triton one (KernelOptions.prefill_impl); decode, fp32 and other GPUs keep the Triton kernel.

K and V may come quantized (quant.Quantized: 8-bit values and an fp32 scale per key and head).
The kernels then read the 8-bit values and the scales, never a dequantized copy: GPU and TPU
convert each tile to q's dtype in registers and fold the scales into the scores and the
probabilities (online_softmax); the Mosaic GPU kernel has the tiles dequantized into shared
memory (mgpu_flash). cuDNN takes no quantized K/V; TPUs take int8 only (v5e has no FP8).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant, tpu
from pallas_kernels.attention import int4_chunk, int4_chunk_tpu, int4_decode, int4_decode_tpu
from pallas_kernels.attention import mgpu_flash
from pallas_kernels import online_softmax as osm
from pallas_kernels import read, reference
from pallas_kernels.decode import split_merge
from pallas_kernels.options import DEFAULT, KernelOptions
from pallas_kernels.route import Route

SQ = gpu.SQ

def flash_attention(q, k, v, *, causal: bool = True, q_offset=0, kv_len=None,
                    scale: float | None = None, kv_layout: str = "BTHD", route: Route,
                    use_cudnn: bool | None = None, tiling: gpu.Tiling | None = None):
  """Softmax(q.k * scale) v. q [B, Lq, H, d]; k, v [B, T, KV, d] (BTHD) or [B, KV, T, d] (BHTD).

  q_offset, kv_len: ints or [B]. scale defaults to 1/sqrt(d). Returns (out [B, Lq, H, d] in q's
  dtype, lse [B, Lq, H] fp32, natural log; rows that see no key give (0, -inf)).
  use_cudnn: None = when the GPU variant runs natively and cuDNN can express the call (and the
  Mosaic kernel is not preferred: route.kernels.mosaic_before_cudnn, or tiling.impl="mosaic"
  asked for). route: the run's kernel route (`Route`: its variant and `KernelOptions`).
  """
  if (q_kernel := read.kernel_queries(q, k, route.variant())) is not q:
    out, lse = flash_attention(q_kernel, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len,
                               scale=scale, kv_layout=kv_layout, route=route, use_cudnn=use_cudnn,
                               tiling=tiling)
    return out.astype(q.dtype), lse
  d = q.shape[-1]
  scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
  if read.four_bit_tiles(q, k, v, route.variant(), route.kernels):
    return _four_bit_decode(q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len,
                            scale=scale, kv_layout=kv_layout, route=route, tiling=tiling)
  if causal and read.four_bit_chunk_tiles(q, k, v, route.variant(), route.kernels):
    if kv_layout != "BHTD":
      raise ValueError("a 4-bit cache is laid out [B, KV, T, d] (kv_layout='BHTD')")
    b, variant = q.shape[0], route.variant()
    kernel = int4_chunk_tpu if variant.kind == "tpu" else int4_chunk
    return kernel.attention(q, k, v, q_offset=layout.per_batch(q_offset, b, 0),
                            kv_len=layout.per_batch(kv_len, b, k.shape[2]), scale=scale,
                            variant=variant)
  k, v = read.four_bit_copies(q.dtype, k, v)
  # Keys stored less an offset (pre-RoPE caches): the kernels score them as stored, which
  # lowers each query row's scores alike; only the LSE needs it back.
  k, key_offset = quant.split_offset(k)
  out, lse = _attention(q, k, v, causal=causal, q_offset=q_offset, kv_len=kv_len, scale=scale,
                        kv_layout=kv_layout, route=route, use_cudnn=use_cudnn, tiling=tiling)
  return out, read.lse_with_key_offset(lse, q, key_offset, scale)


def _four_bit_decode(q, k, v, *, causal, q_offset, kv_len, scale: float, kv_layout: str,
                     route: Route, tiling):
  """flash_attention's one-token decode on the kernel reading the 4-bit tiles of the variant:
  int4_decode (GPU, split-K) or int4_decode_tpu (tiling.block_keys: its keys a step)."""
  if kv_layout != "BHTD":
    raise ValueError("a 4-bit cache is laid out [B, KV, T, d] (kv_layout='BHTD')")
  b, variant = q.shape[0], route.variant()
  per_seq = dict(q_offset=layout.per_batch(q_offset, b, 0),
                 kv_len=layout.per_batch(kv_len, b, k.shape[2]))
  if variant.kind == "tpu":
    return int4_decode_tpu.attention(q, k, v, causal=causal, scale=scale, variant=variant,
                                     block=tiling and tiling.block_keys, **per_seq)
  return int4_decode.attention(q, k, v, causal=causal, scale=scale, variant=variant,
                               merge_kernel=route.kernels.decode_merge_kernel, tiling=tiling,
                               **per_seq)


def _attention(q, k, v, *, causal, q_offset, kv_len, scale: float, kv_layout: str, route: Route,
               use_cudnn, tiling):
  """flash_attention over keys holding no offset."""
  b, lq, h, kvh, t, d = layout.check_qk(q, k, kv_layout)
  quantized = layout.check_kv(k, v)
  variant, options = route.variant(), route.kernels
  if variant.kind == "tpu":
    tpu.check_kv_dtype(k)
  mosaic = _mosaic_config(variant, q, k, v, kv_layout, tiling, options)
  read.check_cudnn_asked(use_cudnn, k)
  if use_cudnn is None:
    asked = tiling is not None and tiling.impl == "mosaic"
    mosaic_first = mosaic is not None and (options.mosaic_before_cudnn or asked)
    use_cudnn = (variant.kind == "gpu" and not variant.interpret and lq > 1 and not mosaic_first
                 and isinstance(q_offset, int) and q_offset == 0 and kv_layout == "BTHD"
                 and q.dtype in (jnp.bfloat16, jnp.float16) and read.cudnn_reads(k))
  q_off = layout.per_batch(q_offset, b, 0)
  kv_len = layout.per_batch(kv_len, b, t)
  eight_bit_q = read.decode_products(q, k, variant, options)
  if variant.kind == "reference":
    return reference.flash_attention(q, k, v, causal=causal, q_offset=q_off, kv_len=kv_len,
                                     scale=scale, kv_layout=kv_layout, products=eight_bit_q)
  if use_cudnn:
    return _cudnn(q, k, v, causal=causal, kv_len=kv_len, scale=scale)
  if mosaic is not None:
    return mgpu_flash.mgpu_flash_attention(q, k, v, q_off, kv_len, causal=causal, scale=scale,
                                               kv_layout=kv_layout, config=mosaic,
                                               interpret=variant.interpret)

  rows = lq * (h // kvh)
  bm = min(max(16, layout.next_pow2(rows)), 128)
  # 8-bit K/V tiles are half a bf16 tile's bytes, so a third stage fits where bf16 keeps two:
  # one-token decode of the 8B shape with an int8 cache 9.44 -> 9.20 ms at 128K, 6.95 -> 6.91 ms
  # at 32K (H100, BENCHMARKS.md "Long contexts on one GPU"; prefill rows not measured: unchanged)
  stages = 3 if bm >= 128 or (quantized and lq == 1) else 2
  bk = 256 if variant.kind != "gpu" else gpu.fitting_block_keys(
      128, block_rows=bm, d=d, itemsize=q.dtype.itemsize, num_stages=stages)
  tl = (tiling or gpu.Tiling()).pick(block_rows=bm, block_keys=bk, num_warps=4 if bm <= 64 else 8,
                                     num_stages=stages, prefetch=False)
  bm, bk = tl.block_rows, tl.block_keys
  rows_padded = layout.round_up(rows, bm)
  q_in_kernel = options.decode_q_in_kernel and variant.kind == "gpu" and lq == 1 and rows < bm
  qr = layout.q_rows(q, kvh, rows if q_in_kernel else rows_padded)
  q_scale = None
  if eight_bit_q:  # the queries as int8 rows and their scales [B, KV, rows, 1]
    quantized_q = quant.quantize(qr, jnp.int8)
    qr, q_scale = quantized_q.values, quantized_q.scale
  meta = jnp.stack([q_off, kv_len], axis=1)  # [B, 2]
  if variant.kind == "gpu":
    kk, vv = (layout.pad_keys(x, kv_layout, bk) for x in (k, v))
    tk = kk.shape[1 if kv_layout == "BTHD" else 2]
    span, splits = gpu.split_plan(b * kvh * (rows_padded // bm), tk, bk,
                                  tl.key_splits or (1 if causal and lq > 1 else None))
    merge_kernel = options.decode_merge_kernel and lq == 1
    (kk, ks), (vv, vs) = layout.parts(kk), layout.parts(vv)
    fp16 = read.fp16_products(q, kk, options)
    outs, lses = _gpu(qr, kk, vv, meta, ks, vs, q_scale, group=h // kvh, span=span,
                      splits=splits, parts=split_merge.parts(splits, merge_kernel),
                      causal=causal, scale=scale, kv_layout=kv_layout, tiling=tl,
                      products=jnp.float16 if fp16 else q.dtype,
                      interpret=variant.interpret_arg())
    out, lse = split_merge.merge(outs, lses, splits=splits, rows=rows, dtype=q.dtype,
                                 kernel=merge_kernel, interpret=variant.interpret_arg())
  else:
    (kh, ks), (vh, vs) = (layout.parts(layout.heads_first(x, kv_layout)) for x in (k, v))
    out, lse = _tpu(qr, kh, vh, meta, *tpu.scale_rows(ks, vs), q_scale, group=h // kvh, bm=bm,
                    bk=bk, causal=causal, scale=scale, values=q.dtype,
                    interpret=variant.interpret_arg())
    lse = lse[..., 0]
  out = layout.from_rows(out, lq, h).astype(q.dtype)
  return out, layout.from_rows(lse, lq, h)


def mosaic_serves(q, k, v, *, kv_layout: str = "BTHD", route: Route) -> bool:
  """Whether `flash_attention` would run these shapes on the Mosaic GPU kernel."""
  return _mosaic_config(route.variant(), q, k, v, kv_layout, None, route.kernels) is not None


def _mosaic_config(variant, q, k, v, kv_layout, tiling, options: KernelOptions = DEFAULT):
  """The Mosaic GPU kernel's Config when it serves this call, else None (the Triton kernel)."""
  if not gpu.mosaic_asked(variant, tiling, options.prefill_impl):
    return None
  if not read.mosaic_reads(k, variant):
    return None
  config = gpu.mosaic_tiling(mgpu_flash.DEFAULT_CONFIG, tiling)
  if mgpu_flash.unsupported(q, k, v, kv_layout=kv_layout, config=config):
    return None  # e.g. decode (fewer queries than a block), fp32, head dim 256
  return config


def _cudnn(q, k, v, *, causal, kv_len, scale):
  b, lq = q.shape[:2]
  out, lse = jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=causal, implementation="cudnn", return_residual=True,
      query_seq_lengths=jnp.full((b,), lq, jnp.int32), key_value_seq_lengths=kv_len)
  return out, lse.astype(jnp.float32)


def _row_positions(first_row, bm: int, group: int, q_off):
  """Positions [bm, 1] of rows first_row.. (row = query * group + head)."""
  return q_off + tpu.div(first_row + lax.broadcasted_iota(jnp.int32, (bm, 1), 0), group)


@functools.partial(jax.jit, static_argnames=("group", "span", "splits", "parts", "causal",
                                             "scale", "kv_layout", "tiling", "interpret",
                                             "products"))
def _gpu(qr, k, v, meta, k_scale=None, v_scale=None, q_scale=None, *, group, span, splits,
         causal, scale, kv_layout, tiling, interpret, parts=None, products=None):
  """Per-split (out, lse) [B, KV, parts, R_padded, d | 1] fp32; parts (default splits) may
  exceed splits (split_merge's power of two), entries past splits left unwritten. qr may hold
  fewer rows than a block (KernelOptions.decode_q_in_kernel): they are repeated to fill it, and the output
  rows past them (padding) hold copies of theirs. k_scale, v_scale: with 8-bit k, v, their
  scales ([B, T, KV] or [B, KV, T] as the keys): each tile is converted in registers, to
  `products` (KernelOptions.fp8_fp16_products, int8_fp16_products) or else q's dtype, as q
  is. q_scale [B, KV, rows, 1] (KernelOptions.decode_int8_products): qr holds int8 rows whose
  products with the int8 keys' tiles run as they are stored (int32), scaled after; only the
  values are converted, to `products`."""
  b, kvh, rq, d = qr.shape
  parts = parts or splits
  bm, bk = tiling.block_rows, tiling.block_keys
  rp = layout.round_up(rq, bm)
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  quantized = k_scale is not None
  eight_bit_q = q_scale is not None
  products = products or qr.dtype

  def load_q(q_ref, dtype):
    if rq >= bm:
      return q_ref[...].astype(dtype)
    rows = lax.broadcasted_iota(jnp.int32, (bm,), 0) % rq  # the real rows, repeated
    return q_ref[rows, :].astype(dtype)

  def kernel(meta_ref, q_ref, k_ref, v_ref, *refs):
    if eight_bit_q:
      ks_ref, vs_ref, qs_ref, o_ref, lse_ref = refs
    else:
      ks_ref, vs_ref, o_ref, lse_ref = refs if quantized else (None, None, *refs)
    q_off, kv_len = meta_ref[0], meta_ref[1]
    first_row = pl.program_id(1) * bm
    start0 = pl.program_id(2) * span
    q_pos = _row_positions(first_row, bm, group, q_off)
    end = jnp.minimum(start0 + span, kv_len)
    if causal:
      end = jnp.minimum(end, q_off + (first_row + bm - 1) // group + 1)
    q = load_q(q_ref, jnp.int8 if eight_bit_q else products)
    row_scale = load_q(qs_ref, jnp.float32) * scale if eight_bit_q else None  # [bm, 1]

    def load(j):
      tile = gpu.key_tile(start0 + j * bk, bk, t)[0]
      scales = (ks_ref[tile], vs_ref[tile]) if quantized else (None, None)
      return k_ref[tile, :], v_ref[tile, :], *scales

    def step(j, kv, carry):
      nominal = start0 + j * bk
      idx = gpu.key_tile(nominal, bk, t)[1]
      ok = (idx >= nominal) & (idx < kv_len)
      if causal:
        ok = ok & (idx <= q_pos)
      (kt, ks), (vt, vs) = (osm.converted(x, sc, dtype, native_gpu=not interpret)
                            for x, sc, dtype in ((*kv[::2], q.dtype), (*kv[1::2], products)))
      s = (osm.scores(q, kt, None, ks) * row_scale if eight_bit_q
           else osm.scores(q, kt, scale, ks))
      s = jnp.where(ok, s, osm.NEG_INF)
      return osm.update(*carry, s, vt, vs)

    n_tiles = jnp.clip(pl.cdiv(end - start0, bk), 0, span // bk)
    out, lse = osm.finish(*gpu.tile_loop(0, n_tiles, load, step, osm.init(bm, d), tiling.prefetch))
    o_ref[...] = out
    lse_ref[...] = lse

  index = lambda bh, r, s: (bh // kvh, bh % kvh, s, r, 0)  # noqa: E731
  keys = gpu.whole_keys_spec(kv_layout, t, d, kvh)
  scales = [gpu.whole_scales_spec(kv_layout, t, kvh)] * 2 if quantized else []
  if eight_bit_q:
    scales.append(gpu.row_spec(kvh, min(bm, rq), 1))
  return gpu.pallas_call(
      kernel, interpret, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
      grid=(b * kvh, rp // bm, splits),
      in_specs=[gpu.per_batch_spec(kvh, 2), gpu.row_spec(kvh, min(bm, rq), d), keys, keys,
                *scales],
      out_specs=[pl.BlockSpec((SQ, SQ, SQ, bm, d), index),
                 pl.BlockSpec((SQ, SQ, SQ, bm, 1), index)],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, parts, rp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, parts, rp, 1), jnp.float32)],
  )(meta, qr, k, v, *([k_scale, v_scale] if quantized else []),
    *([q_scale] if eight_bit_q else []))


@functools.partial(jax.jit, static_argnames=("group", "bm", "bk", "causal", "scale", "values",
                                             "interpret"))
def _tpu(qr, k, v, meta, k_scale=None, v_scale=None, q_scale=None, *, group, bm, bk, causal,
         scale, interpret, values=None):
  """k, v [B, KV, T, d]; with 8-bit k, v their scales as rows [B, KV, 1, T] (tpu.scale_rows).
  q_scale [B, KV, R_padded, 1]: qr holds int8 rows multiplied with the int8 keys as stored on
  the MXU (KernelOptions.decode_int8_products), scaled after; values: the dtype the value
  tiles convert to (default q's)."""
  from jax.experimental.pallas import tpu as pltpu
  b, kvh, rp, d = qr.shape
  t = k.shape[2]
  nk = pl.cdiv(t, bk)
  quantized = k_scale is not None
  eight_bit_q = q_scale is not None
  values = values or qr.dtype

  def kernel(meta_ref, q_ref, k_ref, v_ref, *refs):
    if eight_bit_q:
      ks_ref, vs_ref, qs_ref, o_ref, lse_ref, m_s, l_s, acc_s = refs
    else:
      ks_ref, vs_ref, o_ref, lse_ref, m_s, l_s, acc_s = refs if quantized else (None, None, *refs)
    bi, j = tpu.div(pl.program_id(0), kvh), pl.program_id(2)
    q_off, kv_len = meta_ref[2 * bi], meta_ref[2 * bi + 1]
    first_row = pl.program_id(1) * bm
    end = kv_len
    if causal:
      end = jnp.minimum(end, q_off + tpu.div(first_row + bm - 1, group) + 1)

    @pl.when(j == 0)
    def _():
      m_s[...], l_s[...], acc_s[...] = osm.init(bm, d)

    @pl.when(j * bk < end)
    def _():
      idx = j * bk + lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
      ok = idx < kv_len
      if causal:
        ok = ok & (idx <= _row_positions(first_row, bm, group, q_off))
      # The last tile may run past t: those rows of v (and scales) are undefined and 0 * NaN
      # would spread.
      v_rows = j * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
      v = jnp.where(v_rows < kv_len, v_ref[...], jnp.zeros((), v_ref.dtype))
      ks = vs = None
      if quantized:
        cols = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        ks, vs = ks_ref[...], jnp.where(cols < kv_len, vs_ref[...], 0.0)
      (kt, ks), (vt, vs) = osm.converted(k_ref[...], ks, qr.dtype), osm.converted(v, vs, values)
      if eight_bit_q:
        s = osm.scores(q_ref[...], kt, None, ks) * (qs_ref[...] * scale)
      else:
        s = osm.scores(q_ref[...], kt, scale, ks)
      s = jnp.where(ok, s, osm.NEG_INF)
      m_s[...], l_s[...], acc_s[...] = osm.update(m_s[...], l_s[...], acc_s[...], s, vt, vs)

    @pl.when(j == nk - 1)
    def _():
      o_ref[...], lse_ref[...] = osm.finish(m_s[...], l_s[...], acc_s[...])

  row = lambda bh, r, j, meta: (*tpu.batch_head(bh, kvh), r, 0)  # noqa: E731
  key = pl.BlockSpec((SQ, SQ, bk, d), lambda bh, r, j, meta: (*tpu.batch_head(bh, kvh), j, 0))
  scales = [pl.BlockSpec((SQ, SQ, 1, bk), lambda bh, r, j, meta: (*tpu.batch_head(bh, kvh), 0, j))
            ] * 2 if quantized else []
  if eight_bit_q:
    scales.append(pl.BlockSpec((SQ, SQ, bm, 1), row))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b * kvh, rp // bm, nk),
      in_specs=[pl.BlockSpec((SQ, SQ, bm, d), row), key, key, *scales],
      out_specs=[pl.BlockSpec((SQ, SQ, bm, d), row), pl.BlockSpec((SQ, SQ, bm, 1), row)],
      scratch_shapes=tpu.softmax_scratch(bm, d))
  return tpu.attention_call(kernel, grid_spec, qr.shape, interpret)(
      meta.reshape(-1), qr, k, v, *([k_scale, v_scale] if quantized else []),
      *([q_scale] if eight_bit_q else []))
