"""RefreshKV: decoding that alternates full attention with a small cache it refreshes.

Xu et al., "RefreshKV: Updating Small KV Cache During Long-form Generation", 2025 (paper in
shared/papers/003_*). Each layer keeps the full cache C_f (every token, never evicted) and a
partial cache C_p of K tokens (default K = L/8). Prefill is exact; C_p starts from the last
prompt token's attention, max-pooled (kernel 7), max over a GQA group. Every `qc_stride` decode
steps each layer compares its current query (averaged over its query heads) with the one of its
latest full step: below `threshold` cosine similarity it does a full step (attention over C_f,
then C_p <- the top K of the current query's attention over C_f); otherwise, and at every other
step, it attends over C_p, and the lowest-scoring token leaves C_p so its size stays K.

Decisions where the paper is silent (docs/METHODS.md):
- the similarity uses queries before RoPE (what the token asks, not where it stands);
  `similarity_after_rope=True` compares rotated queries;
- C_p is a gathered copy ([B, KV, K + 1, d] with one spare slot for the step's token), so partial
  steps read K contiguous rows; C_f always receives every token (the paper writes the tokens
  decoded with C_p at the next full step: the same cache when it is read);
- like SnapKV's observation window, the scoring query's own token is always kept (`n_local`
  latest tokens: 1 by default); generated tokens score +inf until the next refresh scores them
  (the oldest of them leaves first);
- the per-layer choice is per sequence: a batch takes the full branch (`lax.cond`) when any of
  its sequences needs it, and each sequence keeps the result its own schedule calls for, so a
  batch decodes exactly as its sequences would alone.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_longctx.attention import attention
from jax_longctx.cache import KVCache
from jax_longctx.methods.base import AttnContext, Method, MethodError, PrefillEnd, register
from jax_longctx.methods.full import Full
from jax_longctx.methods.slot_cache import SlotCache, top_slots
from jax_longctx.methods.snapkv import SnapDecode, SnapKV, SnapPrefill, pooled_scores
from jax_longctx.rope import apply_rope


@struct.dataclass
class RefreshPrefill:
  snap: SnapPrefill  # the exact prompt cache and the last prompt query (SnapKV, window 1)
  q_ref: jnp.ndarray  # [B, d] fp32 mean query of the latest prompt token


@struct.dataclass
class RefreshState:
  full: KVCache  # C_f: post-RoPE keys at slot = position
  part: SlotCache  # C_p: K tokens (slots 0..K-1 in any order) and one spare slot
  q_ref: jnp.ndarray  # [B, d] fp32 mean query of this layer's latest full step
  prompt_lengths: jnp.ndarray  # [B] int32
  n_full: jnp.ndarray  # [B] int32 full steps taken while decoding


def _cosine(a, b):
  dot = jnp.sum(a * b, axis=-1)
  return dot / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-30)


@register
@dataclasses.dataclass(frozen=True)
class RefreshKV(Method):
  name = "refreshkv"

  budget: float = 0.125  # K: tokens, or a fraction of the cache (the paper: L / 8)
  qc_stride: int = 10  # query-comparison stride (the paper: 5 or 10)
  threshold: float = 0.85  # cosine similarity below which a layer refreshes (Llama-3.1-8B)
  pool_kernel: int = 7
  fixed_stride: int = 0  # > 0: a full step every fixed_stride steps in every layer (§5.1)
  refresh: bool = True  # False: the "without refresh" ablation (C_p stays SnapKV's)
  full_attention: bool = True  # False: "without full attention" (refresh, then attend C_p)
  similarity_after_rope: bool = False
  # Latest tokens always in C_p after the prefill and each refresh. 1 (the paper's choice): the
  # scoring query's own token; more keeps a local window as SnapKV's observation window does.
  n_local: int = 1

  def _snap(self) -> SnapKV:
    return SnapKV(budget=self.budget, window=1, pool_kernel=self.pool_kernel, keep_size=True)

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> RefreshPrefill:
    if self.n_local < 1:
      raise MethodError(f"n_local={self.n_local} must be >= 1 (the query's own token)")
    if self.qc_stride < 1 or self.fixed_stride < 0:
      raise MethodError(f"qc_stride={self.qc_stride} must be >= 1 and fixed_stride="
                        f"{self.fixed_stride} >= 0")
    if not (self.refresh or self.full_attention):
      raise MethodError("refresh=False with full_attention=False leaves nothing to do at a full "
                        "step: that is SnapKV (method 'snapkv' with keep_size=True, window=1)")
    snap = self._snap().init_state(cfg, batch, max_len, dtype, chunk)
    return RefreshPrefill(snap, jnp.zeros((batch, cfg.head_dim), jnp.float32))

  def _mean_query(self, q, ctx: AttnContext):
    if self.similarity_after_rope:
      q = apply_rope(q, ctx.q_pos, ctx.freqs)
    return jnp.mean(q.astype(jnp.float32), axis=2)  # [B, S, d]

  def prefill(self, state: RefreshPrefill, q, k, v, ctx: AttnContext):
    out, snap = self._snap().prefill(state.snap, q, k, v, ctx)
    n_valid = jnp.sum(ctx.valid, axis=1)
    latest = jnp.take_along_axis(self._mean_query(q, ctx),
                                 jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    q_ref = jnp.where((n_valid > 0)[:, None], latest, state.q_ref)
    return out, RefreshPrefill(snap, q_ref)

  def end_of_prefill(self, state: RefreshPrefill, info: PrefillEnd) -> RefreshState:
    part = self._snap().compress(state.snap, info.prompt_lengths, room=1, keep_recent=self.n_local)
    b = info.prompt_lengths.shape[0]
    return RefreshState(state.snap.kv, part, state.q_ref, info.prompt_lengths,
                        jnp.zeros((b,), jnp.int32))

  def due(self, state: RefreshState, q, ctx: AttnContext):
    """[B] bool: which sequences take a full step now (step n counts from 1 after the prompt)."""
    n = ctx.q_pos[:, 0] - state.prompt_lengths + 1
    if self.fixed_stride:
      return (n % self.fixed_stride == 0) & ctx.valid[:, 0]
    similar = _cosine(self._mean_query(q, ctx)[:, 0], state.q_ref) >= self.threshold
    return (n % self.qc_stride == 0) & ~similar & ctx.valid[:, 0]

  def refreshed(self, full: KVCache, q_rot, lse, ctx: AttnContext, n: int) -> SlotCache:
    """C_p rebuilt from C_f: the current query's pooled attention, the latest n_local kept."""
    slots = jnp.arange(full.max_len, dtype=jnp.int32)[None, :]
    k_pos = jnp.where(slots <= ctx.q_pos, slots, -1)  # [B, T]: what the query sees
    score = pooled_scores(q_rot, full.k, ctx.q_pos, k_pos, lse, ctx.valid, self.pool_kernel)
    recent = (slots <= ctx.q_pos) & (slots > ctx.q_pos - self.n_local)
    priority = jnp.where(recent[:, None, :], jnp.inf, score)  # [B, KV, T]
    priority = jnp.where((k_pos >= 0)[:, None, :], priority, -jnp.inf)
    return top_slots(full.k, full.v, k_pos, priority, n, n + 1, ordered=False)

  def decode(self, state: RefreshState, q, k, v, ctx: AttnContext):
    if q.shape[1] != 1:
      raise MethodError(f"refreshkv decodes one token per step, got {q.shape[1]}")
    full = state.full.write(ctx.q_pos, apply_rope(k, ctx.q_pos, ctx.freqs), v)
    due = self.due(state, q, ctx)
    out_p, snap = self._snap().decode(SnapDecode(state.part, state.prompt_lengths), q, k, v, ctx)
    q_rot = apply_rope(q, ctx.q_pos, ctx.freqs)
    n = state.part.budget

    def full_step(_):
      out_f, lse = Full().attend(full, q_rot, ctx)
      part = self.refreshed(full, q_rot, lse, ctx, n) if self.refresh else snap.slots
      if not self.full_attention:
        out_f, _ = attention(q_rot, part.k, part.v, ctx.q_pos, part.pos)
      part = jax.tree.map(lambda a, b: jnp.where(due.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                          part, snap.slots) if self.refresh else part
      return jnp.where(due[:, None, None, None], out_f, out_p), part

    out, part = jax.lax.cond(jnp.any(due), full_step, lambda _: (out_p, snap.slots), None)
    q_ref = jnp.where(due[:, None], self._mean_query(q, ctx)[:, 0], state.q_ref)
    return out, state.replace(full=full, part=part, q_ref=q_ref,
                              n_full=state.n_full + due.astype(jnp.int32))

  def effective_stride(self, cache) -> list[float]:
    """Per layer: decode steps per full step, averaged over the batch (inf: never full)."""
    steps = np.asarray(cache.lengths - cache.state[0].prompt_lengths, np.float64)
    return [float(np.mean(np.where(n > 0, steps / np.maximum(n, 1), np.inf)))
            for n in (np.asarray(layer.n_full, np.float64) for layer in cache.state)]

  def report(self, cache) -> dict:
    """JSON-safe counts for an evaluation record: full steps per layer and decode steps."""
    steps = np.asarray(cache.lengths - cache.state[0].prompt_lengths, np.float64)
    return {"full_steps": [float(np.mean(np.asarray(layer.n_full))) for layer in cache.state],
            "decode_steps": float(np.mean(steps))}
