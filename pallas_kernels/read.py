"""How a kernel call reads an 8-bit (quantized) K/V cache: the entry points' decisions, in one
place. quant.py stores the format (values and scales); this module says, per call, which
kernels can read the 8-bit tiles (cuDNN never, the Mosaic GPU flash kernel not yet on a GPU),
and whether they are read as they are, read with fp16 products, or first copied in the
queries' dtype (whole, or a segment of keys at a time) so the bf16 kernels run. What is left
in the lowerings is how each reads the format (scales beside the tiles), not which path runs.

A 4-bit cache (quant4.py) is read here too: one-token decode on the GPU and on the TPU reads
its tiles (`four_bit_tiles`: attention/int4_decode.py, attention/int4_decode_tpu.py) where the
run enables it, and so does a decode step's top-k on the GPU and on the TPU (`four_bit_scores`:
topk/int4_scores.py, topk/int4_scores_tpu.py score the codes for topk_blocks' pick, the kernel
on the GPU, the jnp one on the TPU), and a prefill chunk on the GPU and the TPU where the run
asks for it (`four_bit_chunk_tiles`: attention/int4_chunk.py, attention/int4_chunk_tpu.py);
every other call reads a copy in the queries' dtype made first (`four_bit_copies`: one
layer's keys or values a call; top-k past `topk_dequantize_bytes`, a segment of whole key
groups at a time: `four_bit_topk_segment`), or, for attention over gathered keys, the gathered
rows alone (`four_bit_gathered`).

Each decision reads the call's variant and the run's KernelOptions (pallas_kernels/options.py
says what was measured for each): a native GPU is the only place a copy or fp16 products pay.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import layout, quant, quant4
from pallas_kernels.options import DEFAULT, KernelOptions


def kernel_queries(q, k, variant):
  """The queries a kernel multiplies with float keys stored in another dtype (an fp32 model's
  bf16 cache, `--kv-dtype bfloat16`): on the GPU and TPU variants cast to the keys' dtype, since
  their products take one operand dtype (Triton refuses f32 x bf16), so the products run as
  that dtype's model runs them, accumulated in fp32, with no copy of the cache. The jnp
  reference promotes instead; an 8- or 4-bit cache (its tiles converted to the queries' dtype
  in the kernels) and keys of q's dtype keep q."""
  if variant.kind == "reference" or quant.is_quantized(k) or quant4.is_int4(k):
    return q
  if k.dtype == q.dtype or not jnp.issubdtype(k.dtype, jnp.floating):
    return q
  return q.astype(k.dtype)


def cudnn_reads(k) -> bool:
  """Whether cuDNN's attention can take these keys: never 8-bit ones (it takes no scales)."""
  return not quant.is_quantized(k)


def check_cudnn_asked(use_cudnn: bool | None, k) -> None:
  """A call that asks for cuDNN (use_cudnn=True) over keys it cannot read is refused."""
  if use_cudnn and not cudnn_reads(k):
    raise ValueError("use_cudnn=True: cuDNN cannot read a quantized cache (8-bit K/V)")


def mosaic_reads(k, variant) -> bool:
  """Whether the Mosaic GPU flash kernel may take these keys on this variant. Its 8-bit path
  (tiles dequantized into its SMEM ring) passes the GPU interpreter on a CPU but hung on an
  H200 (2026-11-25, benchmarks/quant_kernels.py check_attention): 8-bit K/V take the Triton
  kernel on a GPU until it is fixed."""
  return variant.interpret or not quant.is_quantized(k)


def dequantized_rows_fitting(x, dtype, variant, budget: int, axis: int) -> int:
  """How many entries along `axis` of the 8-bit `x` a copy in `dtype` of at most `budget` bytes
  holds, on a native GPU (dequantized_copy_fits' rule); 0 where there is no copy route."""
  if not quant.is_quantized(x) or variant.kind != "gpu" or variant.interpret:
    return 0
  return budget // (x.values.size // x.shape[axis] * jnp.dtype(dtype).itemsize)


def dequantized_copy_fits(x, dtype, variant, budget: int, copies: int = 1) -> bool:
  """Whether a kernel call over the 8-bit `x` (and copies - 1 more of its size: V beside K) runs
  on a bf16 copy made first: on a native GPU, the copy at most `budget` bytes. The bf16 kernels
  there (Mosaic, cuDNN) read no 8-bit tiles, and a compute-bound call (a prefill chunk's many
  query rows) spends a few percent on one pass over the 8-bit buffer."""
  if not quant.is_quantized(x) or variant.kind != "gpu" or variant.interpret:
    return False
  return copies * x.values.size * jnp.dtype(dtype).itemsize <= budget


def dequantize_first(q, k_cache, variant, options: KernelOptions = DEFAULT) -> bool:
  """Whether a prefill chunk (chunk_attention) over this 8-bit cache runs on its bf16 copy: on a
  native GPU, the copy of K and V at most `options.prefill_dequantize_bytes`."""
  return dequantized_copy_fits(k_cache, q.dtype, variant, options.prefill_dequantize_bytes,
                               copies=2)


def decode_products(q, k, variant, options: KernelOptions = DEFAULT) -> bool:
  """Whether one-token attention (q [B, 1, H, d]) over int8 keys multiplies them as stored, the
  queries quantized per row (KernelOptions.decode_int8_products: asked, or by default where the
  GPU's kernel runs natively)."""
  asked = options.decode_int8_products
  if asked is None:
    asked = variant.kind == "gpu" and not variant.interpret
  return asked and q.shape[1] == 1 and quant.is_quantized(k) and k.dtype == jnp.int8


def decode_int8_values(q, v, variant, options: KernelOptions = DEFAULT) -> bool:
  """Whether the GPU split-K kernel's one-token attention (q [B, 1, H, d]) multiplies int8
  values as stored, its probabilities quantized per row and tile (KernelOptions.
  decode_int8_values; the GPU kernel only)."""
  return (options.decode_int8_values and variant.kind == "gpu" and q.shape[1] == 1
          and quant.is_quantized(v) and v.dtype == jnp.int8)


def decode_row_groups(rows: int, lq: int, tiling, variant,
                      options: KernelOptions = DEFAULT) -> int:
  """How many copies of its `rows` real query rows (lq = 1, read unpadded: decode_q_in_kernel)
  the GPU split-K kernel's row block holds, each over its own part of every key tile
  (KernelOptions.decode_row_groups): the most, a power of two, that fit the block with parts of
  at least 16 keys (a tensor-core product's least); 1 where it is off or no second copy fits."""
  if not (options.decode_row_groups and variant.kind == "gpu" and lq == 1):
    return 1
  groups, bm, bk = 1, tiling.block_rows, tiling.block_keys
  while 2 * groups * rows <= bm and bk % (2 * groups) == 0 and bk // (2 * groups) >= 16:
    groups *= 2
  return groups


def fp16_products(q, k, options: KernelOptions = DEFAULT) -> bool:
  """Whether the GPU flash kernel multiplies bf16 queries by 8-bit K/V tiles in fp16
  (KernelOptions.fp8_fp16_products / int8_fp16_products); k: the key values' array (a float
  one: never)."""
  return q.dtype == jnp.bfloat16 and (
      (options.fp8_fp16_products and k.dtype == jnp.float8_e4m3fn)
      or (options.int8_fp16_products and k.dtype == jnp.int8))


# The dequantized copy's segments (keys): a multiple of every kernel's key tile, and none
# shorter than COPY_SEGMENT_MIN (there the pass and the extra calls cost more than the Triton
# kernel over 8-bit tiles saves).
COPY_SEGMENT_ALIGN = 1024
COPY_SEGMENT_MIN = 1 << 16


def copy_segment(fitting: int, keys: int) -> int:
  """Keys per segment of the dequantized copy when `fitting` keys fit its cap: all `keys`
  (one copy), else the fewest segments of equal, aligned length that fit, 0 if they are
  shorter than COPY_SEGMENT_MIN (no copy)."""
  if fitting >= keys:
    return keys
  most = fitting // COPY_SEGMENT_ALIGN * COPY_SEGMENT_ALIGN
  if most < COPY_SEGMENT_MIN:
    return 0
  count = pl.cdiv(keys, most)
  return layout.round_up(pl.cdiv(keys, count), COPY_SEGMENT_ALIGN)


def topk_copy_segment(q, k, variant, options: KernelOptions, kv_layout: str, keys: int) -> int:
  """topk_scores with many query rows over 8-bit keys: keys per segment of their copy in q's
  dtype within `options.topk_dequantize_bytes` (all `keys`: one copy; 0: no copy, the Triton
  kernel reads the 8-bit tiles)."""
  return copy_segment(dequantized_rows_fitting(
      k, q.dtype, variant, options.topk_dequantize_bytes, 1 if kv_layout == "BTHD" else 2), keys)


def lse_with_key_offset(lse, q, offset, scale: float):
  """The log-sum-exp of softmax(q.k * scale) over keys k that a kernel read less their offset c
  [KV, d] (quant.split_offset): every score of query row (b, i, h) was lower by scale * q.c,
  which the probabilities do not see and the LSE gets back here. lse [B, Lq, H] fp32, q
  [B, Lq, H, d]; offset None: lse as it is."""
  if offset is None:
    return lse
  per_head = jnp.repeat(offset, q.shape[2] // offset.shape[0], axis=0)  # [H, d]
  return lse + scale * jnp.einsum("bqhd,hd->bqh", q.astype(jnp.float32), per_head)


def four_bit_tiles(q, k, v, variant, options: KernelOptions = DEFAULT) -> bool:
  """Whether flash_attention reads a 4-bit cache's tiles: one-token decode (q [B, 1, H, d])
  over keys grouped along tokens and values along channels where KernelOptions.int4_decode_kernel
  enables it, on the GPU variant (attention/int4_decode.py: q in bf16, fp16 or fp32, each value
  piece (min(value group, d / 2) channels) within one group and at least a tensor-core
  product's 16 wide) or the TPU one (attention/int4_decode_tpu.py: q in bf16 or fp32, TPUs
  having no fp16 arithmetic; key groups of a multiple of 32 tokens, a uint8 block's sublane
  tile, since it reads the residual group's value codes as a block of one group)."""
  return (options.int4_decode_kernel and q.shape[1] == 1
          and _kernels_read_four_bit(q, k, v, variant))


def _kernels_read_four_bit(q, k, v, variant) -> bool:
  """The 4-bit attention kernels' shapes (decode's and a chunk's alike): keys grouped along
  tokens, values along channels, on the GPU (q in bf16, fp16 or fp32, each value piece
  (min(value group, d / 2) channels) within one group and at least a tensor-core product's 16
  wide, key groups too) or the TPU (q in bf16 or fp32; key groups of a multiple of 32 tokens)."""
  if variant.kind not in ("gpu", "tpu"):
    return False
  if not (isinstance(k, quant4.GroupedKeys) and isinstance(v, quant4.Int4)
          and v.axis == v.codes.ndim - 1):
    return False
  if variant.kind == "tpu":
    return q.dtype in (jnp.bfloat16, jnp.float32) and k.main.group % 32 == 0
  d, vg = q.shape[-1], v.group
  w = min(vg, d // 2)
  return (q.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) and w >= 16 and (d // 2) % w == 0
          and vg % w == 0 and k.main.group >= 16)


def four_bit_chunk_tiles(q, k, v, variant, options: KernelOptions = DEFAULT) -> bool:
  """Whether a prefill chunk's attention (q [B, Lq > 1, H, d], causal) reads a 4-bit cache's
  tiles where KernelOptions.int4_chunk_kernel enables it, on the GPU variant
  (attention/int4_chunk.py) or the TPU one (attention/int4_chunk_tpu.py: four_bit_tiles' TPU
  shapes); else it reads a copy in the queries' dtype (four_bit_copies)."""
  return (options.int4_chunk_kernel and q.shape[1] > 1
          and _kernels_read_four_bit(q, k, v, variant))


def four_bit_topk_segment(q, k, options: KernelOptions, keys: int) -> int:
  """topk_scores over 4-bit keys (no kernel reads their tiles): keys per segment of their copy
  in q's dtype, the whole copy (`keys`) where it takes at most `options.topk_dequantize_bytes`,
  else segments of equal length that do (none shorter than COPY_SEGMENT_MIN: a cap below one
  such segment still copies that much). 0 for keys that are not 4-bit."""
  if not isinstance(k, quant4.GroupedKeys):
    return 0
  b, kvh, _, d = k.shape
  fitting = options.topk_dequantize_bytes // (b * kvh * d * jnp.dtype(q.dtype).itemsize)
  return copy_segment(max(fitting, min(keys, COPY_SEGMENT_MIN)), keys)


def four_bit_copies(dtype, *xs) -> tuple:
  """xs with each 4-bit buffer (quant4: values, or keys grouped along tokens) replaced by its
  values in `dtype`, arrays and 8-bit buffers as they are: what a kernel reads of a 4-bit cache
  until it reads 4-bit tiles (one copy of the layer's buffer per call, on every variant)."""
  return tuple(quant4.load(x, dtype) if quant4.is_int4(x) else x for x in xs)


def four_bit_gathered(k, v, indices, valid, dtype, kv_layout: str):
  """(k, v, indices, valid) for attention over the keys at `indices` [B, KV, n] of a 4-bit
  cache: those rows alone dequantized in `dtype` ([B, KV, n, d]; entry j at index j, so entry
  order, key positions and extents mean what they did), indices outside [0, T) invalid."""
  if not (quant4.is_int4(k) or quant4.is_int4(v)):
    return k, v, indices, valid
  if kv_layout != "BHTD":
    raise ValueError("a 4-bit cache is laid out [B, KV, T, d] (kv_layout='BHTD')")
  t = k.shape[2]
  inside = (indices >= 0) & (indices < t)
  at = jnp.clip(indices, 0, t - 1)[..., None]  # [B, KV, n, 1]

  def take(a):
    return jnp.take_along_axis(a, at, axis=2)

  rows = []
  for x in (k, v):
    if isinstance(x, quant4.GroupedKeys):
      rows.append(quant4.rows_of_grouped_keys(take, x).astype(dtype))
    elif isinstance(x, quant4.Int4):
      rows.append(quant4.dequantize(quant4.per_row(take, x), dtype))
    else:
      rows.append(quant.per_row(take, x))
  entries = jnp.broadcast_to(jnp.arange(indices.shape[2], dtype=jnp.int32), indices.shape)
  return rows[0], rows[1], entries, inside if valid is None else valid & inside


def four_bit_scores(q, k, variant, options: KernelOptions, top_k: int, *, tiled: bool,
                    max_rows: int, max_k: int) -> bool:
  """Whether topk_scores scores 4-bit keys by the kernel reading their codes for the few-row
  selection where KernelOptions.int4_topk_scores enables it: no tiling asked, at most `max_rows`
  query rows a KV head and `max_k` picks, keys grouped along tokens. On the GPU variant
  (topk/int4_scores.py, then topk_blocks' pick kernel) groups and halves of d at least a
  tensor-core product's 16 wide; on the TPU one (topk/int4_scores_tpu.py, then topk_blocks'
  jnp pick) q in bf16 or fp32 (no fp16 arithmetic) and key groups of a multiple of 32 tokens
  (a uint8 block's sublane tile), as four_bit_tiles'."""
  if not (options.int4_topk_scores and variant.kind in ("gpu", "tpu")
          and isinstance(k, quant4.GroupedKeys)):
    return False
  b, lq, h, d = q.shape
  if not (not tiled and options.topk_few_rows == "blocks" and options.topk_selection == "exact"
          and lq * (h // k.shape[1]) <= max_rows and top_k <= max_k):
    return False
  if variant.kind == "tpu":
    return q.dtype in (jnp.bfloat16, jnp.float32) and k.main.group % 32 == 0
  return (d % 32 == 0 and k.main.group >= 16
          and q.dtype in (jnp.bfloat16, jnp.float16, jnp.float32))
