"""The n largest entries of each row, without sorting the row: a radix select.

`jax.lax.top_k` sorts each row, which costs far more than a pass over it when n is large (RefreshKV
takes K = L/8 out of L tokens at every refresh). Here the n-th largest value of a row is found
digit by digit (4 bits a pass: 8 counting passes over the row for fp32), then the entries above it
and the first entries equal to it are packed in index order. The selected set is exactly
`lax.top_k`'s (ties go to the lower index); only the order inside it differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BITS = 4
_DIGITS = 1 << _BITS


def _ordered_keys(x: jnp.ndarray) -> jnp.ndarray:
  """fp32 -> uint32 whose unsigned order is the float order (-inf < ... < +inf)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  negative = (bits >> 31) == 1
  return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _nth_largest_key(keys: jnp.ndarray, n: int) -> jnp.ndarray:
  """keys uint32 [..., T] -> [...] the n-th largest key of each row (1-based n)."""
  prefix = jnp.zeros(keys.shape[:-1], jnp.uint32)
  remaining = jnp.full(keys.shape[:-1], n, jnp.int32)  # still to find among the matching keys
  digit_values = jnp.arange(_DIGITS, dtype=jnp.uint32)
  for shift in range(32 - _BITS, -1, -_BITS):
    high = shift + _BITS
    matching = (keys >> high) == (prefix >> high)[..., None] if high < 32 else True
    digit = (keys >> shift) & (_DIGITS - 1)
    counts = jnp.sum((digit[..., None] == digit_values) & jnp.asarray(matching)[..., None],
                     axis=-2, dtype=jnp.int32)  # [..., 16]
    at_least = counts @ jnp.tril(jnp.ones((_DIGITS, _DIGITS), jnp.int32))  # digit >= d
    chosen = jnp.sum(at_least >= remaining[..., None], axis=-1) - 1  # largest d reaching n
    above = jnp.take_along_axis(at_least - counts, chosen[..., None], axis=-1)[..., 0]
    remaining = remaining - above
    prefix = prefix | (chosen.astype(jnp.uint32) << shift)
  return prefix


def top_n(x: jnp.ndarray, n: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(values, indices) [..., n] of the n largest entries of each row of x [..., T].

  The same entries as `jax.lax.top_k(x, n)` (ties to the lower index), in index order.
  """
  t = x.shape[-1]
  if not 0 < n <= t:
    raise ValueError(f"n={n} must be in 1..{t}")
  keys = _ordered_keys(x)
  kth = _nth_largest_key(keys, n)[..., None]
  above = keys > kth
  ties = keys == kth
  room = n - jnp.sum(above, axis=-1, keepdims=True)  # ties to take, lowest index first
  keep = above | (ties & (jnp.cumsum(ties, axis=-1) <= room))
  slot = jnp.where(keep, jnp.cumsum(keep, axis=-1) - 1, n)  # n: dropped
  rows = x.reshape(-1, t)
  slot = slot.reshape(-1, t)
  r = jnp.arange(rows.shape[0])[:, None]
  idx = jnp.zeros((rows.shape[0], n), jnp.int32).at[r, slot].set(
      jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), rows.shape), mode="drop")
  idx = idx.reshape(x.shape[:-1] + (n,))
  return jnp.take_along_axis(x, idx, axis=-1), idx
