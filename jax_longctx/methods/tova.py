"""TOVA: keep the tokens the current query attends to most.

Oren et al., "Transformers are Multi-State RNNs", 2024 (arXiv:2401.06104). After every step the
token with the lowest attention from the newest query, averaged over all heads of the layer, is
dropped, so each layer keeps one token set shared by its heads. After a prefill chunk the
chunk's last token is the query that decides.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_longctx.ops.attention import attention_probs_sum
from jax_longctx.methods.base import Budget, register
from jax_longctx.methods.slot_cache import EvictingMethod, SlotCache


@register
@dataclasses.dataclass(frozen=True)
class TOVA(EvictingMethod):
  name = "tova"

  budget: Budget = 512  # the paper's multi-state sizes range over 64..4096

  def priority(self, state: SlotCache, q, lse, ctx):
    # The newest valid query of each row (a chunk may end in padding).
    last = jnp.max(jnp.where(ctx.valid, jnp.arange(q.shape[1]), -1), axis=1)
    pick = jnp.maximum(last, 0)[:, None]
    q_last = jnp.take_along_axis(q, pick[:, :, None, None], axis=1)
    probs = attention_probs_sum(
        q_last, state.k, jnp.take_along_axis(ctx.q_pos, pick, axis=1), state.pos,
        jnp.take_along_axis(lse, pick[:, :, None], axis=1), (last >= 0)[:, None], group="mean")
    shared = ctx.heads.mean(probs, axis=1)[:, None]  # one decision for all heads of the layer
    return state, jnp.broadcast_to(shared, probs.shape)
