"""The n largest entries of each row, without sorting the row: a radix select.

`jax.lax.top_k` sorts each row, which costs far more than a pass over it when n is large (RefreshKV
takes K = L/8 out of L tokens at every refresh). Here the n-th largest value of a row is found
digit by digit (`bits` a pass over the row's fp32 keys), then the entries above it and the first
entries equal to it are packed in index order. The selected set is exactly `lax.top_k`'s (ties go
to the lower index); only the order inside it differs.

How a pass counts its digits (`counting`) is a speed choice, the result is the same:
- "compare": every key against every digit value, summed over the keys ([rows, T, 2^bits]
  compares fused into one reduction, the digit axis minor);
- "rows": the same compares with the digit axis major ([rows, 2^bits, T] reduced over its minor
  axis: one long row reduction per (row, digit), which a GPU spreads over more blocks);
- "scatter": a histogram by scatter-add ([rows, 2^bits] bins; keys outside the current prefix
  are dropped, not added as zeros), so wide digits (fewer passes) cost no more compares.
On an H200 (BENCHMARKS.md, "RefreshKV decode") the default, 4-bit "compare", was the fastest
measured: wider digits cost more compares or contended atomics than the passes they save.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Counting = Literal["compare", "rows", "scatter"]
# The radix select's default plan (bits a pass, counting, one cumsum or two for the packing);
# measured in benchmarks/refreshkv_step.py.
DEFAULT_BITS = 4
DEFAULT_COUNTING: Counting = "compare"
DEFAULT_ONE_CUMSUM = False


def _ordered_keys(x: jnp.ndarray) -> jnp.ndarray:
  """fp32 -> uint32 whose unsigned order is the float order (-inf < ... < +inf)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _digit_counts(digit, matching, n_digits: int, counting: Counting) -> jnp.ndarray:
  """[..., T] digits (matching: [..., T] bool or True) -> [..., n_digits] int32 counts."""
  if counting == "compare":
    hits = digit[..., None] == jnp.arange(n_digits, dtype=digit.dtype)
    return jnp.sum(hits & jnp.asarray(matching)[..., None], axis=-2, dtype=jnp.int32)
  if counting == "rows":
    hits = digit[..., None, :] == jnp.arange(n_digits, dtype=digit.dtype)[:, None]
    if matching is not True:
      hits = hits & matching[..., None, :]
    return jnp.sum(hits, axis=-1, dtype=jnp.int32)
  rows = digit.reshape(-1, digit.shape[-1])
  bins = jnp.where(jnp.broadcast_to(matching, digit.shape).reshape(rows.shape),
                   rows.astype(jnp.int32), n_digits)  # n_digits: outside the prefix, dropped
  r = jnp.arange(rows.shape[0])[:, None]
  counts = jnp.zeros((rows.shape[0], n_digits), jnp.int32).at[r, bins].add(1, mode="drop")
  return counts.reshape(digit.shape[:-1] + (n_digits,))


def _nth_largest_key(keys: jnp.ndarray, n: int, bits: int = DEFAULT_BITS,
                     counting: Counting = DEFAULT_COUNTING) -> jnp.ndarray:
  """keys uint32 [..., T] -> [...] the n-th largest key of each row (1-based n)."""
  prefix = jnp.zeros(keys.shape[:-1], jnp.uint32)
  remaining = jnp.full(keys.shape[:-1], n, jnp.int32)  # still to find among the matching keys
  high = 32
  while high > 0:  # digits from the top; the last one may be narrower
    width = min(bits, high)
    shift, n_digits = high - width, 1 << width
    matching = (keys >> high) == (prefix >> high)[..., None] if high < 32 else True
    digit = (keys >> shift) & (n_digits - 1)
    counts = _digit_counts(digit, matching, n_digits, counting)  # [..., n_digits]
    at_least = jnp.flip(jnp.cumsum(jnp.flip(counts, -1), axis=-1), -1)  # digit >= d
    chosen = jnp.sum(at_least >= remaining[..., None], axis=-1) - 1  # largest d reaching n
    above = jnp.take_along_axis(at_least - counts, chosen[..., None], axis=-1)[..., 0]
    remaining = remaining - above
    prefix = prefix | (chosen.astype(jnp.uint32) << shift)
    high = shift
  return prefix


def _slots(above, ties, room, n: int, one_cumsum: bool):
  """[..., T] where each kept entry goes in the output (n: not kept): the entries above the n-th
  value and the first `room` ties, in index order."""
  if one_cumsum:  # both running counts from one scan over the stacked masks
    c_above, c_ties = jnp.cumsum(jnp.stack([above, ties]).astype(jnp.int32), axis=-1)
  else:
    c_above, c_ties = jnp.cumsum(above, axis=-1), jnp.cumsum(ties, axis=-1)
  keep = above | (ties & (c_ties <= room))
  # kept up to and including i: every entry above, and the ties up to i, at most `room` of them
  return jnp.where(keep, c_above + jnp.minimum(c_ties, room) - 1, n)


def top_n(x: jnp.ndarray, n: int, *, bits: int = DEFAULT_BITS,
          counting: Counting = DEFAULT_COUNTING,
          one_cumsum: bool = DEFAULT_ONE_CUMSUM) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(values, indices) [..., n] of the n largest entries of each row of x [..., T].

  The same entries as `jax.lax.top_k(x, n)` (ties to the lower index), in index order. bits,
  counting, one_cumsum: how the n-th largest value is found and the entries packed (module
  docstring); every plan gives the same result.
  """
  t = x.shape[-1]
  if not 0 < n <= t:
    raise ValueError(f"n={n} must be in 1..{t}")
  if not 1 <= bits <= 16 or counting not in ("compare", "rows", "scatter"):
    raise ValueError(f"radix plan bits={bits}, counting={counting!r}: bits must be in 1..16 and "
                     "counting 'compare', 'rows' or 'scatter'")
  keys = _ordered_keys(x)
  kth = _nth_largest_key(keys, n, bits, counting)[..., None]
  above = keys > kth
  ties = keys == kth
  room = n - jnp.sum(above, axis=-1, keepdims=True)  # ties to take, lowest index first
  slot = _slots(above, ties, room, n, one_cumsum)
  rows = x.reshape(-1, t)
  slot = slot.reshape(-1, t)
  r = jnp.arange(rows.shape[0])[:, None]
  idx = jnp.zeros((rows.shape[0], n), jnp.int32).at[r, slot].set(
      jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), rows.shape), mode="drop")
  idx = idx.reshape(x.shape[:-1] + (n,))
  return jnp.take_along_axis(x, idx, axis=-1), idx
