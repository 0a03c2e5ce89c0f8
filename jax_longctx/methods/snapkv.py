"""SnapKV: compress the prompt once, using what its last queries attend to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024
(arXiv:2404.14469). Prefill is exact. At its end each layer scores every prompt token by the
attention of the observation window (the last `window` prompt tokens, 32 in the paper), summed
over the window's queries, max-pooled over neighbouring positions (kernel 7) and aggregated over
the query heads of a GQA group by max; per kv head it keeps the window plus the best other tokens
up to `budget`. Generated tokens are appended without further eviction (or, with `keep_size`,
each replaces the lowest-scoring kept token; generated tokens score +inf).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, axes

from jax_longctx.ops.attention import attention, attention_probs_sum
from jax_longctx.ops.cache import KVCache, per_row, stored
from jax_longctx.methods.base import (AttnContext, Budget, Heads, Method, MethodError,
                                      PrefillEnd, register, resolve_budget)
from jax_longctx.methods.full import Full
from jax_longctx.methods.slot_cache import SlotCache, top_slots
from jax_longctx.core.rope import apply_rope


def pooled_scores(q, k, q_pos, k_pos, lse, q_valid, pool_kernel: int,
                  heads: Heads = Heads()) -> jnp.ndarray:
  """Attention each slot gets from the queries q (summed over them, max over a GQA group), then
  max-pooled over `pool_kernel` neighbouring slots (slots in position order; the window shrinks
  at the ends): [B, KV, T] fp32. `lse` is the queries' LSE over the same slots; `heads` the
  layer's (a group's heads may lie on several devices)."""
  score = heads.group(attention_probs_sum(q, k, q_pos, k_pos, lse, q_valid, group="max"), "max")
  return max_pool(score, pool_kernel)


def max_pool(score, pool_kernel: int) -> jnp.ndarray:
  """score [B, KV, T] max-pooled over `pool_kernel` neighbouring slots (the window shrinks at
  the ends)."""
  return jax.lax.reduce_window(score, -jnp.inf, jax.lax.max, (1, 1, pool_kernel), (1, 1, 1),
                               "SAME")


@struct.dataclass
class SnapPrefill:
  kv: KVCache  # the whole prompt, exact
  q_win: jnp.ndarray = axes(ROWS, None, HEADS, None)  # [B, window, H, d] post-RoPE queries of the latest prompt tokens
  q_win_pos: jnp.ndarray = axes(ROWS, None)  # [B, window] their positions (-1: none yet)
  budget: int = struct.field(pytree_node=False, default=0)


@struct.dataclass
class SnapDecode:
  slots: SlotCache  # the kept prompt tokens, then the generated ones
  prompt_lengths: jnp.ndarray = axes(ROWS)  # [B]


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(Method):
  name = "snapkv"
  int4_refusal = ("keeps single slots chosen after the prompt, which a 4-bit key group (one "
                  "range over 32 tokens) cannot take")
  ends_prefill = True  # end_of_prefill below

  budget: Budget = 1024
  window: int = 32
  pool_kernel: int = 7
  # Evict the lowest-scoring token for each generated one, so the cache stays at `budget` (the
  # fixed-size SnapKV that RefreshKV's partial cache becomes when it is never refreshed).
  keep_size: bool = False

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> SnapPrefill:
    n = resolve_budget(self.budget, max_len, method=self.name)
    # A budget covering the cache keeps every token, so a window longer than it changes nothing.
    if self.window < 1 or (self.window > n and n < max_len):
      raise MethodError(f"window={self.window} must be in 1..budget ({n})")
    if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
      raise MethodError(f"pool_kernel={self.pool_kernel} must be a positive odd number")
    q_win = jnp.zeros((batch, self.window, cfg.num_heads, cfg.head_dim), cfg.jnp_dtype)
    return SnapPrefill(KVCache.zeros(cfg, batch, max_len, dtype), q_win,
                       jnp.full((batch, self.window), -1, jnp.int32), n)

  def prefill(self, state: SnapPrefill, q, k, v, ctx: AttnContext):
    out, kv = Full().prefill(state.kv, q, k, v, ctx)
    q_rot = apply_rope(q, ctx.q_pos, ctx.freqs).astype(state.q_win.dtype)
    # Keep the `window` latest valid queries seen so far.
    pos = jnp.concatenate([state.q_win_pos, jnp.where(ctx.valid, ctx.q_pos, -1)], axis=1)
    latest, idx = jax.lax.top_k(pos, self.window)
    q_all = jnp.concatenate([state.q_win, q_rot], axis=1)
    q_win = jnp.take_along_axis(q_all, idx[:, :, None, None], axis=1)
    return out, state.replace(kv=kv, q_win=q_win, q_win_pos=latest)

  def end_of_prefill(self, state: SnapPrefill, info: PrefillEnd) -> SnapDecode:
    room = 1 if self.keep_size else info.decode_room
    return SnapDecode(self.compress(state, info.prompt_lengths, room, info.heads),
                      info.prompt_lengths)

  def compress(self, state: SnapPrefill, prompt_lengths, room: int,
               heads: Heads = Heads()) -> SlotCache:
    """The kept prompt tokens in the first `budget` slots of a cache with `room` more slots."""
    k_pos, priority = self.prompt_priority(state, prompt_lengths, self.window, heads)
    return top_slots(state.kv.k, state.kv.v, k_pos, priority, state.budget, state.budget + room)

  def prompt_priority(self, state: SnapPrefill, prompt_lengths, keep_recent: int,
                      heads: Heads = Heads()):
    """(k_pos [B, T], priority [B, KV, T]): each prompt slot's pooled window attention, +inf for
    the `keep_recent` latest prompt tokens, -inf for slots past the prompt."""
    kv, t = state.kv, state.kv.max_len
    k_pos = jnp.where(jnp.arange(t)[None, :] < prompt_lengths[:, None],
                      jnp.arange(t, dtype=jnp.int32)[None, :], -1)  # [B, T]
    # LSE of the window queries over the prompt (key-blocked for long prompts), then the
    # attention each prompt token receives: [window x prompt] scores, never [prompt x prompt].
    _, lse = attention(state.q_win, kv.k, kv.v, state.q_win_pos, k_pos)
    score = pooled_scores(state.q_win, kv.k, state.q_win_pos, k_pos, lse, state.q_win_pos >= 0,
                          self.pool_kernel, heads)
    in_window = k_pos >= (prompt_lengths[:, None] - keep_recent)
    priority = jnp.where(in_window[:, None, :], jnp.inf, score)
    return k_pos, jnp.where(k_pos[:, None, :] >= 0, priority, -jnp.inf)

  def decode(self, state: SnapDecode, q, k, v, ctx: AttnContext):
    s = state.slots
    if self.keep_size:  # the new token takes the spare last slot and settles after attention
      if q.shape[1] != 1:
        raise MethodError(f"snapkv with keep_size decodes one token per step, got {q.shape[1]}")
      slot = jnp.full(ctx.q_pos.shape, s.capacity - 1)
    else:
      slot = s.budget + ctx.q_pos - state.prompt_lengths[:, None]  # [B, S]
    slot = jnp.where(ctx.valid, slot, s.capacity)  # dropped
    b_idx = jnp.arange(q.shape[0])[:, None]
    k = apply_rope(k, ctx.q_pos, ctx.freqs)

    def put(cache, new):
      return per_row(lambda c, n: c.at[b_idx, :, slot].set(n, mode="drop"), cache,
                     stored(new, cache))

    s = s.replace(
        k=put(s.k, k), v=put(s.v, v),
        pos=s.pos.at[b_idx, :, slot].set(ctx.q_pos[:, :, None], mode="drop"),
        score=s.score.at[b_idx, :, slot].set(jnp.inf, mode="drop"))
    out, _ = attention(apply_rope(q, ctx.q_pos, ctx.freqs), s.k, s.v, ctx.q_pos, s.pos)
    return out, state.replace(slots=s.settle_last() if self.keep_size else s)
