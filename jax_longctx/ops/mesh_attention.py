"""Attention over keys spread across a mesh axis, for use inside `jax.shard_map`.

- `ring_attention`: exact causal attention of a sequence split into equal contiguous blocks, one
  per device: K/V blocks travel around the ring (`lax.ppermute`) while each device keeps its
  queries; partial (out, lse) pairs merge exactly through the log-sum-exp.
- `merge_across`: the exact merge of every device's partial (out, lse) for the same queries
  (Star Attention's phase 2): `pmax` of the LSE, then `psum` of exp-weighted partials, in fp32.

Both take the mesh axis name; outside `shard_map` they have no meaning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from jax_longctx.ops.attention import merge_attention


def merge_across(out, lse, axis_name: str):
  """out [..., d], lse [...] (natural log, -inf for nothing seen) on every device -> the merged
  (out fp32, lse) over the axis, identical on every device."""
  lse = lse.astype(jnp.float32)
  m = jax.lax.pmax(lse, axis_name)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse - m_safe)  # 0 where this device saw nothing
  total = jax.lax.psum(w, axis_name)
  acc = jax.lax.psum(w[..., None] * out.astype(jnp.float32), axis_name)
  safe = jnp.where(total > 0, total, 1.0)
  merged = jnp.where((total > 0)[..., None], acc / safe[..., None], 0.0)
  return merged, jnp.where(total > 0, m_safe + jnp.log(safe), -jnp.inf)


def ring_attention(q, k, v, axis_name: str, *, route: pallas_kernels.Route, causal: bool = True,
                   scale=None):
  """Exact attention of this device's query block over the whole sequence.

  q [B, Tb, H, d], k, v [B, Tb, KV, d]: device i holds tokens i*Tb .. (i+1)*Tb - 1. Returns
  (out [B, Tb, H, d] in q's dtype, lse [B, Tb, H] fp32). Each of the n steps attends to the block
  in hand and passes it on; the partials merge once at the end. Under `causal`, an earlier block
  is seen whole, this device's own block causally, and a later block is skipped (no compute);
  every call has a zero query offset, so on GPU each goes to cuDNN's flash attention. route:
  the run's kernel route, which every block's call takes.
  """
  n = jax.lax.axis_size(axis_name)  # static: the loop unrolls, n - 1 transfers
  me = jax.lax.axis_index(axis_name)
  b, tb, h, _ = q.shape
  perm = [(i, (i + 1) % n) for i in range(n)]
  attend = lambda kb, vb, tri: pallas_kernels.flash_attention(q, kb, vb, causal=tri, scale=scale,
                                                               route=route)
  branches = (lambda kb, vb: attend(kb, vb, False),  # an earlier block
              lambda kb, vb: attend(kb, vb, True),  # this device's own block
              lambda kb, vb: (jnp.zeros_like(q), jnp.full((b, tb, h), -jnp.inf, jnp.float32)))
  outs, lses = [], []
  for s in range(n):
    if s:
      k = jax.lax.ppermute(k, axis_name, perm)
      v = jax.lax.ppermute(v, axis_name, perm)
    src = (me - s) % n  # whose block this device holds now
    which = jnp.where(src < me, 0, jnp.where(src == me, 1, 2)) if causal else 0
    o, l = jax.lax.switch(which, branches, k, v)
    outs.append(o.astype(jnp.float32))
    lses.append(l)
  out, lse = merge_attention(jnp.stack(outs), jnp.stack(lses))
  return out.astype(q.dtype), lse
