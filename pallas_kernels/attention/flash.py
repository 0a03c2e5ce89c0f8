"""Online-softmax attention returning its log-sum-exp, for prefill chunks and decode.

Query i of sequence b sits at position q_offset[b] + i; keys t < kv_len[b] exist; causal masks
t > position. GQA rows as in layout.q_rows. GPU: one program per (batch x kv head, row block,
key split), looping over key tiles up to the causal edge of its rows; decode splits the key axis
(flash-decoding) and merges the splits' (out, lse) exactly. TPU (flash_tpu.py): key tiles as the
innermost grid axis with the softmax state in VMEM. On GPU, "auto" hands prefill that cuDNN can
express (no query offset, BTHD layout, bf16/fp16) to cuDNN, which measured faster
(BENCHMARKS.md). On Hopper, prefill (bf16/fp16, d 64/128) runs the Mosaic GPU kernel of
mgpu_flash.py instead of the Triton one (KernelOptions.prefill_impl); decode, fp32 and other
GPUs keep the Triton kernel.

K and V may come quantized (quant.Quantized: 8-bit values and an fp32 scale per key and head).
The kernels then read the 8-bit values and the scales, never a dequantized copy: GPU and TPU
convert each tile to q's dtype in registers (or multiply int8 keys with query rows the GPU kernel
quantizes itself: KernelOptions.decode_int8_products) and fold the scales into the scores and the
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
from pallas_kernels.attention import flash_tpu, mgpu_decode, mgpu_flash, mgpu_int4_decode
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
  if config := _mosaic_int4_decode(variant, q, k, v, tiling, route.kernels):
    return mgpu_int4_decode.attention(q, k, v, per_seq["q_offset"], per_seq["kv_len"],
                                      causal=causal, scale=scale,
                                      merge_kernel=route.kernels.decode_merge_kernel,
                                      key_splits=tiling and tiling.key_splits, config=config,
                                      interpret=variant.interpret)
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
  if decode_config := _mosaic_decode(variant, q, k, v, kv_layout, tiling, options):
    return mgpu_decode.attention(q, k, v, q_off, kv_len, causal=causal, scale=scale,
                                 kv_layout=kv_layout, merge_kernel=options.decode_merge_kernel,
                                 key_splits=tiling and tiling.key_splits, config=decode_config,
                                 interpret=variant.interpret)
  if mosaic is not None:
    return mgpu_flash.mgpu_flash_attention(q, k, v, q_off, kv_len, causal=causal, scale=scale,
                                               kv_layout=kv_layout, config=mosaic,
                                               interpret=variant.interpret)
  if variant.kind == "gpu" and not gpu.triton_indexable(k, v):
    # Past the Triton kernels' int32 offsets: one query token by XLA ([B, H, T] scores), a
    # chunk refused (its scores would be [B, H, Lq, T]).
    if lq > 1:
      raise ValueError(f"flash_attention: {lq} queries over a cache of 2^31 elements or more "
                       f"(k {k.shape}: past the Triton kernels' int32 offsets) and no Mosaic or "
                       "cuDNN kernel takes the call; shard the cache over the mesh's `ctx` axis "
                       "or run on a Hopper GPU (its Mosaic kernels address by TMA)")
    return reference.flash_attention(q, k, v, causal=causal, q_offset=q_off, kv_len=kv_len,
                                     scale=scale, kv_layout=kv_layout, products=eight_bit_q)

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
  if eight_bit_q and variant.kind != "gpu":  # TPU: int8 rows and their scales [B, KV, rows, 1]
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
    groups = read.decode_row_groups(rows, lq, tl, variant, options) if q_in_kernel else 1
    int8_values = read.decode_int8_values(q, v, variant, options)
    parts = split_merge.parts(splits, merge_kernel)
    outs, lses = _gpu(qr, kk, vv, meta, ks, vs, group=h // kvh, span=span, splits=splits,
                      parts=parts, causal=causal, scale=scale, kv_layout=kv_layout, tiling=tl,
                      products=jnp.float16 if fp16 else q.dtype, int8_rows=eight_bit_q,
                      int8_values=int8_values, interpret=variant.interpret_arg(),
                      row_groups=groups)
    if groups > 1:  # row (g, r) holds query row r over group g's keys: one more split each
      outs, lses = (x[:, :, :, :groups * rows].reshape(b, kvh, parts * groups, rows, -1)
                    for x in (outs, lses))
    out, lse = split_merge.merge(outs, lses, splits=splits * groups, rows=rows, dtype=q.dtype,
                                 kernel=merge_kernel, interpret=variant.interpret_arg())
  else:
    (kh, ks), (vh, vs) = (layout.parts(layout.heads_first(x, kv_layout)) for x in (k, v))
    out, lse = flash_tpu.attention(qr, kh, vh, meta, *tpu.scale_rows(ks, vs), q_scale,
                                   group=h // kvh, bm=bm, bk=bk, causal=causal, scale=scale,
                                   values=q.dtype, interpret=variant.interpret_arg())
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


def _mosaic_decode(variant, q, k, v, kv_layout, tiling, options: KernelOptions):
  """The mgpu_decode config when one-token decode runs that kernel (KernelOptions.decode_impl,
  or a per-call Tiling(impl="mosaic"), where it takes the call), else None: the Triton kernel,
  also where the run asks what only it does (keys converted rather than multiplied as stored,
  int8 probabilities, row groups, a Triton tiling)."""
  if q.shape[1] != 1 or not gpu.mosaic_asked(variant, tiling, options.decode_impl):
    return None
  triton_tiling = tiling is not None and tiling.impl != "mosaic" and any(
      x is not None for x in (tiling.block_rows, tiling.block_keys, tiling.num_warps,
                              tiling.num_stages, tiling.prefetch))
  triton_only = (options.decode_int8_products is False, options.decode_int8_values,
                 options.decode_row_groups, triton_tiling)
  if any(triton_only):
    return None
  config = mgpu_decode.tiled(mgpu_decode.DEFAULT_CONFIG, tiling)
  if mgpu_decode.unsupported(q, k, v, kv_layout=kv_layout, config=config):
    return None  # as _mosaic_config: a call the Mosaic kernel cannot take runs the Triton one
  return config


def _mosaic_int4_decode(variant, q, k, v, tiling, options: KernelOptions):
  """The mgpu_int4_decode config when one-token decode over a 4-bit cache runs that kernel,
  else None (int4_decode's Triton kernel). Asked for only (a run's or a call's
  Tiling(impl="mosaic")), where it takes the call: on an H200 it reads 128K keys in 0.137 ms
  against the Triton kernel's 0.117 (BENCHMARKS.md), its errors against the fp32 reference of
  the same order (the tiles and the products in fp16 in both)."""
  if not (tiling is not None and tiling.impl == "mosaic"
          and gpu.mosaic_asked(variant, tiling, options.decode_impl)):
    return None
  config = mgpu_decode.tiled(mgpu_int4_decode.DEFAULT_CONFIG, tiling)
  return None if mgpu_int4_decode.unsupported(q, k, v, config=config) else config


def _cudnn(q, k, v, *, causal, kv_len, scale):
  b, lq = q.shape[:2]
  out, lse = jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=causal, implementation="cudnn", return_residual=True,
      query_seq_lengths=jnp.full((b,), lq, jnp.int32), key_value_seq_lengths=kv_len)
  return out, lse.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("group", "span", "splits", "parts", "causal",
                                             "scale", "kv_layout", "tiling", "interpret",
                                             "products", "int8_rows", "int8_values",
                                             "row_groups"))
def _gpu(qr, k, v, meta, k_scale=None, v_scale=None, *, group, span, splits, causal, scale,
         kv_layout, tiling, interpret, parts=None, products=None, int8_rows: bool = False,
         int8_values: bool = False, row_groups: int = 1):
  """Per-split (out, lse) [B, KV, parts, R_padded, d | 1] fp32; parts (default splits) may
  exceed splits (split_merge's power of two), entries past splits left unwritten. qr may hold
  fewer rows than a block (KernelOptions.decode_q_in_kernel): they are repeated to fill it, and
  the output rows past them (padding) hold copies of theirs. k_scale, v_scale: with 8-bit k,
  v, their scales ([B, T, KV] or [B, KV, T] as the keys): each tile is converted in registers,
  to `products` (KernelOptions.fp8_fp16_products, int8_fp16_products) or else q's dtype, as q
  is. int8_rows (KernelOptions.decode_int8_products): each program quantizes its query rows
  to int8 as quant.quantize does (quant.kernel_quantize: one scale a row, no XLA kernel a
  call for it) and multiplies them with the int8 keys' tiles as stored (int32), scaled after;
  only the values are converted, to `products`. int8_values (KernelOptions.decode_int8_values):
  the int8 values are not converted either; each tile's probabilities are quantized per row
  (online_softmax.int8_probabilities) and multiply them as stored.

  row_groups > 1 (one-token decode, qr holding fewer rows than a block: read.decode_row_groups):
  the block holds row_groups copies of the rq rows, and copy g takes the g-th of row_groups
  equal parts of each key tile, so each row's softmax runs over bk / row_groups keys a tile
  where one copy would run over bk (the rows past one copy otherwise compute discarded copies
  of it). Row g * rq + r's (out, lse) is then query row r's over group g's keys, which the
  caller merges as one more split."""
  b, kvh, rq, d = qr.shape
  parts = parts or splits
  bm, bk = tiling.block_rows, tiling.block_keys
  rp = layout.round_up(rq, bm)
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  quantized = k_scale is not None
  products = products or qr.dtype
  values = jnp.int8 if int8_values else products

  def load_q(q_ref, dtype):
    if rq >= bm:
      return q_ref[...].astype(dtype)
    rows = lax.broadcasted_iota(jnp.int32, (bm,), 0) % rq  # the real rows, repeated
    return q_ref[rows, :].astype(dtype)

  g = row_groups
  n = bk // g  # keys a row group takes of each tile

  def converted(x, sc, dtype):
    if not isinstance(x, tuple):
      return osm.converted(x, sc, dtype, native_gpu=not interpret)
    tiles = [osm.converted(tile, sc, dtype, native_gpu=not interpret) for tile in x]
    return tuple(tile for tile, _ in tiles), tiles[0][1]

  def kernel(meta_ref, q_ref, k_ref, v_ref, *refs):
    ks_ref, vs_ref, o_ref, lse_ref = refs if quantized else (None, None, *refs)
    q_off, kv_len = meta_ref[0], meta_ref[1]
    first_row = pl.program_id(1) * bm
    start0 = pl.program_id(2) * span
    row_group = None
    if g > 1:  # one query row a copy's row (lq = 1); the rows past g copies see no key
      rows = lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
      row_group = rows // rq
      q_pos = q_off + rows % rq // group
    else:
      q_pos = layout.row_positions(first_row, bm, group, q_off)
    end = jnp.minimum(start0 + span, kv_len)
    if causal:
      end = jnp.minimum(end, q_off + (first_row + bm - 1) // group + 1)
    row_scale = None
    if int8_rows:
      q, row_scale = quant.kernel_quantize(load_q(q_ref, jnp.float32), jnp.int8)
      row_scale = row_scale * scale  # [bm, 1]
    else:
      q = load_q(q_ref, products)
    q_dtype = q.dtype
    if g > 1:  # copy i's rows against group i's keys, zero elsewhere
      q = tuple(jnp.where(row_group == i, q, jnp.zeros((), q.dtype)) for i in range(g))

    def tile_keys(nominal):
      """The clamped tile's first key and its keys' indices ([1, bk]; [bm, n] by row group)."""
      if g == 1:
        tile, idx = gpu.key_tile(nominal, bk, t)
        return tile.start, idx
      start = jnp.minimum(nominal, t - bk)
      group_first = start + jnp.minimum(row_group, g - 1) * n
      return start, group_first + lax.broadcasted_iota(jnp.int32, (1, n), 1)

    def load(j):
      start, idx = tile_keys(start0 + j * bk)
      if g == 1:
        tile = pl.ds(start, bk)
        scales = (ks_ref[tile], vs_ref[tile]) if quantized else (None, None)
        return k_ref[tile, :], v_ref[tile, :], *scales
      scales = (ks_ref[idx], vs_ref[idx]) if quantized else (None, None)  # [bm, n] each
      return (*(tuple(x_ref[pl.ds(start + i * n, n), :] for i in range(g))
                for x_ref in (k_ref, v_ref)), *scales)

    def step(j, kv, carry, masked=True):
      (kt, ks), (vt, vs) = (converted(x, sc, dtype)
                            for x, sc, dtype in ((*kv[::2], q_dtype), (*kv[1::2], values)))
      s = (osm.scores(q, kt, None, ks) * row_scale if int8_rows
           else osm.scores(q, kt, scale, ks))
      if masked:
        nominal = start0 + j * bk
        idx = tile_keys(nominal)[1]
        ok = (idx >= nominal) & (idx < kv_len)
        if causal:
          ok = ok & (idx <= q_pos)
        if g > 1:
          ok = ok & (row_group < g)
        s = jnp.where(ok, s, osm.NEG_INF)
      return osm.update(*carry, s, vt, vs, row_group)

    n_tiles = jnp.clip(pl.cdiv(end - start0, bk), 0, span // bk)
    # Tiles whole below every row's causal edge, the sequence's length and the buffer's end need
    # no mask (a decode step's all but its last): the first loop leaves out the score tile's
    # index compares and selects. The rows past the real ones (discarded) may see keys there
    # that their own mask would hide.
    unmasked_end = jnp.minimum(jnp.minimum(kv_len, q_off + 1) if causal else kv_len, t)
    n_whole = jnp.clip((unmasked_end - start0) // bk, 0, n_tiles)
    state = gpu.tile_loop(0, n_whole, load, functools.partial(step, masked=False),
                          osm.init(bm, d), tiling.prefetch)
    out, lse = osm.finish(*gpu.tile_loop(n_whole, n_tiles, load, step, state, tiling.prefetch))
    o_ref[...] = out
    lse_ref[...] = lse

  index = lambda bh, r, s: (bh // kvh, bh % kvh, s, r, 0)  # noqa: E731
  keys = gpu.whole_keys_spec(kv_layout, t, d, kvh)
  scales = [gpu.whole_scales_spec(kv_layout, t, kvh)] * 2 if quantized else []
  return gpu.pallas_call(
      kernel, interpret, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
      grid=(b * kvh, rp // bm, splits),
      in_specs=[gpu.per_batch_spec(kvh, 2), gpu.row_spec(kvh, min(bm, rq), d), keys, keys,
                *scales],
      out_specs=[pl.BlockSpec((SQ, SQ, SQ, bm, d), index),
                 pl.BlockSpec((SQ, SQ, SQ, bm, 1), index)],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, parts, rp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, parts, rp, 1), jnp.float32)],
  )(meta, qr, k, v, *([k_scale, v_scale] if quantized else []))
