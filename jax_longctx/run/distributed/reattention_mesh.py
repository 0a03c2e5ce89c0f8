"""ReAttention over a mesh axis: the pre-RoPE cache split along the tokens, one shard per device.

Every layer's step runs inside `jax.shard_map` with the activations replicated and the cache of
sequence b, tokens 0..T-1, split into N contiguous shards of T/N tokens (device p: tokens
p*T/N .. (p+1)*T/N - 1). A step (a prefill chunk or one decode token) is the one-device step
(`methods.reattention.ReAttention.step`) with each of its three parts made distributed:

- write: the device owning a new token's position stores its pre-RoPE K/V; the others drop it.
- scope: each device takes its shard's top-k candidates per query and head (the candidate range
  n_global..seq_end-n_local cut to its shard); the candidates of every device are all-gathered
  (k scores and global indices each, small) and the global top-k taken from them, ties to the
  lowest global index as one device's `topk_scores` breaks them. The votes, clip, spans and the
  compacted scope then run replicated: every device holds the scope one device would select.
- attend_scope: the scope's indices ascend, so the entries inside device p's shard are the
  contiguous slots [a_p, b_p) of the scope, at ranks a_p..b_p-1. Each device attends the step's
  queries (ranks q_offset + i) to its part causally by rank, counted from a_p (RoPE is
  relative), giving (out, lse); a device whose part is empty, or whose keys all follow a query,
  gives lse = -inf there. The parts merge exactly by their log-sum-exp (`merge_across`).

So mesh ReAttention computes what one device does (the same scope; outputs equal up to float
rounding) with 1/N of the cache per device. RESA over it (`ShardedRESA`) keeps its prior's
vectors replicated and merges the shards' parts of the prior's sums and attentions.

The driver below (`generate_sharded`) is the generic chunked prefill, end-of-prefill hook and
decode loop run per device on the mesh (run/sharding.py: the cache's tokens over `ctx`, and on
a 2-D mesh its heads over `model`, the weights `model.place`d); with several processes
(`jax.distributed`, one per GPU) the mesh spans them all as Star's does (`driver`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

import pallas_kernels
from jax_longctx.core.mesh import axis_size, make_mesh
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.methods.base import AttnContext, MeshMethod
from jax_longctx.methods.reattention import ReAttention, ReAttentionSettings
from jax_longctx.methods.reattention_scope import (Scope, ballots, candidates, scope_from_votes,
                                                   step_bounds, voters)
from jax_longctx.methods.resa import MeshRESA, RESA
from jax_longctx.ops.cache import Cache, KVCache
from jax_longctx.run import sharding
from jax_longctx.run.chunked_prefill import end_prefill, read_chunks
from jax_longctx.run.distributed.attention import merge_across
from jax_longctx.run.distributed.shard_layout import TokenLayout
from jax_longctx.run.generation import (GenerationError, GenerationResult, Sampling, check_prompts,
                                        decode)


def global_top_k(scores, idx, top_k: int, axis: str, contiguous: bool = True):
  """Every device's candidates (scores, global idx) [B, S, H, k], best first and ties to the
  lower index -> the top_k of their union [B, S, H, top_k] idx, identical on every device.

  `lax.top_k` keeps the earlier of equal values, so equal scores must sit in ascending global
  index: gathered device-major they do when the devices hold ascending token ranges
  (`contiguous`); a block-cyclic layout sorts them by index first. Ties then go to the lowest
  index, as one device's top-k over the whole cache. Holes (-inf, -1) sort last and stay -1."""
  s = jax.lax.all_gather(scores, axis, axis=3, tiled=True)  # [B, S, H, N * k]
  i = jax.lax.all_gather(idx, axis, axis=3, tiled=True)
  if not contiguous:
    order = jnp.argsort(i, axis=3, stable=True)
    s, i = jnp.take_along_axis(s, order, axis=3), jnp.take_along_axis(i, order, axis=3)
  _, at = jax.lax.top_k(s, top_k)
  return jnp.take_along_axis(i, at, axis=3)


def shard_part(sc: Scope, base, size: int) -> Scope:
  """The part of scope `sc` in tokens base..base+size-1, as a Scope over that shard's slots.

  sc.idx ascends over its valid slots, so the part is the slots [first, first + count). Its
  ranks count from `first`: a query at rank q_offset + i and a key at first + j score as at
  q_offset - first + i and j (RoPE is relative). Padded to min(N, size) slots."""
  n = sc.idx.shape[1]
  live = jnp.arange(n)[None, :] < sc.length[:, None]  # [B, N]
  first = jnp.sum(live & (sc.idx < base), axis=1, dtype=jnp.int32)  # [B]
  count = jnp.sum(live & (sc.idx < base + size), axis=1, dtype=jnp.int32) - first
  j = jnp.arange(min(n, size), dtype=jnp.int32)[None, :]
  idx = jnp.take_along_axis(sc.idx, jnp.minimum(first[:, None] + j, n - 1), axis=1) - base
  return Scope(jnp.where(j < count[:, None], idx, 0).astype(jnp.int32), count,
               sc.q_offset - first)


def cyclic_part(sc: Scope, layout: TokenLayout, p) -> Scope:
  """The part of scope `sc` that device p holds in a block-cyclic layout, compacted into
  min(N, t_local) slots: its entries (ascending, as the scope's) with their scope ranks; the
  causal mask counts the part's entries before the step's first query. The step's own tokens
  (one prefill chunk inside one block, or one decode token) are all this part's last entries
  on the device that holds them and none on the others, so the mask by slot is the mask by
  rank."""
  b, n = sc.idx.shape
  m = min(n, layout.t_local)
  rank = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (b, n))
  held = (rank < sc.length[:, None]) & (layout.owner(sc.idx) == p)
  dest = jnp.where(held, jnp.cumsum(held, axis=1) - 1, m)  # m: dropped
  rows = jnp.arange(b)[:, None]
  empty = jnp.zeros((b, m), jnp.int32)
  idx = empty.at[rows, dest].set(layout.slot(sc.idx, p).astype(jnp.int32), mode="drop")
  k_rank = empty.at[rows, dest].set(rank, mode="drop")
  count = jnp.sum(held, axis=1, dtype=jnp.int32)
  before = jnp.sum(held & (rank < sc.q_offset[:, None]), axis=1, dtype=jnp.int32)
  return Scope(idx, count, before, k_rank, sc.q_offset)


def device_part(sc: Scope, layout: TokenLayout, p) -> Scope:
  """The part of scope `sc` in device p's shard, over its slots."""
  if layout.block:
    return cyclic_part(sc, layout, p)
  return shard_part(sc, layout.position(0, p), layout.t_local)


@dataclasses.dataclass(frozen=True)
class ShardedReAttention(ReAttention):
  """ReAttention inside `shard_map` over `axis`: one layer's state is this device's shard of the
  cache, KVCache [B, KV, T/N, d]. Not a registry entry (the entry is `reattention_mesh`)."""

  splits_tokens = True

  axis: str = "ctx"
  block: int = 0  # TokenLayout.block: 0 contiguous shards, else blocks dealt to the devices

  def write(self, state: KVCache, k, v, ctx: AttnContext) -> KVCache:
    layout, p = here(self.axis, state, self.block)
    # Another shard's tokens go to slot t, which the write drops (a negative index would wrap).
    return state.write(layout.slot(ctx.q_pos, p), k, v, ctx.options.cache_write_backend)

  def scope(self, state: KVCache, q, ctx: AttnContext) -> Scope:
    layout, p = here(self.axis, state, self.block)
    seq_end, hi = step_bounds(ctx.q_pos, ctx.valid, self.n_local)
    q, valid = voters(q, ctx.valid, self.vote_stride)
    scores, idx = candidates(q, state.k, layout.held_below(self.n_global, p),
                             layout.held_below(hi, p), self.top_k, self.backend,
                             ctx.options.kernels)
    idx = jnp.where(idx >= 0, layout.position(idx, p), -1)
    idx = global_top_k(scores, idx, min(self.top_k, state.max_len * layout.n_dev), self.axis,
                       contiguous=not self.block)
    return scope_from_votes(ctx.heads.concat(ballots(idx, valid), axis=1), ctx.q_pos,
                            seq_end, hi,
                            n_global=self.n_global, n_local=self.n_local, span=self.span,
                            clip=self.clip, n_tokens=state.max_len * layout.n_dev,
                            backend=self.backend)

  def attend_scope(self, q, state: KVCache, sc: Scope, ctx: AttnContext):
    part = device_part(sc, *here(self.axis, state, self.block))
    out, lse = super().attend_scope(q, state, part, ctx)
    out, lse = merge_across(out, lse, self.axis)
    return out.astype(q.dtype), lse


@dataclasses.dataclass(frozen=True)
class ShardedRESA(RESA):
  """RESA over ShardedReAttention inside `shard_map`: the wrapped cache is this device's shard,
  the prior's vectors are replicated; its attention over the prompt and over the scope merge
  the devices' parts (the key sum by psum, the rest by LSE)."""

  splits_tokens = True

  axis: str = "ctx"
  block: int = 0  # as ShardedReAttention's

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "inner", sharded(self.inner, self.axis, self.block))

  def prior_over_cache(self, mu_q, cache: KVCache, lengths,
                       options: pallas_kernels.KernelOptions = pallas_kernels.KernelOptions()):
    layout, p = here(self.axis, cache, self.block)
    held = layout.held_below(lengths, p)  # this shard's prompt slots: its first ones
    k_sum, o_est, lse_p = super().prior_over_cache(mu_q, cache, held, options)
    o_est, lse_p = merge_across(o_est, lse_p, self.axis)
    return jax.lax.psum(k_sum, self.axis), o_est, lse_p

  def prior_over_scope(self, mu_q, cache: KVCache, sc: Scope):
    part = device_part(sc, *here(self.axis, cache, self.block))
    return merge_across(*super().prior_over_scope(mu_q, cache, part), self.axis)


Sharded = ShardedReAttention | ShardedRESA


def here(axis: str, cache: KVCache, block: int) -> tuple[TokenLayout, jax.Array]:
  """(the cache's layout over `axis`, this device's index), inside shard_map."""
  return TokenLayout(jax.lax.axis_size(axis), cache.max_len, block), jax.lax.axis_index(axis)


def sharded(method, axis: str = "ctx", block: int | None = None) -> Sharded:
  """The per-device method of a setting: `reattention_mesh` (or a one-device `reattention`) ->
  ShardedReAttention; `resa_mesh` (or `resa` over reattention) -> ShardedRESA. block: the
  layout (TokenLayout.block); None takes the entry's `shard_block` (0 for a one-device method)."""
  if block is None:
    block = method.shard_block if isinstance(method, MeshMethod) else 0
  if isinstance(method, MeshRESA):
    method = method.layer_method()
  if isinstance(method, RESA):
    if not method.pre_rope:
      raise GenerationError(f"resa over a mesh wraps reattention, not {method.inner.name!r}")
    settings = {f.name: getattr(method, f.name) for f in dataclasses.fields(RESA) if f.init}
    out = ShardedRESA(**settings, axis=axis, block=block)
  else:
    fields = {f.name: getattr(method, f.name) for f in dataclasses.fields(ReAttentionSettings)}
    out = ShardedReAttention(**fields, axis=axis, block=block)
  chunk = out.prefill_chunk
  if block < 0 or block % chunk:
    raise GenerationError(f"shard_block={block} must be 0 (contiguous shards) or a multiple of "
                          f"the chunk ({chunk}): a step's tokens must lie in one device's block")
  return out


def cache_unit(method: Sharded, n_dev: int) -> int:
  """cache_len over n_dev devices must be a multiple of this (whole blocks on every device)."""
  return n_dev * max(method.block, 1)


def check_cache_len(cache_len: int, method: Sharded, n_dev: int):
  if cache_len % cache_unit(method, n_dev):
    what = (f"the {n_dev} devices of the mesh axis (each holds an equal contiguous shard)"
            if not method.block else
            f"{n_dev} devices x shard_block={method.block} (each holds whole blocks)")
    raise GenerationError(f"cache_len={cache_len} is not divisible by {what}")


def on_mesh(mesh, options: RunOptions) -> RunOptions:
  """The run's options with the mesh (any with a `ctx` axis; `model` splits the heads too)."""
  mesh = make_mesh(mesh)
  if axis_size(mesh, "data") > 1:
    raise GenerationError("mesh ReAttention runs on the ctx and model axes: data must be 1")
  return options.replace(mesh=mesh)


def prefill_sharded(params, cfg, prompts: Sequence[Sequence[int]], method,
                    mesh, *, cache_len: int,
                    on_chunk: Callable[[int, int, jax.Array], None] | None = None,
                    options: RunOptions = DEFAULT):
  """The prompts read whole in the method's chunks into a cache split along the tokens over the
  mesh's `ctx` axis (and along the heads over `model`; params `model.place`d there). method: a
  mesh entry, `reattention_mesh` or `resa_mesh`, or its one-device setting. Returns (cache,
  last-token logits [B, V]); progress on stderr. on_chunk(i, n, last) after chunk i of n is
  dispatched (benchmarks time the chunks through it)."""
  return _prefill(params, cfg, prompts, check_prompts(prompts, cache_len=cache_len), method,
                  on_mesh(mesh, options), cache_len=cache_len, on_chunk=on_chunk)


def _prefill(params, cfg, prompts, lengths, method, options, *, cache_len, on_chunk):
  """`prefill_sharded` after its prompt check: the generic chunk loop on the mesh."""
  method = sharded(method)
  check_cache_len(cache_len, method, axis_size(options.mesh, "ctx"))
  chunk = method.prefill_chunk
  cache = sharding.empty_cache(cfg, method, len(prompts), cache_len, chunk, options)
  cache, last = read_chunks(params, cfg, method, cache, prompts, lengths, chunk, options,
                            on_chunk=on_chunk, desc="mesh prefill")
  return end_prefill(cache, cfg, method, decode_room=0, options=options), last  # room: unread


def decode_sharded(params, cfg, cache: Cache, last_logits, method, mesh, *,
                   max_new_tokens: int, sampling: Sampling = Sampling(), stop_tokens=(),
                   options: RunOptions = DEFAULT):
  """The decode loop over a sharded cache. Returns (new tokens per row, stop excluded; cache)."""
  return decode(params, cfg, cache, last_logits, sharded(method), max_new_tokens=max_new_tokens,
                sampling=sampling, stop_tokens=stop_tokens, options=on_mesh(mesh, options))


def generate_sharded(params, cfg, prompts: Sequence[Sequence[int]], method,
                     mesh, *, max_new_tokens: int,
                     sampling: Sampling = Sampling(), stop_tokens=(),
                     cache_len: int | None = None,
                     options: RunOptions = DEFAULT) -> GenerationResult:
  """Mesh ReAttention (or RESA over it) end to end: prefill, then up to max_new_tokens per
  prompt. cache_len None: the longest prompt plus max_new_tokens, rounded up to whole shards
  (a multiple of 128 and of `cache_unit`)."""
  options = on_mesh(mesh, options)
  n_ctx = axis_size(options.mesh, "ctx")
  lengths = check_prompts(prompts, cache_len=cache_len, new_tokens=max_new_tokens)
  if cache_len is None:
    unit = math.lcm(128, cache_unit(sharded(method), n_ctx))
    cache_len = -(-(max(lengths) + max_new_tokens) // unit) * unit
  t0 = time.perf_counter()
  cache, last = _prefill(params, cfg, prompts, lengths, method, options, cache_len=cache_len,
                         on_chunk=None)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  rows, cache = decode(params, cfg, cache, last, sharded(method), max_new_tokens=max_new_tokens,
                       sampling=sampling, stop_tokens=stop_tokens, options=options)
  return GenerationResult(rows, cache, lengths, t1 - t0, time.perf_counter() - t1)
