"""4-bit storage: two codes a byte, asymmetric levels over groups (KIVI's layout).

What the measurements chose (docs/CLAIMS.md): a scale per (token, KV head) row, the 8-bit
format's, cost +278% NLL at 4 bits on Qwen2.5-Coder-1.5B (a few key channels are large for every
token); KIVI's layout (arXiv 2402.02750), keys per channel over groups of 32 tokens and values
per token over groups of 32 channels, both asymmetric, held +0.14% there (CPU) and +0.46-0.48%
on SmolLM2-135M at 8K for keys before and after RoPE (GPU); KVQuant's static per-channel ranges
(arXiv 2401.18079, uniform grid) cost +19.7% on keys after RoPE.

An `Int4` holds x ~= code * scale + zero, codes 0..15, one (scale, zero) per group of `group`
consecutive entries along `axis`: the last axis for values (each token's channels, so a
one-token decode write is quantized alone), the token axis for keys (each channel over `group`
tokens, so a key group is written once it is full: the cache keeps the newest tokens whole
until then, KIVI's residual). scale and zero have x's shape with `axis` divided by `group`.

Packing (`pack` / `unpack`): a row of d codes is d / 2 bytes; byte j holds channel j in its low
nibble and channel j + d / 2 in its high one, the pair RoPE's rotate-half rotates together, so a
tile of bytes unpacks into both halves of every pair it needs (a kernel rotating keys cached
before RoPE reads one byte column for two channels).

A kernel folds the key scales into the query, group by group: q . (a * c + z) = (q * a) . c +
q . z over one key group's (a, z) [d]; and the value scales into the probabilities, channel
group by channel group. Storage only, as quant.py's: the jnp `dequantize` is the definition a
kernel reading 4-bit tiles is to be tested against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

LEVELS = 16  # codes 0..15
GROUP = 32  # KIVI's group, the one measured first


@dataclasses.dataclass(frozen=True)
class Format:
  """A 4-bit cache's layout, named by its kv_dtype (FORMATS): keys per channel over `group`
  tokens, values per token over `group` channels (or a head's all where it has fewer), their
  scales and zero points stored in `scale_dtype`. In any dtype the codes are computed against
  the stored (rounded) scale and zero point (`as_stored`), so the rounding moves the grid, not the
  codes' meaning."""

  group: int = GROUP
  scale_dtype: str = "float32"

  def row_bytes(self, d: int) -> int:
    """Bytes a token's key and value rows take in one KV head at head dim d (codes, scales
    and zero points; keys' scales counted per token: a group's pair over its `group` tokens)."""
    pair = 2 * np.dtype(self.scale_dtype).itemsize
    value_groups = d // min(self.group, d)
    return d + d * pair // self.group + value_groups * pair


# The 4-bit cache's kv_dtype names (docs/CLAIMS.md, BENCHMARKS.md). "int4": KIVI's groups of
# 32 with fp32 scales (192 bytes a token, KV head and layer at d 128), the default: its quality
# measured on Qwen2.5-Coder-1.5B at 16K / 32K (NLL +0.07% / +0.05%), and the fastest decode (fp16
# scales cost the decode kernel 13% at 128K keys on an H200 though it reads fewer bytes).
# "int4_fp16": KIVI's own storage, scales in fp16 (160 bytes). "int4_g64_fp16": groups of 64,
# fp16 scales (144 bytes): the 3B shape's 4M tokens on one H200; on SmolLM2-135M at 8K its NLL
# is +0.33-0.37% where int4's is +0.19%.
FORMATS = {"int4": Format(32, "float32"), "int4_fp16": Format(32, "float16"),
           "int4_g64_fp16": Format(64, "float16")}


def format_of(name: str) -> Format:
  """The 4-bit format a kv_dtype names (one of FORMATS)."""
  if name not in FORMATS:
    raise ValueError(f"{name!r} is not a 4-bit cache format ({', '.join(FORMATS)})")
  return FORMATS[name]


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


def _check_axis(x, group: int, axis: int) -> int:
  axis = axis % x.ndim
  if group < 1 or x.shape[axis] % group:
    raise ValueError(f"int4: axis {axis} of {x.shape} is not whole groups of {group}")
  return axis


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scale", "zero"],
                   meta_fields=["axis", "group"])
@dataclasses.dataclass(frozen=True)
class Int4:
  """codes uint8 [..., d // 2] (packed); scale, zero (fp32 or fp16: Format.scale_dtype) with the
  shape of x but `axis` divided by `group`: x ~= code * scale + zero, one (scale, zero) per
  group along `axis`."""

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  axis: int  # non-negative: the last (values' channels) or the token axis (keys)
  group: int

  @property
  def shape(self) -> tuple:
    return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])


def as_stored(scale, zero, dtype=jnp.float32):
  """fp32 scales and zero points as they are stored: rounded to `dtype` and back (a scale that
  rounds to 0, a range too small for that dtype: 1, the group's codes all 0)."""
  f32 = jnp.float32
  scale = scale.astype(dtype).astype(f32)
  return jnp.where(scale > 0, scale, 1.0), zero.astype(dtype).astype(f32)


def quantize(x, group: int = GROUP, axis: int = -1, scale_dtype=jnp.float32) -> Int4:
  """x [..., d] -> Int4 over groups of `group` entries along `axis` (-1: each row's channels,
  values; the token axis: each channel over tokens, keys), each group's own min and max, the
  codes against the stored (`scale_dtype`) scale and zero point."""
  axis = _check_axis(x, group, axis)
  xf = x.astype(jnp.float32)
  n = x.shape[axis]
  grouped = xf.reshape(*x.shape[:axis], n // group, group, *x.shape[axis + 1:])
  lo = grouped.min(axis + 1, keepdims=True)
  width = grouped.max(axis + 1, keepdims=True) - lo
  scale, zero = as_stored(jnp.where(width > 0, width / (LEVELS - 1), 1.0), lo, scale_dtype)
  codes = jnp.clip(jnp.round((grouped - zero) / scale), 0, LEVELS - 1).astype(jnp.uint8)
  return Int4(pack(codes.reshape(x.shape)), scale.squeeze(axis + 1).astype(scale_dtype),
              zero.squeeze(axis + 1).astype(scale_dtype), axis, group)


def dequantize(x: Int4, dtype=jnp.float32) -> jax.Array:
  """Int4 -> code * scale + zero in `dtype` (computed in fp32)."""
  def spread(a):  # one entry per group -> one per element along the axis
    return jnp.repeat(a, x.group, axis=x.axis)
  f32 = jnp.float32
  return (unpack(x.codes).astype(f32) * spread(x.scale).astype(f32)
          + spread(x.zero).astype(f32)).astype(dtype)


def per_row(fn: Callable, *xs):
  """fn (an indexing op over the leading axes that keeps rows whole: a gather, a scatter, a
  slice, a concatenation) applied to values grouped along their channels, codes, scales and
  zeros alike. Keys grouped along tokens share a group's scale among its tokens: they move by
  whole groups, not rows, and are refused here."""
  if any(x.axis != x.codes.ndim - 1 for x in xs):
    raise TypeError("per_row: keys grouped along tokens move by whole groups, not rows")
  return Int4(*(fn(*(getattr(x, f) for x in xs)) for f in ("codes", "scale", "zero")),
              xs[0].axis, xs[0].group)


def zeros_values(shape, group: int = GROUP, scale_dtype=jnp.float32) -> Int4:
  """An empty value buffer of `shape` [..., d]: each row over groups of `group` channels."""
  if shape[-1] % group or shape[-1] % 2:
    raise ValueError(f"int4 values: {shape[-1]} channels are not whole groups of {group}")
  grouped = (*shape[:-1], shape[-1] // group)
  return Int4(jnp.zeros((*shape[:-1], shape[-1] // 2), jnp.uint8), jnp.ones(grouped, scale_dtype),
              jnp.zeros(grouped, scale_dtype), len(shape) - 1, group)


def nbytes(x) -> int:
  """Bytes a stored 4-bit buffer holds (codes, scales and zeros)."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(x))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["main", "residual", "residual_group"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GroupedKeys:
  """One layer's keys stored KIVI's way, [B, KV, T, d] (T a multiple of the group G):

  main: Int4 grouped along tokens (axis 2) holding every group whose G tokens are written;
  residual [B, KV, G, d] (a float dtype): each sequence's newest, unfilled group, whole;
  residual_group [B] int32: which group that is (its slots residual_group * G ... + G - 1).
  A group is quantized once, when its last token is written (KIVI's residual; KIVI keeps up to
  one group whole): its range is its own G tokens', as the measured design's."""

  main: Int4
  residual: jax.Array
  residual_group: jax.Array

  @property
  def shape(self) -> tuple:
    return self.main.shape


def zeros_grouped_keys(shape, dtype, group: int = GROUP, scale_dtype=jnp.float32) -> GroupedKeys:
  """An empty key buffer of `shape` [B, KV, T, d]; dtype: the residual's (the model's)."""
  b, kvh, t, d = shape
  if t % group:
    raise ValueError(f"int4 keys: {t} slots are not whole groups of {group}")
  groups = (b, kvh, t // group, d)
  main = Int4(jnp.zeros((b, kvh, t, d // 2), jnp.uint8), jnp.ones(groups, scale_dtype),
              jnp.zeros(groups, scale_dtype), 2, group)
  return GroupedKeys(main, jnp.zeros((b, kvh, group, d), dtype), jnp.zeros((b,), jnp.int32))


def write_grouped_keys(buf: GroupedKeys, positions, new, *, capacity: int | None = None,
                       main_group: Callable | None = None) -> GroupedKeys:
  """buf with new keys [B, S, KV, d] appended at slots `positions` [B, S] (out of range:
  dropped). Appending: a sequence's valid positions continue its last write (the first one
  falls in or right after its residual group), as every append-only cache writes. The residual
  and the new keys are laid out from the residual group's first slot, quantized group by group;
  the groups now full go to `main`, the one still filling becomes the residual.

  A cache split along the tokens over devices (each device's `buf` its shard, the residual and
  its group the same on every device): positions are the whole cache's, `capacity` its slots,
  and main_group(groups [B, n]) -> this shard's group of each of the whole cache's groups
  (T / G where another shard holds it: its codes, scales and zero points are dropped here)."""
  b, kvh, t, d = buf.shape
  g = buf.main.group
  capacity = t if capacity is None else capacity
  s = positions.shape[1]
  span = g * (1 + -(-s // g))  # the residual group and the new keys, whole groups
  valid = (positions >= 0) & (positions < capacity)
  wrote = valid.any(axis=1)  # [B]
  start = buf.residual_group * g  # [B]: the first slot laid out
  length = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)  # [B] after the write
  rows = jnp.arange(b)[:, None]
  seq = jnp.zeros((b, kvh, span, d), jnp.float32).at[:, :, :g].set(buf.residual)
  seq = seq.at[rows, :, jnp.where(valid, positions - start[:, None], span)].set(
      new.astype(jnp.float32), mode="drop")  # [B, KV, span, d]
  q = quantize(seq, g, axis=2, scale_dtype=buf.main.scale.dtype)
  full = jnp.where(wrote, length // g, buf.residual_group)  # [B] groups written whole
  groups = buf.residual_group[:, None] + jnp.arange(span // g)  # [B, span / G]
  done = (groups < full[:, None]) & wrote[:, None]
  here = groups if main_group is None else main_group(groups)  # [B, span / G] in this buffer
  group_slots = jnp.where(done & (here < t // g), here, t // g)
  slots = (group_slots[:, :, None] * g + jnp.arange(g)).reshape(b, span)  # past T: dropped

  def put(old, update, at):  # update [B, KV, n, ...] at [B, n] along axis 2 (else dropped)
    return old.at[rows, :, at].set(jnp.swapaxes(update, 1, 2), mode="drop")

  main = Int4(put(buf.main.codes, q.codes, slots), put(buf.main.scale, q.scale, group_slots),
              put(buf.main.zero, q.zero, group_slots), 2, g)
  first = ((full - buf.residual_group) * g)[:, None, None, None]  # [B, 1, 1, 1] into seq
  residual = jnp.take_along_axis(seq, first + jnp.arange(g)[None, None, :, None], axis=2)
  residual = jnp.where(wrote[:, None, None, None], residual.astype(buf.residual.dtype),
                       buf.residual)
  return GroupedKeys(main, residual, full.astype(jnp.int32))


def grouped_keys_written_whole(k, valid, residual_dtype, group: int = GROUP,
                               scale_dtype=jnp.float32) -> GroupedKeys:
  """Keys written all at once, [B, KV, T, d] (T whole groups), as a buffer with no group open
  (residual_group T / G: past the end). valid [B, T]: the slots a query reads; the others (a
  context's padding) take their group's smallest valid entry, so they widen no range."""
  b, kvh, t, d = k.shape
  if t % group:
    raise ValueError(f"int4 keys: {t} slots are not whole groups of {group}")
  kf = k.astype(jnp.float32)
  ok = valid[:, None, :, None]
  lo = jnp.where(ok, kf, jnp.inf).reshape(b, kvh, t // group, group, d).min(axis=3)
  fill = jnp.repeat(jnp.where(jnp.isfinite(lo), lo, 0.0), group, axis=2)  # [B, KV, T, d]
  return GroupedKeys(quantize(jnp.where(ok, kf, fill), group, axis=2, scale_dtype=scale_dtype),
                     jnp.zeros((b, kvh, group, d), residual_dtype),
                     jnp.full((b,), t // group, jnp.int32))


def slice_grouped_keys(buf: GroupedKeys, start, size: int) -> GroupedKeys:
  """Slots start .. start + size of the keys (start may be traced; both whole groups) as a
  buffer of their own: codes, scales and zero points sliced, the residual group renumbered (a
  number outside the slice: the residual lies elsewhere, and the slice's groups are all read
  from `main`)."""
  g = buf.main.group
  if size % g:
    raise ValueError(f"int4 keys: a slice of {size} slots is not whole groups of {g}")
  cut = functools.partial(jax.lax.dynamic_slice_in_dim, axis=2)
  main = Int4(cut(buf.main.codes, start, size), cut(buf.main.scale, start // g, size // g),
              cut(buf.main.zero, start // g, size // g), buf.main.axis, g)
  return GroupedKeys(main, buf.residual, buf.residual_group - start // g)


def load_grouped_keys(buf: GroupedKeys, dtype=jnp.float32) -> jax.Array:
  """[B, KV, T, d] in `dtype`: the full groups dequantized, the residual group's slots whole
  (slots past a sequence's length hold stale data no causal query reads, as in every cache).
  One elementwise expression (no scatter, no fp32 copy held): XLA writes the result alone."""
  b, kvh, t, d = buf.shape
  g = buf.main.group
  codes = unpack(buf.main.codes).astype(jnp.float32).reshape(b, kvh, t // g, g, d)
  scale, zero = (a.astype(jnp.float32)[:, :, :, None] for a in (buf.main.scale, buf.main.zero))
  keys = codes * scale + zero
  is_open = jnp.arange(t // g) == buf.residual_group[:, None]  # [B, T / G]
  keys = jnp.where(is_open[:, None, :, None, None],
                   buf.residual.astype(jnp.float32)[:, :, None], keys)
  return keys.reshape(b, kvh, t, d).astype(dtype)


def is_int4(x) -> bool:
  """Whether x is a 4-bit buffer (values, or keys grouped along tokens)."""
  return isinstance(x, (Int4, GroupedKeys))


def load(x, dtype) -> jax.Array:
  """A 4-bit buffer's values in `dtype` (keys: their residual group whole)."""
  if isinstance(x, GroupedKeys):
    return load_grouped_keys(x, dtype)
  return dequantize(x, dtype)


def rows_of_grouped_keys(fn: Callable, buf: GroupedKeys) -> jax.Array:
  """fn (an op that moves whole rows of a [B, KV, T, ...] buffer over its leading axes: a
  gather, a slice) applied to the keys, which come back dequantized in the residual's dtype
  (the model's): only the rows fn takes are read, each with its group's scale and zero point,
  or whole from the residual. fn sees the codes and a [B, KV, T, 1] array of row ids, so a row
  keeps its group's (scale, zero) wherever fn puts it."""
  b, kvh, t, d = buf.shape
  g = buf.main.group
  if b * kvh * t >= 2 ** 31:
    raise ValueError(f"int4 keys: {b} x {kvh} x {t} rows overflow int32 row ids")
  ids = jnp.arange(b * kvh * t, dtype=jnp.int32).reshape(b, kvh, t, 1)
  taken = fn(ids)[..., 0]  # [..., n]: which (sequence, head, slot) each row is
  seq_head, slot = taken // t, taken % t
  def of_group(a):  # [B, KV, T / G, d] -> the rows' groups' entries [..., n, d] fp32
    return a.reshape(-1, d)[seq_head * (t // g) + slot // g].astype(jnp.float32)
  rows = unpack(fn(buf.main.codes)).astype(jnp.float32) * of_group(buf.main.scale)
  rows = rows + of_group(buf.main.zero)
  in_residual = slot // g == buf.residual_group[seq_head // kvh]
  whole = buf.residual.reshape(-1, d)[seq_head * g + slot % g].astype(jnp.float32)
  return jnp.where(in_residual[..., None], whole, rows).astype(buf.residual.dtype)
