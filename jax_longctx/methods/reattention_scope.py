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
from jax_longctx.methods.base import Heads
from jax_longctx.ops.cache import split_offset

_NONE = jnp.iinfo(jnp.int32).max  # sorts after every real token index


@struct.dataclass
class Scope:
  """The tokens one step attends to, compacted: positions 0..length-1 within the scope."""

  idx: jnp.ndarray  # [B, N] int32 cache slots (= original token positions), valid entries first
  length: jnp.ndarray  # [B] int32 valid entries; the rest of `idx` is padding
  q_offset: jnp.ndarray  # [B] int32 scope position of the step's first query
  # One device's part of a scope over a block-cyclic mesh (reattention.py, MeshReAttention):
  # its entries are not contiguous in the scope, so each carries its rank there (where RoPE
  # puts it), q_rank is the first query's rank, and q_offset counts only the part's entries
  # before that query (the causal mask over the part's slots). None: ranks are the slots.
  k_rank: jnp.ndarray | None = None  # [B, N] int32
  q_rank: jnp.ndarray | None = None  # [B] int32


def candidates(q, k_cache, lo, hi, top_k: int, *, route: pallas_kernels.Route):
  """Per query and query head, the top-k candidates lo <= t < hi[b] of k_cache by raw q.k.

  q [B, S, H, d] before RoPE; k_cache [B, KV, T, d] before RoPE (GQA: query head h reads kv head
  h // (H // KV)); lo scalar or [B]. Returns (scores fp32, idx int32) [B, S, H, min(top_k, T)],
  best first, ties to the lower index, holes (-inf, -1) where fewer candidates exist.
  """
  top_k = min(top_k, k_cache.shape[2])
  hi = jnp.maximum(hi, lo)  # an empty candidate range, not a negative one
  # An 8-bit cache's keys are scored as stored, less their offset c (ops/cache.py): every
  # candidate score of a query drops by the same q.c, which neither its top-k here nor the mesh
  # variant's gather of every shard's candidates sees.
  k_cache, _ = split_offset(k_cache)

  def score():
    return pallas_kernels.topk_scores(q, k_cache, top_k, scale=1.0, valid_len=hi,
                                      exclude_prefix=lo, kv_layout="BHTD", route=route)

  def nothing():
    shape = q.shape[:3] + (top_k,)
    return jnp.full(shape, -jnp.inf, jnp.float32), jnp.full(shape, -1, jnp.int32)

  if route.is_reference:
    # The jnp reference scores every key, so short contexts (every sequence within global +
    # local) skip it. The kernels only visit candidate tiles already, and a conditional would
    # cost a device-to-host sync per layer on GPU.
    return jax.lax.cond(jnp.any(hi > lo), score, nothing)
  return score()


def voters(q, q_valid, stride: int):
  """The step's queries that vote (q [B, S, ...], q_valid [B, S]): all of them for stride 1 (the
  paper), else every stride-th slot counted back from the step's last slot (a sequence's padded
  slots hold no vote); the others neither score the cache nor vote
  (ReAttentionSettings.vote_stride)."""
  if stride == 1:
    return q, q_valid
  first = (q.shape[1] - 1) % stride
  return q[:, first::stride], q_valid[:, first::stride]


def ballots(idx, q_valid):
  """Candidates idx [B, S, H, k] -> votes [B, S * H * k] int32 (-1: no vote; padding queries
  and candidate sets smaller than k leave holes)."""
  return jnp.where(q_valid[:, :, None, None], idx, -1).reshape(idx.shape[0], -1)


def vote(q, k_cache, lo, hi, q_valid, top_k: int, *, route: pallas_kernels.Route):
  """Per query and query head, the top-k candidates lo <= t < hi[b] by raw q.k, as votes
  [B, S * H * top_k] int32 (`candidates`, `ballots`)."""
  return ballots(candidates(q, k_cache, lo, hi, top_k, route=route)[1], q_valid)


# Up to this many votes a row (a decode step: heads x top_k), most_voted compares every pair of
# votes instead of sorting: a few fused reductions rather than three sorts and a scan.
PAIRWISE_MAX_VOTES = 1024


# With more votes, and tokens below n_tokens (the cache's slots) where n_tokens is at most this
# many times the votes, most_voted counts them in a histogram over the slots: a scatter-add and
# a pick of the most counted instead of sorting the votes (a prefill chunk's 65,536 votes on an
# H200: 29-99 us against 129-175 up to 1M slots, 16 a vote, the most measured; BENCHMARKS.md).
HISTOGRAM_MAX_SLOTS_PER_VOTE = 64
# Picked by one `lax.top_k` (whole_pick_clip), the histogram stays ahead of the sort further: at
# 2M slots, Qwen2.5-Coder-1.5B's 24,576 votes (85 slots a vote), 124 us against 139-164 (an H200).
WHOLE_PICK_MAX_SLOTS_PER_VOTE = 96


def most_voted(votes, clip: int, n_tokens: int | None = None, pairwise_max: int = 0,
               whole_pick_clip: int = 0):
  """The `clip` most voted token indices per row, ascending; ties to the lower index.

  votes [B, V] (-1 = none; else < n_tokens when that is given) -> kept [B, clip] int32, _NONE
  where fewer distinct tokens got votes. O(V^2) by comparing pairs when V is small, a histogram
  over n_tokens slots when the cache is short against the votes, else O(V log V) by sorting
  (all give the same tokens; tests/test_reattention.py). pairwise_max: most_voted_counted's
  (`pairwise_items(route)`); whole_pick_clip: from this clip on (0: never) the histogram's most
  counted are picked by one `lax.top_k` over all its slots (`whole_pick_clip(route)`).
  """
  if votes.shape[1] <= PAIRWISE_MAX_VOTES:
    return most_voted_pairwise(votes, clip)
  whole = bool(whole_pick_clip) and clip >= whole_pick_clip
  per_vote = WHOLE_PICK_MAX_SLOTS_PER_VOTE if whole else HISTOGRAM_MAX_SLOTS_PER_VOTE
  if n_tokens is not None and n_tokens <= per_vote * votes.shape[1]:
    return most_voted_counted(votes, clip, n_tokens, pairwise_max=pairwise_max,
                              direct_max=n_tokens if whole else COUNT_DIRECT_MAX)
  return most_voted_sorted(votes, clip)


# most_voted_counted's top-k over the histogram: blocks of at least this many slots (more where
# the blocks would outnumber PAIRWISE_MAX_ITEMS), the `clip` best blocks by their maxima, then the
# best slots of those; both picks compare all pairs when at most PAIRWISE_MAX_ITEMS take part
# (fused reductions over many thread blocks, where a short sort is one thread block's work),
# else `lax.top_k` through block maxima, sorting rows of up to COUNT_DIRECT_MAX whole.
COUNT_BLOCK = 16
COUNT_DIRECT_MAX = 2048
PAIRWISE_MAX_ITEMS = 4096


def most_voted_counted(votes, clip: int, n_tokens: int, *, block: int = COUNT_BLOCK,
                       direct_max: int = COUNT_DIRECT_MAX,
                       pairwise_max: int = PAIRWISE_MAX_ITEMS):
  """most_voted by a histogram: each slot's votes counted by a scatter-add, then the `clip`
  largest counts, equal counts by lower slot, through block maxima (no sort over all slots)."""
  b = votes.shape[0]
  slot = jnp.where(votes >= 0, votes, n_tokens)  # holes land in a slot past the cache's
  rows = jnp.arange(b)[:, None]
  counts = jnp.zeros((b, n_tokens + 1), jnp.int32).at[rows, slot].add(1, mode="drop")
  counts = counts[:, :n_tokens]
  n = min(clip, n_tokens)
  # Blocks few enough to compare in pairs (block stays a power of 2).
  pair_block = max(block, 1 << (-(-n_tokens // max(pairwise_max, 1)) - 1).bit_length())
  n_blocks = -(-n_tokens // pair_block)
  kb = min(n, n_blocks)
  if n_blocks > pairwise_max or kb * pair_block > pairwise_max:
    top_count, kept = pallas_kernels.top_k_by_blocks(counts, n, block, direct_max=direct_max)
    kept = jnp.sort(jnp.where(top_count > 0, kept, _NONE), axis=-1)
  else:
    # Zero counts pad the last block: they are never kept.
    block = pair_block
    blocked = jnp.pad(counts, ((0, 0), (0, n_blocks * block - n_tokens))).reshape(b, n_blocks,
                                                                                  block)
    maxima = jnp.max(blocked, axis=2)  # [B, n_blocks]
    ids = jnp.broadcast_to(jnp.arange(n_blocks, dtype=jnp.int32), maxima.shape)
    blocks = best_in_order(maxima, ids, maxima > 0, kb)  # [B, kb] ascending, _NONE padded
    some = blocks != _NONE
    blocks = jnp.where(some, blocks, 0)
    cand = jnp.take_along_axis(blocked, blocks[:, :, None], axis=1)  # [B, kb, block]
    slots = blocks[:, :, None] * block + jnp.arange(block, dtype=jnp.int32)
    live = (cand > 0) & some[:, :, None]
    kept = best_in_order(cand.reshape(b, -1), slots.reshape(b, -1), live.reshape(b, -1), n)
  if n < clip:
    kept = jnp.concatenate([kept, jnp.full((b, clip - n), _NONE, kept.dtype)], axis=1)
  return kept.astype(jnp.int32)


def pairwise_items(route: pallas_kernels.Route) -> int:
  """most_voted_counted's pairwise_max for a run's kernel route: on the GPU kernels the pairs'
  reductions were the fastest measured (BENCHMARKS.md); on a 2-core CPU they ran far slower
  than top_k (20,000 votes over 8K-100K slots: 19-138 ms, another job running, against 0.3-0.5
  ms), and the TPU is not measured: both take top_k."""
  return PAIRWISE_MAX_ITEMS if route.on_gpu else 0


# On the GPU a clip this large picks the histogram's most counted by one `lax.top_k` (one radix
# sort of the slots) rather than through block maxima, whose top_k over the blocks and over the
# clip's blocks' slots grow with the clip: a chunk of Qwen2.5-Coder-1.5B's (24,576 votes, clip
# 511) at 128K / 512K / 1M slots 88-106 / 89 / 102-118 us against 136 / 155 / 173-176 (an
# H200; its 1M prefill at 4 layers 1.04x); at the 3B shape's clip of 127 (65,536 votes) the two
# ran level at 1M slots and the blocks faster at 128K (73 against 104-118 us). BENCHMARKS.md,
# "The vote count at Qwen2.5-Coder-1.5B's shape".
WHOLE_PICK_MIN_CLIP = 256


def whole_pick_clip(route: pallas_kernels.Route) -> int:
  """most_voted's whole_pick_clip for a run's kernel route: WHOLE_PICK_MIN_CLIP on the GPU
  kernels, where it was measured; 0 (the block maxima) on the CPU and the TPU."""
  return WHOLE_PICK_MIN_CLIP if route.on_gpu else 0


def best_in_order(value, item, live, n: int):
  """Of the live entries [B, M] (`item`: distinct ids), the n ranked first by (value desc, item
  asc), as their ids ascending [B, n], _NONE where fewer are live: every pair compared (O(M^2)
  in a few fused reductions, no sort)."""
  this_v, other_v = value[:, :, None], value[:, None, :]
  this_i, other_i = item[:, :, None], item[:, None, :]
  ahead = ((other_v > this_v) | ((other_v == this_v) & (other_i < this_i))) & live[:, None, :]
  kept = live & (jnp.sum(ahead, axis=2) < n)
  slot = jnp.sum(kept[:, None, :] & (other_i < this_i), axis=2)  # kept ids below this one
  at = kept[:, None, :] & (slot[:, None, :] == jnp.arange(n)[None, :, None])  # [B, n, M]
  out = jnp.max(jnp.where(at, item[:, None, :], -1), axis=2)
  return jnp.where(out >= 0, out, _NONE).astype(jnp.int32)


def most_voted_sorted(votes, clip: int):
  """most_voted by sorting the votes and counting runs."""
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


def most_voted_pairwise(votes, clip: int):
  """most_voted by comparing all pairs of votes [B, V]: each distinct token (its first vote)
  is ranked by (count desc, token asc) against the others, and the kept ones are placed by how
  many kept tokens are smaller."""
  v = votes.shape[1]
  live = votes >= 0
  a, c = votes[:, :, None], votes[:, None, :]  # [B, V, 1] this vote, [B, 1, V] the others
  same = (a == c) & live[:, None, :]
  count = jnp.sum(same, axis=2)  # [B, V]
  earlier = jnp.arange(v)[None, :] < jnp.arange(v)[:, None]  # [V, V]: other before this
  first = live & ~jnp.any(same & earlier[None], axis=2)  # one vote stands for each token
  return best_in_order(count, votes, first, clip)


def span_runs(kept, lo, hi, span: int):
  """Each kept token i -> [i - span//2, i + (span+1)//2) within [lo, hi[b]); overlaps merged.

  kept [B, c] ascending (_NONE = empty). Returns (first, count) [B, c] int32: span j adds the
  tokens first..first+count-1 that no earlier span holds (ends are non-decreasing because the
  kept tokens are sorted and every span has the same length), so the runs are disjoint and in
  token order.
  """
  b = kept.shape[0]
  live = kept != _NONE
  base = jnp.where(live, kept, 0)
  lo_b = jnp.broadcast_to(lo, (b,))[:, None]
  end = jnp.clip(base + (span + 1) // 2, lo_b, hi[:, None])
  prev_end = jnp.concatenate([lo_b, end[:, :-1]], axis=1)
  first = jnp.maximum(base - span // 2, jnp.maximum(lo_b, prev_end))
  return first.astype(jnp.int32), jnp.where(live, jnp.maximum(end - first, 0), 0).astype(jnp.int32)


def assemble(first, count, n_global: int, n_local: int, size: int, seq_end, first_q):
  """[global, selected runs, local] of each sequence, compacted into a `Scope` of `size` slots.

  seq_end [B]: tokens in the cache after this step; first_q [B]: the step's first query position.
  The local part is the last n_local tokens (it holds the step's own tokens), never overlapping
  the global part; before any selection it simply continues where the global part ends. Slot r
  finds its run by comparing r with the runs' starting slots (c of them): no scan or scatter over
  the whole scope.
  """
  n_glob = jnp.minimum(n_global, seq_end)[:, None]  # [B, 1]
  local_start = jnp.maximum(n_global, seq_end - n_local)[:, None]
  n_loc = jnp.clip(seq_end[:, None] - local_start, 0, n_local)
  c = count.shape[1]
  before = jnp.arange(c)[None, :] < jnp.arange(c)[:, None]  # [c, c]: run i before run j
  # [B, c] each run's first slot after the global part (a masked sum: no scan kernel)
  offset = jnp.sum(jnp.where(before[None], count[:, None, :], 0), axis=2)
  n_sel = jnp.sum(count, axis=1, keepdims=True)
  r = jnp.arange(size, dtype=jnp.int32)[None, :]  # [1, N]
  in_sel = r - n_glob  # slot within the selected part
  run = jnp.sum(offset[:, None, :] <= in_sel[:, :, None], axis=2) - 1  # the last run starting there
  run = jnp.clip(run, 0, first.shape[1] - 1)
  selected = (jnp.take_along_axis(first, run, axis=1)
              + in_sel - jnp.take_along_axis(offset, run, axis=1))
  in_loc = in_sel - n_sel
  idx = jnp.where(r < n_glob, r, jnp.where(in_loc < 0, selected, local_start + in_loc))
  length = (n_glob + n_sel + n_loc)[:, 0]
  idx = jnp.where(r < length[:, None], idx, 0).astype(jnp.int32)
  # The step's queries sit in the local part, after every selected token (hi <= first_q).
  q_offset = (jnp.minimum(n_glob, first_q[:, None]) + n_sel
              + jnp.clip(first_q[:, None] - local_start, 0, n_loc))[:, 0]
  return Scope(idx, length.astype(jnp.int32), q_offset.astype(jnp.int32))


def step_bounds(q_pos, q_valid, n_local: int):
  """(seq_end, hi) [B]: tokens in the cache after this step, and the end of the candidates (the
  local part, the last n_local tokens, is never voted for)."""
  seq_end = jnp.max(jnp.where(q_valid, q_pos + 1, 0), axis=1)
  return seq_end, seq_end - n_local


def scope_from_votes(votes, q_pos, seq_end, hi, *, n_global: int, n_local: int, span: int,
                     clip: int, route: pallas_kernels.Route,
                     n_tokens: int | None = None) -> Scope:
  """The `clip` most voted tokens as spans, between the global and the local part (votes
  [B, V], from `vote` or from the devices' candidates merged; every vote < n_tokens, the
  cache's slots, when that is given)."""
  kept = most_voted(votes, clip, n_tokens, pairwise_items(route), whole_pick_clip(route))
  first, count = span_runs(kept, jnp.int32(n_global), hi, span)
  return assemble(first, count, n_global, n_local, n_global + clip * span + n_local, seq_end,
                  q_pos[:, 0])


def select_scope(q, k_cache, q_pos, q_valid, *, n_global: int, n_local: int, span: int,
                 top_k: int, clip: int, route: pallas_kernels.Route, vote_stride: int = 1,
                 heads: Heads = Heads()) -> Scope:
  """The whole selection for one layer and step (Algorithm 1 for a chunk, 2 for one token).

  q [B, S, H, d] before RoPE, k_cache [B, KV, T, d] before RoPE already holding this step's
  keys; q_pos / q_valid [B, S]. Candidates of sequence b: n_global <= t < seq_end - n_local.
  heads: the layer's (every head votes; the count is order-free, so shards' votes just join).
  vote_stride: which queries vote (`voters`).
  """
  seq_end, hi = step_bounds(q_pos, q_valid, n_local)
  q_vote, valid_vote = voters(q, q_valid, vote_stride)
  votes = heads.concat(vote(q_vote, k_cache, n_global, hi, valid_vote, top_k, route=route),
                       axis=1)
  return scope_from_votes(votes, q_pos, seq_end, hi, n_global=n_global, n_local=n_local,
                          span=span, clip=clip, n_tokens=k_cache.shape[2], route=route)
