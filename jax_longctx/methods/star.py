"""Star Attention and ring attention: the context encoded in blocks over the mesh's `ctx` axis.

Acharya et al., "Star Attention: Efficient LLM Inference over Long Sequences", 2024
(arXiv:2411.17116). Phase 1 encodes the context blockwise: block i (of `block_size` tokens) is
prefixed by the anchor (the context's first `anchor_size` tokens at positions 0..a-1), the block
sits at its global positions, and each (anchor + block) row is an ordinary causal forward; the
anchor's KV is dropped. Rows are laid out over the devices (several per device when there are
more blocks than devices) and encoded in parallel; each device keeps its blocks' KV. By default
the anchor, identical in every row, is computed once and its KV sent to every device
(`AnchoredBlocks`): the same outputs for half the tokens per device. `ring` encodes the context
exactly instead (the paper's baseline): one contiguous block per device, K/V passed around the
ring (`RowEncode` with the ring), then Star's phase 2.

Phase 2 (both) is these entries' own step: the query and every generated token run replicated on
all devices; in each layer every device attends over its context blocks (no mask: the context
precedes the query) and the device holding the last blocks also over the query's and generated
tokens' KV (causal), and the partial (out, lse) pairs merge exactly (`ctx.tokens.merge`, fp32).
run/context_encoding.py runs phase 1 (`encodes_context`), then the query and the decode loop are
the one driver's. With a `model` axis every device holds its heads of all this.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

import pallas_kernels
from pallas_kernels import quant4
from jax_longctx.core.axes import HEADS, ROWS, TOKENS, axes
from jax_longctx.core.rope import apply_rope
from jax_longctx.methods.base import AttnContext, Method, MethodError, register
from jax_longctx.methods.chunk_cache import ChunkCache
from jax_longctx.ops.attention import attention, merge_attention
from jax_longctx.ops.cache import is_int4_dtype, stored_as
from jax_longctx.ops.mesh_attention import ring_attention


@struct.dataclass
class ContextKV:
  """One layer's context on this device: k, v [B, KV, T, d] post-RoPE, pos [B, T] (-1: none)."""
  k: jnp.ndarray = axes(ROWS, HEADS, TOKENS, None)
  v: jnp.ndarray = axes(ROWS, HEADS, TOKENS, None)
  pos: jnp.ndarray = axes(ROWS, TOKENS)


@struct.dataclass
class Phase2State:
  context: ContextKV  # this device's share of the context
  local: ChunkCache  # the query's and generated tokens' KV (post-RoPE), on every device


def _for_compile(n: int, length: int) -> int:
  """n tokens rounded up to a multiple of 128 for contexts of 4K tokens or more, so that samples
  of nearby lengths share one compile."""
  return -(-n // 128) * 128 if length >= 4096 else n


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a context is cut: `n_blocks` rows (a multiple of the devices) of `width` tokens, each
  a block of `block` tokens after the anchor's `anchor` tokens unless the anchor is shared (or
  there is none: then a row is its block)."""
  block: int
  anchor: int
  n_blocks: int
  shared_anchor: bool = True

  @property
  def width(self) -> int:
    return self.block if self.shared_anchor else self.anchor + self.block


def _phase2(state: Phase2State, q, k, v, ctx: AttnContext):
  """Attention over every device's context plus the local tokens, merged exactly."""
  local = state.local.append(apply_rope(k, ctx.q_pos, ctx.freqs), v, ctx.valid, ctx.q_pos)
  q = apply_rope(q, ctx.q_pos, ctx.freqs)
  c = state.context  # its valid slots are a prefix: a device holds contiguous blocks
  out_c, lse_c = pallas_kernels.flash_attention(
      q, c.k, c.v, causal=False, kv_len=jnp.sum(c.pos >= 0, axis=-1), kv_layout="BHTD",
      route=ctx.options.route)
  out_l, lse_l = attention(q, local.k, local.v, ctx.q_pos, local.pos)
  last = ctx.tokens.index() == ctx.tokens.shards - 1
  lse_l = jnp.where(last, lse_l, -jnp.inf)  # the local tokens count once: on the last device
  out, lse = merge_attention(jnp.stack([out_c, out_l]).astype(jnp.float32),
                             jnp.stack([lse_c, lse_l]))
  out, _ = ctx.tokens.merge(out, lse)
  return out.astype(q.dtype), state.replace(local=local)


@dataclasses.dataclass(frozen=True)
class _ContextEncoded(Method):
  """What Star and ring share: the context encoded over `ctx` (phase 1, by `context_encoder`
  over `context_layout`'s rows), then phase 2 as this method's step."""

  splits_tokens = True
  encodes_context = True
  needs_instruction = True  # the query, read apart from the context
  int4_refusal = ""  # the context quantized once encoded (context_in_four_bits)

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    raise MethodError(f"{self.name!r} encodes its context in blocks (run/context_encoding.py), "
                      "it has no chunked prefill")

  def prefill(self, state: Phase2State, q, k, v, ctx: AttnContext):
    return _phase2(state, q, k, v, ctx)


@register
@dataclasses.dataclass(frozen=True)
class StarAttention(_ContextEncoded):
  """Phase 1: anchor + block rows encoded in parallel; phase 2: exact merged attention."""

  name = "star"

  block_size: int = 0  # 0: a quarter of the context (the paper's setting)
  anchor_size: int = -1  # -1: the block size (the paper's setting)
  # The anchor computed once and its KV sent to every device (same outputs); False runs it in
  # every block's row, as the authors' code does.
  shared_anchor: bool = True

  def context_layout(self, length: int, shards: int) -> Layout:
    block = self.block_size or _for_compile(-(-length // 4), length)  # the paper: a quarter
    if block < 1:
      raise MethodError(f"block_size={block} must be >= 1")
    anchor = block if self.anchor_size < 0 else self.anchor_size
    if not 0 <= anchor <= block:
      raise MethodError(f"anchor_size={anchor} must be in 0..block_size ({block})")
    blocks = -(-length // block)
    if blocks == 1:
      anchor = 0  # one block: plain full attention
    return Layout(block, anchor, -(-blocks // shards) * shards, self.shared_anchor)  # empty pad

  def context_encoder(self, layout: Layout, rows_per_device: int) -> Method:
    if layout.shared_anchor:
      return AnchoredBlocks(layout.anchor, rows_per_device)
    return RowEncode()


@register
@dataclasses.dataclass(frozen=True)
class RingAttention(_ContextEncoded):
  """Exact prefill with K/V passed around the ring (one contiguous block per device), then
  Star's phase 2: the Star paper's baseline, as it runs it (no ring.py of its own: only the
  prefill differs from Star)."""

  name = "ring"

  def context_layout(self, length: int, shards: int) -> Layout:
    return Layout(_for_compile(-(-length // shards), length), 0, shards)

  def context_encoder(self, layout: Layout, rows_per_device: int) -> Method:
    return RowEncode(ring=True)


def _context_kv(k, v, ctx: AttnContext) -> ContextKV:
  """A forward's rows as a layer's context: keys after RoPE, [B, KV, T, d], stored as the run
  stores its cache (RunOptions.kv_dtype; a 4-bit cache's keys group along tokens, across the
  rows of a device: kept whole here, quantized once the context is assembled)."""
  dtype = ctx.options.cache_dtype(k.dtype)
  dtype = k.dtype if is_int4_dtype(dtype) else dtype
  return ContextKV(stored_as(jnp.swapaxes(k, 1, 2), dtype),
                   stored_as(jnp.swapaxes(v, 1, 2).astype(k.dtype), dtype),
                   jnp.where(ctx.valid, ctx.q_pos, -1))


def context_in_four_bits(c: ContextKV, kv_dtype: str) -> ContextKV:
  """A device's context, assembled in the model's dtype, as the 4-bit cache of format
  `kv_dtype` stores it (quant4, KIVI's layout): keys per channel over groups of tokens, none
  left open (a context is written once), values per token; its slots padded to whole groups
  (pos -1: never read)."""
  fmt = quant4.format_of(kv_dtype)
  g = fmt.group
  pad = -c.k.shape[2] % g
  widen = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0)))  # noqa: E731
  k, v, pos = widen(c.k), widen(c.v), jnp.pad(c.pos, ((0, 0), (0, pad)), constant_values=-1)
  return ContextKV(quant4.grouped_keys_written_whole(k, pos >= 0, k.dtype, g, fmt.scale_dtype),
                   quant4.quantize(v, min(g, v.shape[-1]), scale_dtype=fmt.scale_dtype), pos)


@dataclasses.dataclass(frozen=True)
class RowEncode(Method):
  """Exact causal attention within each row (valid tokens first, positions increasing), keeping
  the row's post-RoPE KV as a ContextKV. With `ring`, the rows are one sequence split
  contiguously over the devices (`ctx.tokens`) and attention runs around the ring."""

  ring: bool = False

  def prefill(self, state, q, k, v, ctx: AttnContext):
    q, k = apply_rope(q, ctx.q_pos, ctx.freqs), apply_rope(k, ctx.q_pos, ctx.freqs)
    route = ctx.options.route
    if self.ring and ctx.tokens.axis is not None:
      out, _ = ring_attention(q, k, v, ctx.tokens.axis, causal=True, route=route)
    else:
      out, _ = pallas_kernels.flash_attention(q, k, v, causal=True, route=route)
    return out, _context_kv(k, v, ctx)


@dataclasses.dataclass(frozen=True)
class AnchoredBlocks(Method):
  """Star's phase 1 with the anchor computed once. The anchor is the context's first tokens at
  positions 0..a-1 and sees only itself, so its KV in every [anchor; block] row equals the first
  a tokens' KV of block 0's row. Here each row is a block alone: the device holding block 0
  sends those KV to every device, layer by layer (a sum over the devices of what only it holds),
  and each block attends causally to itself and wholly to the anchor, the two merged through
  their LSEs. Same outputs as anchor + block rows; the MLPs and projections skip the anchor's
  tokens."""

  anchor: int = 0
  rows: int = 1  # blocks per device; block 0 is the first device's first row

  def prefill(self, state, q, k, v, ctx: AttnContext):
    q, k = apply_rope(q, ctx.q_pos, ctx.freqs), apply_rope(k, ctx.q_pos, ctx.freqs)
    route = ctx.options.route
    out, lse = pallas_kernels.flash_attention(q, k, v, causal=True, route=route)
    if not self.anchor:
      return out, _context_kv(k, v, ctx)
    br, t, h, d = q.shape
    b = br // self.rows
    on_first = ctx.tokens.index() == 0
    head = lambda x: x.reshape(b, self.rows, *x.shape[1:])[:, 0, :self.anchor]  # noqa: E731
    send = lambda x: ctx.tokens.sum(jnp.where(on_first, x, jnp.zeros_like(x)))  # noqa: E731
    n_anchor = send(jnp.sum(head(ctx.valid), axis=1, dtype=jnp.int32))
    out_a, lse_a = pallas_kernels.flash_attention(
        q.reshape(b, self.rows * t, h, d), send(head(k)), send(head(v)).astype(k.dtype),
        causal=False, kv_len=n_anchor, route=route)
    block0 = on_first & (jnp.arange(br) % self.rows == 0)  # its anchor is its own first tokens
    lse_a = jnp.where(block0[:, None, None], -jnp.inf, lse_a.reshape(br, t, h))
    out, _ = merge_attention(jnp.stack([out, out_a.reshape(br, t, h, d)]).astype(jnp.float32),
                             jnp.stack([lse, lse_a]))
    return out.astype(q.dtype), _context_kv(k, v, ctx)

