"""A decode step's KV-cache write, one token per sequence, as one in-place kernel for K and V (GPU).

`KVCache.write` stores through a scatter with mode="drop" (positions outside the cache are not
written). For a one-token step XLA compiles it, per layer, into four small kernels (a select or
concatenate and a dynamic-update-slice for each of K and V, ~1.1-1.5 us each on an H200 at batch
1: benchmarks/decode_profile.py). Here one program per (sequence, kv head) stores that row of K
and of V at the sequence's own position, into the caches themselves (input_output_aliases), and
stores nothing where the position is out of range. Other backends run the reference (a scatter).

A quantized cache (quant.Quantized) gets the new rows quantized (one scale per row, a row
alone) by the same kernel (quant.kernel_quantize), which writes values and scales, four buffers
in place: the jnp quantization it replaces was four more XLA kernels a layer (~0.16 ms of the 8B's
step on an H200; BENCHMARKS.md "int8 decode: the row quantizations in the kernels"). A buffer
holding a key offset (key smoothing) has its rows quantized by jnp first, less the offset.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as backend_lib
from pallas_kernels import gpu, layout, quant
from pallas_kernels.route import Route

SQ = gpu.SQ


def reference(k_cache, v_cache, positions, k_new, v_new):
  """k/v_cache [B, KV, T, d]; positions [B]; k/v_new [B, KV, d] -> caches with slot positions[b]
  of sequence b set to its row (out of range: dropped; negative ones count from the end, as
  jnp indexing does, down to -T). Quantized caches get the rows quantized, scales set alike."""
  b_idx = jnp.arange(positions.shape[0])
  put = lambda cache, new: cache.at[b_idx, :, positions].set(new, mode="drop")  # noqa: E731
  return tuple(quant.per_row(put, cache, quant.store_like(new, cache, heads_axis=1))
               for cache, new in ((k_cache, k_new), (v_cache, v_new)))


def write_one_token(k_cache, v_cache, positions, k_new, v_new, *, route: Route):
  """As `reference`; on GPU (`route.cache_write_backend`) one in-place kernel (the caches are
  updated where they lie when the caller's buffers can be reused, as inside a jitted step whose
  old cache is dead); with no cache-write backend, or a cache of 2^31 elements or more (which the
  Triton kernel cannot index: gpu.triton_indexable), the reference."""
  b, kvh, _, d = k_cache.shape
  quantized = layout.check_kv(k_cache, v_cache)
  if k_new.shape != (b, kvh, d) or v_new.shape != k_new.shape or positions.shape != (b,):
    raise ValueError(f"k_new {k_new.shape} / v_new {v_new.shape} must be [B, KV, d] = "
                     f"{(b, kvh, d)} and positions {positions.shape} [B]")
  variant = backend_lib.resolve(route.cache_write_backend or "reference")
  if variant.kind != "gpu" or not gpu.triton_indexable(k_cache, v_cache):
    return reference(k_cache, v_cache, positions, k_new, v_new)
  pos = positions.astype(jnp.int32).reshape(b, 1)
  if quantized and k_cache.offset is None and v_cache.offset is None:
    # the rows as they come; values and scales [B, KV, T, 1] of the caches written as quantized
    out = _write(pos, (k_new, v_new),
                 (k_cache.values, v_cache.values, k_cache.scale, v_cache.scale),
                 interpret=variant.interpret_arg(), quantize=True)
    return tuple(dataclasses.replace(cache, values=x, scale=s)
                 for cache, x, s in ((k_cache, out[0], out[2]), (v_cache, out[1], out[3])))
  kn, vn = (quant.store_like(x, cache, heads_axis=1) for x, cache in ((k_new, k_cache),
                                                                       (v_new, v_cache)))
  if not quantized:
    return _write(pos, (kn, vn), (k_cache, v_cache), interpret=variant.interpret_arg())
  # scales: rows [B, KV, 1] and caches [B, KV, T, 1], written as the values (the same kernel)
  out = _write(pos, (kn.values, vn.values, kn.scale, vn.scale),
               (k_cache.values, v_cache.values, k_cache.scale, v_cache.scale),
               interpret=variant.interpret_arg())
  return tuple(dataclasses.replace(cache, values=x, scale=s)  # any key offset stays
               for cache, x, s in ((k_cache, out[0], out[2]), (v_cache, out[1], out[3])))


def _kernel(pos_ref, *refs, quantize: bool):
  """refs: the rows, the caches as inputs (aliased to the outputs: nothing is read), the caches;
  quantize: two float rows (K, V) into four caches (their values, then their scales)."""
  n = (len(refs) - 2) // 2 if quantize else len(refs) // 3
  rows, caches = refs[:len(refs) - 2 * n], refs[len(refs) - n:]
  t = caches[0].shape[0]
  pos = pos_ref[0]
  pos = jnp.where(pos < 0, pos + t, pos)  # as the scatter's index normalization

  @pl.when((pos >= 0) & (pos < t))
  def _():
    if quantize:
      for row, values, scales in zip(rows, caches[:2], caches[2:]):
        x, scale = quant.kernel_quantize(row[...][None].astype(jnp.float32), values.dtype)
        values[pl.ds(pos, 1), :] = x
        scales[pl.ds(pos, 1), :] = scale
      return
    for row, cache in zip(rows, caches):
      cache[pl.ds(pos, 1), :] = row[...][None]


@functools.partial(jax.jit, static_argnames=("interpret", "quantize"))
def _write(positions, rows, caches, *, interpret, quantize: bool = False):
  """rows[i] [B, KV, w] into caches[i] [B, KV, T, w] (K, V; with their scales as w = 1);
  quantize: rows (K, V) [B, KV, d] in a float dtype into caches (K values, V values, K scales,
  V scales), quantized as quant.quantize does."""
  b, kvh, t, _ = caches[0].shape
  cache = [gpu.whole_keys_spec("BHTD", t, x.shape[-1], kvh) for x in caches]
  row = [pl.BlockSpec((SQ, SQ, x.shape[-1]), lambda bh: (bh // kvh, bh % kvh, 0)) for x in rows]
  n = len(caches)
  return gpu.pallas_call(
      functools.partial(_kernel, quantize=quantize), interpret, num_warps=1, num_stages=1,
      grid=(b * kvh,),
      in_specs=[gpu.per_batch_spec(kvh, 1), *row, *cache],
      out_specs=cache,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in caches],
      input_output_aliases={1 + len(rows) + i: i for i in range(n)},
  )(positions, *rows, *caches)
