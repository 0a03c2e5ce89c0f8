"""A decode step's ReAttention scope from its votes in one kernel: the most voted tokens, their
spans merged, and [global, spans, local] compacted into a padded index list.

jax_longctx/methods/reattention_scope.py computes the same thing in jnp (`scope_from_votes`:
most_voted_pairwise, span_runs, assemble), which XLA runs as about a dozen small kernels per layer
and step (benchmarks/results/reattention_select_profile_32k_h200.jsonl: ~20 us of launches at
the 8B shape, 128 votes). Here one Pallas (Triton) kernel does it; every program recomputes the
vote ranking from the step's few votes (a [V, V] comparison, V <= MAX_VOTES) and fills its own
block of the index list, so the list is written by many programs at once.

Everything is in "vote space": the kept tokens are not sorted into a list. A vote stands for its
token when it is the token's first vote; a token is kept when fewer than `clip` tokens precede
it by (votes desc, token asc); a kept token's span starts after the previous kept token's span
ends (the ends rise with the tokens, so the previous end is the largest end among smaller kept
tokens); its run's first slot is the sum of the runs of smaller kept tokens. A slot of the
selected part finds its run as the one whose [offset, offset + count) holds it (runs are
disjoint). The same integers as the jnp path, by construction and by test
(tests/kernels/test_vote_scope.py, every case against `scope_from_votes`' jnp path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout

SQ = gpu.SQ
MAX_VOTES = 256  # the [V, V] comparisons stay in registers (decode: heads x top_k)
BLOCK_SLOTS = 128  # index-list slots per program
META = 8  # per program: (length, q_offset, 0...)


def voted_scope(votes, bounds, *, n_global: int, n_local: int, span: int, clip: int, size: int,
                block: int = BLOCK_SLOTS, num_warps: int = 4, interpret=False):
  """votes [B, V] int32 (-1: none), V <= MAX_VOTES; bounds [B, 3] int32: (hi, seq_end,
  first_q): the candidates' end (the local part's start), the tokens in the cache after the
  step, the step's first query position. Returns (idx [B, size], length [B], q_offset [B]) int32,
  as reattention_scope.assemble (its docstring says what each means)."""
  b, v = votes.shape
  if v > MAX_VOTES:
    raise ValueError(f"{v} votes per sequence: the scope kernel takes at most {MAX_VOTES}")
  if bounds.shape != (b, 3):
    raise ValueError(f"bounds must be [batch={b}, 3] (hi, seq_end, first_q), got {bounds.shape}")
  vp = max(16, layout.next_pow2(v))
  votes = jnp.pad(votes.astype(jnp.int32), ((0, 0), (0, vp - v)), constant_values=-1)
  bounds = jnp.pad(bounds.astype(jnp.int32), ((0, 0), (0, 1)))  # 4 entries: a power of two
  idx, meta = _call(votes, bounds, n_global=n_global, n_local=n_local, span=span, clip=clip,
                    size=size, block=block, num_warps=num_warps, interpret=interpret)
  return idx[:, :size], meta[:, 0, 0], meta[:, 0, 1]


@functools.partial(jax.jit, static_argnames=("n_global", "n_local", "span", "clip", "size",
                                             "block", "num_warps", "interpret"))
def _call(votes, bounds, *, n_global, n_local, span, clip, size, block, num_warps, interpret):
  b, vp = votes.shape
  blocks = pl.cdiv(size, block)
  kernel = functools.partial(_kernel, n_global=n_global, n_local=n_local, span=span, clip=clip,
                             block=block)
  return gpu.pallas_call(
      kernel, interpret, num_warps=num_warps, num_stages=1, grid=(b, blocks),
      in_specs=[pl.BlockSpec((SQ, 4), lambda i, j: (i, 0)),
                pl.BlockSpec((SQ, vp), lambda i, j: (i, 0))],
      out_specs=[pl.BlockSpec((SQ, block), lambda i, j: (i, j)),
                 pl.BlockSpec((SQ, SQ, META), lambda i, j: (i, j, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, blocks * block), jnp.int32),
                 jax.ShapeDtypeStruct((b, blocks, META), jnp.int32)],
  )(bounds, votes)


def _count(mask):
  """Per row of a [n, V] mask, how many entries are set."""
  return jnp.sum(jnp.where(mask, 1, 0), axis=1)


def _kernel(bounds_ref, votes_ref, idx_ref, meta_ref, *, n_global, n_local, span, clip, block):
  hi, seq_end, first_q = bounds_ref[0], bounds_ref[1], bounds_ref[2]
  lo = jnp.int32(n_global)
  vote = votes_ref[...]  # [V]
  vp = vote.shape[0]
  live = vote >= 0
  this, other = vote[:, None], vote[None, :]  # [V, 1] this vote, [1, V] every vote
  same = (this == other) & live[None, :]
  count = _count(same)  # the votes of this vote's token
  other_first = (lax.broadcasted_iota(jnp.int32, (vp, vp), 1)
                 < lax.broadcasted_iota(jnp.int32, (vp, vp), 0))
  first = live & (_count(same & other_first) == 0)  # the token's first vote stands for it
  ahead = ((count[None, :] > count[:, None])
           | ((count[None, :] == count[:, None]) & (other < this)))
  kept = first & (_count(ahead & first[None, :]) < clip)
  below = kept[None, :] & (other < this)  # [V, V]: kept tokens smaller than this one

  # Spans: [token - span//2, token + (span+1)//2) within [lo, hi), after the previous span.
  base = jnp.where(kept, vote, 0)
  end = jnp.minimum(jnp.maximum(base + (span + 1) // 2, lo), hi)
  prev_end = jnp.max(jnp.where(below, end[None, :], lo), axis=1)
  start = jnp.maximum(base - span // 2, jnp.maximum(lo, prev_end))
  run = jnp.where(kept, jnp.maximum(end - start, 0), 0)
  offset = jnp.sum(jnp.where(below, run[None, :], 0), axis=1)  # the run's first selected slot
  n_sel = jnp.sum(run)

  # [global, selected runs, local] (reattention_scope.assemble)
  n_glob = jnp.minimum(lo, seq_end)
  local_start = jnp.maximum(lo, seq_end - n_local)
  n_loc = jnp.clip(seq_end - local_start, 0, n_local)
  r = pl.program_id(1) * block + lax.broadcasted_iota(jnp.int32, (block,), 0)
  in_sel = r - n_glob
  inside = (offset[None, :] <= in_sel[:, None]) & (in_sel[:, None] < (offset + run)[None, :])
  selected = in_sel + jnp.sum(jnp.where(inside, (start - offset)[None, :], 0), axis=1)
  in_loc = in_sel - n_sel
  idx = jnp.where(r < n_glob, r, jnp.where(in_loc < 0, selected, local_start + in_loc))
  length = n_glob + n_sel + n_loc
  idx_ref[...] = jnp.where(r < length, idx, 0)
  q_offset = jnp.minimum(n_glob, first_q) + n_sel + jnp.clip(first_q - local_start, 0, n_loc)
  slot = lax.broadcasted_iota(jnp.int32, (META,), 0)
  meta_ref[...] = jnp.where(slot == 0, length, jnp.where(slot == 1, q_offset, 0))
