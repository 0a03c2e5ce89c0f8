"""One kernel that merges the key splits of split-K flash decoding and writes the result in the
query's dtype, only for real rows (GPU).

flash_attention's GPU kernel leaves per-split (out, lse) of every padded row block: [B, KV, P,
R_padded, d] fp32. Merging them with jnp (reference.merge_attention) compiles to two XLA kernels
(the max-then-exp fusion and the weighted-sum reduction), and dropping the padding rows after
(layout.from_rows) to a third; at batch-1 decode each is a ~1.3-1.9 us launch per layer for a
few KB (H200 profile, benchmarks/decode_profile.py). Here one program per (batch x kv head, real
row) reads that row's P partials once and writes its merged row; padding rows are never read.

P is allocated as a power of two (Triton tiles are powers of two); only the first `splits`
entries were written by the attention kernel, and the rest (uninitialized memory) are masked.

The Mosaic decode kernel leaves its partials rows-minor ([B, KV, P, d, R]: its output is O^T).
Read a row at a time they are strided columns of 4 bytes, which took 6.9 us a layer at the 8B's
128K step on an H200 (bf16's rows-major merge: 3.4; BENCHMARKS.md): the rows-minor merge reads
a block of channels of every row at once instead ([P, dc, R'] with R' the real rows' power of
two, R' contiguous floats a (split, channel)) and writes it transposed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, reference

SQ = gpu.SQ
NEG_INF = float("-inf")


def parts(splits: int, kernel: bool) -> int:
  """The split axis a split-K kernel allocates: a power of two for the merge kernel."""
  return layout.next_pow2(splits) if kernel else splits


def merge(outs, lses, *, splits: int, rows: int, dtype, kernel: bool, interpret,
          rows_minor: bool = False):
  """A split-K decode's partials (outs, lses as merge_splits takes them, `parts(splits,
  kernel)` of them) -> (out [B, KV, R, d], lse [B, KV, R] fp32), by merge_splits (kernel: the
  real rows, in dtype) or by jnp (every padded row, fp32: the caller drops the padding).
  rows_minor: outs [B, KV, P, d, R] and lses [B, KV, P, R] (the Mosaic decode kernel's)."""
  if rows_minor and not kernel:
    outs, lses = jnp.swapaxes(outs, 3, 4), lses[..., None]
  if kernel:
    out, lse = merge_splits(outs, lses, splits=splits, rows=rows, dtype=dtype,
                            interpret=interpret, rows_minor=rows_minor)
    return out, lse[..., 0]
  return reference.merge_attention(jnp.moveaxis(outs, 2, 0), jnp.moveaxis(lses[..., 0], 2, 0))


def merge_splits(outs, lses, *, splits: int, rows: int, dtype, interpret,
                 rows_minor: bool = False):
  """outs [B, KV, P, R_padded, d] fp32, lses [B, KV, P, R_padded, 1] (entries p >= splits are
  garbage) -> (out [B, KV, rows, d] in dtype, lse [B, KV, rows, 1] fp32; (0, -inf) for a row
  that saw no key). rows_minor: outs [B, KV, P, d, R_padded], lses [B, KV, P, R_padded] (every row's
  partials read a block of channels at a time, `_merge_columns`)."""
  if rows_minor:
    return _merge_columns(outs, lses, splits=splits, rows=rows, dtype=jnp.dtype(dtype),
                          interpret=interpret)
  return _merge(outs, lses, splits=splits, rows=rows, dtype=jnp.dtype(dtype), interpret=interpret)


def _kernel(o_ref, s_ref, out_ref, lse_ref, *, splits: int):
  p = s_ref.shape[0]
  written = lax.broadcasted_iota(jnp.int32, (p, 1), 0) < splits
  s = jnp.where(written, s_ref[...], NEG_INF)  # [P, 1]
  m = jnp.max(s, axis=0, keepdims=True)
  m_safe = jnp.where(m == NEG_INF, 0.0, m)
  w = jnp.where(written, jnp.exp(s - m_safe), 0.0)
  total = jnp.sum(w, axis=0, keepdims=True)  # [1, 1]
  # where, not w * o: a garbage entry may hold NaN, and 0 * NaN is NaN
  acc = jnp.sum(jnp.where(written, w * o_ref[...], 0.0), axis=0, keepdims=True)  # [1, d]
  seen = total > 0
  safe = jnp.where(seen, total, 1.0)
  out_ref[...] = jnp.where(seen, acc / safe, 0.0).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, m_safe + jnp.log(safe), NEG_INF)


@functools.partial(jax.jit, static_argnames=("splits", "rows", "dtype", "interpret"))
def _merge(outs, lses, *, splits, rows, dtype, interpret):
  b, kvh, p, _, d = outs.shape
  part = lambda bh, r: (bh // kvh, bh % kvh, 0, r, 0)  # noqa: E731
  row = lambda bh, r: (bh // kvh, bh % kvh, r, 0)  # noqa: E731
  return gpu.pallas_call(
      functools.partial(_kernel, splits=splits), interpret, num_warps=4, num_stages=1,
      grid=(b * kvh, rows),
      in_specs=[pl.BlockSpec((SQ, SQ, p, SQ, d), part), pl.BlockSpec((SQ, SQ, p, SQ, 1), part)],
      out_specs=[pl.BlockSpec((SQ, SQ, 1, d), row), pl.BlockSpec((SQ, SQ, 1, 1), row)],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, rows, d), dtype),
                 jax.ShapeDtypeStruct((b, kvh, rows, 1), jnp.float32)],
  )(outs, lses)


# Channels a program of the rows-minor merge: at the 8B's shape and one sequence, 8 KV heads x 8
# blocks of 16 = 64 programs, each reading [P, 16, 4] floats.
COLUMN_BLOCK = 16


def _columns_kernel(o_ref, s_ref, out_ref, lse_ref, *, splits: int):
  """One (sequence x KV head, block of channels): o [P, dc, R'], s [P, R'] -> out [R', dc] in
  out's dtype, lse [R'] (as _kernel, for every row at once)."""
  p = s_ref.shape[0]
  written = lax.broadcasted_iota(jnp.int32, (p, 1), 0) < splits
  s = jnp.where(written, s_ref[...], NEG_INF)  # [P, R']
  m = jnp.max(s, axis=0)  # [R']
  m_safe = jnp.where(m == NEG_INF, 0.0, m)
  w = jnp.where(written, jnp.exp(s - m_safe[None, :]), 0.0)
  total = jnp.sum(w, axis=0)
  # where, not w * o: a garbage entry may hold NaN, and 0 * NaN is NaN
  acc = jnp.sum(jnp.where(written[:, :, None], w[:, None, :] * o_ref[...], 0.0), axis=0)
  seen = total > 0
  safe = jnp.where(seen, total, 1.0)
  out_ref[...] = jnp.where(seen[None, :], acc / safe[None, :], 0.0).T.astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, m_safe + jnp.log(safe), NEG_INF)


@functools.partial(jax.jit, static_argnames=("splits", "rows", "dtype", "interpret"))
def _merge_columns(outs, lses, *, splits, rows, dtype, interpret):
  """merge_splits of rows-minor partials: outs [B, KV, P, d, R], lses [B, KV, P, R]."""
  b, kvh, p, d, r = outs.shape
  width = layout.next_pow2(rows)  # the real rows' block (Triton blocks: powers of two)
  assert width <= r, (rows, r)
  dc = min(COLUMN_BLOCK, d)
  at = lambda bh, c: (bh // kvh, bh % kvh)  # noqa: E731
  out, lse = gpu.pallas_call(
      functools.partial(_columns_kernel, splits=splits), interpret, num_warps=4, num_stages=1,
      grid=(b * kvh, d // dc),
      in_specs=[pl.BlockSpec((SQ, SQ, p, dc, width), lambda bh, c: (*at(bh, c), 0, c, 0)),
                pl.BlockSpec((SQ, SQ, p, width), lambda bh, c: (*at(bh, c), 0, 0))],
      # Every block of channels writes its rows' lse (the same values).
      out_specs=[pl.BlockSpec((SQ, SQ, width, dc), lambda bh, c: (*at(bh, c), 0, c)),
                 pl.BlockSpec((SQ, SQ, width), lambda bh, c: (*at(bh, c), 0))],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, width, d), dtype),
                 jax.ShapeDtypeStruct((b, kvh, width), jnp.float32)],
  )(outs, lses)
  return out[:, :, :rows], lse[:, :, :rows, None]
