"""Residual add and the RMSNorm that follows it in one kernel, for decode steps (GPU).

At batch-1 decode XLA runs a layer's `x = x + h` and the next norm's reduction and multiply as
separate ~1.3-1.6 us kernels on a few KB each (H200 profile, benchmarks/decode_profile.py). Here
one program per row reads x and h once and writes x + h and the normed row. Other backends run
the reference, the formula of model.RMSNorm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu
from pallas_kernels.route import Route


def reference(x, h, scale, eps: float):
  """x, h [N, D]; scale [D] -> (s = x + h in x's dtype, y = scale * (s * r)) with r = 1 / rms(s)
  in fp32 and the product rounded to s's dtype before the scale (model.RMSNorm)."""
  s = x + h
  sf = s.astype(jnp.float32)
  r = lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)
  return s, scale * (sf * r).astype(s.dtype)


def supported(d: int) -> bool:
  """Whether the GPU kernel takes rows of d (one Triton tile: a power of two)."""
  return d >= 16 and d & (d - 1) == 0


def add_rms_norm(x, h, scale, *, eps: float, route: Route):
  """As `reference`; on GPU (`route.add_norm_backend`; rows of a power-of-two width) one kernel;
  with no add+norm backend, the reference."""
  if x.ndim != 2 or h.shape != x.shape or scale.shape != x.shape[1:]:
    raise ValueError(f"x {x.shape}, h {h.shape} must be [N, D] and scale {scale.shape} [D]")
  variant = backend_lib.resolve(route.add_norm_backend or "reference")
  if (variant.kind != "gpu" or not supported(x.shape[1]) or h.dtype != x.dtype
      or scale.dtype != x.dtype):  # mixed dtypes: jnp's promotion rules
    return reference(x, h, scale, eps)
  return _call(x, h, scale, eps=float(eps), interpret=variant.interpret_arg())


def _kernel(x_ref, h_ref, scale_ref, s_ref, y_ref, *, eps: float):
  s = x_ref[...] + h_ref[...]  # [1, D] in x's dtype, as the unfused add rounds it
  sf = s.astype(jnp.float32)
  r = lax.rsqrt(jnp.sum(sf * sf, axis=1, keepdims=True) / sf.shape[1] + eps)  # [1, 1]
  s_ref[...] = s
  y_ref[...] = scale_ref[...] * (sf * r).astype(s.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _call(x, h, scale, *, eps, interpret):
  n, d = x.shape
  row = pl.BlockSpec((1, d), lambda i: (i, 0))
  return gpu.pallas_call(
      functools.partial(_kernel, eps=eps), interpret, num_warps=4, num_stages=1, grid=(n,),
      in_specs=[row, row, pl.BlockSpec((1, d), lambda i: (0, 0))], out_specs=[row, row],
      out_shape=[jax.ShapeDtypeStruct((n, d), x.dtype)] * 2)(x, h, scale.reshape(1, d))
