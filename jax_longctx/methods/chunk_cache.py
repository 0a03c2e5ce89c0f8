"""A compact cache of pre-RoPE states, evicted a chunk at a time: the state of CItruS.

Occupied slots are 0..n-1 of each sequence, in token order, and one set of tokens is kept per
layer for all heads (CItruS evicts layer-wise, not head-wise). With the position shift of
StreamingLLM a slot's rank is its RoPE position: keys are rotated at 0..n-1 on every step and
new tokens at n, n+1, ..., so no position ever exceeds the cache's size.

Scores are attention probabilities that new queries give old slots, from the LSE the attention
already returned: the score block is [queries x (budget + chunk)], never over the document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, axes

from jax_longctx.methods.base import AttnContext
from jax_longctx.ops.attention import attention, attention_probs_sum
from jax_longctx.ops.cache import Quantized, load, per_row, stored, zeros
from jax_longctx.core.rope import apply_rope, rotate


@struct.dataclass
class ChunkCache:
  k: jnp.ndarray = axes(ROWS, HEADS, None, None)  # [B, KV, C, d] before RoPE
  v: jnp.ndarray = axes(ROWS, HEADS, None, None)  # [B, KV, C, d]
  pos: jnp.ndarray = axes(ROWS, None)  # [B, C] int32 original position of the token in each slot, -1 if empty
  n: jnp.ndarray = axes(ROWS)  # [B] int32 occupied slots (0..n-1)
  score: jnp.ndarray = axes(ROWS, None)  # [B, C] fp32 importance from the latest instruction pass
  history: jnp.ndarray = axes(ROWS, None)  # [B, C] fp32 attention accumulated from document queries (H2O)
  seen: jnp.ndarray = axes(ROWS, None)  # [B, C] fp32 how many document queries `history` adds up
  budget: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def empty(cls, cfg, batch: int, budget: int, capacity: int, dtype) -> "ChunkCache":
    """dtype: how keys and values are stored (ops/cache.py; the keys, before RoPE, with their
    offset)."""
    kv = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    rows = (batch, capacity)  # every field its own buffer: the cache is donated
    return cls(zeros(kv, dtype, offset_heads_axis=1), zeros(kv, dtype),
               jnp.full(rows, -1, jnp.int32),
               jnp.zeros((batch,), jnp.int32), jnp.zeros(rows, jnp.float32),
               jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.float32), budget)

  @property
  def capacity(self) -> int:
    return self.pos.shape[-1]

  def slot_positions(self) -> jnp.ndarray:
    """[B, C] RoPE position of each slot (its rank), -1 for empty slots."""
    rank = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
    return jnp.where(rank < self.n[:, None], rank, -1)

  def attend_and_score(self, q, k_new, v_new, ctx: AttnContext):
    """New tokens (q [B,S,H,d], k/v_new [B,S,KV,d], pre-RoPE) over the cache and each other.

    Returns (out [B,S,H,d], scores [B, C]): scores are the attention each old slot receives,
    averaged over heads and the valid queries (Eq. 1 of CItruS), and its sum over queries.
    From ctx: valid, freqs, heads (the average takes every head of the layer, over devices too).
    """
    valid, freqs, heads = ctx.valid, ctx.freqs, ctx.heads
    b, s = valid.shape
    q_pos = self.n[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [B, S]
    new_pos = jnp.where(valid, q_pos, -1)
    old_pos = self.slot_positions()
    # The cache's keys as stored (8-bit ones dequantized: the scores steering the eviction are
    # the attention the model computes), rotated at their ranks; the new ones as they are.
    k_stored = load(self.k, q.dtype)
    v_stored = load(self.v, q.dtype)
    k_old = rotate(k_stored, old_pos[:, None, :], freqs)
    q_rot = apply_rope(q, q_pos, freqs)
    k_all = jnp.concatenate([k_old, jnp.swapaxes(apply_rope(k_new, q_pos, freqs), 1, 2)], axis=2)
    v_all = jnp.concatenate([v_stored, jnp.swapaxes(v_new, 1, 2).astype(v_stored.dtype)], axis=2)
    pos_all = jnp.concatenate([old_pos, new_pos], axis=1)
    out, lse = attention(q_rot, k_all.astype(k_stored.dtype), v_all, q_pos, pos_all)
    probs = attention_probs_sum(q_rot, k_old, q_pos, old_pos, lse, valid, group="sum")  # [B,KV,C]
    # mean over the layer's heads (this device's q.shape[2] of them), summed over queries
    summed = heads.sum(probs, axis=1) / (q.shape[2] * heads.shards)
    n_valid = jnp.maximum(jnp.sum(valid, axis=1), 1).astype(jnp.float32)
    return out, summed / n_valid[:, None], summed

  def append(self, k_new, v_new, valid, tok_pos) -> "ChunkCache":
    """Writes the valid new tokens [B, S, KV, d] at slots n, n+1, ... in order (tok_pos [B, S]);
    invalid ones anywhere in the row are skipped."""
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    slot = jnp.where(valid, self.n[:, None] + rank, self.capacity)  # padding: out of range, dropped
    bi = jnp.arange(valid.shape[0])[:, None]

    def put(cache, new):
      return per_row(lambda c, n: c.at[bi, :, slot].set(n, mode="drop"), cache,
                     stored(new, cache, heads_axis=2))

    k, v = put(self.k, k_new), put(self.v, v_new)
    fresh = jnp.zeros(slot.shape, jnp.float32)
    return self.replace(
        k=k, v=v, pos=self.pos.at[bi, slot].set(tok_pos.astype(jnp.int32), mode="drop"),
        n=self.n + jnp.sum(valid, axis=1, dtype=jnp.int32),
        score=self.score.at[bi, slot].set(fresh, mode="drop"),
        history=self.history.at[bi, slot].set(fresh, mode="drop"),
        seen=self.seen.at[bi, slot].set(fresh, mode="drop"))

  def evict(self, priority, active=None) -> "ChunkCache":
    """Keeps the `budget` occupied slots of highest priority [B, C], compacted in token order.

    Rows where `active` [B] is False are left as they are (their document has ended).
    """
    c = self.capacity
    occupied = jnp.arange(c)[None, :] < self.n[:, None]
    prio = jnp.where(occupied, priority.astype(jnp.float32), -jnp.inf)
    top, idx = jax.lax.top_k(prio, min(self.budget, c))
    key = jnp.sort(jnp.where(top > -jnp.inf, idx, c), axis=-1)  # kept slots in token order
    ok = key < c
    idx = jnp.where(ok, key, 0)
    pad = c - idx.shape[1]

    k = per_row(lambda a: _gather_slots(a, idx, pad), self.k)  # scales move with their rows
    v = per_row(lambda a: _gather_slots(a, idx, pad), self.v)
    pos = _gather_rows(jnp.where(occupied, self.pos, -1), idx, ok, pad, -1)
    score = _gather_rows(self.score, idx, ok, pad, 0)
    kept = self.replace(k=k, v=v, pos=pos, n=jnp.sum(ok, axis=1, dtype=jnp.int32), score=score,
                        history=_gather_rows(self.history, idx, ok, pad, 0),
                        seen=_gather_rows(self.seen, idx, ok, pad, 0))
    if active is None:
      return kept
    # per_row: an 8-bit buffer's scales go with their rows, its key offset stays the buffer's.
    rows = lambda new, old: per_row(lambda n, o: _where_rows(active, n, o), new, old)  # noqa: E731
    return jax.tree.map(rows, kept, self, is_leaf=lambda x: isinstance(x, Quantized))


def _gather_slots(a, idx, pad):
  """a [B, KV, C, d] -> the slots idx [B, n] then `pad` zero slots."""
  taken = jnp.take_along_axis(a, idx[:, None, :, None], axis=2)
  return jnp.concatenate([taken, jnp.zeros(a.shape[:2] + (pad,) + a.shape[3:], a.dtype)], axis=2)


def _gather_rows(a, idx, ok, pad, fill):
  """a [B, C] -> a[idx] where ok (else fill), then `pad` fill entries."""
  taken = jnp.where(ok, jnp.take_along_axis(a, idx, axis=1), fill).astype(a.dtype)
  return jnp.concatenate([taken, jnp.full((a.shape[0], pad), fill, a.dtype)], axis=1)


def _where_rows(active, new, old):
  return jnp.where(active.reshape(active.shape + (1,) * (new.ndim - 1)), new, old)
