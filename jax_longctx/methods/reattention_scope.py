"""ReAttention's position-agnostic selection: which cached tokens one step attends to.

Liu et al., "ReAttention: Training-Free Infinite Context with Finite Attention Scope",
arXiv:2407.15176, §2.1 and Algorithms 1-2. Every query of the step and every query
head scores the candidate tokens (between the global and the local part) by raw pre-RoPE q.k;
each takes its top-k; the votes of all heads, queries and ranks are pooled and the `clip` most
voted tokens kept; each expands to a span, overlapping spans merge, and the scope is
[global, spans, local] in token order. Everything here has static shapes: the scope is a padded
index list with a per-sequence length, so one compiled step serves every context length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

import pallas_kernels

_NONE = jnp.iinfo(jnp.int32).max  # sorts after every real token index


@struct.dataclass
class Scope:
  """The tokens one step attends to, compacted: positions 0..length-1 within the scope."""

  idx: jnp.ndarray  # [B, N] int32 cache slots (= original token positions), valid entries first
  length: jnp.ndarray  # [B] int32 valid entries; the rest of `idx` is padding
  q_offset: jnp.ndarray  # [B] int32 scope position of the step's first query


def vote(q, k_cache, lo, hi, q_valid, top_k: int, backend: str = "auto"):
  """Per query and query head, the top-k candidates lo <= t < hi[b] by raw q.k.

  q [B, S, H, d] before RoPE; k_cache [B, KV, T, d] before RoPE (GQA: query head h reads kv head
  h // (H // KV)). Returns votes [B, S * H * top_k] int32 (-1: no vote; padding queries and
  candidate sets smaller than top_k leave holes).
  """
  b = q.shape[0]
  top_k = min(top_k, k_cache.shape[2])
  hi = jnp.maximum(hi, lo)  # an empty candidate range, not a negative one

  def score():
    _, idx = pallas_kernels.topk_scores(q, k_cache, top_k, scale=1.0, valid_len=hi,
                                        exclude_prefix=lo, kv_layout="BHTD", backend=backend)
    return idx

  def nothing():
    return jnp.full(q.shape[:3] + (top_k,), -1, jnp.int32)

  if pallas_kernels.resolve(backend).kind == "reference":
    # The jnp reference scores every key, so short contexts (every sequence within global +
    # local) skip it. The kernels only visit candidate tiles already, and a conditional would
    # cost a device-to-host sync per layer on GPU.
    idx = jax.lax.cond(jnp.any(hi > lo), score, nothing)
  else:
    idx = score()
  idx = jnp.where(q_valid[:, :, None, None], idx, -1)
  return idx.reshape(b, -1)


def most_voted(votes, clip: int):
  """The `clip` most voted token indices per row, ascending; ties to the lower index.

  votes [B, V] (-1 = none) -> kept [B, clip] int32, _NONE where fewer distinct tokens got votes.
  O(V log V): a sort and run lengths, independent of the cache length.
  """
  b, v = votes.shape
  s = jnp.sort(jnp.where(votes >= 0, votes, _NONE), axis=-1)
  pos = jnp.arange(v)
  starts = (s != jnp.concatenate([jnp.full((b, 1), -1, s.dtype), s[:, :-1]], axis=1))
  starts = starts & (s != _NONE)
  # Run length = the next run's start minus this one's.
  boundary = jnp.where(starts | (s == _NONE), pos, v)
  next_start = jnp.concatenate(
      [jax.lax.cummin(boundary, axis=1, reverse=True)[:, 1:], jnp.full((b, 1), v, pos.dtype)],
      axis=1)
  count = jnp.where(starts, next_start - pos, 0)
  n = min(clip, v)
  top_count, at = jax.lax.top_k(count, n)  # stable: equal counts keep the lower token first
  kept = jnp.where(top_count > 0, jnp.take_along_axis(s, at, axis=1), _NONE)
  kept = jnp.sort(kept, axis=-1)
  if n < clip:
    kept = jnp.concatenate([kept, jnp.full((b, clip - n), _NONE, kept.dtype)], axis=1)
  return kept


def expand_spans(kept, lo, hi, span: int):
  """Each kept token i -> [i - span//2, i + (span+1)//2) within [lo, hi[b]); overlaps merged.

  kept [B, c] ascending (_NONE = empty). Returns (tokens [B, c * span], valid) in ascending token
  order among the valid entries: an entry is new only past the end of the span before it (ends
  are non-decreasing because the kept tokens are sorted and every span has the same length).
  """
  b, c = kept.shape
  live = kept != _NONE
  base = jnp.where(live, kept, 0)
  start = base - span // 2
  lo_b = jnp.broadcast_to(lo, (b,))[:, None]
  end = jnp.clip(base + (span + 1) // 2, lo_b, hi[:, None])
  prev_end = jnp.concatenate([lo_b, end[:, :-1]], axis=1)
  tokens = start[:, :, None] + jnp.arange(span)[None, None, :]  # [B, c, span]
  valid = (live[:, :, None] & (tokens >= jnp.maximum(lo_b, prev_end)[:, :, None])
           & (tokens < end[:, :, None]))
  return tokens.reshape(b, c * span), valid.reshape(b, c * span)


def assemble(selected, selected_valid, n_global: int, n_local: int, seq_end, first_q):
  """[global, selected, local] of each sequence, compacted into a `Scope`.

  seq_end [B]: tokens in the cache after this step; first_q [B]: the step's first query position.
  The local part is the last n_local tokens (it holds the step's own tokens), never overlapping
  the global part; before any selection it simply continues where the global part ends.
  """
  b = selected.shape[0]
  glob = jnp.broadcast_to(jnp.arange(n_global, dtype=jnp.int32), (b, n_global))
  local = (jnp.maximum(n_global, seq_end - n_local)[:, None]
           + jnp.arange(n_local, dtype=jnp.int32)[None, :])
  tokens = jnp.concatenate([glob, selected.astype(jnp.int32), local], axis=1)
  valid = jnp.concatenate(
      [glob < seq_end[:, None], selected_valid, local < seq_end[:, None]], axis=1)
  n = tokens.shape[1]
  dest = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, n)
  idx = jnp.zeros((b, n), jnp.int32).at[jnp.arange(b)[:, None], dest].set(tokens, mode="drop")
  q_offset = jnp.sum(valid & (tokens < first_q[:, None]), axis=1, dtype=jnp.int32)
  return Scope(idx, jnp.sum(valid, axis=1, dtype=jnp.int32), q_offset)


def select_scope(q, k_cache, q_pos, q_valid, *, n_global: int, n_local: int, span: int,
                 top_k: int, clip: int, backend: str = "auto") -> Scope:
  """The whole selection for one layer and step (Algorithm 1 for a chunk, 2 for one token).

  q [B, S, H, d] before RoPE, k_cache [B, KV, T, d] before RoPE already holding this step's
  keys; q_pos / q_valid [B, S]. Candidates of sequence b: n_global <= t < seq_end - n_local.
  """
  seq_end = jnp.max(jnp.where(q_valid, q_pos + 1, 0), axis=1)
  hi = seq_end - n_local
  votes = vote(q, k_cache, n_global, hi, q_valid, top_k, backend)
  kept = most_voted(votes, clip)
  selected, selected_valid = expand_spans(kept, jnp.int32(n_global), hi, span)
  return assemble(selected, selected_valid, n_global, n_local, seq_end, q_pos[:, 0])
