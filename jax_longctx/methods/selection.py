"""Attention over tokens chosen per query head from the full cache (Quest, ideal top-k).

Selection happens at decode (one query per step); prefill stays dense. The gather reads only the
chosen slots of each query head's kv head, so no per-head copy of the cache is made.
`SelectingMethod` splits a decode step into write, select and attend, so wrappers (RESA) can
reuse a method's selection and replace its attention.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_longctx.ops.attention import attention
from jax_longctx.ops.cache import KVCache, per_row
from jax_longctx.methods.base import AttnContext, MethodError, resolve_budget
from jax_longctx.methods.full import Full
from jax_longctx.core.rope import apply_rope


def gather_slots(kv: KVCache, slots):
  """Each query head's slots [B, H, n] -> k, v [B, H, n, d] from its kv head, and their
  positions [B, H, n] (-1 for slots past the cache end)."""
  b, h, _ = slots.shape
  group = h // kv.k.shape[1]
  b_idx = jnp.arange(b)[:, None, None]
  kv_head = (jnp.arange(h) // group)[None, :, None]
  safe = jnp.clip(slots, 0, kv.max_len - 1)
  k_pos = jnp.where((slots >= 0) & (slots < kv.max_len), slots, -1)
  take = lambda x: per_row(lambda a: a[b_idx, kv_head, safe], x)  # noqa: E731
  return take(kv.k), take(kv.v), k_pos


def gathered_attention(q, kv: KVCache, slots, q_pos):
  """q [B, 1, H, d] (after RoPE) over slots [B, H, n] of the full cache (slot = position).

  Slots past the query's position or the cache end are masked. Returns (out, lse).
  """
  k, v, k_pos = gather_slots(kv, slots)
  return attention(q, k, v, q_pos, k_pos)  # one "kv head" per query head


def head_scores(q, keys):
  """q [B, 1, H, d] against per-kv-head rows [B, KV, N, d] -> [B, H, N] fp32 (GQA-aware)."""
  b, _, h, d = q.shape
  kvh = keys.shape[1]
  qg = q[:, 0].reshape(b, kvh, h // kvh, d)
  s = jnp.einsum("bkgd,bknd->bkgn", qg, keys, preferred_element_type=jnp.float32)
  return s.reshape(b, h, -1)


@dataclasses.dataclass(frozen=True)
class SelectingMethod(Full):
  """Keeps the whole cache (post-RoPE keys, slot = position); prefill is exact; each decode step
  attends per query head to the slots `select` returns, plus `n_sink` first and `n_recent` last
  tokens when set (the fixed part of every budget in RESA's evaluation: 4 and 64)."""

  n_sink: int = 0
  n_recent: int = 0

  def select_budget(self, max_len: int) -> int:
    """Tokens `select` chooses: the budget less the fixed sink and recent tokens, or the whole
    cache (`max_len`) when the budget covers it: every slot is then chosen, the fixed ones
    among them (`selected_slots` reads each slot once), so decode is exact attention."""
    total = resolve_budget(self.budget, max_len, method=self.name)
    if total >= max_len and self.n_sink >= 0 and self.n_recent >= 0:
      return max_len
    n = total - self.n_sink - self.n_recent
    if self.n_sink < 0 or self.n_recent < 0 or n < 1:
      raise MethodError(f"budget={self.budget} leaves no tokens to select after n_sink="
                        f"{self.n_sink} and n_recent={self.n_recent} (both >= 0)")
    return n

  def selected_slots(self, state, q_rot, ctx: AttnContext) -> jnp.ndarray:
    """`select`'s slots with the fixed ones appended, each slot at most once: [B, H, n]."""
    slots = self.select(state, q_rot, ctx)
    if not (self.n_sink or self.n_recent):
      return slots
    newest = ctx.q_pos[:, :1]  # [B, 1]
    recent = newest - jnp.arange(self.n_recent)[None, :]
    recent = jnp.where(recent < self.n_sink, -1, recent)  # already a sink (or before 0)
    sink = jnp.broadcast_to(jnp.arange(self.n_sink)[None, :], (newest.shape[0], self.n_sink))
    fixed = jnp.concatenate([sink, recent], axis=1)[:, None, :]  # [B, 1, n_fixed]
    fixed_already = (slots < self.n_sink) | (slots > newest[:, :, None] - self.n_recent)
    slots = jnp.where(fixed_already, -1, slots)
    return jnp.concatenate([slots, jnp.broadcast_to(fixed, slots.shape[:2] + fixed.shape[2:])],
                           axis=-1)

  def dense_at(self, ctx: AttnContext) -> bool:
    """Layers that decode with exact attention instead of selecting."""
    return False

  def cache(self, state) -> KVCache:
    return state

  def write(self, state, k_rot, v, ctx: AttnContext):
    """Stores the new tokens' post-RoPE keys and values (and any per-method summaries)."""
    return state.write(ctx.q_pos, k_rot, v, route=ctx.options.route, valid=ctx.valid)

  def select(self, state, q_rot, ctx: AttnContext) -> jnp.ndarray:
    """[B, H, n] cache slots for each query head (out-of-range or future slots are masked)."""
    raise NotImplementedError

  def decode(self, state, q, k, v, ctx: AttnContext):
    if self.dense_at(ctx):
      return self.prefill(state, q, k, v, ctx)
    if q.shape[1] != 1:
      raise MethodError(f"{self.name} decodes one token per step")
    state = self.write(state, apply_rope(k, ctx.q_pos, ctx.freqs), v, ctx)
    q = apply_rope(q, ctx.q_pos, ctx.freqs)
    out, _ = gathered_attention(q, self.cache(state), self.selected_slots(state, q, ctx),
                                ctx.q_pos)
    return out, state
