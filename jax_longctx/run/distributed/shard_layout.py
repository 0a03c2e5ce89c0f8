"""Which device of a mesh axis holds which token of a cache split along the tokens.

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

import jax.numpy as jnp


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
