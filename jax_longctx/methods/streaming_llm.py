"""StreamingLLM: attention sinks plus a window of recent tokens, with the position shift.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(arXiv:2309.17453). The first `n_sink` tokens (4 in the paper) stay forever; the rest of the
budget holds the most recent tokens. Keys are cached before RoPE and rotated at their rank in the
cache (0 .. n-1), and each query at its own rank, so positions never exceed the budget.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_longctx.ops.attention import attention
from jax_longctx.ops.cache import load
from jax_longctx.methods.base import AttnContext, Budget, MethodError, register
from jax_longctx.methods.slot_cache import EvictingMethod, SlotCache
from jax_longctx.core.rope import apply_rope, rotate


@register
@dataclasses.dataclass(frozen=True)
class StreamingLLM(EvictingMethod):
  name = "streaming_llm"
  keys_before_rope = True

  budget: Budget = 1024
  n_sink: int = 4

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> SlotCache:
    state = super().init_state(cfg, batch, max_len, dtype, chunk)
    if not 0 <= self.n_sink < state.budget:
      raise MethodError(f"n_sink={self.n_sink} must be >= 0 and below the budget ({state.budget})")
    return state

  def attend_slots(self, state: SlotCache, q, ctx: AttnContext):
    # Slots are in position order, so a slot's rank among occupied slots is its shifted position.
    rank = jnp.cumsum(state.pos >= 0, axis=-1, dtype=jnp.int32) - 1
    k_pos = jnp.where(state.pos >= 0, rank, -1)
    q_rank = k_pos[:, 0, state.budget:state.budget + q.shape[1]]  # the chunk's own slots
    k = rotate(load(state.k, q.dtype), k_pos, ctx.freqs)
    out, lse = attention(apply_rope(q, q_rank, ctx.freqs), k, state.v, q_rank, k_pos)
    return q, out, lse

  def priority(self, state: SlotCache, q, lse, ctx):
    return state, jnp.where(state.pos < self.n_sink, jnp.inf, state.pos.astype(jnp.float32))
