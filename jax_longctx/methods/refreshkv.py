"""RefreshKV: decoding that alternates full attention with a small cache it refreshes.

Xu et al., "RefreshKV: Updating Small KV Cache During Long-form Generation", 2025 (paper in
shared/papers/003_*). Each layer keeps the full cache C_f (every token, never evicted) and a
partial cache C_p of K tokens (default K = L/8). Prefill is exact; C_p starts from the last
prompt token's attention, max-pooled (kernel 7), max over a GQA group. Every `qc_stride` decode
steps each layer compares its current query (averaged over its query heads) with the one of its
latest full step: below `threshold` cosine similarity it does a full step (attention over C_f,
then C_p <- the top K of the current query's attention over C_f); otherwise, and at every other
step, it attends over C_p, and the lowest-scoring token leaves C_p so its size stays K.

The threshold is chosen per model on held-out text, as the paper does (its Appendix A.4: 0.85 for
Llama-3.1-8B, 0.95 for Qwen2-7B): `threshold=None` and `similarity_after_rope=None` (the defaults)
mean "this model's calibration" (`jax_longctx.app.calibration`), which the API, the CLI and the eval
sweeps fill in when they know the model; a method run without one uses FALLBACK_THRESHOLD, before
RoPE.

Decisions where the paper is silent (docs/METHODS.md):
- whether the similarity compares queries before RoPE (what the token asks, not where it stands)
  or after (rotated queries drift with position, so the two need different thresholds): the
  calibration measures both and records the one that closes more of the gap;
- C_p holds positions into C_f, not copies of its rows ([B, KV, K + 1] with one free entry for
  the step's token): partial steps read their K rows of C_f with the gathered-attention kernel,
  and neither a refresh nor an eviction moves any K/V (a gathered copy cost more per step in
  copies XLA made around its updates than the contiguous reads saved; BENCHMARKS.md). C_f always
  receives every token (the paper writes the tokens decoded with C_p at the next full step: the
  same cache when it is read);
- a full step takes its attention and the refresh's pooled scores from one QK^T over C_f (K read
  once), and the partial step's gathered attention reads nothing for the sequences refreshing;
- like SnapKV's observation window, the scoring query's own token is always kept (`n_local`
  latest tokens: 1 by default); generated tokens score +inf until the next refresh scores them
  (the oldest of them leaves first);
- the per-layer choice is per sequence: a batch takes the full branch (`lax.cond`) when any of
  its sequences needs it, and each sequence keeps the result its own schedule calls for, so a
  batch decodes exactly as its sequences would alone. Those conditionals exist only in steps
  where some sequence is at a comparison step (`decode_gate`, decided once per step): on GPU
  each conditional waits for its predicate on the host (32 cost 1.0 ms a step; BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, axes

import pallas_kernels
from jax_longctx.ops.cache import KVCache
from jax_longctx.methods.base import (AttnContext, Budget, Method, MethodError, PrefillEnd,
                                      register, resolve_budget)
from jax_longctx.methods.full import Full
from jax_longctx.methods.snapkv import SnapKV, SnapPrefill, max_pool
from jax_longctx.ops.attention import attention_with_probs
from jax_longctx.core.rope import apply_rope
from jax_longctx.ops.top_n import top_n

_LAST = jnp.iinfo(jnp.int32).max
# The paper's threshold for Llama-3.1-8B (Section 3): what a model without a calibration gets.
FALLBACK_THRESHOLD = 0.85
# What a calibration sweeps by default: the paper's 0.80-0.95 (Table 9) widened both ways, as
# queries after RoPE drift with position and so compare lower.
CALIBRATION_THRESHOLDS = (0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)


@struct.dataclass
class PartialCache:
  """C_p: for each (sequence, kv head) the positions (= C_f slots) of at most K tokens and their
  scores, in K + 1 entries so the step's token always finds a free one (-1: free)."""

  pos: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, KV, K + 1] int32
  score: jnp.ndarray = axes(ROWS, HEADS, None)  # [B, KV, K + 1] fp32; +inf for tokens generated since the last refresh
  budget: int = struct.field(pytree_node=False, default=0)

  @classmethod
  def top(cls, k_pos, priority, n: int, selection: str = "radix") -> "PartialCache":
    """The n highest-priority slots of priority [B, KV, T] (k_pos [B, T]; -1 marks no token).

    selection: "radix" (`top_n`, no sort) or "sort" (`lax.top_k`): the same slots."""
    pick = top_n if selection == "radix" else jax.lax.top_k
    score, idx = pick(priority.astype(jnp.float32), n)
    pos = jnp.take_along_axis(jnp.broadcast_to(k_pos[:, None, :], priority.shape), idx, axis=-1)
    pad = [(0, 0), (0, 0), (0, 1)]
    return cls(jnp.pad(pos, pad, constant_values=-1), jnp.pad(score, pad), n)

  def add(self, q_pos, valid) -> "PartialCache":
    """The step's token q_pos [B] into the first free entry, scored +inf (where valid [B])."""
    free = jnp.argmax(self.pos < 0, axis=-1)  # [B, KV]; a free entry always exists
    free = jnp.where(valid[:, None], free, self.pos.shape[-1])  # dropped
    b_idx, h_idx = jnp.indices(free.shape)
    pos = self.pos.at[b_idx, h_idx, free].set(q_pos[:, None], mode="drop")
    return self.replace(pos=pos, score=self.score.at[b_idx, h_idx, free].set(jnp.inf, mode="drop"))

  def evict(self) -> "PartialCache":
    """Over K tokens, the lowest-scoring one leaves (the earliest on ties: the step's own token,
    the latest and scored +inf, never does)."""
    occupied = self.pos >= 0
    prio = jnp.where(occupied, self.score, jnp.inf)
    low = jnp.min(prio, axis=-1, keepdims=True)
    victim = jnp.argmin(jnp.where(occupied & (prio == low), self.pos, _LAST), axis=-1)
    victim = jnp.where(jnp.sum(occupied, axis=-1) > self.budget, victim, self.pos.shape[-1])
    b_idx, h_idx = jnp.indices(victim.shape)
    return self.replace(pos=self.pos.at[b_idx, h_idx, victim].set(-1, mode="drop"))

  def attend_rows(self, full: KVCache, q_rot, *, route: pallas_kernels.Route, skip=None):
    """q_rot [B, 1, H, d] over the C_f rows this cache names (each query head its kv head's).

    route: the run's kernel route (RunOptions.route). skip [B] bool: sequences whose answer is
    not wanted (zeros); the kernel reads none of their rows."""
    extent = None if skip is None else jnp.broadcast_to(
        jnp.where(skip, 0, self.pos.shape[-1])[:, None], self.pos.shape[:2])
    out, _ = pallas_kernels.gathered_attention(q_rot, full.k, full.v, jnp.maximum(self.pos, 0),
                                               self.pos >= 0, kv_layout="BHTD", extent=extent,
                                               route=route)
    return out


@struct.dataclass
class RefreshPrefill:
  snap: SnapPrefill  # the exact prompt cache and the last prompt query (SnapKV, window 1)
  q_ref: jnp.ndarray = axes(ROWS, None)  # [B, d] fp32 mean query of the latest prompt token


@struct.dataclass
class RefreshState:
  full: KVCache  # C_f: post-RoPE keys at slot = position
  part: PartialCache  # C_p: K positions into C_f
  q_ref: jnp.ndarray = axes(ROWS, None)  # [B, d] fp32 mean query of this layer's latest full step
  prompt_lengths: jnp.ndarray = axes(ROWS)  # [B] int32
  n_full: jnp.ndarray = axes(ROWS)  # [B] int32 full steps taken while decoding


def _cosine(a, b):
  dot = jnp.sum(a * b, axis=-1)
  return dot / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), 1e-30)


@register
@dataclasses.dataclass(frozen=True)
class RefreshKV(Method):
  name = "refreshkv"
  int4_refusal = ""  # C_f only appends; C_p holds positions into it, not keys
  ends_prefill = True  # end_of_prefill below

  budget: Budget = 0.125  # K: tokens, or a fraction of the cache (the paper: L / 8)
  qc_stride: int = 10  # query-comparison stride (the paper: 5 or 10)
  # Cosine similarity below which a layer refreshes; None: the model's calibration (§3, A.4:
  # chosen per model on held-out text), else FALLBACK_THRESHOLD.
  threshold: float | None = None
  pool_kernel: int = 7
  fixed_stride: int = 0  # > 0: a full step every fixed_stride steps in every layer (§5.1)
  refresh: bool = True  # False: the "without refresh" ablation (C_p stays SnapKV's)
  full_attention: bool = True  # False: "without full attention" (refresh, then attend C_p)
  # Compare queries after RoPE (True) or before (False); None: the model's calibration, else
  # before. The paper does not say (docs/METHODS.md).
  similarity_after_rope: bool | None = None
  # Latest tokens always in C_p after the prefill and each refresh. 1 (the paper's choice): the
  # scoring query's own token; more keeps a local window as SnapKV's observation window does.
  n_local: int = 1
  # How a refresh picks the top K of L scores: "radix" (a radix select, no sort) or "sort"
  # (`lax.top_k`). The same tokens either way; radix is the faster on GPU (BENCHMARKS.md).
  selection: Literal["radix", "sort"] = "radix"

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
    # The budget resolved here, so a budget above the cache is reported as refreshkv's.
    budget = resolve_budget(self.budget, max_len, method=self.name)
    snap = dataclasses.replace(self._snap(), budget=budget).init_state(cfg, batch, max_len,
                                                                      dtype, chunk)
    return RefreshPrefill(snap, jnp.zeros((batch, cfg.head_dim), jnp.float32))

  def _mean_query(self, q, ctx: AttnContext):
    if ctx.query_smoothing is not None:  # the similarity is of the model's own queries
      q = q / ctx.query_smoothing.astype(q.dtype)
    if self.similarity_after_rope:  # None (no calibration) compares before RoPE
      q = apply_rope(q, ctx.q_pos, ctx.freqs)
    return ctx.heads.mean(q.astype(jnp.float32), axis=2)  # [B, S, d]: over the layer's heads

  def _threshold(self):
    """The threshold compared with each sequence's similarity (a scalar, or one per sequence)."""
    return FALLBACK_THRESHOLD if self.threshold is None else self.threshold

  def prefill(self, state: RefreshPrefill, q, k, v, ctx: AttnContext):
    out, snap = self._snap().prefill(state.snap, q, k, v, ctx)
    n_valid = jnp.sum(ctx.valid, axis=1)
    latest = jnp.take_along_axis(self._mean_query(q, ctx),
                                 jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    q_ref = jnp.where((n_valid > 0)[:, None], latest, state.q_ref)
    return out, RefreshPrefill(snap, q_ref)

  def end_of_prefill(self, state: RefreshPrefill, info: PrefillEnd) -> RefreshState:
    k_pos, priority = self._snap().prompt_priority(state.snap, info.prompt_lengths, self.n_local,
                                                   info.heads)
    part = PartialCache.top(k_pos, priority, state.snap.budget, self.selection)
    b = info.prompt_lengths.shape[0]
    return RefreshState(state.snap.kv, part, state.q_ref, info.prompt_lengths,
                        jnp.zeros((b,), jnp.int32))

  def _stride(self) -> int:
    return self.fixed_stride or self.qc_stride

  def due(self, state: RefreshState, q, ctx: AttnContext):
    """[B] bool: which sequences take a full step now (step n counts from 1 after the prompt)."""
    n = ctx.q_pos[:, 0] - state.prompt_lengths + 1
    at_stride = (n % self._stride() == 0) & ctx.valid[:, 0]
    if self.fixed_stride:
      return at_stride
    return at_stride & (_cosine(self._mean_query(q, ctx)[:, 0], state.q_ref) < self._threshold())

  def decode_gate(self, cache, q_pos):
    """Whether any sequence is at a comparison (or fixed-stride) step: only those can refresh."""
    state = cache.state[0]
    if self._stride() == 1 or not isinstance(state, RefreshState):
      return None
    return jnp.any((q_pos[:, 0] - state.prompt_lengths + 1) % self._stride() == 0)

  def full_attention_step(self, full: KVCache, q_rot, ctx: AttnContext, n: int):
    """(out [B, 1, H, d], C_p rebuilt): attention over C_f and, from the same scores (K read
    once), the current query's attention max over its GQA group and max-pooled; the top n of
    it, the latest n_local always, form the new C_p."""
    slots = jnp.arange(full.max_len, dtype=jnp.int32)[None, :]
    k_pos = jnp.where(slots <= ctx.q_pos, slots, -1)  # [B, T]: what the query sees
    out, _, probs = attention_with_probs(q_rot, full.k, full.v, ctx.q_pos, k_pos)
    probs = jnp.where(ctx.valid[:, None, None, :, None], probs, 0.0)  # [B, KV, G, 1, T]
    score = max_pool(ctx.heads.group(jnp.max(probs[:, :, :, 0], axis=2), "max"), self.pool_kernel)
    recent = (slots <= ctx.q_pos) & (slots > ctx.q_pos - self.n_local)
    priority = jnp.where(recent[:, None, :], jnp.inf, score)  # [B, KV, T]
    priority = jnp.where((k_pos >= 0)[:, None, :], priority, -jnp.inf)
    return out, PartialCache.top(k_pos, priority, n, self.selection)

  def decode(self, state: RefreshState, q, k, v, ctx: AttnContext):
    if q.shape[1] != 1:
      raise MethodError(f"refreshkv decodes one token per step, got {q.shape[1]}")
    route = ctx.options.route
    full = state.full.write(ctx.q_pos, apply_rope(k, ctx.q_pos, ctx.freqs), v, route=route,
                            valid=ctx.valid)
    q_rot = apply_rope(q, ctx.q_pos, ctx.freqs)
    # The partial step: attend over C_p and the step's token, then the lowest-scoring one leaves.
    added = state.part.add(ctx.q_pos[:, 0], ctx.valid[:, 0])
    part_p = added.evict()
    if not ctx.gate_open:  # no sequence is at a comparison step: a partial step, no conditional
      return added.attend_rows(full, q_rot, route=route), state.replace(full=full, part=part_p)
    due = self.due(state, q, ctx)

    def full_step(_):
      if self.refresh:
        out_f, part = self.full_attention_step(full, q_rot, ctx, part_p.budget)
      else:
        out_f, part = Full().attend_cache(full, q_rot, ctx)[0], part_p
      if not self.full_attention:
        out_f = part.attend_rows(full, q_rot, route=route)
      keep = jax.tree.map(lambda a, b: jnp.where(due[:, None, None], a, b), part, part_p)
      out_p = added.attend_rows(full, q_rot, route=route,
                                skip=due)  # only the sequences not due: none read
      return jnp.where(due[:, None, None, None], out_f.astype(out_p.dtype), out_p), keep

    # Only positions and scores leave the branches (no K/V is updated inside them), so the
    # common partial step pays no copy for the branch it skips.
    out, part = jax.lax.cond(jnp.any(due), full_step,
                             lambda _: (added.attend_rows(full, q_rot, route=route), part_p),
                             None)
    q_ref = jnp.where(due[:, None], self._mean_query(q, ctx)[:, 0], state.q_ref)
    return out, state.replace(full=full, part=part, q_ref=q_ref,
                              n_full=state.n_full + due.astype(jnp.int32))

  def effective_stride(self, cache) -> list[float]:
    """Per layer: decode steps per full step, both summed over the batch (inf: no sequence
    took a full step in that layer; a mean of per-sequence strides would be inf if one had not)."""
    steps = float(np.sum(np.asarray(cache.lengths - cache.state[0].prompt_lengths, np.float64)))
    return [steps / n if n > 0 else float("inf")
            for n in (float(np.sum(np.asarray(layer.n_full))) for layer in cache.state)]

  def report(self, cache) -> dict:
    """JSON-safe counts for an evaluation record: full steps per layer and decode steps."""
    steps = np.asarray(cache.lengths - cache.state[0].prompt_lengths, np.float64)
    return {"full_steps": [float(np.mean(np.asarray(layer.n_full))) for layer in cache.state],
            "decode_steps": float(np.mean(steps))}
