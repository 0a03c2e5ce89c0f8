"""Ideal top-k: each query head attends to its `budget` highest-scoring cached tokens.

The oracle that sparse-attention papers (RESA, Quest) measure against: exact q.k scores over
the whole cache at every decode step, softmax over the selected tokens only. Memory: the whole
cache; compute: a full scoring pass per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_longctx.methods.base import AttnContext, Budget, register
from jax_longctx.ops.cache import load
from jax_longctx.methods.selection import SelectingMethod, head_scores


@register
@dataclasses.dataclass(frozen=True)
class TopK(SelectingMethod):
  name = "topk"
  int4_refusal = ""

  budget: Budget = 1024

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    self.select_budget(max_len)
    return super().init_state(cfg, batch, max_len, dtype, chunk)

  def select(self, state, q_rot, ctx: AttnContext):
    n = self.select_budget(state.max_len)
    s = head_scores(q_rot, load(state.k, q_rot.dtype))  # [B, H, T]
    t = jnp.arange(state.max_len)[None, None, :]
    newest = ctx.q_pos[:, :, None]
    # The fixed sink and recent tokens are read anyway: the budget goes to the others.
    candidate = (t <= newest) & (t >= self.n_sink) & (t <= newest - self.n_recent)
    return jax.lax.top_k(jnp.where(candidate, s, -jnp.inf), n)[1]
