"""Ideal top-k: each query head attends to its `budget` highest-scoring cached tokens.

The oracle that sparse-attention papers (RESA, Quest) measure against: exact q.k scores over
the whole cache at every decode step, softmax over the selected tokens only. Memory: the whole
cache; compute: a full scoring pass per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_longctx.methods.base import AttnContext, MethodError, register, resolve_budget
from jax_longctx.methods.full import Full
from jax_longctx.methods.selection import gathered_attention, head_scores
from jax_longctx.rope import apply_rope


@register
@dataclasses.dataclass(frozen=True)
class TopK(Full):
  name = "topk"

  budget: float = 1024

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    resolve_budget(self.budget, max_len)
    return super().init_state(cfg, batch, max_len, dtype, chunk)

  def decode(self, state, q, k, v, ctx: AttnContext):
    if q.shape[1] != 1:
      raise MethodError("topk decodes one token per step")
    n = resolve_budget(self.budget, state.max_len)
    state = state.write(ctx.q_pos, apply_rope(k, ctx.q_pos, ctx.freqs), v)
    q = apply_rope(q, ctx.q_pos, ctx.freqs)
    s = head_scores(q, state.k)  # [B, H, T]
    visible = jnp.arange(state.max_len)[None, None, :] <= ctx.q_pos[:, :, None]
    _, slots = jax.lax.top_k(jnp.where(visible, s, -jnp.inf), n)
    out, _ = gathered_attention(q, state, slots, ctx.q_pos)
    return out, state
