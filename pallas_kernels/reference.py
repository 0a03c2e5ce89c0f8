"""Pure-jnp references for every kernel: the definition the Pallas variants are tested against.

They materialize full score matrices, so they are for checking and for short inputs on CPU. The
exception is `merge_attention`, the library's one merge of partial attentions (the kernels' key
splits, Star and ring attention, RESA): an elementwise pass over the parts, with no kernel.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import quant
from pallas_kernels.layout import heads_first, parts

NEG_INF = float("-inf")


def grouped_scores(q, k, kv_layout: str, scale):
  """[B, Lq, H, d] x keys -> fp32 scores [B, Lq, KV, G, T]."""
  b, lq, h, d = q.shape
  kh = heads_first(k, kv_layout)
  kvh = kh.shape[1]
  qg = q.reshape(b, lq, kvh, h // kvh, d)
  s = jnp.einsum("bqkgd,bktd->bqkgt", qg, kh, preferred_element_type=jnp.float32)
  return s if scale is None else s * scale


def key_parts(k, dtype, kv_layout: str):
  """Keys as the top-k products take them: (values [B, KV, T, d] in `dtype`, their fp32 scales
  [B, KV, T] or None). 8-bit values are exact in bf16; a key's score is its scale times q . its
  values (quant.Quantized), the fp32 product of which equals q . dequantize(k) up to rounding."""
  kh, scale = parts(heads_first(k, kv_layout))
  return (kh, None) if scale is None else (kh.astype(dtype), scale)


def key_scores(q, k, kv_layout: str, scale):
  """[B, Lq, H, d] x keys (an array or quant.Quantized) -> fp32 scores [B, Lq, KV, G, T]."""
  kh, ks = key_parts(k, q.dtype, kv_layout)
  s = grouped_scores(q, kh, "BHTD", None)
  if ks is not None:
    s = s * ks[:, None, :, None, :]
  return s if scale is None else s * scale


def product_scores(q, k, kv_layout: str, scale):
  """The scores of the 8-bit products (KernelOptions.topk_eight_bit="products"): q quantized per
  (token, head) row to k's 8-bit dtype, multiplied with k's values as stored (int8: exact int32
  sums; E4M3: fp32 sums here, where Hopper's tensor cores keep fewer bits), then times the key's
  scale and the row's scale (and `scale`) in the kernels' order. [B, Lq, KV, G, T] fp32."""
  kh, ks = parts(heads_first(k, kv_layout))
  qv, qs = parts(quant.quantize(q, kh.dtype))  # [B, Lq, H, d], [B, Lq, H, 1]
  b, lq, h, d = q.shape
  kvh = kh.shape[1]
  qg = qv.reshape(b, lq, kvh, h // kvh, d)
  exact = jnp.int32 if kh.dtype == jnp.int8 else jnp.float32
  s = jnp.einsum("bqkgd,bktd->bqkgt", qg, kh, preferred_element_type=exact)
  s = s.astype(jnp.float32) * ks[:, None, :, None, :]
  row = qs.reshape(b, lq, kvh, h // kvh, 1)
  return s * (row if scale is None else row * scale)


def topk_scores(q, k, top_k: int, lo, hi, *, scale=None, kv_layout="BTHD", products=False):
  """Exact top-k of q.k over keys lo[b] <= t < hi[b]; ties to the lowest index; unfilled ->
  (-inf, -1). Quantized keys: q . dequantize(k) as `key_scores` computes it, or with `products`
  the 8-bit products' scores (`product_scores`)."""
  b, lq, h, _ = q.shape
  if products and isinstance(k, quant.Quantized):
    s = product_scores(q, k, kv_layout, scale)
  else:
    s = key_scores(q, k, kv_layout, scale)
  t = jnp.arange(s.shape[-1])
  ok = (t >= lo[:, None]) & (t < hi[:, None])
  s = jnp.where(ok[:, None, None, None, :], s, NEG_INF)
  v, i = lax.top_k(s, top_k)
  i = jnp.where(v == NEG_INF, -1, i)
  return v.reshape(b, lq, h, top_k), i.reshape(b, lq, h, top_k).astype(jnp.int32)


def _softmax_out(s, v_heads_first, dtype):
  """Masked scores [B, Lq, KV, G, T] (-inf = masked) and V [B, KV, T, d] -> (out, lse)."""
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("bqkgt,bktd->bqkgd", p, v_heads_first.astype(jnp.float32))
  out = jnp.where(l > 0, out / jnp.where(l > 0, l, 1.0), 0.0)
  lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)),
                  NEG_INF)
  b, lq, kvh, g, d = out.shape
  return out.reshape(b, lq, kvh * g, d).astype(dtype), lse.reshape(b, lq, kvh * g)


def _in_model_dtype(x, dtype):
  """Attention's K or V as the attention computes with it: a quantized one (quant.Quantized)
  dequantized to q's dtype, an array as it is."""
  return quant.dequantize(x, dtype) if quant.is_quantized(x) else x


def flash_attention(q, k, v, *, causal, q_offset, kv_len, scale, kv_layout="BTHD",
                    products=False):
  """Softmax attention; query i of sequence b sits at position q_offset[b] + i; keys < kv_len[b].
  Quantized k, v are dequantized to q's dtype first (the definition the kernels match); with
  `products`, quantized keys score as the 8-bit products do (`product_scores`)."""
  if products and isinstance(k, quant.Quantized):
    s = product_scores(q, k, kv_layout, scale)
  else:
    s = grouped_scores(q, _in_model_dtype(k, q.dtype), kv_layout, scale)
  v = _in_model_dtype(v, q.dtype)
  lq, t = s.shape[1], s.shape[-1]
  k_pos = jnp.arange(t)
  ok = k_pos[None, None, :] < kv_len[:, None, None]  # [B, 1, T]
  if causal:
    q_pos = q_offset[:, None] + jnp.arange(lq)[None, :]  # [B, Lq]
    ok = ok & (k_pos[None, None, :] <= q_pos[:, :, None])
  s = jnp.where(ok[:, :, None, None, :], s, NEG_INF)
  return _softmax_out(s, heads_first(v, kv_layout), q.dtype)


def gathered_attention(q, k, v, indices, valid, *, scale, kv_layout="BTHD", key_rope_freqs=None,
                       key_positions=None, key_offset=None):
  """Attention of each query head over keys indices[b, kv_head, :] of its group, where valid;
  with key_rope_freqs [d / 2], the key of entry j rotated (rotate-half RoPE) at position j, or
  at key_positions[b, j] ([B or 1, n]) when given, in the keys' dtype as the models rotate
  (jax_longctx.core.rope.rotate, transformers: cos and sin cast to it). Quantized k, v: the
  selected rows dequantized to q's dtype first, then rotated in it; key_offset [KV, d] added to
  the keys (in that dtype) before the rotation."""
  kh, vh = heads_first(k, kv_layout), heads_first(v, kv_layout)
  t = kh.shape[2]
  ok = valid & (indices >= 0) & (indices < t)
  safe = jnp.clip(indices, 0, t - 1)
  take = lambda x: jnp.take_along_axis(x, safe[..., None], axis=2, mode="clip")  # noqa: E731
  kg, vg = (_in_model_dtype(quant.per_row(take, x), q.dtype) for x in (kh, vh))  # [B, KV, n, d]
  if key_offset is not None:
    kg = kg + key_offset[None, :, None, :].astype(kg.dtype)
  if key_rope_freqs is not None:
    pos = (jnp.arange(kg.shape[2])[None, :] if key_positions is None else key_positions)
    angles = pos.astype(jnp.float32)[:, None, :, None] * key_rope_freqs  # [B or 1, 1, n, d/2]
    k1, k2 = jnp.split(kg, 2, axis=-1)
    cos, sin = jnp.cos(angles).astype(kg.dtype), jnp.sin(angles).astype(kg.dtype)
    kg = jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)
  s = grouped_scores(q, kg, "BHTD", scale)
  s = jnp.where(ok[:, None, :, None, :], s, NEG_INF)
  return _softmax_out(s, vg, q.dtype)


def merge_attention(outs, lses):
  """Exact merge of partial attentions over disjoint key sets, in fp32: outs [P, ..., d], lses
  [P, ...] (natural log, -inf for an empty part) -> (out in outs' dtype, lse fp32); a row empty
  in every part gives (0, -inf).

  No Pallas kernel: a kernel for it existed, but no library call ran it and nothing measured it
  faster than what XLA fuses these few elementwise ops into (the split-K decode merge that was
  worth a kernel is split_merge.py)."""
  if outs.shape[:-1] != lses.shape:
    raise ValueError(f"outs {outs.shape} must be lses {lses.shape} plus a head dim")
  lses = lses.astype(jnp.float32)
  m = jnp.max(lses, axis=0)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lses - m_safe)
  total = jnp.sum(w, axis=0)
  out = jnp.sum(w[..., None] * outs.astype(jnp.float32), axis=0)
  safe_total = jnp.where(total > 0, total, 1.0)
  out = jnp.where(total[..., None] > 0, out / safe_total[..., None], 0.0)
  lse = jnp.where(total > 0, m_safe + jnp.log(safe_total), NEG_INF)
  return out.astype(outs.dtype), lse
