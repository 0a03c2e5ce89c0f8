"""Split-K matrix-vector product x [N, K] @ w [K, F] for one-token decode steps (GPU).

At batch-1 decode every projection is a read of its weight; XLA's Triton GEMMs for the two narrow
ones read it slowly (H200, 8B shape: q/k/v [4096, 6144] at 80%, o [4096, 4096] at 75% of the copy
rate; gate/up and down at 95-100%; benchmarks/decode_profile.py). Here program (j, s) of the grid
(F // block_f, splits) streams the weight tile w[s*Ks:(s+1)*Ks, j*block_f:(j+1)*block_f] in
block_k-row chunks (an in-kernel loop the Triton pipeliner keeps num_stages loads ahead on) and
writes its fp32 partial [N, block_f]; jnp sums the splits and casts (one small XLA reduction).

Two forms of the partial product (GemvConfig.dot):
- multiply + sum (default): x's column times the [block_k, block_f] tile, summed over K on the CUDA
  cores, one x row at a time. Nothing is padded; the tile stays in registers.
- dot: a tensor-core dot of x padded to 16 rows (Triton's smallest dot; N = 1 is broadcast in the
  kernel, larger N padded by jnp) with the tile. 15/16 of the MMA work is padding and the tile
  goes through the dot operand layout, so it is expected to be no faster for a weight read;
  it is in SWEEP to be measured.
Other backends, and shapes that do not tile, run the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu

SQ = gpu.SQ
MAX_ROWS = 16
DOT_ROWS = 16  # Triton's dot needs M >= 16


@dataclasses.dataclass(frozen=True)
class GemvConfig:
  """block_f: output columns per program; splits: programs along K; block_k: weight rows per
  loop step; num_warps, num_stages: Triton launch options; dot: the tensor-core form."""
  block_f: int
  splits: int
  block_k: int
  num_warps: int
  num_stages: int
  dot: bool = False


# 8B shape: q/k/v (F 6144) 48 x 8 = 384 programs, o (F 4096) 256: about 2-3 per SM of 132;
# each reads 512 weight rows in 4 chunks of 32 KB.
DEFAULT = GemvConfig(block_f=128, splits=8, block_k=128, num_warps=4, num_stages=3)

# Worth timing on the H200 (benchmarks/gemv.py).
SWEEP = (
    DEFAULT,
    GemvConfig(128, 4, 128, 4, 3),
    GemvConfig(128, 16, 64, 4, 3),
    GemvConfig(128, 8, 64, 4, 4),
    GemvConfig(128, 8, 256, 8, 2),
    GemvConfig(128, 8, 128, 8, 3),
    GemvConfig(64, 8, 128, 4, 3),
    GemvConfig(64, 4, 256, 4, 3),
    GemvConfig(256, 8, 64, 8, 3),
    GemvConfig(256, 16, 64, 8, 2),
    GemvConfig(128, 8, 128, 4, 1),
    GemvConfig(128, 8, 128, 4, 3, dot=True),
    GemvConfig(64, 8, 128, 4, 3, dot=True),
)


def reference(x, w):
  """x [N, K] @ w [K, F] -> [N, F] in x's dtype, accumulated in fp32."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def tiles(k: int, f: int, config: GemvConfig) -> bool:
  """Whether the kernel takes [K, F] with config: whole tiles only (no masked loads or stores, so
  a ragged edge runs the reference rather than a slower kernel), power-of-two tiles (Triton)."""
  c = config
  pow2 = all(v > 0 and v & (v - 1) == 0 for v in (c.block_f, c.block_k))
  return pow2 and f % c.block_f == 0 and k % (c.splits * c.block_k) == 0


def gemv(x, w, *, backend: str = "auto", config: GemvConfig | None = None):
  """As `reference`; on GPU (N <= 16 rows, shapes that tile) the split-K kernel."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or x.dtype != w.dtype:
    raise ValueError(f"x {x.shape} {x.dtype} and w {w.shape} {w.dtype} must be [N, K] and "
                     "[K, F] of one dtype")
  config = config or DEFAULT
  variant = backend_lib.resolve(backend)
  (n, k), f = x.shape, w.shape[1]
  if variant.kind != "gpu" or n > MAX_ROWS or not tiles(k, f, config):
    return reference(x, w)
  return _call(x, w, config=config, interpret=variant.interpret_arg())


def _sum_kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int):
  """x_ref [Ks, Np] (x transposed), w_ref [Ks, block_f], out_ref [Np, block_f] fp32."""
  rows = x_ref.shape[1]

  def step(i, accs):
    kk = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    wt = w_ref[kk, :].astype(jnp.float32)
    return tuple(acc + jnp.sum(x_ref[kk, pl.ds(r, 1)].astype(jnp.float32) * wt, axis=0,
                               keepdims=True) for r, acc in enumerate(accs))

  init = tuple(jnp.zeros((1, w_ref.shape[1]), jnp.float32) for _ in range(rows))
  for r, acc in enumerate(lax.fori_loop(0, steps, step, init)):
    out_ref[pl.ds(r, 1), :] = acc


def _dot_kernel(x_ref, w_ref, out_ref, *, block_k: int, steps: int):
  """x_ref [Np, Ks] (Np 1 or 16), w_ref [Ks, block_f], out_ref [Np, block_f] fp32."""
  rows = x_ref.shape[0]

  def step(i, acc):
    kk = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
    xt = x_ref[:, kk]
    if rows < DOT_ROWS:  # one row: the same row in all 16
      xt = jnp.broadcast_to(xt, (DOT_ROWS, block_k))
    return acc + lax.dot_general(xt, w_ref[kk, :], (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, steps, step, jnp.zeros((DOT_ROWS, w_ref.shape[1]), jnp.float32))
  if rows < DOT_ROWS:  # row 0 exactly (the others are copies): a sum of it and zeros
    first = lax.broadcasted_iota(jnp.int32, acc.shape, 0) == 0
    acc = jnp.sum(jnp.where(first, acc, 0.0), axis=0, keepdims=True)
  out_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _call(x, w, *, config, interpret):
  (n, k), f = x.shape, w.shape[1]
  c = config
  ks = k // c.splits
  if c.dot:
    rows = 1 if n == 1 else DOT_ROWS
    xin = jnp.pad(x, ((0, rows - n), (0, 0)))
    kernel, x_spec = _dot_kernel, pl.BlockSpec((rows, ks), lambda j, s: (0, s))
  else:  # Triton tiles are powers of two: rows padded to one; x transposed (free for N = 1)
    rows = 1 << (n - 1).bit_length()
    xin = jnp.pad(x, ((0, rows - n), (0, 0))).T
    kernel, x_spec = _sum_kernel, pl.BlockSpec((ks, rows), lambda j, s: (s, 0))
  parts = gpu.pallas_call(
      functools.partial(kernel, block_k=c.block_k, steps=ks // c.block_k), interpret,
      num_warps=c.num_warps, num_stages=c.num_stages, grid=(f // c.block_f, c.splits),
      in_specs=[x_spec, pl.BlockSpec((ks, c.block_f), lambda j, s: (s, j))],
      out_specs=pl.BlockSpec((SQ, rows, c.block_f), lambda j, s: (s, 0, j)),
      out_shape=jax.ShapeDtypeStruct((c.splits, rows, f), jnp.float32))(xin, w)
  return jnp.sum(parts, axis=0)[:n].astype(x.dtype)
