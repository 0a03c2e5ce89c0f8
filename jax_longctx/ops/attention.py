"""Attention that returns its log-sum-exp, over a cache laid out [batch, kv_heads, slots, head_dim].

Each cache slot carries the position of the token it holds (-1 for an empty slot); a query at
position p sees slot j iff 0 <= k_pos[j] <= p. That one rule covers causal prefill chunks,
decoding, batches of different lengths and methods that keep a subset of tokens in any order.

The cache layout puts kv_heads before slots so that XLA's batched matmuls read K and V in place
(batch dimensions must be major on GPU; a [batch, slots, heads, d] layout makes XLA copy the cache
every step). LSE is natural-log. Pallas kernels (pallas_kernels/) replace these jnp paths on
accelerators; these stay the reference and the CPU path. K and V may be stored in 8 bits
(ops/cache.py): the scores are those of the dequantized keys, P.V accumulates in fp32, and a long
cache is dequantized one key block at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_longctx.ops.cache import load, per_row
from pallas_kernels.reference import merge_attention  # noqa: F401  (defined once, there)

# Above this many score elements per call, keys are processed in blocks with an online softmax so
# that no [queries x cache] matrix is ever held for a long context.
_DENSE_LIMIT = 1 << 24
_KEY_BLOCK = 1024
_MAX_SPLITS = 64
_ROWS_UNSPLIT = 256  # query rows (per kv head) from which P.V runs unsplit


def _group(q: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
  b, s, h, d = q.shape
  return q.reshape(b, s, num_kv_heads, h // num_kv_heads, d)  # query head h -> kv head h // G


def _scores(qg, k, scale):
  # The queries moved to [B, KV, G, S, d] first, so the product's batch dimensions lead both
  # operands: XLA:CPU ran the einsum straight from [B, S, KV, G, d] at 2.5x the time (a 512-query
  # chunk over 3,200 keys, SmolLM2's 9 / 3 heads: 86 against 34 ms), most of the default model's
  # CPU prefill.
  qg = jnp.transpose(qg, (0, 2, 3, 1, 4))
  return jnp.einsum("bkgsd,bktd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale


def _visible(q_pos, k_pos):
  """[B, KV or 1, 1, S, T] mask of which slots each query sees (k_pos [B, KV, T])."""
  kp = k_pos[:, :, None, :]
  m = (kp >= 0) & (kp <= q_pos[:, None, :, None])
  return m[:, :, None]


def _per_head(k_pos):
  return k_pos[:, None, :] if k_pos.ndim == 2 else k_pos


def _finish(acc, m, l, out_shape, dtype):
  """acc [B,KV,G,S,d], running max m and sum l [B,KV,G,S] -> out [B,S,H,d], lse [B,S,H]."""
  b, s, h, d = out_shape
  safe_l = jnp.where(l > 0, l, 1.0)
  out = jnp.where((l > 0)[..., None], acc / safe_l[..., None], 0.0)
  lse = jnp.where(l > 0, m + jnp.log(safe_l), -jnp.inf)
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, s, h, d).astype(dtype)
  lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, s, h)
  return out, lse


def _key_splits(t: int) -> int:
  """Parts to split a long key axis into for P.V (a power of two dividing t, parts >= 512)."""
  n = 1
  while n < _MAX_SPLITS and t % (2 * n) == 0 and t // (2 * n) >= 512:
    n *= 2
  return n


def _dense(qg, k, v, q_pos, k_pos, scale):
  p, m, l = _dense_probs(qg, k, q_pos, k_pos, scale)
  return _pv(p, v), m, l


def _dense_probs(qg, k, q_pos, k_pos, scale):
  """Unnormalized probabilities p [B, KV, G, S, T] (exp(s - m)), running max m and sum l."""
  s = jnp.where(_visible(q_pos, k_pos), _scores(qg, k, scale), -jnp.inf)
  m = jnp.max(s, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[..., None])
  return p, m, jnp.sum(p, axis=-1)


def _pv(p, v):
  """sum_t p[..., t] v[t]: [B, KV, G, S, d] fp32."""
  # P.V reduces over the whole key axis; with few queries that is a handful of long reductions
  # that leave most of a GPU idle, so the key axis is split into parts summed afterwards. Many
  # query rows fill the device without it, and the split tripled XLA:CPU's time for a 512-query
  # chunk over 3,200 keys (SmolLM2's heads: 52 against 16 ms).
  b, kvh, g, sq, t = p.shape
  n = 1 if g * sq >= _ROWS_UNSPLIT else _key_splits(t)
  pn = p.astype(v.dtype).reshape(b, kvh, g, sq, n, t // n)
  vn = v.reshape(b, kvh, n, t // n, v.shape[-1])
  acc = jnp.einsum("bkgsnt,bkntd->bkngsd", pn, vn, preferred_element_type=jnp.float32)
  return jnp.sum(acc, axis=2)


def _blocked(qg, k, v, q_pos, k_pos, scale, kv_extent, block):
  """Online softmax over key blocks; blocks past `kv_extent` slots are never visited."""
  t = k.shape[2]
  b, s, kvh, g, d = qg.shape
  n_blocks = (jnp.minimum(kv_extent, t) + block - 1) // block

  def body(i, carry):
    acc, m, l = carry
    start = jnp.minimum(i * block, t - block)  # the last block may overlap the one before it
    kb, vb = (load(per_row(lambda a: jax.lax.dynamic_slice_in_dim(a, start, block, axis=2), x),
                   qg.dtype) for x in (k, v))
    pb = jax.lax.dynamic_slice_in_dim(k_pos, start, block, axis=2)
    fresh = (start + jnp.arange(block)) >= i * block  # slots not seen by an earlier block
    pb = jnp.where(fresh, pb, -1)
    sc = jnp.where(_visible(q_pos, pb), _scores(qg, kb, scale), -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(sc - m_safe[..., None])
    corr = jnp.exp(jnp.where(jnp.isfinite(m), m, m_safe) - m_safe)
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum(
        "bkgst,bktd->bkgsd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return acc, m_new, l

  acc0 = jnp.zeros((b, kvh, g, s, d), jnp.float32)
  m0 = jnp.full((b, kvh, g, s), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((b, kvh, g, s), jnp.float32)
  acc, m, l = jax.lax.fori_loop(0, n_blocks, body, (acc0, m0, l0))
  return acc, jnp.where(jnp.isfinite(m), m, 0.0), l


def attention(q, k, v, q_pos, k_pos, *, scale=None, kv_extent=None, key_block=_KEY_BLOCK):
  """Softmax attention of q over cache slots, with its log-sum-exp.

  q: [B, S, H, d]; k, v: [B, KV, T, d]; q_pos: [B, S] int; k_pos: [B, T] or [B, KV, T] int
  positions of the slots (-1 = empty; per kv head when methods keep different tokens per head).
  kv_extent: optional scalar bound, all visible slots lie below it (lets long caches stop early).
  Returns out [B, S, H, d] in q's dtype and lse [B, S, H] fp32 (-inf where nothing is visible).
  """
  b, s, h, d = q.shape
  kvh, t = k.shape[1], k.shape[2]
  if h % kvh:
    raise ValueError(f"{h} query heads do not divide into {kvh} kv heads")
  scale = d ** -0.5 if scale is None else scale
  qg = _group(q, kvh)
  k_pos = _per_head(k_pos)
  if b * h * s * t <= _DENSE_LIMIT or t <= key_block:
    acc, m, l = _dense(qg, load(k, q.dtype), load(v, q.dtype), q_pos, k_pos, scale)
  else:
    extent = t if kv_extent is None else kv_extent
    acc, m, l = _blocked(qg, k, v, q_pos, k_pos, scale, extent, key_block)
  return _finish(acc, m, l, q.shape, q.dtype)


def attention_with_probs(q, k, v, q_pos, k_pos, *, scale=None):
  """`attention`, and from the same scores each query head's attention probabilities over the
  slots: (out [B, S, H, d], lse [B, S, H], probs [B, KV, G, S, T] fp32, zero where a slot is not
  visible). K is read once (attention then `attention_probs_sum` read it twice: RefreshKV's
  refresh, BENCHMARKS.md). Holds the [B, H, S, T] scores whole: for a decode step's few queries.
  """
  b, s, h, d = q.shape
  kvh = k.shape[1]
  if h % kvh:
    raise ValueError(f"{h} query heads do not divide into {kvh} kv heads")
  scale = d ** -0.5 if scale is None else scale
  p, m, l = _dense_probs(_group(q, kvh), load(k, q.dtype), q_pos, _per_head(k_pos), scale)
  out, lse = _finish(_pv(p, load(v, q.dtype)), m, l, q.shape, q.dtype)
  return out, lse, p / jnp.where(l > 0, l, 1.0)[..., None]


def attention_probs_sum(q, k, q_pos, k_pos, lse, q_valid, *, scale=None, group="sum"):
  """Attention probability each slot receives, summed over the valid queries: [B, KV, T] fp32.

  Uses the LSE that `attention` returned over the same slots, so the probabilities are exact
  without a second softmax; cost and memory are those of one [queries x slots] score block, so
  callers keep the slot count bounded (a method's budget plus one chunk). `group` reduces the
  query heads that share a kv head: "sum", "max" or "mean".
  """
  kvh = k.shape[1]
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  s = _scores(_group(q, kvh), load(k, q.dtype), scale)  # [B, KV, G, S, T]
  lse_g = jnp.transpose(lse.reshape(lse.shape[0], lse.shape[1], kvh, -1), (0, 2, 3, 1))
  ok = _visible(q_pos, _per_head(k_pos)) & q_valid[:, None, None, :, None]
  ok = ok & jnp.isfinite(lse_g)[..., None]
  p = jnp.where(ok, jnp.exp(s - jnp.where(ok, lse_g[..., None], 0.0)), 0.0)
  p = jnp.sum(p, axis=3)  # over queries -> [B, KV, G, T]
  return {"sum": jnp.sum, "max": jnp.max, "mean": jnp.mean}[group](p, axis=2)
