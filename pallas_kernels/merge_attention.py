"""Exact merge of partial attentions over disjoint key sets through their log-sum-exps (fp32).

Star Attention, ring attention and RESA combine partial (out, lse) pairs with it. It is a
bandwidth-bound elementwise pass: one program per block of rows reads the P partials of each row
once (GPU and TPU share the body; only the call differs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu, layout, reference

NEG_INF = float("-inf")


def merge_attention(outs, lses, *, backend: str = "auto", block_rows: int = 128):
  """outs [P, ..., d], lses [P, ...] (natural log, -inf for an empty part) -> (out, lse).

  out has outs' dtype, lse is fp32; a row empty in every part gives (0, -inf).
  """
  if outs.shape[:-1] != lses.shape:
    raise ValueError(f"outs {outs.shape} must be lses {lses.shape} plus a head dim")
  variant = backend_lib.resolve(backend)
  if variant.kind == "reference":
    return reference.merge_attention(outs, lses)
  p, d = outs.shape[0], outs.shape[-1]
  rows = lses[0].size
  bm = min(block_rows, max(8, layout.next_pow2(rows)))
  padded = layout.round_up(rows, bm)
  o = jnp.pad(outs.reshape(p, rows, d), ((0, 0), (0, padded - rows), (0, 0)))
  s = jnp.pad(lses.reshape(p, rows, 1).astype(jnp.float32), ((0, 0), (0, padded - rows), (0, 0)),
              constant_values=NEG_INF)
  out, lse = _merge(o, s, bm=bm, kind=variant.kind, interpret=variant.interpret_arg())
  return out[:rows].reshape(outs.shape[1:]).astype(outs.dtype), lse[:rows, 0].reshape(lses.shape[1:])


def _kernel(o_ref, s_ref, out_ref, lse_ref):
  parts = s_ref.shape[0]
  m = s_ref[0]
  for i in range(1, parts):
    m = jnp.maximum(m, s_ref[i])
  m_safe = jnp.where(m == NEG_INF, 0.0, m)
  total = jnp.zeros_like(m)
  acc = jnp.zeros(out_ref.shape, jnp.float32)
  for i in range(parts):
    w = jnp.exp(s_ref[i] - m_safe)
    total = total + w
    acc = acc + w * o_ref[i].astype(jnp.float32)
  seen = total > 0
  safe = jnp.where(seen, total, 1.0)
  out_ref[...] = jnp.where(seen, acc / safe, 0.0)
  lse_ref[...] = jnp.where(seen, m_safe + jnp.log(safe), NEG_INF)


@functools.partial(jax.jit, static_argnames=("bm", "kind", "interpret"))
def _merge(o, s, *, bm, kind, interpret):
  p, n, d = o.shape
  kwargs = dict(
      grid=(n // bm,),
      in_specs=[pl.BlockSpec((p, bm, d), lambda r: (0, r, 0)),
                pl.BlockSpec((p, bm, 1), lambda r: (0, r, 0))],
      out_specs=[pl.BlockSpec((bm, d), lambda r: (r, 0)), pl.BlockSpec((bm, 1), lambda r: (r, 0))],
      out_shape=[jax.ShapeDtypeStruct((n, d), jnp.float32),
                 jax.ShapeDtypeStruct((n, 1), jnp.float32)])
  if kind == "gpu":
    return gpu.pallas_call(_kernel, interpret, num_warps=4, num_stages=1, **kwargs)(o, s)
  return pl.pallas_call(_kernel, interpret=interpret, **kwargs)(o, s)
