"""4-bit storage: two codes a byte, asymmetric levels, keys per channel and values per token.

The layouts the 4-bit literature measured to hold quality (KIVI, arXiv 2402.02750; KVQuant,
arXiv 2401.18079), and what this project's CPU proxy measured on Qwen2.5-Coder-1.5B
(experiments/int4_designs_proxy.py, docs/CLAIMS.md): a scale per (token, KV head) row, as the
8-bit format has, cost +278% NLL at 4 bits, because a few key channels are large for every
token; per-channel key ranges cost +0.14-0.62%.

- per row (values): x ~= code * scale + zero, codes 0..15, scale and zero per row [..., 1]
  (a row: one token of one KV head), from the row's min and max. A row is quantized alone, so a
  one-token decode write needs no other token.
- per channel (keys, `Int4.per_channel`): x ~= code * scale + zero with scale and zero per (KV head, channel),
  belonging to the buffer, not to a row (as quant.Quantized's offset): ranges calibrated on
  held-out text before the run (KVQuant's static per-channel ranges), values outside clipped.
  No row carries a scale, so evicting or rewriting one slot moves only its codes, and a kernel
  folds the scales into the query: q . (a * c + z) = (q * a) . c + q . z, the last term the same
  for every key of a query (no change to a softmax or a top-k over keys that are not rotated).

Packing (`pack` / `unpack`): a row of d codes is d / 2 bytes; byte j holds channel j in its low
nibble and channel j + d / 2 in its high one, the pair RoPE's rotate-half rotates together, so
a tile of bytes unpacks into both halves of every pair it needs (a kernel rotating keys cached
before RoPE reads one byte column for two channels).

Storage only, as quant.py's: the jnp `dequantize` is the definition a kernel reading 4-bit
tiles is to be tested against. `per_row` moves row-level arrays and carries buffer-level ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = 16  # codes 0..15


def pack(codes: jax.Array) -> jax.Array:
  """codes [..., d] (integers 0..15, d even) -> uint8 [..., d // 2]: byte j = code j | code
  (j + d / 2) << 4."""
  d = codes.shape[-1]
  if d % 2:
    raise ValueError(f"pack: the last axis ({d}) must be even (two codes a byte)")
  c = codes.astype(jnp.uint8)
  return c[..., : d // 2] | (c[..., d // 2:] << 4)


def unpack(packed: jax.Array) -> jax.Array:
  """uint8 [..., d // 2] -> codes uint8 [..., d] (pack's inverse)."""
  return jnp.concatenate([packed & 15, packed >> 4], axis=-1)


def _levels(x, lo, hi):
  """(codes uint8, scale, zero) of x within [lo, hi] (broadcasting), 16 uniform levels; a
  range of width zero gets scale 1 (codes 0: x == zero), so dequantizing is always finite."""
  width = hi - lo
  scale = jnp.where(width > 0, width / (LEVELS - 1), 1.0)
  codes = jnp.clip(jnp.round((x - lo) / scale), 0, LEVELS - 1).astype(jnp.uint8)
  return codes, scale, lo


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scale", "zero"],
                   meta_fields=["per_channel"])
@dataclasses.dataclass(frozen=True)
class Int4:
  """codes uint8 [..., d // 2] (packed), x ~= code * scale + zero; scale and zero fp32 either
  per row, [..., 1] (per_channel False: values), or per (KV head, channel) for the whole buffer,
  size-1 axes but the KV heads' and the last, e.g. [1, KV, 1, d] for [B, KV, T, d] (keys)."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  per_channel: bool = False

  @property
  def shape(self) -> tuple:
    return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])


def quantize_rows(x) -> Int4:
  """x [..., d] -> Int4 with each row's own min and max (fp32)."""
  xf = x.astype(jnp.float32)
  codes, scale, zero = _levels(xf, xf.min(-1, keepdims=True), xf.max(-1, keepdims=True))
  return Int4(pack(codes), scale, zero)


def channel_ranges(x, heads_axis: int) -> tuple[jax.Array, jax.Array]:
  """(min, max) of x [..., d] per (KV head, channel) over every other axis, shaped to broadcast
  against x (size 1 but on heads_axis and the last): a calibration's ranges."""
  axes = tuple(a for a in range(x.ndim - 1) if a != heads_axis % x.ndim)
  xf = x.astype(jnp.float32)
  return xf.min(axes, keepdims=True), xf.max(axes, keepdims=True)


def quantize_channels(x, lo, hi) -> Int4:
  """x [..., d] -> Int4 per channel within the calibrated ranges lo <= hi (channel_ranges' shapes;
  jit-safe, so their order is the calibration's to hold); values outside are clipped."""
  lo, hi = jnp.asarray(lo, jnp.float32), jnp.asarray(hi, jnp.float32)
  if lo.shape != hi.shape or lo.ndim != x.ndim or lo.shape[-1] != x.shape[-1]:
    raise ValueError(f"quantize_channels: ranges {lo.shape} / {hi.shape} do not broadcast per "
                     f"channel against rows {x.shape}")
  codes, scale, zero = _levels(x.astype(jnp.float32), lo, hi)
  return Int4(pack(codes), scale, zero, per_channel=True)


def dequantize(x, dtype=jnp.float32) -> jax.Array:
  """Int4 -> code * scale + zero in `dtype` (computed in fp32)."""
  return (unpack(x.codes).astype(jnp.float32) * x.scale + x.zero).astype(dtype)


def per_row(fn: Callable, *xs):
  """fn (an indexing op over the leading axes: a gather, a scatter, a slice, a concatenation)
  applied to the row-level arrays of xs alike: the codes, and per-row scales and zeros; a
  buffer's per-channel ranges (the first one's) are carried unchanged."""
  if len({x.per_channel for x in xs}) != 1:
    raise TypeError("per_row: a mix of per-row and per-channel 4-bit buffers")
  codes = fn(*(x.codes for x in xs))
  if xs[0].per_channel:
    return Int4(codes, xs[0].scale, xs[0].zero, per_channel=True)
  return Int4(codes, fn(*(x.scale for x in xs)), fn(*(x.zero for x in xs)))


def nbytes(x) -> int:
  """Bytes a stored 4-bit buffer holds (codes, scales and zeros)."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(x))
