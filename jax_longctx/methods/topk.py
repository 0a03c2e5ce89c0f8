"""Ideal top-k: each query head attends to its `budget` highest-scoring cached tokens.

The oracle that sparse-attention papers (RESA, Quest) measure against: exact q.k scores over
the whole cache at every decode step, softmax over the selected tokens only. Memory: the whole
cache; compute: a full scoring pass per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_longctx.methods.base import AttnContext, register, resolve_budget
from jax_longctx.methods.selection import SelectingMethod, head_scores


@register
@dataclasses.dataclass(frozen=True)
class TopK(SelectingMethod):
  name = "topk"

  budget: float = 1024

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    resolve_budget(self.budget, max_len)
    return super().init_state(cfg, batch, max_len, dtype, chunk)

  def select(self, state, q_rot, ctx: AttnContext):
    n = resolve_budget(self.budget, state.max_len)
    s = head_scores(q_rot, state.k)  # [B, H, T]
    visible = jnp.arange(state.max_len)[None, None, :] <= ctx.q_pos[:, :, None]
    return jax.lax.top_k(jnp.where(visible, s, -jnp.inf), n)[1]
