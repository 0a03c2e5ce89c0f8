"""Attention over tokens chosen per query head from the full cache (Quest, ideal top-k).

Selection happens at decode (one query per step); prefill stays dense. The gather reads only the
chosen slots of each query head's kv head, so no per-head copy of the cache is made.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_longctx.attention import attention
from jax_longctx.cache import KVCache


def gathered_attention(q, kv: KVCache, slots, q_pos):
  """q [B, 1, H, d] (after RoPE) over slots [B, H, n] of the full cache (slot = position).

  Slots past the query's position or the cache end are masked. Returns (out, lse).
  """
  b, _, h, _ = q.shape
  group = h // kv.k.shape[1]
  b_idx = jnp.arange(b)[:, None, None]
  kv_head = (jnp.arange(h) // group)[None, :, None]
  safe = jnp.clip(slots, 0, kv.max_len - 1)
  k = kv.k[b_idx, kv_head, safe]  # [B, H, n, d]
  v = kv.v[b_idx, kv_head, safe]
  k_pos = jnp.where((slots >= 0) & (slots < kv.max_len), slots, -1)
  return attention(q, k, v, q_pos, k_pos)  # one "kv head" per query head


def head_scores(q, keys):
  """q [B, 1, H, d] against per-kv-head rows [B, KV, N, d] -> [B, H, N] fp32 (GQA-aware)."""
  b, _, h, d = q.shape
  kvh = keys.shape[1]
  qg = q[:, 0].reshape(b, kvh, h // kvh, d)
  s = jnp.einsum("bkgd,bknd->bkgn", qg, keys, preferred_element_type=jnp.float32)
  return s.reshape(b, h, -1)
