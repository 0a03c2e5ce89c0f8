"""ReAttention: position-agnostic top-k selection before ordinary RoPE attention.

Liu et al., "ReAttention: Training-Free Infinite Context with Finite Attention Scope",
arXiv:2407.15176. The cache keeps every token's keys before RoPE. Each step (a
prefill chunk or one generated token) and layer selects a scope of at most
n_global + clip * span + n_local tokens (reattention_scope.py), gathers it, rotates it at the
contiguous positions 0..n-1 and attends with the step's queries at the last positions. Positions
therefore never exceed the scope, and with the paper's defaults the scope is exactly the 8K window
of Llama-3-8B: 32 + 127 * 32 + 4096 = 8192.

Both registry entries of the paper's method are here: `reattention` (one device) and
`reattention_mesh` (the same steps over a cache split along the tokens across the devices of the
mesh's `ctx` axis; the parts of the scope each device holds: methods/token_layout.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import quant4
from jax_longctx.ops.attention import attention
from jax_longctx.ops.cache import KVCache, is_int4_dtype, load, per_row
from jax_longctx.methods.base import AttnContext, Method, MethodError, TokenShards, register
from jax_longctx.methods.reattention_scope import (Scope, ballots, candidates, scope_from_votes,
                                                   select_scope, step_bounds, voters)
from jax_longctx.methods.token_layout import device_part, global_top_k, layout_here
from jax_longctx.core.options import RunOptions
from jax_longctx.core.rope import apply_rope, rotate


@dataclasses.dataclass(frozen=True)
class ReAttentionSettings:
  """ReAttention's hyper-parameters, shared by the one-device method and its registry entry over
  a device mesh (`reattention_mesh`). Defaults are the paper's §3.1 settings (OpenMOSS/
  ReAttention uses per-query top-1; the paper's runs top-4). Which kernel variant runs is the
  run's (`RunOptions.route`), as for every method. vote_stride (not the paper's): in a step of
  several queries, only every vote_stride-th query, counted back from the step's last, scores
  the cache and votes; 1 (the default) is the paper's rule, where every query votes."""

  n_global: int = 32
  n_local: int = 4096
  span: int = 32
  top_k: int = 4
  clip: int = 127
  chunk: int = 512
  vote_stride: int = 1

  @property
  def prefill_chunk(self) -> int:
    return self.chunk

  @property
  def scope_size(self) -> int:
    """The most tokens one step attends to, hence the largest position RoPE ever sees, plus 1."""
    return self.n_global + self.clip * self.span + self.n_local

  @classmethod
  def for_window(cls, window: int, *, local_fraction: float = 0.5, n_global: int = 32,
                 span: int = 32, top_k: int = 4, chunk: int = 512, **kw):
    """A setting whose scope fills `window`: local = local_fraction of the window (the paper:
    half), the rest after the global part spans (window 8192 gives the paper's defaults).

    On the default model (SmolLM2-135M, window 8192) `local_fraction=0.25` (local 2048, clip
    191) read passkeys at 8K-64K where the paper's split failed past 16K (docs/METHODS.md)."""
    n_local = int(window * local_fraction)
    clip = (window - n_global - n_local) // span
    if clip < 1 or chunk > n_local:
      raise MethodError(f"window={window} with local_fraction={local_fraction} is too small for "
                        f"n_global={n_global}, span={span} and chunk={chunk}")
    return cls(n_global=n_global, n_local=n_local, span=span, top_k=top_k, clip=clip,
               chunk=chunk, **kw)


@register
@dataclasses.dataclass(frozen=True)
class ReAttention(ReAttentionSettings, Method):
  """One device: the whole pre-RoPE cache here. A step is `write`, `scope` (the selection) and
  `attend_scope`; the mesh variant (MeshReAttention, below) replaces each of them."""

  name = "reattention"
  int4_refusal = ""
  keys_before_rope = True  # rotated at their ranks in the scope

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> KVCache:
    for field in ("n_local", "span", "top_k", "clip", "chunk", "vote_stride"):
      if getattr(self, field) < 1:
        raise MethodError(f"{field}={getattr(self, field)} must be >= 1")
    if self.n_global < 0:
      raise MethodError(f"n_global={self.n_global} must be >= 0")
    if chunk > self.n_local:
      raise MethodError(f"a step of {chunk} tokens is longer than n_local={self.n_local}: the "
                        "local part must hold the whole step (use a smaller chunk)")
    if self.scope_size > cfg.max_position_embeddings:
      raise MethodError(
          f"scope n_global + clip * span + n_local = {self.scope_size} exceeds the model's window "
          f"({cfg.max_position_embeddings}); see ReAttention.for_window")
    return KVCache.zeros(cfg, batch, max_len, dtype, keys_before_rope=True)

  def write(self, state: KVCache, k, v, ctx: AttnContext) -> KVCache:
    return state.write(ctx.q_pos, k, v, route=ctx.options.route,
                       valid=ctx.valid)  # keys before RoPE, slot = position

  def scope(self, state: KVCache, q, ctx: AttnContext) -> Scope:
    return select_scope(q, state.k, ctx.q_pos, ctx.valid, n_global=self.n_global,
                        n_local=self.n_local, span=self.span, top_k=self.top_k, clip=self.clip,
                        vote_stride=self.vote_stride, route=ctx.options.route,
                        heads=ctx.heads)

  def step(self, state: KVCache, q, k, v, ctx: AttnContext):
    """One step: (out [B, S, H, d], lse [B, S, H] fp32, state, the scope attended)."""
    state = self.write(state, k, v, ctx)
    sc = self.scope(state, q, ctx)
    out, lse = self.attend_scope(q, state, sc, ctx)
    return out, lse, state, sc

  def prefill(self, state: KVCache, q, k, v, ctx: AttnContext):
    out, _, state, _ = self.step(state, q, k, v, ctx)
    return out, state

  def cache(self, state: KVCache) -> KVCache:
    """The pre-RoPE keys and values (RESA's prior reads them)."""
    return state

  def attend_scope(self, q, state: KVCache, sc: Scope, ctx: AttnContext):
    """The step's queries (ranks q_offset + i) over the scope's keys (ranks 0..length-1) of the
    cache: (out, lse). The mesh variant calls it with one device's part of the scope (with a
    block-cyclic layout, a part whose ranks are sc.k_rank and sc.q_rank)."""
    if q.shape[1] == 1 and not ctx.options.route.is_reference:
      return self._attend_one(q, state, sc, ctx)
    ranked = sc.k_rank is not None  # a block-cyclic mesh part: ranks apart from slots
    take = sc.idx[:, None, :, None]  # one scope per sequence, shared by its kv heads
    k_scope, v_scope = (load(per_row(lambda a: jnp.take_along_axis(a, take, axis=2), x), q.dtype)
                        for x in (state.k, state.v))  # [B, KV, N, d]
    n = sc.idx.shape[1]
    k_rank = sc.k_rank if ranked else jnp.arange(n, dtype=jnp.int32)[None, :]  # [B or 1, N]
    k_scope = rotate(k_scope, k_rank[:, None, :], ctx.freqs)
    q_rank = ((sc.q_rank if ranked else sc.q_offset)[:, None]
              + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :])
    return self._attend(apply_rope(q, q_rank, ctx.freqs), k_scope, v_scope, q_rank, k_rank, sc,
                        ctx.options)

  def _attend_one(self, q, state: KVCache, sc: Scope, ctx: AttnContext):
    """One query (decode), the last of its scope, so after every key of it (or of a mesh part of
    it): the kernel reads the scope's rows straight from the cache and rotates each key at its
    rank, so no rotated copy of the scope is made."""
    b, n = sc.idx.shape
    kvh = state.k.shape[1]
    idx = jnp.broadcast_to(sc.idx[:, None, :], (b, kvh, n))
    valid = jnp.broadcast_to((jnp.arange(n) < sc.length[:, None])[:, None, :], (b, kvh, n))
    q_rank = sc.q_offset if sc.k_rank is None else sc.q_rank
    return pallas_kernels.gathered_attention(
        apply_rope(q, q_rank[:, None], ctx.freqs), state.k, state.v, idx, valid,
        kv_layout="BHTD", key_rope_freqs=ctx.freqs, key_positions=sc.k_rank,
        route=ctx.options.route)

  def _attend(self, q, k, v, q_rank, k_rank, sc: Scope, options: RunOptions):
    """Causal attention over the compacted scope: slot j < sc.length sits at rank k_rank[j]
    (ascending; j itself but in a block-cyclic mesh part), the kernel's causal mask counting
    slots from sc.q_offset."""
    if options.route.is_reference:
      # CPU: the jnp path stops at the longest scope instead of scoring all N padded slots.
      slots = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
      k_pos = jnp.where(slots < sc.length[:, None], k_rank, -1)
      return attention(q, k, v, q_rank, k_pos, kv_extent=jnp.max(sc.length))
    return pallas_kernels.flash_attention(q, k, v, causal=True, q_offset=sc.q_offset,
                                          kv_len=sc.length, kv_layout="BHTD",
                                          route=options.route)


@register
@dataclasses.dataclass(frozen=True)
class MeshReAttention(ReAttention):
  """ReAttention with its pre-RoPE cache split along the tokens over the mesh's `ctx` axis, so a
  context N times longer than one device holds fits N devices (the paper's defaults). A step is
  ReAttention's with each part made distributed (`ctx.tokens`; methods/token_layout.py):

  - write: the device owning a new token's position stores its K/V; the others drop it;
  - scope: each device takes its shard's top-k candidates per query and head (the candidate
    range cut to its shard), the candidates of every device are gathered (k scores and global
    indices each, small) and the global top-k taken from them, ties to the lowest global index
    as one device breaks them; the votes, spans and the compacted scope then run replicated:
    every device holds the scope one device would select;
  - attend_scope: each device attends the step's queries to the part of the scope it holds
    (out, lse) and the parts merge exactly by their log-sum-exp.

  So it computes what `reattention` does (the same scope; outputs equal up to float rounding)
  with 1/N of the cache a device; on one device it is `reattention`. shard_block (no paper has
  it): 0, contiguous shards; > 0 (a multiple of `chunk`), blocks of that many tokens dealt to
  the devices in turn, which balances the causal prefill's scoring (TokenLayout)."""

  name = "reattention_mesh"
  splits_tokens = True
  int4_refusal = ""  # a 4-bit key group lies in one shard: KVCache.write_shard

  shard_block: int = 0

  def init_state(self, cfg, batch, max_len, dtype, chunk) -> KVCache:
    if self.shard_block < 0 or self.shard_block % self.chunk:
      raise MethodError(f"shard_block={self.shard_block} must be 0 (contiguous shards) or a "
                        f"multiple of the chunk ({self.chunk}): a step's tokens must lie in one "
                        "device's block")
    g = quant4.format_of(dtype).group if is_int4_dtype(dtype) else 1
    if self.shard_block % g:
      raise MethodError(f"shard_block={self.shard_block} must be a multiple of the 4-bit "
                        f"cache's key group ({g}): a group must lie in one block")
    return super().init_state(cfg, batch, max_len, dtype, chunk)

  def cache_unit(self, shards: int, kv_dtype=None) -> int:
    # Whole blocks on every device; in 4 bits whole key groups too (one device rounds its
    # slots up to whole groups itself).
    block = max(self.shard_block, 1)
    grouped = is_int4_dtype(kv_dtype) and shards > 1
    return shards * (math.lcm(block, quant4.format_of(kv_dtype).group) if grouped else block)

  def write(self, state: KVCache, k, v, ctx: AttnContext) -> KVCache:
    layout, p = layout_here(ctx.tokens, state.max_len, self.shard_block)
    g = state.k.main.group if isinstance(state.k, quant4.GroupedKeys) else 1
    # Another shard's tokens go to slot t, which the write drops (a negative index would wrap).
    return state.write_shard(ctx.q_pos, layout.slot(ctx.q_pos, p), k, v,
                             capacity=state.max_len * layout.n_dev,
                             group_here=lambda groups: layout.slot(groups * g, p) // g,
                             route=ctx.options.route, valid=ctx.valid)

  def here(self, state: KVCache, tokens: TokenShards) -> KVCache:
    """This device's shard as a cache of its own, as every read takes it (a 4-bit residual key
    group at its slot here, or none where another shard holds it)."""
    if not isinstance(state.k, quant4.GroupedKeys):
      return state
    layout, p = layout_here(tokens, state.max_len, self.shard_block)
    return state.shard_view(layout.slot(state.k.residual_group * state.k.main.group, p))

  def scope(self, state: KVCache, q, ctx: AttnContext) -> Scope:
    state = self.here(state, ctx.tokens)
    layout, p = layout_here(ctx.tokens, state.max_len, self.shard_block)
    seq_end, hi = step_bounds(ctx.q_pos, ctx.valid, self.n_local)
    q, valid = voters(q, ctx.valid, self.vote_stride)
    scores, idx = candidates(q, state.k, layout.held_below(self.n_global, p),
                             layout.held_below(hi, p), self.top_k, route=ctx.options.route)
    idx = jnp.where(idx >= 0, layout.position(idx, p), -1)
    idx = global_top_k(scores, idx, min(self.top_k, state.max_len * layout.n_dev), ctx.tokens,
                       contiguous=not self.shard_block)
    return scope_from_votes(ctx.heads.concat(ballots(idx, valid), axis=1), ctx.q_pos,
                            seq_end, hi,
                            n_global=self.n_global, n_local=self.n_local, span=self.span,
                            clip=self.clip, n_tokens=state.max_len * layout.n_dev,
                            route=ctx.options.route)

  def attend_scope(self, q, state: KVCache, sc: Scope, ctx: AttnContext):
    part = device_part(sc, *layout_here(ctx.tokens, state.max_len, self.shard_block))
    out, lse = super().attend_scope(q, self.here(state, ctx.tokens), part, ctx)
    out, lse = ctx.tokens.merge(out, lse)
    return out.astype(q.dtype), lse
