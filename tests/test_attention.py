"""Attention with LSE against a naive softmax, exact merging, and attention-probability sums."""

import jax.numpy as jnp
import numpy as np

from jax_longctx.ops.attention import (attention, attention_probs_sum, attention_with_probs,
                                      merge_attention)

B, S, H, KV, T, D = 2, 3, 6, 2, 40, 8


def _data(seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, S, H, D)).astype(np.float32)
  k = rng.normal(size=(B, KV, T, D)).astype(np.float32)
  v = rng.normal(size=(B, KV, T, D)).astype(np.float32)
  q_pos = np.array([[30, 31, 32], [10, 11, 12]], np.int32)
  k_pos = np.where(rng.random((B, KV, T)) < 0.8, np.arange(T), -1).astype(np.int32)
  return q, k, v, q_pos, k_pos


def _naive(q, k, v, q_pos, k_pos):
  out = np.zeros((B, S, H, D))
  lse = np.zeros((B, S, H))
  probs = np.zeros((B, KV, T))
  for b in range(B):
    for s in range(S):
      for h in range(H):
        kv = h // (H // KV)
        ok = (k_pos[b, kv] >= 0) & (k_pos[b, kv] <= q_pos[b, s])
        logits = np.where(ok, k[b, kv] @ q[b, s, h] / np.sqrt(D), -np.inf)
        m = logits.max()
        p = np.exp(logits - m)
        out[b, s, h] = p @ v[b, kv] / p.sum()
        lse[b, s, h] = m + np.log(p.sum())
        probs[b, kv] += p / p.sum()
  return out, lse, probs


def test_attention_matches_naive_softmax_with_per_head_slots():
  q, k, v, q_pos, k_pos = _data()
  out, lse = attention(*map(jnp.asarray, (q, k, v, q_pos, k_pos)))
  ref_out, ref_lse, _ = _naive(q, k, v, q_pos, k_pos)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5)


def test_merging_two_halves_equals_attention_over_all():
  q, k, v, q_pos, k_pos = map(jnp.asarray, _data(1))
  full_out, full_lse = attention(q, k, v, q_pos, k_pos)
  parts = [attention(q, k[:, :, sl], v[:, :, sl], q_pos, k_pos[:, :, sl])
           for sl in (slice(0, 17), slice(17, T))]
  out, lse = merge_attention(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
  np.testing.assert_allclose(out, full_out, atol=1e-5)
  np.testing.assert_allclose(lse, full_lse, atol=1e-5)


def test_merge_with_an_empty_part():
  q, k, v, q_pos, k_pos = map(jnp.asarray, _data(2))
  out, lse = attention(q, k, v, q_pos, k_pos)
  empty = attention(q, k, v, q_pos, jnp.full_like(k_pos, -1))
  assert np.all(np.isneginf(np.asarray(empty[1])))
  m_out, m_lse = merge_attention(jnp.stack([out, empty[0]]), jnp.stack([lse, empty[1]]))
  np.testing.assert_allclose(m_out, out, atol=1e-6)
  np.testing.assert_allclose(m_lse, lse, atol=1e-6)


def test_attention_probs_sum_matches_naive():
  q, k, v, q_pos, k_pos = _data(3)
  _, lse = attention(*map(jnp.asarray, (q, k, v, q_pos, k_pos)))
  got = attention_probs_sum(jnp.asarray(q), jnp.asarray(k), jnp.asarray(q_pos), jnp.asarray(k_pos),
                            lse, jnp.ones((B, S), bool), group="sum")
  np.testing.assert_allclose(got, _naive(q, k, v, q_pos, k_pos)[2], atol=1e-5)


def test_attention_with_probs_matches_naive_from_one_pass():
  q, k, v, q_pos, k_pos = _data(4)
  out, lse, probs = attention_with_probs(*map(jnp.asarray, (q, k, v, q_pos, k_pos)))
  ref_out, ref_lse, ref_probs = _naive(q, k, v, q_pos, k_pos)
  np.testing.assert_allclose(out, ref_out, atol=1e-5)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
  assert probs.shape == (B, KV, H // KV, S, T)
  np.testing.assert_allclose(jnp.sum(probs, axis=(2, 3)), ref_probs, atol=1e-5)  # heads, queries
  kp = k_pos[:, :, None, None, :]
  visible = (kp >= 0) & (kp <= q_pos[:, None, None, :, None])
  assert np.all(np.asarray(probs)[~np.broadcast_to(visible, probs.shape)] == 0)
