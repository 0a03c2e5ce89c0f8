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

import pallas_kernels
from jax_longctx.ops.cache import Cache
from jax_longctx.core.config import LlamaConfig
from jax_longctx.methods.base import Method, PrefillEnd
from jax_longctx.model import device_view, forward
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.core.progress import progress
from jax_longctx.core.axes import ROWS
from jax_longctx.run.sharding import mesh_step

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


@mesh_step(inputs={"params": "params", "tokens": (ROWS,), "start": (), "prompt_lengths": (ROWS,),
                   "cache": "cache", "last": (ROWS,)},
           outputs=("same", (ROWS,)), donate=("cache", "last"))
def prefill_step(params, tokens, start, prompt_lengths, cache: Cache, last, *, cfg: LlamaConfig,
                 method: Method, options: RunOptions = DEFAULT):
  """One prompt chunk [B, C] at positions start..start+C-1; keeps each row's last-token logits."""
  b, c = tokens.shape
  positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
  valid = positions < prompt_lengths[:, None]
  idx = jnp.clip(prompt_lengths - 1 - start, 0, c - 1)
  logits, cache = forward(params, tokens, positions, cache, method, cfg, valid=valid,
                          logits_index=idx, options=options)
  ends_here = (prompt_lengths - 1 >= start) & (prompt_lengths - 1 < start + c)
  return cache, jnp.where(ends_here[:, None], logits, last)


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
  n, last, cache) after chunk i of n is dispatched (benchmarks time chunks through it;
  `DecodeAhead`). A progress bar on stderr (`desc`) for prompts of many chunks. Returns (cache,
  last-token logits [B, V])."""
  n_chunks = -(-max(lengths) // chunk)
  tokens = padded(rows, n_chunks * chunk)
  last = jnp.zeros((len(rows), cfg.vocab_size), jnp.float32)
  plen = jnp.asarray(lengths, jnp.int32)
  chunks = range(n_chunks) if n_chunks < _PROGRESS_CHUNKS else progress(range(n_chunks), desc=desc)
  for c in chunks:
    if before_chunk is not None:
      cache = before_chunk(cache)
    cache, last = prefill_step(params, tokens[:, c * chunk:(c + 1) * chunk], jnp.int32(c * chunk),
                               plen, cache, last, cfg=cfg, method=method, options=options)
    if on_chunk is not None:
      on_chunk(c, n_chunks, last, cache)
  return cache, last


def end_prefill(cache: Cache, cfg: LlamaConfig, method: Method, decode_room: int,
                options: RunOptions = DEFAULT) -> Cache:
  """The method's end-of-prefill hook on every layer, if it `ends_prefill`.

  The prompt cache is donated leaf by leaf where the result has a buffer of its shape to reuse
  (RefreshKV keeps its full cache as it is: donating it avoids a second copy). Leaves the hook
  turns into something smaller (SnapKV's compression) are not donated: no output could reuse
  them, and XLA would only warn that it cannot. On a mesh the pairing is per device: an input
  and an output leaf pair when their shapes, dtypes and layouts are the same.
  """
  if not method.ends_prefill:
    return cache
  kw = dict(cfg=cfg, method=method, decode_room=decode_room, options=options)
  reuse = _reusable(jax.tree.map(_aval, cache), **kw)
  donated = jax.tree.map(lambda x, r: x if r else None, cache, reuse)
  kept = jax.tree.map(lambda x, r: None if r else x, cache, reuse)
  return finish_prefill(donated, kept, **kw)


def _aval(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def _layout(x):
  sharding = getattr(x, "sharding", None)
  return getattr(sharding, "spec", None)


@functools.lru_cache(maxsize=64)
def _reusable_tree(leaves: tuple, tree, **kw):
  cache = jax.tree.unflatten(tree, leaves)
  out = jax.eval_shape(lambda c: finish_prefill(_nones(c), c, **kw), cache)
  free = collections.Counter((x.shape, x.dtype, _layout(x)) for x in jax.tree.leaves(out))
  reuse = []
  for x in leaves:
    key = (x.shape, x.dtype, _layout(x))
    reuse.append(free[key] > 0)
    free[key] -= reuse[-1]
  return jax.tree.unflatten(tree, reuse)


def _reusable(avals, **kw):
  """Which leaves of a cache an output of the hook can take over (a tree of bools)."""
  leaves, tree = jax.tree.flatten(avals)
  return _reusable_tree(tuple(leaves), tree, **kw)


def _nones(tree):
  return jax.tree.map(lambda _: None, tree)


@mesh_step(inputs={"donated": "cache", "kept": "cache"}, outputs="cache", donate=("donated",),
           static=("cfg", "method", "decode_room", "options"))
def finish_prefill(donated, kept, *, cfg: LlamaConfig, method: Method, decode_room: int,
                   options: RunOptions = DEFAULT) -> Cache:
  """The method's end-of-prefill hook on every layer (SnapKV's one-time compression) over a
  cache given as two trees, the leaves to donate and the others (None in each where the other
  has the leaf)."""
  cache = jax.tree.map(lambda a, b: b if a is None else a, donated, kept,
                       is_leaf=lambda x: x is None)
  local, heads, tokens = device_view(cfg, options)
  state = tuple(method.end_of_prefill(s, PrefillEnd(local, i, cache.lengths, decode_room, options,
                                                    heads, tokens))
                for i, s in enumerate(cache.state))
  return cache.replace(state=state)
