"""A decode step's KV-cache write, one token per sequence, as one in-place kernel for K and V (GPU).

`KVCache.write` stores through a scatter with mode="drop" (positions outside the cache are not
written). For a one-token step XLA compiles it, per layer, into four small kernels (a select or
concatenate and a dynamic-update-slice for each of K and V, ~1.1-1.5 us each on an H200 at batch
1: benchmarks/decode_profile.py). Here one program per (sequence, kv head) stores that row of K
and of V at the sequence's own position, into the caches themselves (input_output_aliases), and
stores nothing where the position is out of range. Other backends run the reference (a scatter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu

SQ = gpu.SQ


def reference(k_cache, v_cache, positions, k_new, v_new):
  """k/v_cache [B, KV, T, d]; positions [B]; k/v_new [B, KV, d] -> caches with slot positions[b]
  of sequence b set to its row (out of range: dropped; negative ones count from the end, as
  jnp indexing does, down to -T)."""
  b_idx = jnp.arange(positions.shape[0])
  k = k_cache.at[b_idx, :, positions].set(k_new.astype(k_cache.dtype), mode="drop")
  v = v_cache.at[b_idx, :, positions].set(v_new.astype(v_cache.dtype), mode="drop")
  return k, v


def write_one_token(k_cache, v_cache, positions, k_new, v_new, *, backend: str = "auto"):
  """As `reference`; on GPU one in-place kernel (the caches are updated where they lie when the
  caller's buffers can be reused, as inside a jitted step whose old cache is dead)."""
  b, kvh, _, d = k_cache.shape
  if k_new.shape != (b, kvh, d) or v_new.shape != k_new.shape or positions.shape != (b,):
    raise ValueError(f"k_new {k_new.shape} / v_new {v_new.shape} must be [B, KV, d] = "
                     f"{(b, kvh, d)} and positions {positions.shape} [B]")
  variant = backend_lib.resolve(backend)
  if variant.kind != "gpu":
    return reference(k_cache, v_cache, positions, k_new, v_new)
  return _write(k_cache, v_cache, positions.astype(jnp.int32).reshape(b, 1),
                k_new.astype(k_cache.dtype), v_new.astype(v_cache.dtype),
                interpret=variant.interpret_arg())


def _kernel(pos_ref, k_row_ref, v_row_ref, k_in_ref, v_in_ref, k_ref, v_ref):
  del k_in_ref, v_in_ref  # the same buffers as k_ref, v_ref (aliased); nothing is read
  t = k_ref.shape[0]
  pos = pos_ref[0]
  pos = jnp.where(pos < 0, pos + t, pos)  # as the scatter's index normalization

  @pl.when((pos >= 0) & (pos < t))
  def _():
    k_ref[pl.ds(pos, 1), :] = k_row_ref[...][None]
    v_ref[pl.ds(pos, 1), :] = v_row_ref[...][None]


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write(k_cache, v_cache, positions, k_new, v_new, *, interpret):
  b, kvh, t, d = k_cache.shape
  cache = gpu.whole_keys_spec("BHTD", t, d, kvh)
  row = pl.BlockSpec((SQ, SQ, d), lambda bh: (bh // kvh, bh % kvh, 0))
  return gpu.pallas_call(
      _kernel, interpret, num_warps=1, num_stages=1, grid=(b * kvh,),
      in_specs=[gpu.per_batch_spec(kvh, 1), row, row, cache, cache],
      out_specs=[cache, cache],
      out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
      input_output_aliases={3: 0, 4: 1},
  )(positions, k_new, v_new, k_cache, v_cache)
