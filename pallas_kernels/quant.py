"""8-bit storage with a scale per row: the quantized KV cache's one format, shared by every kernel.

A `Quantized` holds `values` [..., d] in int8 or float8_e4m3fn and `scale` [..., 1] fp32, one per
row (a KV cache row is one token of one KV head), symmetric: x ~= values * scale. The scale keeps
its row's last axis (size 1) so it broadcasts against the values and every op over the leading
axes applies to both leaves alike.
int8 rounds x / scale to the nearest integer in [-127, 127] (clipped; -128 is never used, so
the grid is symmetric); fp8 (E4M3, no infinities) casts x / scale, whose largest magnitude is
448, the format's largest finite value. A row of zeros gets scale 1 (values 0): a scale is never
zero, inf or NaN for finite input, so dequantizing never divides by zero or spreads a NaN.

Why a scale per (token, KV head) and not per tensor: a token's keys are written once, when the
token is, and never rescaled, so a token may be quantized alone (a one-token decode write needs
no other token's values); one fp32 scale per 128-value row costs 3% of the 8-bit bytes.

Kernels take `k` and `v` either as arrays in the model's dtype or as `Quantized` (the same
shapes as the arrays would have: `Quantized.shape` is the values' shape), read the 8-bit values
and the scales from HBM and dequantize in registers: the key scale multiplies each key's scores
(q . (s k) = s (q . k)), the value scale each key's probability before P.V (sum p s v); the
product and the softmax accumulate in fp32. The jnp references dequantize first
(`dequantize`), which is the definition the kernels are tested against. How a call reads an
8-bit buffer (as it is, with fp16 products, or copied in the queries' dtype first) is read.py's.

`per_row(fn, *xs)` applies an indexing op (a gather of slots, a scatter of new tokens, a
concatenation along the token axis) to values and scales alike, so an eviction or a write moves
a token's scale with it; it never touches the last axis (the head dim).

A buffer of keys cached before RoPE may also hold an `offset` per (KV head, channel), shaped to
broadcast in the buffer's own layout ([1, KV, 1, d] for [B, KV, T, d]): its rows are stored less
it (`store_like`) and read back with it (`dequantize`: values * scale + offset), so an 8-bit
row rounds what is left of a key, not a large common part of it (E4M3 rounds relative to each
value). The model fills it in (jax_longctx/model/decoder.py, run/key_smoothing.py's calibrated
mean). It belongs to the buffer, not to a row: `per_row` carries it unchanged, `swap_axes`
swaps it with the values. A kernel that reads 8-bit tiles takes it apart first
(`split_offset`; `layout.parts` refuses a buffer still holding one).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant4

# The stored dtypes of a KV cache: the model's own dtype (no scales), one of the 8-bit ones, or
# a 4-bit format, "int4" and the others of quant4.FORMATS (made by jax_longctx's KVCache alone).
KV_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "int8", *quant4.FORMATS)
EIGHT_BIT = ("float8_e4m3fn", "int8")
_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
  """values [..., d] int8 / float8_e4m3fn, scale [..., 1] fp32, offset None or fp32 with size-1
  axes but the KV heads' and the last: x ~= values * scale + offset."""

  values: jax.Array
  scale: jax.Array
  offset: jax.Array | None = None

  @property
  def shape(self) -> tuple:
    return self.values.shape

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def dtype(self):
    """The stored (8-bit) dtype."""
    return self.values.dtype

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    return dequantize(self, dtype)


def is_quantized(x) -> bool:
  return isinstance(x, Quantized)


def check_kv_dtype(dtype) -> str:
  """A KV-cache dtype (a name or a dtype) as its name, checked: one of KV_DTYPES."""
  name = dtype if isinstance(dtype, str) else getattr(jnp.dtype(dtype), "name", str(dtype))
  if name not in KV_DTYPES:
    raise ValueError(f"kv_dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
  return name


def quantize(x, dtype) -> Quantized:
  """x [..., d] (any float dtype) -> Quantized in `dtype` (int8 or float8_e4m3fn), one scale per
  row over the last axis, computed in fp32."""
  name = jnp.dtype(dtype).name
  if name not in _QMAX:
    raise ValueError(f"cannot quantize to {name!r}: one of {', '.join(EIGHT_BIT)}")
  qmax = _QMAX[name]
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, amax / qmax, 1.0)
  # A magnitude past fp32's range (amax inf) would make inf scales: clip to the largest finite.
  scale = jnp.minimum(scale, np.finfo(np.float32).max / qmax)
  y = jnp.clip(xf / scale, -qmax, qmax)
  values = jnp.round(y).astype(jnp.int8) if name == "int8" else y.astype(jnp.float8_e4m3fn)
  return Quantized(values, scale.astype(jnp.float32))


def kernel_quantize(xf, dtype):
  """quantize(xf, dtype) of fp32 rows [n, d] as a Pallas kernel computes it (a GPU kernel
  quantizing its query rows or a decode step's new K/V rows): (values, scale [n, 1] fp32), the
  same formula, int8's rounding (half to even, as jnp.round) written with floor, which Pallas'
  Triton lowering has where it has no rounding primitive. Equal to quantize's but where a
  kernel's fp32 division rounds a quotient across a half."""
  name = jnp.dtype(dtype).name
  qmax = _QMAX[name]
  amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
  scale = jnp.minimum(jnp.where(amax > 0, amax / qmax, 1.0), np.finfo(np.float32).max / qmax)
  y = jnp.clip(xf / scale, -qmax, qmax)
  if name != "int8":
    return y.astype(dtype), scale
  up = jnp.floor(y + 0.5)  # half up; a tie to an odd integer goes back down to the even one
  odd_tie = (up - y == 0.5) & (up - 2.0 * jnp.floor(up * 0.5) == 1.0)
  return jnp.where(odd_tie, up - 1.0, up).astype(jnp.int32).astype(jnp.int8), scale


def dequantize(x, dtype=jnp.float32):
  """Quantized -> values * scale (+ offset) in `dtype` (computed in fp32); an array is only
  cast."""
  if not isinstance(x, Quantized):
    return x.astype(dtype)
  y = x.values.astype(jnp.float32) * x.scale
  return (y if x.offset is None else y + x.offset).astype(dtype)


def store_like(x, like, heads_axis: int | None = None):
  """x [..., d] in the storage of `like`: quantized as `like` is (less its offset, if it holds
  one), or cast to its dtype. heads_axis: x's KV-head axis, needed where `like` holds an
  offset (new rows often come in another layout than the buffer's: [B, S, KV, d] into
  [B, KV, T, d])."""
  if not isinstance(like, Quantized):
    return x.astype(like.dtype)
  if like.offset is None:
    return quantize(x, like.dtype)
  if heads_axis is None:
    raise ValueError("store_like: the buffer holds a key offset: give the new rows' heads_axis")
  shape = [1] * x.ndim
  shape[heads_axis], shape[-1] = offset_rows(like).shape
  stored = quantize(x.astype(jnp.float32) - offset_rows(like).reshape(shape), like.dtype)
  return dataclasses.replace(stored, offset=like.offset)


def offset_rows(x) -> jax.Array | None:
  """A Quantized's offset as [KV, d] fp32 (None: it holds none, or x is an array)."""
  if not isinstance(x, Quantized) or x.offset is None:
    return None
  return x.offset.reshape(-1, x.offset.shape[-1])


def split_offset(x):
  """(x without its offset, the offset [KV, d] fp32 or None): for a kernel that adds the offset
  itself, or whose result it shifts by one known amount (read.lse_with_key_offset)."""
  offset = offset_rows(x)
  return (x if offset is None else dataclasses.replace(x, offset=None)), offset


def zeros_like_storage(shape, dtype, offset_heads_axis: int | None = None):
  """An empty buffer of `shape` [..., d] stored as `dtype` (a KV_DTYPES name or dtype): an
  array, or for an 8-bit dtype a Quantized of zeros with scales 1. offset_heads_axis: the KV-head
  axis of a buffer of keys cached before RoPE; an 8-bit one then holds a zero offset (module
  doc), which the model fills in."""
  name = jnp.dtype(dtype).name
  if name not in _QMAX:
    return jnp.zeros(shape, dtype)
  offset = None
  if offset_heads_axis is not None:
    offset_shape = [1] * len(shape)
    offset_shape[offset_heads_axis], offset_shape[-1] = shape[offset_heads_axis], shape[-1]
    offset = jnp.zeros(offset_shape, jnp.float32)
  return Quantized(jnp.zeros(shape, name), jnp.ones((*shape[:-1], 1), jnp.float32), offset)


def per_row(fn: Callable, *xs):
  """fn applied to the arrays xs, or, where they are Quantized, to their values and their scales
  alike: an indexing op over the leading axes that keeps their order (a gather, a scatter, a
  slice, a concatenation) moves each row's scale with its values; the first one's offset comes
  along unchanged (`swap_axes` reorders axes). A plain array among quantized ones must be made
  Quantized first (`store_like`)."""
  if len({isinstance(x, Quantized) for x in xs}) > 1:
    raise TypeError("per_row: mix of Quantized and plain arrays (store_like the new rows first)")
  if not isinstance(xs[0], Quantized):
    return fn(*xs)
  out = Quantized(fn(*(x.values for x in xs)), fn(*(x.scale for x in xs)), xs[0].offset)
  if out.offset is not None and out.values.ndim != out.offset.ndim:
    raise ValueError(f"per_row: rows of {out.values.ndim} axes from a buffer whose offset has "
                     f"{out.offset.ndim}: an op over a key buffer must keep its axes")
  return out


def swap_axes(x, a: int, b: int):
  """x with axes a and b swapped: an array, or a Quantized's values, scales and offset alike."""
  return jax.tree.map(lambda y: jnp.swapaxes(y, a, b), x)


def nbytes(x) -> int:
  """Bytes a stored buffer holds (values, scales and any offset)."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(x))
