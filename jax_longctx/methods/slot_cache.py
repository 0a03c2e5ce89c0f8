"""A bounded cache whose slots remember which token they hold: the base of evicting methods.

Every (sequence, kv head) row keeps at most `budget` tokens. A step appends its new tokens after
them (slots budget .. budget+S-1), attends, and `keep` gathers the `budget` best slots back to
the front in position order, emptying the rest. Rows may keep different tokens per kv head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, axes

from jax_longctx.ops.attention import attention
from jax_longctx.ops.cache import per_row, stored, zeros
from jax_longctx.methods.base import AttnContext, Budget, Method, resolve_budget
from jax_longctx.core.rope import apply_rope

_LAST = jnp.iinfo(jnp.int32).max


@struct.dataclass
class SlotCache:
  k: jnp.ndarray = axes(ROWS, HEADS, None, None)  # [B, KV, C, d]
  v: jnp.ndarray = axes(ROWS, HEADS, None, None)  # [B, KV, C, d]
  pos: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, KV, C] int32 position of the token in each slot, -1 if empty
  score: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, KV, C] fp32 per-method importance (H2O's accumulated attention)
  budget: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def empty(cls, cfg, batch: int, budget: int, capacity: int, dtype,
            keys_before_rope: bool = False) -> "SlotCache":
    """dtype: how keys and values are stored (ops/cache.py); keys_before_rope: the keys are
    cached before RoPE (an 8-bit buffer then holds their offset: ops/cache.py)."""
    shape = (batch, cfg.num_kv_heads, capacity)
    key_heads = 1 if keys_before_rope else None
    return cls(zeros(shape + (cfg.head_dim,), dtype, offset_heads_axis=key_heads),
               zeros(shape + (cfg.head_dim,), dtype),
               jnp.full(shape, -1, jnp.int32), jnp.zeros(shape, jnp.float32), budget)

  @property
  def capacity(self) -> int:
    return self.pos.shape[-1]

  def append(self, k_new, v_new, q_pos, valid) -> "SlotCache":
    """New tokens k/v_new [B, S, KV, d] into slots budget..budget+S-1 (padding gets pos -1)."""
    start = (0, 0, self.budget, 0)

    def put(cache, new):
      return per_row(lambda c, n: jax.lax.dynamic_update_slice(c, n, start), cache,
                     stored(jnp.swapaxes(new, 1, 2), cache, heads_axis=1))

    k, v = put(self.k, k_new), put(self.v, v_new)
    pos_new = jnp.broadcast_to(jnp.where(valid, q_pos, -1)[:, None, :],
                               (q_pos.shape[0], self.pos.shape[1], q_pos.shape[1]))
    pos = jax.lax.dynamic_update_slice(self.pos, pos_new.astype(jnp.int32), start[:3])
    score = jax.lax.dynamic_update_slice(self.score, jnp.zeros(pos_new.shape, jnp.float32),
                                         start[:3])
    return self.replace(k=k, v=v, pos=pos, score=score)

  def keep(self, priority: jnp.ndarray) -> "SlotCache":
    """Keeps the `budget` occupied slots of highest priority [B, KV, C], in position order."""
    return top_slots(self.k, self.v, self.pos, jnp.where(self.pos >= 0, priority, -jnp.inf),
                     self.budget, self.capacity, scores=self.score)

  def settle_last(self) -> "SlotCache":
    """Moves the token in the last slot into the lowest-scoring other slot (an empty one first).

    Fixed-size caches (SnapKV with `keep_size`) write each new token into the last slot, attend,
    then settle: the lowest-scoring token leaves so the others hold at most capacity - 1. Ties go
    to the earliest position. A scatter of one slot per row, O(d).
    """
    last = self.capacity - 1
    front = self.pos[..., :last]
    prio = jnp.where(front >= 0, self.score[..., :last], -jnp.inf)
    low = jnp.min(prio, axis=-1, keepdims=True)
    slot = jnp.argmin(jnp.where(prio == low, front, _LAST), axis=-1)  # [B, KV]
    occupied = self.pos[..., last] >= 0
    slot = jnp.where(occupied, slot, self.capacity)  # nothing to move: dropped
    b_idx, h_idx = jnp.indices(slot.shape)

    def move(a):
      return per_row(lambda x: x.at[b_idx, h_idx, slot].set(x[:, :, last], mode="drop"), a)

    return self.replace(k=move(self.k), v=move(self.v), score=move(self.score),
                        pos=move(self.pos).at[..., last].set(-1))

  def most_recent(self, n: int) -> jnp.ndarray:
    """[B, KV, C] bool: the n occupied slots with the latest positions."""
    if n <= 0:
      return jnp.zeros(self.pos.shape, bool)
    kth = jax.lax.top_k(self.pos, min(n, self.capacity))[0][..., -1:]
    return (self.pos >= 0) & (self.pos >= kth)


def top_slots(k, v, pos, priority, n: int, capacity: int, *, scores=None) -> SlotCache:
  """A SlotCache of `capacity` slots whose first n hold the n highest-priority slots of k/v/pos.

  k, v [B, KV, T, d], pos [B, KV, T] (or [B, T]; -1: empty), priority [B, KV, T]. Only
  n rows are gathered, so taking a small cache out of a long one costs O(n), not O(T). The kept
  slots are in position order; `scores` (default: the priority) go with them.
  """
  pos = jnp.broadcast_to(pos[:, None, :] if pos.ndim == 2 else pos, priority.shape)
  priority = priority.astype(jnp.float32)
  _, idx = jax.lax.top_k(priority, n)
  kept_pos = jnp.take_along_axis(pos, idx, axis=-1)
  order = jnp.argsort(jnp.where(kept_pos >= 0, kept_pos, _LAST), axis=-1)
  idx = jnp.take_along_axis(idx, order, axis=-1)
  scores = priority if scores is None else scores
  pad = capacity - n

  def gather(a, fill):
    taken = jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 3)), axis=2)
    return jnp.concatenate([taken, jnp.full(a.shape[:2] + (pad,) + a.shape[3:], fill, a.dtype)],
                           axis=2)

  rows = lambda a: per_row(lambda x: gather(x, 0), a)  # noqa: E731  (scales move with rows)
  return SlotCache(rows(k), rows(v), gather(pos, -1), gather(scores, 0.0), n)


@dataclasses.dataclass(frozen=True)
class EvictingMethod(Method):
  """Shared step of methods that keep a bounded set of tokens and evict after every step.

  Subclasses define `priority(state, q, lse, ctx)`, which may also update `state.score`.
  Keys are cached after RoPE at their original positions unless `keys_before_rope`.
  """

  budget: Budget = 1024
  int4_refusal = "evicts single cache slots, which a 4-bit key group (one range over 32 tokens) cannot take"

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> SlotCache:
    n = resolve_budget(self.budget, max_len, method=self.name)
    return SlotCache.empty(cfg, batch, n, n + chunk, dtype, self.keys_before_rope)

  def attend_slots(self, state: SlotCache, q, ctx: AttnContext):
    """q (pre-RoPE) over the occupied slots. Returns (q after RoPE, out, lse)."""
    q = apply_rope(q, ctx.q_pos, ctx.freqs)
    out, lse = attention(q, state.k, state.v, ctx.q_pos, state.pos)
    return q, out, lse

  def prefill(self, state: SlotCache, q, k, v, ctx: AttnContext):
    if not self.keys_before_rope:
      k = apply_rope(k, ctx.q_pos, ctx.freqs)
    state = state.append(k, v, ctx.q_pos, ctx.valid)
    q, out, lse = self.attend_slots(state, q, ctx)
    state, priority = self.priority(state, q, lse, ctx)
    return out, state.keep(priority)

  def priority(self, state: SlotCache, q, lse, ctx: AttnContext):
    raise NotImplementedError
