"""A prefill chunk's attention: the cached keys before it, plus its own keys causally.

Queries i = 0..C-1 of sequence b sit at positions q_offset[b] + i and see every key before
q_offset[b] (the cache) and the chunk's own keys up to their own position. On NVIDIA GPUs this is
two cuDNN fused-attention calls merged exactly by log-sum-exp: non-causal over the cache with
kv_seqlen = q_offset (cuDNN skips the tiles past it, so the cost follows the offset, not the cache
size) and causal over the chunk's own keys (square, so cuDNN's top-left causal mask is the right
one). One cuDNN call cannot do it: the causal mask JAX exposes is top-left aligned, and a chunk at
an offset needs bottom-right alignment.

The call goes through jax's private `jax._src.cudnn.fused_attention_stablehlo.
dot_product_attention`, which returns the softmax statistics in fp32 (the public
`jax.nn.dot_product_attention` casts them to the output dtype, too coarse to merge by). It is
guarded: `cudnn_available()` is False when that function is missing or its signature changed,
and the chunk then runs the Pallas flash-attention kernel (tests cover both routes).

A quantized cache (quant.Quantized, 8-bit values and a scale per key and head) cannot go to cuDNN.
On a GPU, while the dequantized copy fits `KernelOptions.prefill_dequantize_bytes`, the cache is
dequantized to the queries' dtype and the chunk takes the bf16 route: the attention of a 4096-query
chunk is compute-bound, so one pass over the 8-bit cache costs a few percent of it, while the
8-bit flash kernel runs at about half the bf16 kernel's rate. Otherwise (longer caches, TPUs, the
interpreter) the chunk is one `flash_attention` call with the offset over the 8-bit cache, which
holds the chunk's own keys too (quantized, as decode will read them; k/v_chunk go unused).
"""

from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp

from pallas_kernels import layout, quant, read, reference
from pallas_kernels.attention.flash import flash_attention, mosaic_serves
from pallas_kernels.route import Route

NEG_INF = float("-inf")
_NEEDED = ("q_seqlen", "kv_seqlen", "scale", "mask_type", "qkv_layout", "return_residual")


@functools.lru_cache(maxsize=None)
def _private_cudnn():
  """(dot_product_attention, MaskType) from jax's private cuDNN module, or None."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    params = inspect.signature(fa.dot_product_attention).parameters
    if not all(p in params for p in _NEEDED) or not hasattr(fa, "MaskType"):
      return None
    return fa.dot_product_attention, fa.MaskType
  except Exception:  # noqa: BLE001  (any import or signature change means: not available)
    return None


def cudnn_available() -> bool:
  return _private_cudnn() is not None


def cudnn_dense(q, k, v, q_seqlen, kv_seqlen, *, causal: bool, scale: float, layout: str):
  """One cuDNN call. layout "BTNH" (q [B,S,H,d], k/v [B,T,KV,d]) or "BNTH" (heads first).

  Masks keys past kv_seqlen[b]; causal is top-left (query i sees keys j <= i). Returns (out in
  q's layout and dtype, lse fp32 natural log [B,H,S] in either layout: cuDNN's statistics are
  heads-first); rows that see no key are unspecified (the caller masks them by kv_seqlen)."""
  fn, mask = _private_cudnn()
  out, lse = fn(q, k, v, q_seqlen=q_seqlen, kv_seqlen=kv_seqlen, scale=scale,
                mask_type=mask.PADDING_CAUSAL if causal else mask.PADDING, qkv_layout=layout,
                return_residual=True)
  return out, lse.astype(jnp.float32)


def reference_dense(q, k, v, q_seqlen, kv_seqlen, *, causal: bool, scale: float, layout: str):
  """`cudnn_dense`'s definition in jnp (CPU tests of the composition)."""
  del q_seqlen
  if layout == "BNTH":
    q = jnp.swapaxes(q, 1, 2)
  zero = jnp.zeros(q.shape[0], jnp.int32)
  out, lse = reference.flash_attention(q, k, v, causal=causal, q_offset=zero, kv_len=kv_seqlen,
                                       scale=scale, kv_layout="BHTD" if layout == "BNTH" else
                                       "BTHD")
  if layout == "BNTH":
    out = jnp.swapaxes(out, 1, 2)
  return out, jnp.swapaxes(lse, 1, 2)


def chunk_attention_composed(q, k_cache, v_cache, k_chunk, v_chunk, q_offset, *, scale: float,
                             kv_layout: str, dense=None):
  """q [B,C,H,d]; cache keys/values [B,T,KV,d] (BTHD) or [B,KV,T,d] (BHTD) of which the first
  q_offset[b] are before the chunk; k/v_chunk [B,C,KV,d] the chunk's own (after RoPE).
  Returns (out [B,C,H,d] in q's dtype, lse [B,C,H] fp32)."""
  dense = dense or cudnn_dense
  b, c = q.shape[:2]
  full = jnp.full((b,), c, jnp.int32)
  if kv_layout == "BHTD":  # cuDNN takes q in the keys' layout: a chunk-sized transpose
    out_p, lse_p = dense(jnp.swapaxes(q, 1, 2), k_cache, v_cache, full, q_offset, causal=False,
                         scale=scale, layout="BNTH")
    out_p = jnp.swapaxes(out_p, 1, 2)
  else:
    out_p, lse_p = dense(q, k_cache, v_cache, full, q_offset, causal=False, scale=scale,
                         layout="BTNH")
  out_c, lse_c = dense(q, k_chunk, v_chunk, full, full, causal=True, scale=scale, layout="BTNH")
  lse_p, lse_c = jnp.swapaxes(lse_p, 1, 2), jnp.swapaxes(lse_c, 1, 2)  # [B, H, C] -> [B, C, H]
  before = (q_offset > 0)[:, None, None]  # the first chunk has no prefix: its part is empty
  lse_p = jnp.where(before, lse_p, NEG_INF)
  out_p = jnp.where(before[..., None], out_p, jnp.zeros((), out_p.dtype))
  out, lse = reference.merge_attention(jnp.stack([out_p, out_c]), jnp.stack([lse_p, lse_c]))
  return out.astype(q.dtype), lse


def cudnn_route(q, k_cache, route: Route, kv_layout: str = "BTHD") -> bool:
  """Whether `chunk_attention` takes the cuDNN route: on a GPU (not interpreted) with the private
  entry present, bf16/fp16 queries and cache of one dtype, unless the Mosaic GPU flash kernel
  serves the chunk (Hopper: one call with the offset, measured 1.10-1.14x the two cuDNN calls);
  never for a quantized cache."""
  if not route.kernels.chunk_cudnn or not read.cudnn_reads(k_cache):
    return False
  if mosaic_serves(q, k_cache, k_cache, kv_layout=kv_layout, route=route):
    return False
  variant = route.variant()
  return (variant.kind == "gpu" and not variant.interpret and cudnn_available()
          and q.dtype in (jnp.bfloat16, jnp.float16) and q.dtype == k_cache.dtype)


def chunk_attention(q, k_cache, v_cache, k_chunk, v_chunk, q_offset, *, kv_layout: str = "BTHD",
                    scale: float | None = None, route: Route, use_cudnn: bool | None = None):
  """Causal attention of a prefill chunk at positions q_offset[b] + i over the cache and itself.

  q [B,C,H,d]; k/v_cache [B,T,KV,d] (BTHD) or [B,KV,T,d] (BHTD), holding the chunk's own keys at
  slots q_offset.. as well (the non-cuDNN routes read them there); k/v_chunk [B,C,KV,d] those
  keys again (the cuDNN route reads them here). q_offset: int or [B]. Returns (out [B,C,H,d],
  lse [B,C,H] fp32). use_cudnn: None = on a GPU when the private cuDNN entry exists and the
  dtype is bf16/fp16; else the flash-attention kernel (or the jnp reference off-GPU). A quantized
  cache (k/v_cache Quantized, k/v_chunk arrays or Quantized) runs the flash-attention kernel.
  """
  if (q_kernel := read.kernel_queries(q, k_cache, route.variant())) is not q:
    out, lse = chunk_attention(q_kernel, k_cache, v_cache, k_chunk, v_chunk, q_offset,
                               kv_layout=kv_layout, scale=scale, route=route, use_cudnn=use_cudnn)
    return out.astype(q.dtype), lse
  b, c, _, d = q.shape
  scale = float(scale) if scale is not None else d ** -0.5
  q_off = layout.per_batch(q_offset, b, 0)
  if read.four_bit_chunk_tiles(q, k_cache, v_cache, route.variant(), route.kernels):
    return flash_attention(q, k_cache, v_cache, causal=True, q_offset=q_off, kv_len=q_off + c,
                           scale=scale, kv_layout=kv_layout, route=route)
  k_cache, v_cache = read.four_bit_copies(q.dtype, k_cache, v_cache)
  if read.dequantize_first(q, k_cache, route.variant(), route.kernels):
    k_cache, v_cache, k_chunk, v_chunk = (quant.dequantize(x, q.dtype)
                                          for x in (k_cache, v_cache, k_chunk, v_chunk))
  if use_cudnn is None:
    use_cudnn = cudnn_route(q, k_cache, route, kv_layout)
  read.check_cudnn_asked(use_cudnn, k_cache)
  if use_cudnn:
    return chunk_attention_composed(q, k_cache, v_cache, k_chunk.astype(q.dtype),
                                    v_chunk.astype(q.dtype), q_off, scale=scale,
                                    kv_layout=kv_layout)
  return flash_attention(q, k_cache, v_cache, causal=True, q_offset=q_off, kv_len=q_off + c,
                         scale=scale, kv_layout=kv_layout, route=route)
