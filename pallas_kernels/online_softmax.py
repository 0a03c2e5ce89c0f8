"""Online softmax over key tiles (flash attention's running max / sum / accumulator), shared by
the GPU and TPU kernels of flash_attention and gathered_attention. Arrays stay 2-D for TPU.

8-bit keys and values (quant.Quantized) come in as their values, converted to q's dtype by the
caller (int8 and E4M3 values are exact in bf16), and their scales as rows [1, n]: a key's scale
multiplies its column of scores (q . s k = s (q . k)), a value's scale its column of
probabilities before P V (sum_j p_j s_j v_j); sums and products stay fp32."""

from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")


def converted(x, scale, dtype, native_gpu: bool = False):
  """An 8-bit K or V tile as the products take it: its values converted to `dtype` (exact: int8
  and E4M3 values are bf16 / fp16 / fp32 values) and its scales ([n] or [1, n]) as a row [1, n];
  a tile without scales (None) as it is. native_gpu: a Triton kernel compiled for CUDA, where
  int8 goes to fp16 by `int8_as_float16_ptx`."""
  if scale is None:
    return x, None
  if native_gpu and x.dtype == jnp.int8 and dtype == jnp.float16:
    values = int8_as_float16_ptx(x)
  else:
    values = x.astype(dtype)
  return values, scale if scale.ndim == 2 else scale[None, :]


# Four int8 in a register to four fp16 in two: x ^ 0x80 is x + 128 as a byte; a byte b under an
# fp16 high byte of 0x64 is 1024 + b (fp16 steps by 1 from 1024 to 2048), so less 1152 (0x6480)
# it is x, exactly. A xor, two byte permutes and two packed subtracts per four values, where
# the conversion unit's int -> float -> bf16 takes two conversions a value (16 a clock per SM
# on Hopper), the likely bound of an int8 decode tile (BENCHMARKS.md "On one H200 again").
_INT8_TO_F16 = """{
.reg .b32 biased, magic;
xor.b32 biased, $2, 0x80808080;
prmt.b32 $0, biased, 0x64646464, 0x5140;
prmt.b32 $1, biased, 0x64646464, 0x7362;
mov.b32 magic, 0x64806480;
sub.f16x2 $0, $0, magic;
sub.f16x2 $1, $1, magic;
}"""


def int8_as_float16_ptx(x):
  """int8 -> float16 in a Triton kernel for CUDA, by PTX on four values a register (exact)."""
  import jax
  from jax.experimental.pallas import triton as pltriton
  [out] = pltriton.elementwise_inline_asm(
      _INT8_TO_F16, args=[x], constraints="=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
  return out


def dequantized(x, scale_col, dtype):
  """An 8-bit tile [n, w] times its rows' scales [n, 1] in fp32, rounded to `dtype`: the values
  `quant.dequantize` gives, where an operation must see them (keys rotated after it)."""
  return (x.astype(jnp.float32) * scale_col).astype(dtype)


def scores(q, kt, scale, key_scale=None):
  """[rows, d] x [n, d] -> fp32 [rows, n] (times scale when given; times key_scale [1, n] or
  [rows, n], the keys' quantization scales, when given). int8 q and kt multiply into int32
  (exact; the TPU MXU's int8 products). q and kt may be tuples of as many tiles: the sum of
  their products (row groups: each q tile zero outside its group's rows), converted once."""
  pairs = tuple(zip(q, kt)) if isinstance(q, tuple) else ((q, kt),)
  exact = pairs[0][0].dtype == jnp.int8
  s = _summed([lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.int32 if exact else jnp.float32)
                for a, b in pairs])
  s = s.astype(jnp.float32)
  if key_scale is not None:
    return s * (key_scale if scale is None else key_scale * scale)
  return s if scale is None else s * scale


def rope_scores(q1, q2, k1, k2, cos, sin, scale):
  """Scores of q = [q1 | q2] against keys [k1 | k2] rotated (RoPE, rotate-half) by cos, sin
  [n, d/2] here, not in HBM; halves come apart because a GPU kernel cannot slice its registers.
  The rotation runs in the dtype of cos and sin: the keys' own (as transformers rotates, cos and
  sin cast to the model's dtype), or fp32, after which the keys go back to their dtype for the
  product."""
  if cos.dtype != jnp.float32:
    r1, r2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
  else:
    k1f, k2f = k1.astype(jnp.float32), k2.astype(jnp.float32)
    r1, r2 = (k1f * cos - k2f * sin).astype(k1.dtype), (k2f * cos + k1f * sin).astype(k1.dtype)
  return (scores(q1, r1, None) + scores(q2, r2, None)) * scale



def init(rows: int, d: int):
  return (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))


def update(m, l, acc, s, vt, value_scale=None, row_group=None):
  """Folds masked scores s [rows, n] (-inf = masked) and values vt [n, d] into the state;
  value_scale [1, n] or [rows, n]: the values' quantization scales (each multiplies its entry
  of p). vt may be a tuple of tiles, one a row group: row r's p multiplies vt[row_group[r]]
  (row_group [rows, 1] int32)."""
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing seen yet stay at zero
  p = jnp.exp(s - m_safe)
  alpha = jnp.exp(m - m_safe)
  l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
  tiles = vt if isinstance(vt, tuple) else (vt,)
  if tiles[0].dtype == jnp.int8:  # values as stored (KernelOptions.decode_int8_values)
    pq, p_scale = int8_probabilities(p if value_scale is None else p * value_scale)
    pv = _weighted_values(pq, tiles, row_group, jnp.int32)
    return m_new, l, acc * alpha + pv.astype(jnp.float32) * p_scale
  tile_scale = None
  if value_scale is not None and tiles[0].dtype == jnp.float16:
    # fp16's range: the scales relative to the tile's largest, which multiplies P.V in fp32, so
    # no p * scale falls among fp16's subnormals (an error of at most 2^-24 of that scale)
    tile_scale = jnp.max(value_scale, axis=1, keepdims=True)
    value_scale = value_scale / tile_scale
  pw = (p if value_scale is None else p * value_scale).astype(tiles[0].dtype)
  pv = _weighted_values(pw, tiles, row_group, jnp.float32)
  return m_new, l, acc * alpha + (pv if tile_scale is None else pv * tile_scale)


def _weighted_values(w, tiles, row_group, accumulate):
  """w [rows, n] . tiles' [n, d] (row r's weights multiply tiles[row_group[r]] when there are
  row groups), accumulated in `accumulate`."""
  return _summed([lax.dot_general(w if row_group is None else jnp.where(row_group == i, w, 0),
                                  x, (((1,), (0,)), ((), ())), preferred_element_type=accumulate)
                  for i, x in enumerate(tiles)])


def int8_probabilities(pw):
  """Weights pw [rows, n] >= 0 (p, or p times the values' scales) -> (int8 [rows, n] in
  0..127, scale [rows, 1] fp32): each row's largest entry to 127, the rest rounded half up on
  that scale (an entry below 1/254 of its row's largest to 0); a row of zeros stays zero."""
  top = jnp.max(pw, axis=1, keepdims=True)
  inv = jnp.where(top > 0, 127.0 / top, 0.0)
  return jnp.floor(pw * inv + 0.5).astype(jnp.int32).astype(jnp.int8), top * (1.0 / 127.0)


def _summed(xs):
  """xs[0] + xs[1] + ...: no zero added first (a kernel would add it)."""
  return functools.reduce(operator.add, xs)


def finish(m, l, acc):
  """-> (out fp32 [rows, d], lse [rows, 1]); rows that saw no key give (0, -inf)."""
  seen = l > 0
  safe_l = jnp.where(seen, l, 1.0)
  return jnp.where(seen, acc / safe_l, 0.0), jnp.where(seen, m + jnp.log(safe_l), NEG_INF)
