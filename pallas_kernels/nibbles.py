"""A 4-bit cache's codes (quant4: two a byte) as floats in a kernel's registers, exactly.

Shared by the kernels that read 4-bit tiles (attention/int4_decode.py, topk/int4_scores.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# x | MAGIC, read as the float type, is BIAS + x exactly for 0 <= x < 16 (the float's last
# mantissa bits count by one there): a code becomes a float by an or and a subtraction, not by
# the conversion unit (two conversions a value for uint8 -> bf16, the bound of the 8-bit tiles).
_MAGIC = {jnp.dtype(jnp.bfloat16): (jnp.uint16, 0x4300, 128.0),
          jnp.dtype(jnp.float16): (jnp.uint16, 0x6400, 1024.0),
          jnp.dtype(jnp.float32): (jnp.uint32, 0x4B000000, 8388608.0)}

# The same on a CUDA GPU in PTX, four bytes a register: byte permutes spread the bytes over
# 16-bit lanes ({shifts}: by 4 for the high nibbles), one lop3 a lane pair ors a nibble into MAGIC
# ((a & b) | c: 0xEA), one packed fma subtracts BIAS: 3 instructions a pair of low codes, 4 a
# pair of high ones (a shift first), where Triton's lowering of `nibbles`' jnp takes 4-6 a code.
# {magic}, {one}, {neg_bias}: 16-bit patterns in both lanes; {t}: f16x2 or bf16x2. Low and high
# nibbles come from two calls (JAX's Triton lowering takes one result an inline asm).
_NIBBLES_PTX = """{{
.reg .b32 p0, p1, mask, magic, one, neg;
mov.b32 mask, 0x000F000F;
mov.b32 magic, {magic};
mov.b32 one, {one};
mov.b32 neg, {neg_bias};
prmt.b32 p0, $2, 0, 0x5140;
prmt.b32 p1, $2, 0, 0x7362;
{shifts}lop3.b32 $0, p0, mask, magic, 0xEA;
lop3.b32 $1, p1, mask, magic, 0xEA;
fma.rn.{t} $0, $0, one, neg;
fma.rn.{t} $1, $1, one, neg;
}}"""
PTX_CONSTANTS = {jnp.dtype(jnp.bfloat16): dict(magic="0x43004300", one="0x3F803F80",
                                                neg_bias="0xC300C300", t="bf16x2"),
                  jnp.dtype(jnp.float16): dict(magic="0x64006400", one="0x3C003C00",
                                               neg_bias="0xE400E400", t="f16x2")}


def nibbles(packed, dtype, native_gpu: bool = False):
  """uint8 [n, w] -> (low, high) codes [n, w] in `dtype` (exact). native_gpu: a Triton kernel
  compiled for CUDA, where 16-bit floats come by `_NIBBLES_PTX`."""
  dtype = jnp.dtype(dtype)
  if native_gpu and dtype in PTX_CONSTANTS:
    from jax.experimental.pallas import triton as pltriton
    out = jax.ShapeDtypeStruct(packed.shape, dtype)
    return tuple(pltriton.elementwise_inline_asm(
        _NIBBLES_PTX.format(shifts=shifts, **PTX_CONSTANTS[dtype]), args=[packed],
        constraints="=r,=r,r", pack=4, result_shape_dtypes=[out])[0]
        for shifts in ("", "shr.b32 p0, p0, 4;\nshr.b32 p1, p1, 4;\n"))
  uint, magic, bias = _MAGIC[dtype]
  wide = packed.astype(uint)
  def as_float(bits):
    return lax.bitcast_convert_type(bits | uint(magic), dtype) - jnp.asarray(bias, dtype)
  return as_float(wide & uint(15)), as_float(wide >> uint(4))
