"""Star Attention (Acharya et al. 2024, arXiv:2411.17116) and ring attention over a mesh axis.

Phase 1 encodes the context blockwise: block i (of `block_size` tokens) is prefixed by the
anchor (the context's first `anchor_size` tokens at positions 0..a-1), the block sits at its
global positions, and each (anchor + block) row is an ordinary causal forward; the anchor's KV is
dropped. Rows are laid out over the mesh axis (several per device when there are more blocks than
devices) and encoded in parallel under `jax.shard_map`; each device keeps its blocks' KV.
`ring` encodes the context exactly instead: contiguous equal blocks, K/V passed around the ring.

Phase 2 (both): the query and every generated token run replicated on all devices; in each
layer every device attends over its local context KV (no mask: the context precedes the query)
and the query device also over the query's and generated tokens' KV (causal), and the partial
(out, lse) pairs merge exactly across the axis (`merge_across`, fp32). Weights are replicated.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jax_longctx.attention import attention, merge_attention
from jax_longctx.cache import Cache
from jax_longctx.distributed.attention import merge_across, ring_attention
from jax_longctx.generate import GenerationError, Sampling, decode_loop
from jax_longctx.methods.base import Method
from jax_longctx.methods.chunk_cache import ChunkCache
from jax_longctx.model import forward
from jax_longctx.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class Packed(Method):
  """Exact causal attention over slots filled in order, each remembering its position (post-RoPE
  keys): a row whose positions are not its slot indices, as an anchor + block row."""

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    return ChunkCache.empty(cfg, batch, max_len, max_len, dtype)

  def prefill(self, state: ChunkCache, q, k, v, ctx):
    state = state.append(apply_rope(k, ctx.q_pos, ctx.freqs), v, ctx.valid, ctx.q_pos)
    out, _ = attention(apply_rope(q, ctx.q_pos, ctx.freqs), state.k, state.v, ctx.q_pos, state.pos)
    return out, state


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
    c = state.context
    out_c, lse_c = attention(q, c.k, c.v, ctx.q_pos, c.pos)
    out_l, lse_l = attention(q, local.k, local.v, ctx.q_pos, local.pos)
    last = jax.lax.axis_index(self.axis) == jax.lax.axis_size(self.axis) - 1
    lse_l = jnp.where(last, lse_l, -jnp.inf)  # the local tokens count once: on the query device
    out, lse = merge_attention(jnp.stack([out_c, out_l]).astype(jnp.float32),
                               jnp.stack([lse_c, lse_l]))
    out, _ = merge_across(out, lse, self.axis)
    return out.astype(q.dtype), state.replace(local=local)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a context of `length` tokens is cut: `n_blocks` rows of anchor + block on `n_dev`."""
  block: int
  anchor: int
  n_blocks: int

  @classmethod
  def star(cls, length: int, n_dev: int, block_size: int | None, anchor_size: int | None):
    block = block_size or -(-length // 4)  # the paper's default: a quarter of the context
    if block < 1:
      raise GenerationError(f"block_size={block} must be >= 1")
    anchor = block if anchor_size is None else anchor_size
    if not 0 <= anchor <= block:
      raise GenerationError(f"anchor_size={anchor} must be in 0..block_size ({block})")
    blocks = -(-length // block)
    if blocks == 1:
      anchor = 0  # one block: plain full attention
    return cls(block, anchor, -(-blocks // n_dev) * n_dev)  # empty blocks pad the mesh


def _rows(context, lengths, lay: Layout):
  """[B, n_blocks, anchor + block] tokens, positions and validity (numpy)."""
  b = context.shape[0]
  a, blk, nb = lay.anchor, lay.block, lay.n_blocks
  tok = np.zeros((b, nb, a + blk), np.int32)
  pos = np.zeros((b, nb, a + blk), np.int32)
  ok = np.zeros((b, nb, a + blk), bool)
  for i in range(nb):
    start = i * blk
    pos[:, i, a:] = start + np.arange(blk)
    pos[:, i, :a] = np.arange(a)
    ok[:, i, a:] = pos[:, i, a:] < lengths[:, None]
    ok[:, i, :a] = (i > 0) & (np.arange(a)[None, :] < lengths[:, None])
    span = context[:, start:start + blk]
    tok[:, i, a:a + span.shape[1]] = span
    tok[:, i, :a] = context[:, :a]
  return tok, pos, ok


def _encode_rows(params, tok, pos, ok, *, cfg, lay: Layout):
  """Inside shard_map: this device's rows [B, r, a + blk] -> per-layer ContextKV [B, KV, r*blk]."""
  b, r, w = tok.shape
  flat = lambda x: x.reshape(b * r, w)
  cache = Cache(jnp.zeros((b * r,), jnp.int32),
                tuple(Packed().init_state(cfg, b * r, w, cfg.jnp_dtype, w)
                      for _ in range(cfg.num_layers)), w)
  _, cache = forward(params, flat(tok), flat(pos), cache, Packed(), cfg, valid=flat(ok),
                     logits_index=jnp.zeros((b * r,), jnp.int32))
  # The block's tokens follow the anchor's valid ones in each row; drop the anchor.
  start = jnp.sum(flat(ok)[:, :lay.anchor], axis=1)
  idx = start[:, None] + jnp.arange(lay.block)[None, :]
  in_block = jnp.arange(lay.block)[None, :] < jnp.sum(flat(ok)[:, lay.anchor:], axis=1)[:, None]
  out = []
  for s in cache.state:
    take = lambda a: jnp.take_along_axis(a, jnp.minimum(idx, w - 1)[:, None, :, None], axis=2)
    k = take(s.k).reshape(b, r, *s.k.shape[1:2], lay.block, -1)
    v = take(s.v).reshape(b, r, *s.v.shape[1:2], lay.block, -1)
    p = jnp.where(in_block, jnp.take_along_axis(s.pos, jnp.minimum(idx, w - 1), axis=1), -1)
    to_t = lambda x: jnp.moveaxis(x, 1, 2).reshape(b, x.shape[2], r * lay.block, -1)
    out.append(ContextKV(to_t(k), to_t(v), p.reshape(b, r * lay.block)))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class RingPrefill(Method):
  """Exact causal attention of a context split contiguously over the axis; keeps the local KV."""

  axis: str = "ctx"

  def prefill(self, state, q, k, v, ctx):
    k = apply_rope(k, ctx.q_pos, ctx.freqs)
    out, _ = ring_attention(apply_rope(q, ctx.q_pos, ctx.freqs), k, v, self.axis, causal=True)
    kv = ContextKV(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2).astype(k.dtype),
                   jnp.where(ctx.valid, ctx.q_pos, -1))
    return out, kv


def _context_specs(cfg, axis):
  kv = P(None, None, axis)
  return tuple(ContextKV(kv, kv, P(None, axis)) for _ in range(cfg.num_layers))


def encode_context(params, cfg, contexts, mesh, axis: str = "ctx", *, method: str = "star",
                   block_size: int | None = None, anchor_size: int | None = None):
  """Phase 1: per-layer ContextKV sharded over `axis` (each device holds its blocks)."""
  lengths = np.asarray([len(c) for c in contexts], np.int32)
  if lengths.min() < 1:
    raise GenerationError("empty context: phase 1 needs >= 1 token per sequence")
  n_dev = mesh.shape[axis]
  longest = int(lengths.max())
  if method == "star":
    lay = Layout.star(longest, n_dev, block_size, anchor_size)
    padded = np.zeros((len(contexts), lay.n_blocks * lay.block), np.int32)
  elif method == "ring":
    padded = np.zeros((len(contexts), -(-longest // n_dev) * n_dev), np.int32)
  else:
    raise GenerationError(f"unknown context encoding {method!r}: 'star' or 'ring'")
  for i, c in enumerate(contexts):
    padded[i, :len(c)] = c
  shard = P(None, axis)
  if method == "ring":
    pos = np.broadcast_to(np.arange(padded.shape[1], dtype=np.int32), padded.shape)

    def ring_rows(params, tok, pos, ok):
      cache = Cache(jnp.zeros(tok.shape[:1], jnp.int32), (None,) * cfg.num_layers, 0)
      _, cache = forward(params, tok, pos, cache, RingPrefill(axis), cfg, valid=ok,
                         logits_index=jnp.zeros(tok.shape[:1], jnp.int32))
      return cache.state

    fn, args = ring_rows, (padded, pos, pos < lengths[:, None])
  else:
    fn = functools.partial(_encode_rows, cfg=cfg, lay=lay)
    args = _rows(padded, lengths, lay)
  run = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(), shard, shard, shard),
                              out_specs=_context_specs(cfg, axis), check_vma=False))
  return run(params, *map(jnp.asarray, args))


def generate_distributed(params, cfg, contexts, queries, mesh, axis: str = "ctx", *,
                         method="star", block_size: int | None = None,
                         anchor_size: int | None = None, max_new_tokens: int = 32,
                         stop_tokens=(), sampling: Sampling = Sampling()):
  """Star Attention (or ring attention) end to end: phase 1 over the context, then the query
  and `max_new_tokens` generated tokens with the exact cross-device merge. Returns (new tokens
  per sequence, the query's last-token logits [B, V]).

  method: "star", "ring", or the registry's Star / Ring object (whose settings apply).
  """
  if isinstance(method, Method):
    block_size = method.settings().get("block_size", block_size)
    anchor_size = method.settings().get("anchor_size", anchor_size)
    method = method.name
  if len(queries) != len(contexts) or min(map(len, queries), default=0) < 1:
    raise GenerationError("one non-empty query per context is needed")
  context_kv = encode_context(params, cfg, contexts, mesh, axis, method=method,
                              block_size=block_size, anchor_size=anchor_size)
  b, q_w = len(queries), max(map(len, queries))
  q_tok = np.zeros((b, q_w), np.int32)
  for i, q in enumerate(queries):
    q_tok[i, :len(q)] = q
  q_len = np.asarray([len(q) for q in queries], np.int32)
  room = q_w + max_new_tokens
  attn = GlobalAttention(axis)

  def phase2(params, context_kv, q_tok, q_len, lengths, stops, key):
    local = [ChunkCache.empty(cfg, b, room, room, cfg.jnp_dtype) for _ in range(cfg.num_layers)]
    cache = Cache(lengths, tuple(Phase2State(c, l) for c, l in zip(context_kv, local)), 0)
    steps = jnp.arange(q_w, dtype=jnp.int32)[None, :]
    logits, cache = forward(params, q_tok, lengths[:, None] + steps, cache, attn, cfg,
                            valid=steps < q_len[:, None], logits_index=q_len - 1)
    out, n, _ = decode_loop(params, cache, logits, stops, key, cfg=cfg, method=attn,
                            max_new_tokens=max_new_tokens, sampling=sampling)
    return out, n, logits

  run = jax.jit(jax.shard_map(phase2, mesh=mesh,
                              in_specs=(P(), _context_specs(cfg, axis), P(), P(), P(), P(), P()),
                              out_specs=(P(), P(), P()), check_vma=False))
  stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
  lengths = jnp.asarray([len(c) for c in contexts], jnp.int32)
  out, n, logits = run(params, context_kv, jnp.asarray(q_tok), jnp.asarray(q_len), lengths, stops,
                       jax.random.key(sampling.seed))
  stop_set = set(int(t) for t in stop_tokens)
  rows = []
  for row in np.asarray(out)[:, :int(n)].tolist():
    rows.append(row[:next((i for i, t in enumerate(row) if t in stop_set), len(row))])
  return rows, logits
