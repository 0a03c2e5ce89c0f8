"""Quest: query-aware page selection over the full cache.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024
(arXiv:2406.10774). Keys live in pages of `page_size` tokens (16); each page keeps the
elementwise min and max of its post-RoPE keys, and a query head scores a page by
sum_d max(q_d * kmax_d, q_d * kmin_d), an upper bound of its best q.k. Each query head attends to
its top pages within the token budget; the page holding the current token is always chosen. The
first `dense_layers` layers (2 in the paper) and prefill stay dense; nothing is evicted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, axes

from jax_longctx.ops.cache import KVCache
from jax_longctx.methods.base import AttnContext, Budget, MethodError, register
from jax_longctx.methods.full import Full
from jax_longctx.methods.selection import SelectingMethod
from jax_longctx.core.rope import apply_rope


@struct.dataclass
class QuestState:
  kv: KVCache  # slots rounded up to whole pages
  kmin: jnp.ndarray = axes(ROWS, HEADS, None, None)  # [B, KV, pages, d]
  kmax: jnp.ndarray = axes(ROWS, HEADS, None, None)  # [B, KV, pages, d]


@register
@dataclasses.dataclass(frozen=True)
class Quest(SelectingMethod):
  name = "quest"
  int4_refusal = ""

  budget: Budget = 1024
  page_size: int = 16
  dense_layers: int = 2

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> QuestState:
    if self.page_size < 1:
      raise MethodError(f"page_size={self.page_size} must be >= 1")
    pages = -(-max_len // self.page_size)
    # The budget counts against the cache as stored, in whole pages: the same length `select`
    # sees, so a budget covering it (a default 1024 on a short prompt) selects every page.
    n = self.select_budget(pages * self.page_size)
    if n % self.page_size:
      fixed = f" less {self.n_sink + self.n_recent} fixed" if self.n_sink or self.n_recent else ""
      raise MethodError(
          f"page_size={self.page_size} does not divide the budget ({n} tokens{fixed})")
    shape = (batch, cfg.num_kv_heads, pages, cfg.head_dim)
    return QuestState(KVCache.zeros(cfg, batch, pages * self.page_size, dtype),
                      jnp.full(shape, jnp.inf, cfg.jnp_dtype),
                      jnp.full(shape, -jnp.inf, cfg.jnp_dtype))

  def dense_at(self, ctx: AttnContext) -> bool:
    return ctx.layer < self.dense_layers

  def cache(self, state: QuestState) -> KVCache:
    return state.kv

  def write(self, state: QuestState, k, v, ctx: AttnContext) -> QuestState:
    """Stores post-RoPE k and folds it into its page's min/max (padding is dropped)."""
    kv = state.kv.write(ctx.q_pos, k, v, route=ctx.options.route, valid=ctx.valid)
    page = jnp.where(ctx.valid, ctx.q_pos // self.page_size, state.kmin.shape[2])
    b_idx = jnp.arange(k.shape[0])[:, None]
    kmin = state.kmin.at[b_idx, :, page].min(k.astype(state.kmin.dtype), mode="drop")
    kmax = state.kmax.at[b_idx, :, page].max(k.astype(state.kmax.dtype), mode="drop")
    return QuestState(kv, kmin, kmax)

  def prefill(self, state: QuestState, q, k, v, ctx: AttnContext):
    k = apply_rope(k, ctx.q_pos, ctx.freqs)
    state = self.write(state, k, v, ctx)
    out, _ = Full().attend_cache(state.kv, apply_rope(q, ctx.q_pos, ctx.freqs), ctx, chunk_kv=(k, v))
    return out, state

  def select(self, state: QuestState, q_rot, ctx: AttnContext):
    b, _, h, d = q_rot.shape
    kvh, pages = state.kmin.shape[1], state.kmin.shape[2]
    qg = q_rot[:, 0].reshape(b, kvh, h // kvh, 1, d).astype(jnp.float32)
    bound = jnp.maximum(qg * state.kmax[:, :, None].astype(jnp.float32),
                        qg * state.kmin[:, :, None].astype(jnp.float32))
    score = jnp.sum(bound, axis=-1).reshape(b, h, pages)  # [B, H, pages]
    page_ids = jnp.arange(pages)[None, None, :]
    current = (ctx.q_pos[:, :, None] // self.page_size)  # [B, 1, 1]
    score = jnp.where(page_ids * self.page_size > ctx.q_pos[:, :, None], -jnp.inf, score)
    score = jnp.where(page_ids == current, jnp.inf, score)
    n_pages = min(self.select_budget(state.kv.max_len) // self.page_size, pages)
    _, top = jax.lax.top_k(score, n_pages)  # [B, H, n_pages]
    return (top[..., None] * self.page_size + jnp.arange(self.page_size)).reshape(b, h, -1)
