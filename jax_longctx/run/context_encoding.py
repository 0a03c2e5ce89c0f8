"""Prefill of a method that `encodes_context` (Star Attention, ring attention): a branch of the one
prefill road (`generation.prefill` routes such a method here).

The context is cut into rows of blocks (`Method.context_layout`), the rows are split over the
mesh's `ctx` axis (several per device when there are more blocks than devices) and over `data`,
and one forward per device runs them with the method's row encoder (`Method.context_encoder`),
whose per-layer state is that layer's context KV; the step returns the cache the method answers
from (its context blocks and an empty local cache for the query and the answer). The query
(the instruction) is then appended with the method's own step (`instructed.encode_appended`), and
decoding is the one decode loop's.

Rows (numpy, [B, n_blocks, width]): valid tokens come first in every row and their positions
increase, so causal attention by row index is causal attention by position. Block 0 sits at the
front of its row (no anchor); the others follow the anchor unless it is shared.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jax_longctx.core.axes import ROWS, TOKENS
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import axis_size
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.methods.base import Method, check_cache_dtype
from jax_longctx.methods.chunk_cache import ChunkCache
from jax_longctx.methods.star import ContextKV, Layout, Phase2State, context_in_four_bits
from jax_longctx.model import device_view, forward
from jax_longctx.ops.cache import Cache, is_int4_dtype, per_row
from jax_longctx.run.chunked_prefill import padded
from jax_longctx.run.instructed import INSTRUCTION_ROUND, encode_appended
from jax_longctx.run.sharding import mesh_step

_BLOCKS = (ROWS, TOKENS)  # rows of blocks: sequences over `data`, blocks over `ctx`


def prefill_context(params, cfg: LlamaConfig, contexts: Sequence[Sequence[int]],
                    queries: Sequence[Sequence[int]], method: Method, *, decode_room: int,
                    options: RunOptions = DEFAULT):
  """(cache, the query's last-token logits [B, V]) after the context and the query; the router
  checked the rows."""
  check_cache_dtype(method, options.cache_dtype(cfg.jnp_dtype))
  lengths = np.asarray([len(c) for c in contexts], np.int32)
  lay = method.context_layout(int(lengths.max()), axis_size(options.mesh, "ctx"))
  width = -(-max(map(len, queries)) // INSTRUCTION_ROUND) * INSTRUCTION_ROUND
  context = np.zeros((len(contexts), lay.n_blocks * lay.block), np.int32)
  for i, c in enumerate(contexts):
    context[i, :len(c)] = c
  cache = encode_blocks(params, *map(jnp.asarray, _rows(context, lengths, lay)),
                        jnp.asarray(lengths), cfg=cfg, method=method, layout=lay,
                        room=width + decode_room, options=options)
  q_len = jnp.asarray([len(q) for q in queries], jnp.int32)
  return encode_appended(params, padded(queries, width), q_len, cache, cfg=cfg, method=method,
                         options=options)


def _rows(context, lengths, lay: Layout):
  """[B, n_blocks, width] tokens, positions, validity, and where each block starts in its row."""
  b = context.shape[0]
  a, blk, nb = lay.anchor, lay.block, lay.n_blocks
  tok = np.zeros((b, nb, lay.width), np.int32)
  pos = np.zeros((b, nb, lay.width), np.int32)
  ok = np.zeros((b, nb, lay.width), bool)
  offset = np.zeros((b, nb), np.int32)
  for i in range(nb):
    start, off = i * blk, (a if i and not lay.shared_anchor else 0)
    span = context[:, start:start + blk]
    offset[:, i] = off
    tok[:, i, :off] = context[:, :off]
    pos[:, i, :off] = np.arange(off)
    ok[:, i, :off] = np.arange(off)[None, :] < lengths[:, None]
    tok[:, i, off:off + span.shape[1]] = span
    pos[:, i, off:off + blk] = start + np.arange(blk)
    ok[:, i, off:off + blk] = pos[:, i, off:off + blk] < lengths[:, None]
  return tok, pos, ok, offset


@mesh_step(inputs={"params": "params", "tok": _BLOCKS, "pos": _BLOCKS, "ok": _BLOCKS,
                   "offset": _BLOCKS, "lengths": (ROWS,)}, outputs="cache",
           static=("cfg", "method", "layout", "room", "options"))
def encode_blocks(params, tok, pos, ok, offset, lengths, *, cfg: LlamaConfig, method: Method,
                  layout: Layout, room: int, options: RunOptions = DEFAULT) -> Cache:
  """This device's rows [B, r, W] -> the cache the method answers from: per layer its blocks'
  context KV [B, KV, r * block] (the anchor's dropped) and a local cache of `room` slots."""
  b, r, w = tok.shape
  flat = lambda x: x.reshape(b * r, *x.shape[2:])  # noqa: E731
  rows = Cache(jnp.zeros((b * r,), jnp.int32), (None,) * cfg.num_layers, 0)
  _, rows = forward(params, flat(tok), flat(pos), rows, method.context_encoder(layout, r), cfg,
                    valid=flat(ok), logits_index=jnp.zeros((b * r,), jnp.int32), options=options)
  def to_t(x):  # [b*r, KV, blk, d] -> [b, KV, r*blk, d] (an 8-bit buffer's scales alike)
    return per_row(lambda a: jnp.moveaxis(a.reshape(b, r, *a.shape[1:]), 1, 2).reshape(
        b, a.shape[1], r * layout.block, -1), x)

  if layout.shared_anchor:  # the rows are the blocks
    context = [ContextKV(to_t(s.k), to_t(s.v), s.pos.reshape(b, r * layout.block))
               for s in rows.state]
  else:
    idx = flat(offset)[:, None] + jnp.arange(layout.block)[None, :]  # [b*r, blk]
    take = lambda x: per_row(  # noqa: E731
        lambda a: jnp.take_along_axis(a, idx[:, None, :, None], axis=2), x)
    context = [ContextKV(to_t(take(s.k)), to_t(take(s.v)),
                         jnp.take_along_axis(s.pos, idx, axis=1).reshape(b, r * layout.block))
               for s in rows.state]  # pos -1 past the context's end
  local_cfg = device_view(cfg, options)[0]
  dtype = options.cache_dtype(cfg.jnp_dtype)
  if is_int4_dtype(dtype):  # the query's and generated tokens (a few hundred) stay whole
    context, dtype = [context_in_four_bits(c, dtype) for c in context], cfg.jnp_dtype
  state = tuple(Phase2State(c, ChunkCache.empty(local_cfg, b, room, room, dtype))
                for c in context)
  return Cache(lengths, state, 0)
