"""The chunk loop of prefill, below the one router (`generation.prefill`) that checks prompts and
picks the road: token rows in, a cache and each row's last logits out.

Prompts are left-aligned (every sequence starts at position 0) and consumed in fixed-size chunks;
one jitted chunk step serves all chunks (its start is traced). After the last chunk a method that
`ends_prefill` rewrites each layer's state once (SnapKV compresses there).
"""

from __future__ import annotations

import collections
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jax_longctx.ops.cache import Cache
from jax_longctx.core.config import LlamaConfig
from jax_longctx.methods.base import Method, PrefillEnd
from jax_longctx.model import forward
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.core.progress import progress
from jax_longctx.run import sharding

_PROGRESS_CHUNKS = 16  # prompts of this many chunks or more show a progress bar


def default_chunk() -> int:
  """Prefill chunk when neither the caller nor the method names one.

  8192 on GPUs: measured on an H200 (8B shape, batch 1, BENCHMARKS.md), prefill at 32K / 128K ran
  1.10x / 1.04x transformers' speed at 4096, 1.11x / 1.05x at 8192 and 1.12x / 1.05x at 16384,
  with the same peak memory (the cache and weights dominate it); 8192 keeps most of the gain at
  half of 16384's activations. 512 elsewhere: on CPU the jnp attention holds chunk x cache score
  blocks, and TPU chunk sizes are not measured. The platform is the kernels' (`pallas_kernels.
  platform()`), which `pallas_kernels.lowering_for` overrides while exporting for another one.
  """
  return 8192 if pallas_kernels.platform() == "gpu" else 512


@functools.partial(jax.jit, static_argnames=("cfg", "method", "options"),
                   donate_argnames=("cache", "last"))
def prefill_step(params, tokens, start, prompt_lengths, cache: Cache, last, *, cfg: LlamaConfig,
                 method: Method, options: RunOptions = DEFAULT):
  """One prompt chunk [B, C] at positions start..start+C-1; keeps each row's last-token logits.
  On a mesh, every device's part of it (run/sharding.py)."""

  def body(params, tokens, start, prompt_lengths, cache, last):
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    valid = positions < prompt_lengths[:, None]
    idx = jnp.clip(prompt_lengths - 1 - start, 0, c - 1)
    logits, cache = forward(params, tokens, positions, cache, method, cfg, valid=valid,
                            logits_index=idx, options=options)
    ends_here = (prompt_lengths - 1 >= start) & (prompt_lengths - 1 < start + c)
    return cache, jnp.where(ends_here[:, None], logits, last)

  cache_spec = sharding.cache_specs(cache, options.mesh) if options.mesh is not None else None
  run = sharding.per_device(body, options, (sharding.params(params), P("data"), sharding.ALL,
                                            P("data"), cache_spec, P("data")),
                            (cache_spec, P("data")))
  return run(params, tokens, start, prompt_lengths, cache, last)


def padded(rows: Sequence[Sequence[int]], width: int) -> jnp.ndarray:
  """Token rows, left-aligned and zero-padded to [B, width] int32."""
  out = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return jnp.asarray(out)


def chunk_for(method: Method, options: RunOptions, longest: int) -> int:
  """The prefill chunk: the method's own, else the run's, else `default_chunk()`; a short prompt
  is not padded up to the default chunk but rounded up to a multiple of 512."""
  return (method.prefill_chunk or options.prefill_chunk
          or min(default_chunk(), -(-longest // 512) * 512))


def read_chunks(params, cfg: LlamaConfig, method: Method, cache: Cache, rows, lengths, chunk: int,
                options: RunOptions = DEFAULT, before_chunk=None, on_chunk=None,
                desc: str = "prefill"):
  """Rows (token id lists, checked by the caller) into `cache`, `chunk` tokens a step.
  before_chunk(cache) -> cache runs before each step (CItruS' instruction passes); on_chunk(i,
  n, last) after chunk i of n is dispatched (benchmarks time chunks through it). A progress bar
  on stderr (`desc`) for prompts of many chunks. Returns (cache, last-token logits [B, V])."""
  n_chunks = -(-max(lengths) // chunk)
  tokens = padded(rows, n_chunks * chunk)
  last = jnp.zeros((len(rows), cfg.vocab_size), jnp.float32)
  plen = jnp.asarray(lengths, jnp.int32)
  if options.mesh is not None:  # laid out as the step lays out its outputs: one compile
    tokens, last, plen = (sharding.on_mesh(x, options.mesh, P("data")) for x in (tokens, last, plen))
  chunks = range(n_chunks) if n_chunks < _PROGRESS_CHUNKS else progress(range(n_chunks), desc=desc)
  for c in chunks:
    if before_chunk is not None:
      cache = before_chunk(cache)
    cache, last = prefill_step(params, tokens[:, c * chunk:(c + 1) * chunk], jnp.int32(c * chunk),
                               plen, cache, last, cfg=cfg, method=method, options=options)
    if on_chunk is not None:
      on_chunk(c, n_chunks, last)
  return cache, last


def end_prefill(cache: Cache, cfg: LlamaConfig, method: Method, decode_room: int,
                options: RunOptions = DEFAULT) -> Cache:
  """The method's end-of-prefill hook on every layer, if it `ends_prefill`.

  The prompt cache is donated leaf by leaf where the result has a buffer of its shape to reuse
  (RefreshKV keeps its full cache as it is: donating it avoids a second copy). Leaves the hook
  turns into something smaller (SnapKV's compression) are not donated: no output could reuse
  them, and XLA would only warn that it cannot. On a mesh the pairing is per device.
  """
  if not method.ends_prefill:
    return cache
  leaves, tree = jax.tree.flatten(cache)
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
  roles = None
  if options.mesh is not None:  # how the hook's new state splits
    roles = sharding.end_roles(method, jax.tree.unflatten(tree, avals), cfg, decode_room, options)
  reuse = _reusable_leaves(tree, avals, cfg, method, decode_room, options, roles)
  return finish_prefill([x for x, r in zip(leaves, reuse) if r],
                        [x for x, r in zip(leaves, reuse) if not r],
                        tree=tree, reuse=reuse, cfg=cfg, method=method, decode_room=decode_room,
                        options=options, roles=roles)


def _end_of_prefill_all(cache: Cache, cfg: LlamaConfig, method: Method, decode_room: int,
                        options: RunOptions, roles) -> Cache:
  local, heads = sharding.local_config(cfg, options), sharding.heads_of(cfg, options)
  state = tuple(
      method.end_of_prefill(s, PrefillEnd(local, i, cache.lengths, decode_room, options, heads))
      for i, s in enumerate(cache.state))
  return cache.replace(state=state, roles=roles)


@functools.lru_cache(maxsize=64)
def _reusable_leaves(tree, avals, cfg, method, decode_room, options, roles) -> tuple[bool, ...]:
  """Which input leaves an output of the same shape and dtype can take over (as XLA pairs
  donated buffers with outputs: on a mesh, each device's)."""
  cache = jax.tree.unflatten(tree, avals)
  mesh = options.mesh
  if mesh is not None:
    cache = sharding.local_avals(cache, sharding.cache_specs(cache, mesh), mesh)
  out = sharding.eval_local(
      lambda c: _end_of_prefill_all(c, cfg, method, decode_room, options, roles), mesh, cache)
  free = collections.Counter((x.shape, x.dtype) for x in jax.tree.leaves(out))
  reuse = []
  for x in jax.tree.leaves(cache):
    reuse.append(free[(x.shape, x.dtype)] > 0)
    free[(x.shape, x.dtype)] -= reuse[-1]
  return tuple(reuse)


@functools.partial(jax.jit, static_argnames=("tree", "reuse", "cfg", "method", "decode_room",
                                             "options", "roles"), donate_argnames=("donated",))
def finish_prefill(donated, kept, *, tree, reuse, cfg: LlamaConfig, method: Method,
                   decode_room: int, options: RunOptions = DEFAULT, roles=None) -> Cache:
  """Runs the method's end-of-prefill hook on every layer (SnapKV's one-time compression) on the
  cache flattened into donated and kept leaves (`reuse` says which is which); roles: how its
  new state splits on `options.mesh`."""

  def body(donated, kept):
    donated, kept = iter(donated), iter(kept)
    leaves = [next(donated) if r else next(kept) for r in reuse]
    return _end_of_prefill_all(jax.tree.unflatten(tree, leaves), cfg, method, decode_room,
                               options, roles)

  if options.mesh is None:
    return body(donated, kept)
  mesh = options.mesh
  cache = jax.tree.unflatten(tree, [*donated, *kept])  # structure only: the leaves' order is moot
  specs = jax.tree.leaves(sharding.cache_specs(cache, mesh), is_leaf=lambda x: isinstance(x, P))
  in_specs = ([s for s, r in zip(specs, reuse) if r], [s for s, r in zip(specs, reuse) if not r])
  out = sharding.eval_local(body, mesh, *sharding.local_avals((donated, kept), in_specs, mesh))
  return sharding.per_device(body, options, in_specs, sharding.cache_specs(out, mesh))(donated,
                                                                                       kept)
