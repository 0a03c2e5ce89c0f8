"""The tile updates of mgpu_topk.py's running sets: which (score, key) pairs a compute
warpgroup keeps after each tile of scores (fp32 [block_q, block_kv], keys above all kept).

"exact": rounds that move each row's best into its set (`_select`, the module doc of
mgpu_topk.py says why it is exact), or for top-1 a running argmax; "segments": each row's kp best
segments of keys (topk_segments.py's stage 1); "columns": the same for strided segments, a set
for each of a row's 8 columns (`_select_columns`); "max_only": a benchmark diagnostic.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.mgpu_common import NEG_INF, plgpu, rows

__all__ = ["BIG_INDEX", "COLUMNS", "selection", "set_width"]

BIG_INDEX = 2**31 - 1
# WGMMA's accumulator layout gives a thread two adjacent columns of every 8-column block of a
# row: the columns c, c + 8, c + 16, ... of a score tile meet in one thread, with no shuffles.
COLUMNS = 8


def _select(state, s, key, start, ops):
  """The running sets ([kp] row vectors of scores, of keys) after the tile s [bq, bk] of keys
  `key` (all above those kept): see the module doc."""
  def threshold(vals):
    return functools.reduce(jnp.minimum, vals)

  def pending(carry):
    _, vals, _, best = carry
    return jnp.max(jnp.where(best > threshold(vals), 1, 0)) > 0  # across the warpgroup

  def take_best(carry):
    s, vals, keys, best = carry
    worst = threshold(vals)
    worst_key = functools.reduce(jnp.maximum, [jnp.where(v == worst, i, -BIG_INDEX)
                                               for v, i in zip(vals, keys)])
    best_key = jnp.min(jnp.where(s == rows(best, s.shape), key, BIG_INDEX), axis=1)
    take = best > worst
    hits = [take & (i == worst_key) for i in keys]
    vals = [jnp.where(hit, best, v) for hit, v in zip(hits, vals)]
    keys = [jnp.where(hit, best_key, i) for hit, i in zip(hits, keys)]
    s = jnp.where(key == rows(best_key, s.shape), NEG_INF, s)
    return s, vals, keys, s.max(axis=1)

  del start, ops
  vals, keys = state
  _, vals, keys, _ = lax.while_loop(pending, take_best, (s, vals, keys, s.max(axis=1)))
  return vals, keys


def _select_one(state, s, key, start, ops):
  """kp = 1, a running argmax: a row changes only where the tile's max beats its kept score
  strictly, to the lowest key among the tile's equal maxima. At most one round, so no masking,
  no second max and no second test across the warpgroup; the round runs only when some row
  gains (running it on every tile measured slower at 512K keys: BENCHMARKS.md)."""
  del start, ops
  (val,), (kept,) = state
  best = s.max(axis=1)
  take = best > val

  def update(_):
    best_key = jnp.min(jnp.where(s == rows(best, s.shape), key, BIG_INDEX), axis=1)
    return [jnp.where(take, best, val)], [jnp.where(take, best_key, kept)]

  return lax.cond(jnp.max(jnp.where(take, 1, 0)) > 0, update, lambda _: ([val], [kept]), None)


def _select_segments(state, s, key, start, ops, *, segment: int, test_first: bool):
  """selection="segments" (topk_segments.py, stage 1): each row keeps its kp best segments of
  `segment` consecutive keys, ranked by their max score, as a sorted set: (maxima descending,
  first keys), equal maxima in key order. Per tile: every segment's row max (slices of S, about
  one row reduction's work). If some row's best segment beats its worst kept one, that segment
  (the first of equal maxima) goes in; if then some row's next best also beats its worst kept
  one, the tile's other segments go in one by one in key order (rare once the sets fill). A
  segment goes in after the kept ones it does not beat strictly, so of equal maxima the earlier
  segment stays ahead. Row-vector work, no rounds over S. The clamped last tile starts on a
  segment boundary (topk_segments needs T % segment == 0); its masked part holds -inf, which
  never goes in."""
  del key
  row = plgpu.Layout.WGMMA.reduce(1)
  maxima = [s[:, j:j + segment].max(axis=1) for j in range(0, s.shape[1], segment)]
  best = functools.reduce(jnp.maximum, maxima)
  n = len(maxima)

  def some_row(gains):  # across the warpgroup
    return jnp.max(jnp.where(gains, 1, 0)) > 0

  def keep(state):
    return tuple(list(x) for x in state)

  def insert_best(state):
    j_best = functools.reduce(jnp.minimum, [jnp.where(m == best, j, n)
                                            for j, m in enumerate(maxima)])
    vals, firsts = _insert(*state, best, start + j_best * segment)
    rest = [jnp.where(j_best == j, NEG_INF, m) for j, m in enumerate(maxima)]

    def insert_rest(state):
      for j, m in enumerate(rest):
        state = _insert(*state, m, ops.layout(jnp.full(m.shape, start + j * segment, jnp.int32),
                                              row))
      return state

    gains = some_row(functools.reduce(jnp.maximum, rest) > vals[-1])
    return lax.cond(gains, insert_rest, keep, (vals, firsts))

  if not test_first:
    return insert_best(state)
  return lax.cond(some_row(best > state[0][-1]), insert_best, keep, state)


def _select_columns(state, s, key, start, ops, *, window: int):
  """selection="columns": a strided segment is the keys of one window of `window` keys (windows
  aligned to multiples of `window` from key 0) whose index is c mod 8, for each column c of 8;
  each (row, c) keeps its kp best segments, as a sorted set of [bq, 8] tiles (maxima descending,
  first keys), equal maxima in key order (windows come in key order, and a segment goes in
  after the kept ones it does not beat strictly). Per window: a segment's max is the
  elementwise max of the window's [bq, 8] column blocks, all in each thread's own registers
  (the contiguous "segments" reduce each segment across 4 lanes by shuffles and test across the
  warpgroup), then one insertion, branch-free. topk_segments resolves the sets to keys."""
  del key
  bq, bk = s.shape
  column = ops.layout(lax.broadcasted_iota(jnp.int32, (bq, COLUMNS), 1), plgpu.Layout.WGMMA)
  vals, firsts = state
  for w in range(0, bk, window):
    m = functools.reduce(jnp.maximum, [s[:, j:j + COLUMNS] for j in range(w, w + window, COLUMNS)])
    vals, firsts = _insert(vals, firsts, m, start + w + column)
  return vals, firsts


def _insert(vals, firsts, m, first):
  """The sorted set (vals descending, their firsts) with (m, first) after every kept value >= m,
  the last one dropped."""
  stays = [x >= m for x in vals]  # a prefix
  def shifted(xs, new):
    return [jnp.where(stays[0], xs[0], new)] + [
        jnp.where(stays[i], xs[i], jnp.where(stays[i - 1], new, xs[i - 1]))
        for i in range(1, len(xs))]
  return shifted(vals, m), shifted(firsts, first)


def _running_max(state, s, key, start, ops):
  """selection="max_only" (a benchmark diagnostic, results meaningless): slot 0 of each row's set
  keeps the running max of s; no keys, no rounds."""
  del key, start, ops
  vals, keys = state
  return [jnp.maximum(vals[0], s.max(axis=1)), *vals[1:]], keys


_SELECTIONS = {"max_only": _running_max}


def set_width(selection: str) -> int:
  """A row's sets: 1, or COLUMNS for "columns" (each row's state is then [bq, COLUMNS] tiles)."""
  return COLUMNS if selection == "columns" else 1


def selection(selection: str, kp: int, segment: int, test_first: bool):
  """The tile update: "exact" is the running argmax for kp = 1 (measured 1.19x faster than
  the rounds at 128K keys, H200), the rounds otherwise; "segments": see _select_segments, whose
  best segment goes in on every tile up to TEST_FIRST_SPAN keys per split (no test across the
  warpgroup: 1.10-1.25x faster at 16K-128K keys on an H200) and after the test beyond (1.01x
  faster at 512K keys, where most tiles no longer gain)."""
  if selection == "exact":
    return _select_one if kp == 1 else _select
  if selection == "segments":
    return functools.partial(_select_segments, segment=segment, test_first=test_first)
  if selection == "columns":  # segment: the window
    return functools.partial(_select_columns, window=segment)
  return _SELECTIONS[selection]
