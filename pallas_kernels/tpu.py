"""Helpers shared by the TPU kernels: the grid semantics and the attention kernels' call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def compiler_params():
  """(batch x kv head, row block) are independent; the key axis carries state: sequential."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))


def softmax_scratch(bm: int, d: int):
  """VMEM for the online-softmax state (running max, sum, accumulator) of bm rows."""
  from jax.experimental.pallas import tpu as pltpu
  return [pltpu.VMEM((bm, 1), jnp.float32), pltpu.VMEM((bm, 1), jnp.float32),
          pltpu.VMEM((bm, d), jnp.float32)]


def attention_call(kernel, grid_spec, out_rows_shape, interpret):
  """pallas_call of an attention kernel writing (out fp32 [..., d], lse fp32 [..., 1]) per row."""
  *lead, d = out_rows_shape
  return pl.pallas_call(
      kernel, grid_spec=grid_spec, interpret=interpret, compiler_params=compiler_params(),
      out_shape=[jax.ShapeDtypeStruct((*lead, d), jnp.float32),
                 jax.ShapeDtypeStruct((*lead, 1), jnp.float32)])
