"""Running exact top-k per row, updated one score tile at a time (shared by GPU and TPU kernels).

Neither Pallas GPU lowering has sort, top_k or argmax inside a kernel, so the running set is an
unsorted [rows, kp] buffer updated by max + compare/select. Tiles arrive in increasing key order,
so a newcomer that only ties the worst kept score has the higher index and loses: the strict `>`
below is what makes ties go to the lowest index. Each row takes at most k entries from a tile, and
once the k-th best is high most tiles take none, which costs one compare and one reduction per
score instead of k passes. All arrays stay 2-D (keepdims) for the TPU lowering.
"""

from __future__ import annotations


import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")
BIG_INDEX = 2**31 - 1


def empty(rows: int, kp: int):
  """Empty running set: scores -inf, distinct negative indices (so one slot is 'the worst')."""
  v = jnp.full((rows, kp), NEG_INF, jnp.float32)
  i = -1 - lax.broadcasted_iota(jnp.int32, (rows, kp), 1)
  return v, i


def _worst(run_v, run_i):
  """Per row: the score to beat and a mask of the one slot it sits in (lowest score, highest index)."""
  worst_v = jnp.min(run_v, axis=1, keepdims=True)
  worst_i = jnp.max(jnp.where(run_v == worst_v, run_i, -BIG_INDEX), axis=1, keepdims=True)
  return worst_v, run_i == worst_i


def merge_tile(run_v, run_i, scores, index):
  """Merges scores [rows, n] of keys index [1, n] (all above those kept) into the running set.

  Each round moves every row's best remaining score into its set if it beats the row's worst
  kept one; rounds go on while some row has such a score. The row maxima are carried between
  rounds so a round costs four passes over the tile (max, two selects, min).
  """

  def pending(carry):
    _, v, _, best = carry
    return jnp.max(jnp.where(best > jnp.min(v, axis=1, keepdims=True), 1, 0)) > 0

  def take_best(carry):
    s, v, i, best = carry
    worst_v, worst_slot = _worst(v, i)
    best_i = jnp.min(jnp.where(s == best, index, BIG_INDEX), axis=1, keepdims=True)
    slot = worst_slot & (best > worst_v)
    v = jnp.where(slot, best, v)
    i = jnp.where(slot, best_i, i)
    s = jnp.where(index == best_i, NEG_INF, s)
    return s, v, i, jnp.max(s, axis=1, keepdims=True)

  carry = (scores, run_v, run_i, jnp.max(scores, axis=1, keepdims=True))
  _, run_v, run_i, _ = lax.while_loop(pending, take_best, carry)
  return run_v, run_i


def running_max(run_v, run_i, scores, index):
  """KernelOptions.topk_selection="max_only" (a benchmark diagnostic, results meaningless): every
  slot of a row holds its running max of scores [rows, n]; the indices stay those of `empty`."""
  del index
  return jnp.maximum(run_v, jnp.max(scores, axis=1, keepdims=True)), run_i


def merger(selection: str):
  """The tile update for KernelOptions.topk_selection: "exact" or "max_only"."""
  return {"exact": merge_tile, "max_only": running_max}[selection]


def finish(vals, idx, top_k: int):
  """Candidates [..., n] (from any number of merged parts) -> best-first top_k, ties by index.

  Unfilled slots come back as (-inf, -1).
  """
  key_i = jnp.where(idx < 0, BIG_INDEX, idx)
  neg_v, key_i = lax.sort((-vals, key_i), dimension=vals.ndim - 1, num_keys=2)
  v = -neg_v[..., :top_k]
  i = key_i[..., :top_k]
  return v, jnp.where(v == NEG_INF, -1, i).astype(jnp.int32)


