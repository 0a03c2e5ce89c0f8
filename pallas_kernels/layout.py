"""Shape plumbing shared by the kernels: GQA row grouping, key layouts, padding and checks.

Kernels see one KV head at a time. The query heads of its group and the query positions are
flattened into rows (row = query * group + head_in_group), so a K tile read once serves every
query head of the group, as one matrix product.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import quant, tpu

KV_LAYOUTS = ("BTHD", "BHTD")


def check_qk(q, k, kv_layout: str):
  """Validates shapes; returns (batch, q_len, q_heads, kv_heads, kv_len, d)."""
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"unknown kv_layout {kv_layout!r}; expected one of {KV_LAYOUTS}")
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q and k must be rank 4, got shapes {q.shape} and {k.shape}")
  b, lq, h, d = q.shape
  if kv_layout == "BTHD":
    kb, t, kvh, kd = k.shape
  else:
    kb, kvh, t, kd = k.shape
  if kb != b or kd != d:
    raise ValueError(f"q {q.shape} and k {k.shape} ({kv_layout}) disagree on batch or head dim")
  if h % kvh:
    raise ValueError(f"{h} query heads do not divide into {kvh} kv heads")
  return b, lq, h, kvh, t, d


def check_kv(k, v) -> bool:
  """Whether keys and values come quantized (`quant.Quantized`, the 8-bit KV cache); checks that
  both are arrays of one shape or both Quantized of one 8-bit dtype, scales shaped as their
  values with a head dim of 1."""
  kq, vq = quant.is_quantized(k), quant.is_quantized(v)
  if kq != vq:
    raise ValueError(f"k and v must both be Quantized or both arrays, got k "
                     f"{type(k).__name__}, v {type(v).__name__}")
  if v.shape != k.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
  if not kq:
    return False
  for name, x in (("k", k), ("v", v)):
    if x.dtype.name not in quant.EIGHT_BIT:
      raise ValueError(f"quantized {name} holds {x.dtype.name}: expected one of {quant.EIGHT_BIT}")
    if x.scale.shape != (*x.values.shape[:-1], 1):
      raise ValueError(f"{name}.scale {x.scale.shape} must be its values' shape with a head dim "
                       f"of 1, {(*x.values.shape[:-1], 1)}")
  if k.dtype != v.dtype:
    raise ValueError(f"k ({k.dtype.name}) and v ({v.dtype.name}) must be quantized alike")
  return True


def parts(x):
  """(values, scale fp32 [...]) of a Quantized, (x, None) of an array. The kernels tile the
  scales as one vector per (batch, KV head), so the stored trailing 1 goes here, once."""
  if quant.is_quantized(x):
    if x.offset is not None:
      raise ValueError("a kernel got 8-bit keys still holding their offset: take it apart "
                       "first (quant.split_offset)")
    return x.values, x.scale[..., 0].astype(jnp.float32)
  return x, None


def heads_first(k, kv_layout: str):
  """[B, KV, T, d] view (a transpose, i.e. a copy, only for BTHD); a Quantized moves its scales
  [B, T, KV] -> [B, KV, T] (and any offset) alike."""
  if kv_layout == "BHTD":
    return k
  return quant.swap_axes(k, 1, 2)


def next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def q_rows(q, kvh: int, rows_padded: int):
  """[B, Lq, H, d] -> [B, KV, R, d] with R = Lq * group, zero-padded to rows_padded."""
  b, lq, h, d = q.shape
  g = h // kvh
  rows = q.reshape(b, lq, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, lq * g, d)
  return jnp.pad(rows, ((0, 0), (0, 0), (0, rows_padded - lq * g), (0, 0)))


def row_positions(first_row, bm: int, group: int, q_off):
  """Positions [bm, 1] of a kernel's rows first_row.. (row = query * group + head: q_rows)."""
  return q_off + tpu.div(first_row + lax.broadcasted_iota(jnp.int32, (bm, 1), 0), group)


def from_rows(x, lq: int, h: int):
  """[B, KV, R_padded, ...] -> [B, Lq, H, ...] (drops padding rows)."""
  b, kvh = x.shape[:2]
  g = h // kvh
  rest = x.shape[3:]
  x = x[:, :, : lq * g].reshape(b, kvh, lq, g, *rest)
  x = jnp.moveaxis(x, 2, 1)  # [B, Lq, KV, G, ...]
  return x.reshape(b, lq, h, *rest)


def pad_keys(k, kv_layout: str, min_len: int):
  """Pads the key axis up to min_len (only when shorter: kernels clamp their last tile instead)."""
  axis = 1 if kv_layout == "BTHD" else 2
  t = k.shape[axis]
  if t >= min_len:
    return k
  pad = [(0, 0)] * 4
  pad[axis] = (0, min_len - t)
  return quant.per_row(lambda x: jnp.pad(x, pad), k)


def per_batch(x, b: int, default: int):
  """Scalar / [B] / None -> int32 [B]."""
  if x is None:
    x = default
  return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (b,))
