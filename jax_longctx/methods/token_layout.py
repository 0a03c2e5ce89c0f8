"""Which device of a mesh axis holds which token of a cache split along the tokens, and the
part of a ReAttention scope each device holds (mesh ReAttention, RESA over it).

A cache of n_dev * t_local slots: device p holds t_local of them, in token order. Contiguous
(block 0): device p holds tokens p * t_local .. (p + 1) * t_local - 1, the simplest split, but a
causal scan over it is unbalanced: while the prompt streams in, the devices holding its start
are full and score every step's candidates while the others still fill (measured: 1.81x on 4
GPUs at 1M tokens, BENCHMARKS.md). Block-cyclic (block b > 0): blocks of b tokens dealt to the
devices in turn (block j to device j mod n_dev), so every device holds about 1/n_dev of any
prefix. Either way a device's slots ascend in token position, so a range of positions is a
range of its slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_longctx.methods.base import TokenShards
from jax_longctx.methods.reattention_scope import Scope


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  n_dev: int
  t_local: int  # slots per device
  block: int = 0  # 0: contiguous shards; > 0: blocks of `block` tokens dealt in turn

  def __post_init__(self):
    if self.block and self.t_local % self.block:
      raise ValueError(f"a device's {self.t_local} slots do not hold whole blocks of {self.block}")

  @property
  def period(self) -> int:
    return self.block * self.n_dev

  def owner(self, pos):
    """The device holding token `pos`."""
    return pos // self.t_local if not self.block else (pos // self.block) % self.n_dev

  def slot(self, pos, p):
    """Device p's slot of token `pos`, or t_local where p does not hold it (a write drops it)."""
    if self.block:
      s = (pos // self.period) * self.block + pos % self.block
    else:
      s = pos - p * self.t_local
    held = (self.owner(pos) == p) & (pos >= 0) & (s >= 0) & (s < self.t_local)
    return jnp.where(held, s, self.t_local)

  def position(self, slot, p):
    """The token held in device p's `slot`."""
    if self.block:
      return ((slot // self.block) * self.n_dev + p) * self.block + slot % self.block
    return slot + p * self.t_local

  def held_below(self, x, p):
    """How many of device p's slots hold tokens before position x: its slots 0..that - 1."""
    if self.block:
      whole = (x // self.period) * self.block
      return jnp.minimum(whole + jnp.clip(x % self.period - p * self.block, 0, self.block),
                         self.t_local)
    return jnp.clip(x - p * self.t_local, 0, self.t_local)


def layout_here(tokens: TokenShards, t_local: int, block: int) -> tuple[TokenLayout, jax.Array]:
  """(how a cache of t_local slots a device lies over the shards, this device's index)."""
  return TokenLayout(tokens.shards, t_local, block), tokens.index()


def global_top_k(scores, idx, top_k: int, tokens: TokenShards, contiguous: bool = True):
  """Every device's candidates (scores, global idx) [B, S, H, k], best first and ties to the
  lower index -> the top_k of their union [B, S, H, top_k] idx, identical on every device.

  `lax.top_k` keeps the earlier of equal values, so equal scores must sit in ascending global
  index: gathered device-major they do when the devices hold ascending token ranges
  (`contiguous`); a block-cyclic layout sorts them by index first. Ties then go to the lowest
  index, as one device's top-k over the whole cache. Holes (-inf, -1) sort last and stay -1."""
  s = tokens.gather(scores, axis=3)  # [B, S, H, N * k]
  i = tokens.gather(idx, axis=3)
  if not contiguous:
    order = jnp.argsort(i, axis=3, stable=True)
    s, i = jnp.take_along_axis(s, order, axis=3), jnp.take_along_axis(i, order, axis=3)
  _, at = jax.lax.top_k(s, top_k)
  return jnp.take_along_axis(i, at, axis=3)


def shard_part(sc: Scope, base, size: int) -> Scope:
  """The part of scope `sc` in tokens base..base+size-1, as a Scope over that shard's slots.

  sc.idx ascends over its valid slots, so the part is the slots [first, first + count). Its
  ranks count from `first`: a query at rank q_offset + i and a key at first + j score as at
  q_offset - first + i and j (RoPE is relative). Padded to min(N, size) slots."""
  n = sc.idx.shape[1]
  live = jnp.arange(n)[None, :] < sc.length[:, None]  # [B, N]
  first = jnp.sum(live & (sc.idx < base), axis=1, dtype=jnp.int32)  # [B]
  count = jnp.sum(live & (sc.idx < base + size), axis=1, dtype=jnp.int32) - first
  j = jnp.arange(min(n, size), dtype=jnp.int32)[None, :]
  idx = jnp.take_along_axis(sc.idx, jnp.minimum(first[:, None] + j, n - 1), axis=1) - base
  return Scope(jnp.where(j < count[:, None], idx, 0).astype(jnp.int32), count,
               sc.q_offset - first)


def cyclic_part(sc: Scope, layout: TokenLayout, p) -> Scope:
  """The part of scope `sc` that device p holds in a block-cyclic layout, compacted into
  min(N, t_local) slots: its entries (ascending, as the scope's) with their scope ranks; the
  causal mask counts the part's entries before the step's first query. The step's own tokens
  (one prefill chunk inside one block, or one decode token) are all this part's last entries
  on the device that holds them and none on the others, so the mask by slot is the mask by
  rank."""
  b, n = sc.idx.shape
  m = min(n, layout.t_local)
  rank = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (b, n))
  held = (rank < sc.length[:, None]) & (layout.owner(sc.idx) == p)
  dest = jnp.where(held, jnp.cumsum(held, axis=1) - 1, m)  # m: dropped
  rows = jnp.arange(b)[:, None]
  empty = jnp.zeros((b, m), jnp.int32)
  idx = empty.at[rows, dest].set(layout.slot(sc.idx, p).astype(jnp.int32), mode="drop")
  k_rank = empty.at[rows, dest].set(rank, mode="drop")
  count = jnp.sum(held, axis=1, dtype=jnp.int32)
  before = jnp.sum(held & (rank < sc.q_offset[:, None]), axis=1, dtype=jnp.int32)
  return Scope(idx, count, before, k_rank, sc.q_offset)


def device_part(sc: Scope, layout: TokenLayout, p) -> Scope:
  """The part of scope `sc` in device p's shard, over its slots."""
  if layout.block:
    return cyclic_part(sc, layout, p)
  return shard_part(sc, layout.position(0, p), layout.t_local)
