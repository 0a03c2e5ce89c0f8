"""Star Attention (Acharya et al. 2024, arXiv:2411.17116) and ring attention over a mesh axis.

Phase 1 encodes the context blockwise: block i (of `block_size` tokens) is prefixed by the
anchor (the context's first `anchor_size` tokens at positions 0..a-1), the block sits at its
global positions, and each (anchor + block) row is an ordinary causal forward; the anchor's KV is
dropped. Rows are laid out over the mesh axis (several per device when there are more blocks than
devices) and encoded in parallel under `jax.shard_map`; each device keeps its blocks' KV. By
default the anchor, identical in every row, is computed once and its KV sent to every device
(`AnchoredBlocks`): the same outputs for half the tokens per device.
`ring` encodes the context exactly instead: contiguous equal blocks, K/V passed around the ring.

Phase 2 (both): the query and every generated token run replicated on all devices; in each
layer every device attends over its local context KV (no mask: the context precedes the query)
and the query device also over the query's and generated tokens' KV (causal), and the partial
(out, lse) pairs merge exactly across the axis (`merge_across`, fp32). On a mesh with a `model`
axis every device holds its heads of all this and its part of the weights (`model.place`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jax_longctx.core.mesh import make_mesh
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.core.rope import apply_rope
from jax_longctx.methods.base import MeshMethod, Method
from jax_longctx.methods.chunk_cache import ChunkCache
from jax_longctx.model import forward
from jax_longctx.ops.attention import attention, merge_attention
from jax_longctx.ops.cache import Cache
from jax_longctx.run import sharding
from jax_longctx.run.distributed.attention import merge_across, ring_attention
from jax_longctx.run.generation import GenerationError, Sampling, decode_rows, trim_at_stops


@struct.dataclass
class ContextKV:
  """One layer's context on this device: k, v [B, KV, T, d] post-RoPE, pos [B, T] (-1: none)."""
  k: jnp.ndarray
  v: jnp.ndarray
  pos: jnp.ndarray


@struct.dataclass
class Phase2State:
  context: ContextKV  # this device's share of the context
  local: ChunkCache  # the query's and generated tokens' KV (post-RoPE), replicated


@dataclasses.dataclass(frozen=True)
class GlobalAttention(Method):
  """Phase 2: attention over every device's context plus the local tokens, merged exactly."""

  axis: str = "ctx"

  def prefill(self, state: Phase2State, q, k, v, ctx):
    local = state.local.append(apply_rope(k, ctx.q_pos, ctx.freqs), v, ctx.valid, ctx.q_pos)
    q = apply_rope(q, ctx.q_pos, ctx.freqs)
    c = state.context  # its valid slots are a prefix: a device holds contiguous blocks
    out_c, lse_c = pallas_kernels.flash_attention(
        q, c.k, c.v, causal=False, kv_len=jnp.sum(c.pos >= 0, axis=-1), kv_layout="BHTD")
    out_l, lse_l = attention(q, local.k, local.v, ctx.q_pos, local.pos)
    last = jax.lax.axis_index(self.axis) == jax.lax.axis_size(self.axis) - 1
    lse_l = jnp.where(last, lse_l, -jnp.inf)  # the local tokens count once: on the query device
    out, lse = merge_attention(jnp.stack([out_c, out_l]).astype(jnp.float32),
                               jnp.stack([lse_c, lse_l]))
    out, _ = merge_across(out, lse, self.axis)
    return out.astype(q.dtype), state.replace(local=local)


def _for_compile(n: int, length: int) -> int:
  """n tokens rounded up to a multiple of 128 for contexts of 4K tokens or more, so that samples
  of nearby lengths share one compile."""
  return -(-n // 128) * 128 if length >= 4096 else n


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a context of `length` tokens is cut: `n_blocks` rows of anchor + block on `n_dev`
  (rows of the block alone when the anchor is shared, see AnchoredBlocks)."""
  block: int
  anchor: int
  n_blocks: int
  shared_anchor: bool = True

  @property
  def width(self) -> int:
    return self.block if self.shared_anchor else self.anchor + self.block

  @classmethod
  def star(cls, length: int, n_dev: int, block_size: int | None, anchor_size: int | None,
           shared_anchor: bool = True):
    # The paper's default: a quarter of the context.
    block = block_size or _for_compile(-(-length // 4), length)
    if block < 1:
      raise GenerationError(f"block_size={block} must be >= 1")
    anchor = block if anchor_size is None else anchor_size
    if not 0 <= anchor <= block:
      raise GenerationError(f"anchor_size={anchor} must be in 0..block_size ({block})")
    blocks = -(-length // block)
    if blocks == 1:
      anchor = 0  # one block: plain full attention
    return cls(block, anchor, -(-blocks // n_dev) * n_dev, shared_anchor)  # empty blocks pad


def _rows(context, lengths, lay: Layout):
  """[B, n_blocks, width] tokens, positions, validity, and where each block starts in its row
  (numpy). Valid tokens come first in every row and their positions increase, so causal
  attention by row index is causal attention by position: block 0 sits at the front of its row
  (no anchor), the others follow the anchor unless it is shared."""
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


@dataclasses.dataclass(frozen=True)
class RowEncode(Method):
  """Exact causal attention within each row (valid tokens first, positions increasing), keeping
  the row's post-RoPE KV as a ContextKV. With `ring_axis`, the rows are one sequence split
  contiguously over that mesh axis and attention runs around the ring."""

  ring_axis: str | None = None

  def prefill(self, state, q, k, v, ctx):
    q, k = apply_rope(q, ctx.q_pos, ctx.freqs), apply_rope(k, ctx.q_pos, ctx.freqs)
    if self.ring_axis is None:
      out, _ = pallas_kernels.flash_attention(q, k, v, causal=True)
    else:
      out, _ = ring_attention(q, k, v, self.ring_axis, causal=True)
    kv = ContextKV(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2).astype(k.dtype),
                   jnp.where(ctx.valid, ctx.q_pos, -1))
    return out, kv


@dataclasses.dataclass(frozen=True)
class AnchoredBlocks(Method):
  """Star's phase 1 with the anchor computed once. The anchor is the context's first tokens at
  positions 0..a-1 and sees only itself, so its KV in every [anchor; block] row equals the first
  a tokens' KV of block 0's row. Here each row is a block alone: the device holding block 0
  sends those KV to every device, layer by layer (`psum` of what only it holds), and each block
  attends causally to itself and wholly to the anchor, the two merged through their LSEs. Same
  outputs as anchor + block rows; the MLPs and projections skip the anchor's tokens."""

  axis: str = "ctx"
  anchor: int = 0
  rows: int = 1  # blocks per device; block 0 is device 0's first row

  def prefill(self, state, q, k, v, ctx):
    q, k = apply_rope(q, ctx.q_pos, ctx.freqs), apply_rope(k, ctx.q_pos, ctx.freqs)
    kv = ContextKV(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2).astype(k.dtype),
                   jnp.where(ctx.valid, ctx.q_pos, -1))
    out, lse = pallas_kernels.flash_attention(q, k, v, causal=True)
    if not self.anchor:
      return out, kv
    br, t, h, d = q.shape
    b = br // self.rows
    on_first = jax.lax.axis_index(self.axis) == 0
    head = lambda x: x.reshape(b, self.rows, *x.shape[1:])[:, 0, :self.anchor]
    send = lambda x: jax.lax.psum(jnp.where(on_first, x, jnp.zeros_like(x)), self.axis)
    n_anchor = send(jnp.sum(head(ctx.valid), axis=1, dtype=jnp.int32))
    out_a, lse_a = pallas_kernels.flash_attention(
        q.reshape(b, self.rows * t, h, d), send(head(k)), send(head(v)).astype(k.dtype),
        causal=False, kv_len=n_anchor)
    block0 = on_first & (jnp.arange(br) % self.rows == 0)  # its anchor is its own first tokens
    lse_a = jnp.where(block0[:, None, None], -jnp.inf, lse_a.reshape(br, t, h))
    out, _ = merge_attention(jnp.stack([out, out_a.reshape(br, t, h, d)]).astype(jnp.float32),
                             jnp.stack([lse, lse_a]))
    return out.astype(q.dtype), kv


def _encode(params, tok, pos, ok, *, cfg, method: Method, options: RunOptions = DEFAULT):
  """One forward of rows [B, W] under `method`: per-layer ContextKV of the rows."""
  cache = Cache(jnp.zeros(tok.shape[:1], jnp.int32), (None,) * cfg.num_layers, 0)
  _, cache = forward(params, tok, pos, cache, method, cfg, valid=ok,
                     logits_index=jnp.zeros(tok.shape[:1], jnp.int32), options=options)
  return cache.state


def _encode_blocks(params, tok, pos, ok, offset, *, cfg, lay: Layout, axis: str,
                   options: RunOptions = DEFAULT):
  """Inside shard_map: this device's rows [B, r, W] -> per-layer ContextKV [B, KV, r*blk] of
  their blocks (the anchor's KV dropped)."""
  b, r, w = tok.shape
  flat = lambda x: x.reshape(b * r, *x.shape[2:])
  method = AnchoredBlocks(axis, lay.anchor, r) if lay.shared_anchor else RowEncode()
  rows = _encode(params, flat(tok), flat(pos), flat(ok), cfg=cfg, method=method, options=options)
  to_t = lambda x: jnp.moveaxis(x.reshape(b, r, *x.shape[1:]), 1, 2).reshape(
      b, x.shape[1], r * lay.block, -1)
  if lay.shared_anchor:  # the rows are the blocks
    return tuple(ContextKV(to_t(s.k), to_t(s.v), s.pos.reshape(b, r * lay.block)) for s in rows)
  idx = flat(offset)[:, None] + jnp.arange(lay.block)[None, :]  # [b*r, blk], offset + blk <= w
  take = lambda a: jnp.take_along_axis(a, idx[:, None, :, None], axis=2)
  return tuple(ContextKV(to_t(take(s.k)), to_t(take(s.v)),
                         jnp.take_along_axis(s.pos, idx, axis=1).reshape(b, r * lay.block))
               for s in rows)  # pos -1 past the context's end


def _context_specs(cfg, axis):
  """Each layer's ContextKV: rows over `data`, heads over `model`, tokens over `axis`."""
  kv = P("data", "model", axis)
  return tuple(ContextKV(kv, kv, P("data", axis)) for _ in range(cfg.num_layers))


@functools.partial(jax.jit, static_argnames=("cfg", "axis", "lay", "options"))
def _phase1(params, *rows, cfg, axis: str, lay: Layout | None, options: RunOptions):
  """Phase 1 on options.mesh (`lay` None: ring): rows [B, ...] split over `data` and along
  the context over `axis`; the weights `model.place`d."""
  if lay is None:
    fn = functools.partial(_encode, cfg=cfg, method=RowEncode(axis), options=options)
  else:
    fn = functools.partial(_encode_blocks, cfg=cfg, lay=lay, axis=axis, options=options)
  return jax.shard_map(fn, mesh=options.mesh,
                       in_specs=(sharding.params(params),) + (P("data", axis),) * len(rows),
                       out_specs=_context_specs(cfg, axis), check_vma=False)(params, *rows)


def _mesh_options(mesh, options: RunOptions) -> RunOptions:
  """The run's options on `mesh` (axes ctx and model; data splits the rows)."""
  return options.replace(mesh=make_mesh(mesh))


def encode_context(params, cfg, contexts, mesh, axis: str = "ctx", *, method: str = "star",
                   block_size: int | None = None, anchor_size: int | None = None,
                   shared_anchor: bool = True, options: RunOptions = DEFAULT):
  """Phase 1: per-layer ContextKV sharded over `axis` (each device holds its blocks; on a mesh
  with a `model` axis, its heads of them). params: `model.place`d on the mesh.

  shared_anchor: compute the anchor once and send its KV to every device (AnchoredBlocks; the
  same result) instead of running it in every block's row as the authors' code does."""
  options = _mesh_options(mesh, options)
  lengths = np.asarray([len(c) for c in contexts], np.int32)
  if lengths.min() < 1:
    raise GenerationError("empty context: phase 1 needs >= 1 token per sequence")
  sharding.check_batch(len(contexts), options)
  n_dev = options.mesh.shape[axis]
  longest = int(lengths.max())
  if method == "star":
    lay = Layout.star(longest, n_dev, block_size, anchor_size, shared_anchor)
    padded = np.zeros((len(contexts), lay.n_blocks * lay.block), np.int32)
  elif method == "ring":
    lay = None
    share = _for_compile(-(-longest // n_dev), longest)
    padded = np.zeros((len(contexts), share * n_dev), np.int32)
  else:
    raise GenerationError(f"unknown context encoding {method!r}: 'star' or 'ring'")
  for i, c in enumerate(contexts):
    padded[i, :len(c)] = c
  if lay is None:
    pos = np.broadcast_to(np.arange(padded.shape[1], dtype=np.int32), padded.shape)
    args = (padded, pos, pos < lengths[:, None])
  else:
    args = _rows(padded, lengths, lay)
  return _phase1(params, *map(jnp.asarray, args), cfg=cfg, axis=axis, lay=lay, options=options)


@functools.partial(jax.jit, static_argnames=("cfg", "axis", "max_new_tokens", "sampling",
                                             "options"))
def _phase2(params, context_kv, q_tok, q_len, lengths, stops, key, *, cfg, axis: str,
            max_new_tokens: int, sampling: Sampling, options: RunOptions):
  """Phase 2 on options.mesh for queries [B, q_w]: the query, then the decode loop."""
  batch, q_w = q_tok.shape
  room = q_w + max_new_tokens
  attn = GlobalAttention(axis)
  local_cfg = sharding.local_config(cfg, options)

  def phase2(params, context_kv, q_tok, q_len, lengths, stops, key):
    b = q_tok.shape[0]
    local = [ChunkCache.empty(local_cfg, b, room, room, cfg.jnp_dtype)
             for _ in range(cfg.num_layers)]
    cache = Cache(lengths, tuple(Phase2State(c, l) for c, l in zip(context_kv, local)), 0)
    steps = jnp.arange(q_w, dtype=jnp.int32)[None, :]
    logits, cache = forward(params, q_tok, lengths[:, None] + steps, cache, attn, cfg,
                            valid=steps < q_len[:, None], logits_index=q_len - 1,
                            options=options)
    out, n, _ = decode_rows(params, cache, logits, stops, key, cfg=cfg, method=attn,
                            max_new_tokens=max_new_tokens, sampling=sampling, options=options)
    return out, n, sharding.all_rows(logits, options)

  rows = P("data")
  return jax.shard_map(phase2, mesh=options.mesh,
                       in_specs=(sharding.params(params), _context_specs(cfg, axis), rows, rows,
                                 rows, P(), P()),
                       out_specs=(P(), P(), P()), check_vma=False)(
                           params, context_kv, q_tok, q_len, lengths, stops, key)


def answer(params, cfg, context_kv, context_lengths, queries, mesh, axis: str = "ctx", *,
           max_new_tokens: int = 32, stop_tokens=(), sampling: Sampling = Sampling(),
           options: RunOptions = DEFAULT):
  """Phase 2 over an encoded context (`encode_context`): each query, then `max_new_tokens`
  generated tokens, attend to every device's context share merged exactly. Returns (new tokens
  per sequence, the query's last-token logits [B, V])."""
  if len(queries) != len(context_lengths) or min(map(len, queries), default=0) < 1:
    raise GenerationError("one non-empty query per context is needed")
  b, q_w = len(queries), max(map(len, queries))
  q_tok = np.zeros((b, q_w), np.int32)
  for i, q in enumerate(queries):
    q_tok[i, :len(q)] = q
  q_len = np.asarray([len(q) for q in queries], np.int32)
  stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
  out, n, logits = _phase2(params, context_kv, jnp.asarray(q_tok), jnp.asarray(q_len),
                           jnp.asarray(context_lengths, jnp.int32), stops,
                           jax.random.key(sampling.seed), cfg=cfg, axis=axis,
                           max_new_tokens=max_new_tokens, sampling=sampling,
                           options=_mesh_options(mesh, options))
  return trim_at_stops(np.asarray(out)[:, :int(n)], stop_tokens), logits


def generate_distributed(params, cfg, contexts, queries, mesh, axis: str = "ctx", *,
                         method="star", block_size: int | None = None,
                         anchor_size: int | None = None, shared_anchor: bool = True,
                         max_new_tokens: int = 32, stop_tokens=(),
                         sampling: Sampling = Sampling(), options: RunOptions = DEFAULT):
  """Star Attention (or ring attention) end to end: phase 1 over the context (`encode_context`),
  then the query and `max_new_tokens` generated tokens (`answer`). Returns (new tokens per
  sequence, the query's last-token logits [B, V]).

  method: "star", "ring", or the registry's StarAttention / RingAttention object (whose settings
  apply). mesh: a Mesh with a `ctx` axis (a `model` axis splits the heads too; `data` the
  rows) or a spec such as "ctx=4,model=2". The weights are `model.place`d on it (weights placed
  already are not copied again).
  """
  if isinstance(method, MeshMethod):
    settings = method.settings()
    block_size = settings.get("block_size", block_size)
    anchor_size = settings.get("anchor_size", anchor_size)
    shared_anchor = settings.get("shared_anchor", shared_anchor)
    method = method.name
  if len(queries) != len(contexts) or min(map(len, queries), default=0) < 1:
    raise GenerationError("one non-empty query per context is needed")
  mesh = make_mesh(mesh)
  params = sharding.placed(params, cfg, mesh)
  context_kv = encode_context(params, cfg, contexts, mesh, axis, method=method,
                              block_size=block_size, anchor_size=anchor_size,
                              shared_anchor=shared_anchor, options=options)
  return answer(params, cfg, context_kv, [len(c) for c in contexts], queries, mesh, axis,
                max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, sampling=sampling,
                options=options)
