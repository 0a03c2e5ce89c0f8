"""The 4-bit decode kernel's tiles dequantized in SMEM (attention/mgpu_int4_decode.py's stream
warpgroups): a tile's bytes [bk, d / 2] (a byte: channel j in its low nibble, j + d / 2 in its
high one) into [bk, d] in fp16, code * scale + zero, one packed fma an entry pair.

Keys: per channel over a key group of G tokens; a warp of the byte layout (WGMMA_8BIT) holds 16
rows of a 64-row chunk, so one key group (G >= 32), and loads its group's row of scales alone
(`_warp_group_rows`, inline Mosaic GPU: Pallas has no warp index). Values: per row and value
group, by chunks of 32 bytes, each within one value group in either nibble. The codes come out
exact by `_nibble_pairs` (PTX) natively and `_codes` (jnp) in the interpreter.

On an H200, at 128K keys of the 8B's attention shape (experiments/mgpu_decode_costs.py --cache
int4, 64-key tiles): every row choosing among the chunk's groups cost 58 of the kernel's 188 us,
the warps' own rows 32 of 138 (128-key tiles); Mosaic's 16-bit path to the codes (widen, shift,
mask, or) 5.6 PTX instructions an entry, `_nibble_pairs` 0.127 -> 0.120 ms the kernel.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mgpu_common import plgpu

# The dequantized tiles' (and the products' operands') dtype: fp16 under bf16 queries too, as
# int4_decode.py's products: a dequantized entry rounded to 11 significant bits, not bf16's 8 (a
# cache entry or query beyond fp16's 65504 is out of this kernel's range).
TILE_DTYPE = jnp.dtype(jnp.float16)


_BYTES = plgpu.Layout.WGMMA_8BIT if plgpu is not None else None


def _load(ref, layout, native: bool):
  return plgpu.load(ref, (), layout=layout) if native else ref[...]


def _spread(x, shape, dim: int, native: bool):
  """A vector broadcast along `dim` of shape, in the byte tile's layout."""
  y = lax.broadcast_in_dim(x, shape, [1 - dim])
  return plgpu.layout_cast(y, _BYTES) if native else y


def _codes(x8, nib: int, dtype):
  """A byte tile's low (nib 0) or high nibbles as codes in `dtype` (fp16), exactly: the nibble
  under fp16's exponent of 1024 (whose mantissa counts units) is 1024 + code, less 1024. In jnp
  (the interpreter and the reference of `_nibble_pairs`, which does this natively)."""
  x = x8.astype(jnp.uint16)
  bits = (x >> 4 if nib else x & 15) | 0x6400
  return lax.bitcast_convert_type(bits, dtype) - jnp.asarray(1024, dtype)


# PTX for two codes of a 32-bit word of 4 bytes (`$1`, shifted right by 4 for the high nibbles):
# bytes (i, i + 1) to the low bytes of two halves (prmt), the nibble under fp16's 1024 (lop3:
# (t & 0x000F000F) | 0x64006400), less 1024: one fp16x2 pair of exact codes, 3 full-rate
# instructions a pair where Mosaic's 16-bit path took ~10 (a shift a code, widenings, packing).
_PAIR_PTX = ("{ .reg .b32 t, m; prmt.b32 t, $1, 0, %s; "
             "lop3.b32 t, t, 0x000F000F, 0x64006400, 0xea; mov.b32 m, 0x64006400; "
             "sub.f16x2 $0, t, m; }")


def _nibble_pairs(x8, shape):
  """Natively, (low, high) nibbles of a byte tile x8 [n, w] (uint8, the byte layout) as fp16
  codes [n, w] each (= `_codes`), by `_PAIR_PTX` on each register's 4 bytes (inline Mosaic GPU)."""
  import jax.experimental.mosaic.gpu as mgpu
  import numpy as np
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm

  out = plgpu.ShapeDtypeStruct(shape, jnp.float16, layout=_BYTES)

  @plgpu.inline_mgpu(arg_types=(_BYTES,), return_type=(out, out))
  def pairs(ctx, x):
    del ctx
    i32, f16 = ir.IntegerType.get_signless(32), ir.F16Type.get()
    halves = [np.empty_like(x.registers) for _ in range(2)]
    for idx, reg in np.ndenumerate(x.registers):
      word = mgpu.utils.bitcast(reg, i32)
      for nib, src in enumerate((word, arith.shrui(word, mgpu.c(4, i32)))):
        two = [mgpu.utils.bitcast(llvm.inline_asm(i32, [src], _PAIR_PTX % sel, "=r,r"),
                                  ir.VectorType.get((2,), f16)) for sel in ("0x4140", "0x4342")]
        halves[nib][idx] = mgpu.utils.vector_concat(two)
    return tuple(mgpu.FragmentedArray(_registers=h, _layout=x.layout, _is_signed=None)
                 for h in halves)

  return pairs(x8)


def _warp_group_rows(ref, shape, dtype, key_group: int):
  """[64, w] in the byte tile's layout: row r holds ref[r // key_group] (ref [64 / G, w] fp32
  SMEM) in dtype. A warp of the layout holds 16 consecutive rows, so one key group: each warp loads
  its group's row alone (inline Mosaic GPU: Pallas has no warp index), where selecting by row
  among every group's row cost a conversion and a select an entry (58 of the kernel's 188 us
  at 128K keys on an H200: experiments/mgpu_decode_costs.py --cache int4)."""
  import jax.experimental.mosaic.gpu as mgpu
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith

  n, w = shape
  layout = mgpu.WGMMA_LAYOUT_8BIT

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct(shape, dtype, layout=_BYTES))
  def rows(ctx, ref):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    warp = arith.remui(mgpu.warp_idx(sync=True), mgpu.c(4, i32))
    group = arith.divui(arith.muli(warp, mgpu.c(16, i32)), mgpu.c(key_group, i32))
    row = mgpu.utils.memref_slice(ref, arith.index_cast(ir.IndexType.get(), group))
    vec = mgpu.FragmentedArray.load_untiled(row, layout=layout.reduce((0,)), optimized=False)
    vec = vec.astype(mgpu.utils.dtype_to_ir_type(jnp.dtype(dtype)))
    return vec.broadcast_in_dim((n, w), (1,), layout)

  return rows(ref)


def dequantize_keys(k8, ka, kz, out, *, key_group: int, native: bool):
  """out [bk, d] = the key tile's codes (k8 [bk, d / 2]) times their group's channel scales
  plus zero points (ka, kz [bk / G, d], rounded to out's dtype), one fma in out's dtype."""
  n, half = k8.shape
  per_chunk = 64 // key_group  # key groups in a chunk of 64 rows, the layout's row tile

  def per_row(ref, r, c0):  # the entry of each row's group, rows r .., channels c0 ..
    view = ref.at[pl.ds(r // key_group, per_chunk), pl.ds(c0, half)]
    if native:
      return _warp_group_rows(view, (64, half), out.dtype, key_group)
    return jnp.repeat(view[...].astype(out.dtype), key_group, axis=0)  # [64, half]

  for r in range(0, n, 64):
    x = _load(k8.at[pl.ds(r, 64)], _BYTES, native)
    for nib, codes in enumerate(_both_nibbles(x, out.dtype, native)):
      c0 = nib * half
      out.at[pl.ds(r, 64), pl.ds(c0, half)][...] = (
          codes * per_row(ka, r, c0) + per_row(kz, r, c0))


def dequantize_values(v8, va, vz, out, *, native: bool):
  """out [bk, d] = the value tile's codes (v8 [bk, d / 2]) times each row's group scale plus
  zero point (va, vz [bk, d / vg], rounded to out's dtype), one fma in out's dtype: by chunks of
  64 rows and 32 bytes, each within one value group in either nibble (vg a multiple of 32)."""
  n, half = v8.shape
  vg = 2 * half // va.shape[1]
  for r, c in itertools.product(range(0, n, 64), range(0, half, 32)):
    x = _load(v8.at[pl.ds(r, 64), pl.ds(c, 32)], _BYTES, native)
    for nib, codes in enumerate(_both_nibbles(x, out.dtype, native)):
      ch = c + nib * half
      a, z = (_load(ref.at[pl.ds(r, 64), ch // vg], _BYTES.reduce(1) if native else None,
                    native) for ref in (va, vz))
      a, z = (_spread(y.astype(out.dtype), (64, 32), 1, native) for y in (a, z))
      out.at[pl.ds(r, 64), pl.ds(ch, 32)][...] = codes * a + z


def _both_nibbles(x8, dtype, native: bool):
  """(low, high) nibbles' codes of a byte tile in dtype (fp16)."""
  if native and jnp.dtype(dtype) == jnp.float16:
    return _nibble_pairs(x8, x8.shape)
  return tuple(_codes(x8, nib, dtype) for nib in (0, 1))
