"""Helpers shared by the TPU kernels: the grid semantics, integer division of grid indices and
the attention kernels' call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def div(x, n: int):
  """x // n for a non-negative traced int32 x (grid indices, positions) and n > 0.

  `//` on a traced int adds a sign correction (floor vs truncation) whose Mosaic lowering asks
  the local TPU for its generation: it cannot lower without a TPU (export on CPU) and is extra
  work on one. For x >= 0 truncating division is floor division.
  """
  return lax.div(x, n)


def check_kv_dtype(k):
  """The TPU kernels read int8 K/V but not FP8 (TPU v5e has no FP8 arithmetic or conversion)."""
  if getattr(k, "dtype", None) == jnp.float8_e4m3fn and hasattr(k, "scale"):
    raise ValueError("float8_e4m3fn K/V on a TPU: TPU v5e has no FP8; store the KV cache in int8")


def scale_rows(*scales):
  """Quantization scales [B, KV, T] -> rows [B, KV, 1, T] (keys along lanes: a tile's scales
  multiply its score columns), or the Nones of unquantized K/V."""
  return tuple(None if s is None else s[:, :, None, :] for s in scales)


def column(row):
  """A row [1, n] as a column [n, 1] by a masked lane sum (exact: one nonzero term per lane
  row), with no transpose of a one-row array for Mosaic to lay out."""
  n = row.shape[1]
  iota = lambda axis: lax.broadcasted_iota(jnp.int32, (n, n), axis)  # noqa: E731
  return jnp.sum(jnp.where(iota(0) == iota(1), row, 0.0), axis=1, keepdims=True)


def batch_head(bh, kvh: int):
  """(batch, kv head) of the first grid axis, which runs over batch x kv heads."""
  return div(bh, kvh), lax.rem(bh, kvh)


def compiler_params():
  """(batch x kv head, row block) are independent; the key axis carries state: sequential."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def softmax_scratch(bm: int, d: int):
  """VMEM for the online-softmax state (running max, sum, accumulator) of bm rows."""
  from jax.experimental.pallas import tpu as pltpu
  return [pltpu.VMEM((bm, 1), jnp.float32), pltpu.VMEM((bm, 1), jnp.float32),
          pltpu.VMEM((bm, d), jnp.float32)]


def attention_call(kernel, grid_spec, out_rows_shape, interpret, name: str | None = None):
  """pallas_call of an attention kernel writing (out fp32 [..., d], lse fp32 [..., 1]) per row;
  name: the kernel's in the lowered module (else its function's)."""
  *lead, d = out_rows_shape
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, interpret=interpret, compiler_params=compiler_params(),
      name=name,
      out_shape=[jax.ShapeDtypeStruct((*lead, d), jnp.float32),
                 jax.ShapeDtypeStruct((*lead, 1), jnp.float32)])
