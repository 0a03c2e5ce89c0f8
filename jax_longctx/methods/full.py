"""Full (exact) attention over a preallocated cache: the reference every method is compared to."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

import pallas_kernels
from jax_longctx.ops.attention import attention
from jax_longctx.ops.cache import KVCache
from jax_longctx.methods.base import AttnContext, Method, register
from jax_longctx.core.rope import apply_rope


@register
@dataclasses.dataclass(frozen=True)
class Full(Method):
  """Exact causal attention; keys are cached after RoPE at slot = position.

  Memory: the whole context, O(L) per decode step.
  """

  name = "full"
  int4_refusal = ""

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> KVCache:
    return KVCache.zeros(cfg, batch, max_len, dtype)

  def attend_cache(self, state: KVCache, q, ctx: AttnContext, chunk_kv=None):
    """q (after RoPE) over every cached slot it may see. Returns (out, lse).

    chunk_kv: (k, v) [B, S, KV, d] of a prefill chunk just written (k after RoPE), which lets
    the chunk's own part run as a square causal cuDNN call (pallas_kernels.chunk_attention).
    """
    route = ctx.options.route
    if q.shape[1] == 1 and route.fused_decode:
      pos = ctx.q_pos[:, 0]
      return pallas_kernels.flash_attention(q, state.k, state.v, causal=True, q_offset=pos,
                                            kv_len=pos + 1, kv_layout="BHTD",
                                            tiling=route.decode_tiling, route=route)
    if q.shape[1] > 1 and route.fused_prefill:
      # A prefill chunk's positions are contiguous, so the causal rule is the kernel's own; keys
      # past the chunk's end are never read. (The jnp path stays for CPU, where the kernel's
      # reference would hold a score matrix, and for decode on TPU.)
      if chunk_kv is not None:
        return pallas_kernels.chunk_attention(q, state.k, state.v, *chunk_kv, ctx.q_pos[:, 0],
                                              kv_layout="BHTD", route=route)
      return pallas_kernels.flash_attention(q, state.k, state.v, causal=True,
                                            q_offset=ctx.q_pos[:, 0], kv_len=ctx.q_pos[:, -1] + 1,
                                            kv_layout="BHTD", route=route)
    b, t = ctx.q_pos.shape[0], state.max_len
    k_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return attention(q, state.k, state.v, ctx.q_pos, k_pos, kv_extent=jnp.max(ctx.q_pos) + 1)

  def prefill(self, state: KVCache, q, k, v, ctx: AttnContext):
    k = apply_rope(k, ctx.q_pos, ctx.freqs)
    state = state.write(ctx.q_pos, k, v, route=ctx.options.route, valid=ctx.valid)
    out, _ = self.attend_cache(state, apply_rope(q, ctx.q_pos, ctx.freqs), ctx, chunk_kv=(k, v))
    return out, state
