"""Residual add and the RMSNorm that follows it in one kernel, for decode steps (GPU).

At batch-1 decode XLA runs a layer's `x = x + h` and the next norm's reduction (and, with the
scale not folded into the next weight, its multiply) as separate ~1.3-1.6 us kernels on a few
KB each (H200 profile, benchmarks/decode_profile.py). Here one program per row reads x and h
once and writes x + h and either the normed row or its 1 / rms (model.fold_norm_scales' layout).
Other backends run the reference, the formula of model.RMSNorm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu


def reference(x, h, scale, eps: float):
  """x, h [N, D]; scale [D] or None -> (s = x + h in x's dtype, y): y = scale * (s * r) with the
  product rounded to s's dtype before the scale (model.RMSNorm), or with scale None r = 1 / rms(s)
  fp32 [N, 1]."""
  s = x + h
  sf = s.astype(jnp.float32)
  r = lax.rsqrt(jnp.mean(sf * sf, axis=-1, keepdims=True) + eps)
  if scale is None:
    return s, r
  return s, scale * (sf * r).astype(s.dtype)


def supported(d: int) -> bool:
  """Whether the GPU kernel takes rows of d (one Triton tile: a power of two)."""
  return d >= 16 and d & (d - 1) == 0


def add_rms_norm(x, h, scale, *, eps: float, backend: str = "auto"):
  """As `reference`; on GPU (rows of a power-of-two width) one kernel."""
  if x.ndim != 2 or h.shape != x.shape or (scale is not None and scale.shape != x.shape[1:]):
    raise ValueError(f"x {x.shape}, h {h.shape} must be [N, D] and scale "
                     f"{None if scale is None else scale.shape} [D] or None")
  variant = backend_lib.resolve(backend)
  if (variant.kind != "gpu" or not supported(x.shape[1]) or h.dtype != x.dtype
      or (scale is not None and scale.dtype != x.dtype)):  # mixed dtypes: jnp's promotion rules
    return reference(x, h, scale, eps)
  return _call(x, h, scale, eps=float(eps), interpret=variant.interpret_arg())


def _kernel(*refs, eps: float, scaled: bool):
  if scaled:
    x_ref, h_ref, scale_ref, s_ref, y_ref = refs
  else:
    x_ref, h_ref, s_ref, y_ref = refs
  s = x_ref[...] + h_ref[...]  # [1, D] in x's dtype, as the unfused add rounds it
  sf = s.astype(jnp.float32)
  r = lax.rsqrt(jnp.sum(sf * sf, axis=1, keepdims=True) / sf.shape[1] + eps)  # [1, 1]
  s_ref[...] = s
  if scaled:
    y_ref[...] = scale_ref[...] * (sf * r).astype(s.dtype)
  else:
    y_ref[...] = r


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _call(x, h, scale, *, eps, interpret):
  n, d = x.shape
  row = pl.BlockSpec((1, d), lambda i: (i, 0))
  scaled = scale is not None
  in_specs = [row, row] + ([pl.BlockSpec((1, d), lambda i: (0, 0))] if scaled else [])
  y_shape = (jax.ShapeDtypeStruct((n, d), x.dtype) if scaled else
             jax.ShapeDtypeStruct((n, 1), jnp.float32))
  y_spec = row if scaled else pl.BlockSpec((1, 1), lambda i: (i, 0))
  args = (x, h) + ((scale.reshape(1, d),) if scaled else ())
  return gpu.pallas_call(
      functools.partial(_kernel, eps=eps, scaled=scaled), interpret, num_warps=4, num_stages=1,
      grid=(n,), in_specs=in_specs, out_specs=[row, y_spec],
      out_shape=[jax.ShapeDtypeStruct((n, d), x.dtype), y_shape])(*args)
