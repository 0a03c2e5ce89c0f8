"""H2O: heavy hitters by accumulated attention plus the most recent tokens.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023 (arXiv:2306.14048). Half of the budget keeps the most recent tokens, the
other half the tokens with the largest attention accumulated over every query so far. Decided per
kv head; the query heads of a GQA group add their attention.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_longctx.ops.attention import attention_probs_sum
from jax_longctx.methods.base import Budget, register
from jax_longctx.methods.slot_cache import EvictingMethod, SlotCache


@register
@dataclasses.dataclass(frozen=True)
class H2O(EvictingMethod):
  name = "h2o"

  budget: Budget = 0.2  # the paper's 20% KV cache (10% heavy hitters + 10% recent)
  recent_ratio: float = 0.5

  def priority(self, state: SlotCache, q, lse, ctx):
    gained = ctx.heads.group(
        attention_probs_sum(q, state.k, ctx.q_pos, state.pos, lse, ctx.valid, group="sum"), "sum")
    state = state.replace(score=state.score + gained)
    recent = state.most_recent(int(round(self.recent_ratio * state.budget)))
    return state, jnp.where(recent, jnp.inf, state.score)
