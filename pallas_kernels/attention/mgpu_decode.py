"""One-token decode attention over an 8-bit K/V cache on Hopper's tensor cores (Mosaic GPU).

The Triton split-K kernel (flash.py) multiplies a decode step's few query rows (the query heads
of one KV head: 4 for Llama-3-8B) as a 16-row block with each key tile, so its softmax work runs
on four times the rows it needs, and on an H200 it reads an int8 cache at 76% of copy bandwidth,
bound by latency at low occupancy (BENCHMARKS.md "int8 decode: the kernel profiled"). Here the
products are turned around, the keys being many and the rows few:

- S^T = K Q^T: a key tile [bk, d] is WGMMA's A operand as stored (int8, K-major), the rows'
  queries its B (quantized per row as the keys are, as KernelOptions.decode_int8_products:
  int8 x int8 -> s32, exact), N = ROWS columns: a warpgroup holds a score tile of [bk, ROWS],
  8 values a thread at bk = 64.
- O^T += V^T P^T: an 8-bit WGMMA operand must be K-major, and a value tile's keys are its major
  axis, so each value tile is converted to the queries' dtype into SMEM (exact: |v| <= 127);
  the values' scales multiply the probabilities instead. P^T [bk, ROWS] goes to SMEM as the B
  operand (N-major, which 16-bit operands allow), in the swizzle of its 32-byte rows, which the
  converted values take too (WGMMA asks both operands' swizzles to match).
- A CTA is one compute warpgroup and one TMA warpgroup, two CTAs a core. The TMA warpgroup
  streams the key tiles and both scales into a ring, and the value tiles into a landing ring
  that it converts into the value ring: the conversion runs beside the compute warpgroup's
  chain (products, softmax, products), not in it. The column max crosses the compute
  warpgroup's warps by warp shuffles and one exchange through SMEM (DecodeOps.column_max).

Split-K over the grid (batch x kv head, key split), each split's (out^T [d, ROWS], lse [ROWS])
merged as the Triton kernel's (split_merge, rows_minor). One query token a sequence at position
q_offset[b] sees keys t < kv_len[b] (and t <= q_offset[b] if causal). Keys stored less an offset
are the caller's (flash_attention splits it off first).

Off a GPU the kernel runs in jax's Mosaic GPU interpreter (`interpret=True`, native=False: plain
dot products of the SMEM tiles stand in for WGMMA and identity casts for layout casts, as in
mgpu_flash); the native code lowers on a CPU (tests) and runs on the GPU in
benchmarks/decode_loop.py.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant
from pallas_kernels.attention.mgpu_decode_compute import compute
from pallas_kernels.attention.mgpu_decode_ops import (EXCHANGE, REDUCTION_SCRATCH, ROWS, launch,
                                                     tile_start)
from pallas_kernels.decode import split_merge
from pallas_kernels.mgpu_common import (DTYPES, HEAD_DIMS, keyrows,
                                        operand_transforms, plgpu,
                                        returns_when_done_if_interpreted, scale_rows)

__all__ = ["DecodeConfig", "ROWS", "attention", "smem_bytes", "tiled", "unsupported"]

SMEM_PER_CORE = 228 * 1024  # a Hopper core's; each CTA also takes 1 KiB the driver reserves


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """block_kv: keys a tile (a multiple of 64: WGMMA's M); stages: key tiles in flight and value
  tiles converted ahead, a CTA; landing: value tiles in flight as stored; per_core: CTAs a GPU
  core the split plan aims at (gpu.split_plan); auto_barriers: Mosaic's warpgroup barriers
  around every SMEM load and store (False: only the kernel's own, at each commit_smem; safe
  here, as no thread reads SMEM it wrote and every SMEM read by the tensor cores follows a
  commit_smem). The defaults: the best of sweeps at 128K and 512K keys and at 14 sequences of
  128K on an H200 (BENCHMARKS.md), 72 KiB of SMEM a CTA, two CTAs a core. The kernel takes 80
  registers a thread, so a third CTA of 256 threads just fits (3 x 256 x 80 of 64K): 1.6% faster
  at 14 sequences, but one register more and the plan's third CTA runs as a second wave (88
  registers did: 1.25x slower at 128K), so two."""
  block_kv: int = 64
  stages: int = 2
  landing: int = 2
  per_core: int = 2
  auto_barriers: bool = False

  def __post_init__(self):
    if self.block_kv % 64 or min(self.stages, self.landing) < 2 or self.per_core < 1:
      raise ValueError(f"{self}: block_kv a multiple of 64, stages and landing at least 2, "
                       "per_core >= 1")


DEFAULT_CONFIG = DecodeConfig()


def tiled(config: DecodeConfig, tiling) -> DecodeConfig:
  """config with a per-call gpu.Tiling(impl="mosaic") applied, as gpu.mosaic_tiling does for the
  other Mosaic kernels: block_keys and num_stages are block_kv and stages (key_splits goes to the
  split plan); the Triton kernels' other fields are refused, not dropped."""
  if tiling is None or tiling.impl != "mosaic":
    return config
  if tiling.block_rows or tiling.num_warps or tiling.prefetch:
    raise ValueError(f"{tiling}: the Mosaic decode kernel takes block_keys, num_stages and "
                     "key_splits (its rows are a KV head's query heads, its warps fixed)")
  return dataclasses.replace(config, block_kv=tiling.block_keys or config.block_kv,
                             stages=tiling.num_stages or config.stages)


def smem_bytes(config: DecodeConfig, d: int, itemsize: int = 2) -> int:
  """Q, the key ring (8-bit, with both scales), the value landing ring (8-bit), the converted
  value ring, P^T, reduction scratch and barriers."""
  bk, n = config.block_kv, ROWS
  return (n * d + config.stages * bk * (d + 8) + config.landing * bk * d
          + config.stages * bk * d * itemsize + bk * n * itemsize + REDUCTION_SCRATCH
          + 4 * math.prod(EXCHANGE) + 512)


def unsupported(q, k, v, *, kv_layout: str, config: DecodeConfig = DEFAULT_CONFIG) -> str | None:
  """Why this kernel cannot run the call (None: it can)."""
  b, lq, h, d = q.shape
  t, kvh = (k.shape[1], k.shape[2]) if kv_layout == "BTHD" else (k.shape[2], k.shape[1])
  if plgpu is None:
    return "this jaxlib has no Mosaic GPU"
  if not (quant.is_quantized(k) and quant.is_quantized(v)):
    return "needs an 8-bit cache"
  if q.dtype not in DTYPES or k.dtype != jnp.int8 or v.dtype != k.dtype:
    # E4M3 would multiply queries rounded to 3 mantissa bits: the LSE moved by up to 0.8 on
    # random inputs with outlier channels (int8's: 2e-6 against the same products in jnp).
    return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: needs bf16 or fp16 q and int8 k, v"
  if lq != 1:
    return f"{lq} queries: one-token decode only"
  if h // kvh > ROWS:
    return f"{h // kvh} query heads a KV head: at most {ROWS}"
  if d not in HEAD_DIMS:
    return f"head dim {d} not in {HEAD_DIMS}"
  if t < config.block_kv or t % 8:
    return f"{t} keys: needs at least {config.block_kv} and a multiple of 8 (TMA)"
  fits = min(SMEM_PER_CORE // config.per_core, 227 * 1024 + 1024) - 1024
  if (need := smem_bytes(config, d, q.dtype.itemsize)) > fits:
    return (f"{config} needs {need} bytes of SMEM a CTA at d={d}; {config.per_core} a core "
            f"fit {fits}")
  return None


def attention(q, k, v, q_offset, kv_len, *, causal: bool, scale: float, kv_layout: str,
              merge_kernel: bool, key_splits: int | None = None,
              config: DecodeConfig = DEFAULT_CONFIG, interpret=False):
  """flash_attention for one query token over an 8-bit cache: q [B, 1, H, d]; k, v
  quant.Quantized [B, T, KV, d] (BTHD) or [B, KV, T, d] (BHTD) without key offsets; q_offset,
  kv_len int32 [B]. Returns (out [B, 1, H, d] in q's dtype, lse [B, 1, H] fp32). key_splits:
  the split plan's override; merge_kernel: the splits merged by split_merge's kernel."""
  b, _, h, d = q.shape
  t, kvh = (k.shape[1], k.shape[2]) if kv_layout == "BTHD" else (k.shape[2], k.shape[1])
  if why := unsupported(q, k, v, kv_layout=kv_layout, config=config):
    raise ValueError(f"mgpu_decode: {why}")
  group = h // kvh
  span, splits = gpu.split_plan(b * kvh, t, config.block_kv, key_splits,
                                per_core=config.per_core)
  # One query token: its rows are a reshape of q. Quantized as the keys are and padded with
  # zero rows (scale 1; their columns are computed and dropped), one XLA fusion beside the
  # projections' (repeating the real rows took a gather of its own).
  q8 = quant.quantize(q.reshape(b, kvh, group, d), k.dtype)
  rows = ((0, 0), (0, 0), (0, ROWS - group), (0, 0))
  meta = jnp.stack([q_offset, kv_len], axis=1).astype(jnp.int32)
  (kk, ks), (vv, vs) = layout.parts(k), layout.parts(v)
  parts = split_merge.parts(splits, merge_kernel)
  # The rows' scales go in as they are: the kernel reads them as scalars (a padded copy for a
  # TMA was one more XLA launch a layer, ~1.1 us at the 8B's step on an H200).
  outs, lses = _kernel(meta, jnp.pad(q8.values, rows), q8.scale[..., 0], kk,
                       scale_rows(ks, kv_layout), vv, scale_rows(vs, kv_layout), dtype=q.dtype,
                       span=span, parts=parts, scale=scale, causal=causal, kv_layout=kv_layout,
                       config=config, interpret=interpret)
  out, lse = split_merge.merge(outs, lses, splits=splits, rows=group, dtype=q.dtype,
                               kernel=merge_kernel, interpret=interpret is not False,
                               rows_minor=True)
  return (layout.from_rows(out, 1, h).astype(q.dtype), layout.from_rows(lse, 1, h))


@dataclasses.dataclass(frozen=True)
class _Dims:
  t: int  # keys in the arrays
  d: int
  kvh: int
  span: int  # keys a split, a multiple of block_kv


@returns_when_done_if_interpreted
@functools.partial(jax.jit, static_argnames=("dtype", "span", "parts", "scale", "causal",
                                             "kv_layout", "config", "interpret"))
def _kernel(meta, q8, q_scale, k, k_scale, v, v_scale, *, dtype, span, parts, scale, causal,
            kv_layout, config, interpret=False):
  """Per-split (out^T [B, KV, parts, d, ROWS], lse [B, KV, parts, ROWS]) fp32; entries past the
  grid's splits (parts: split_merge's power of two) are left unwritten. q8 [B, KV, ROWS, d]
  (zero rows past the group's), q_scale [B, KV, group]."""
  b, kvh, _, d = q8.shape
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  dims = _Dims(t=t, d=d, kvh=kvh, span=span)
  native = interpret is False
  body = functools.partial(_entry, dims=dims, cfg=config, causal=causal, kv_layout=kv_layout,
                           native=native, dtype=jnp.dtype(dtype), scale=scale)
  return launch(body, b, dims, parts, config, interpret)(meta, q8, q_scale, k, k_scale, v,
                                                          v_scale)


def _entry(meta_ref, q_ref, c_ref, k_ref, ks_ref, v_ref, vs_ref, o_ref, lse_ref, *, dims, cfg,
           dtype, **kw):
  """Allocates the CTA's SMEM and barriers and runs its two warpgroups."""
  eight = k_ref.dtype
  bk, st, nl = cfg.block_kv, cfg.stages, cfg.landing
  operand = operand_transforms(eight, dims.d)
  landed = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))  # _convert's chunks
  narrow = operand_transforms(dtype, ROWS)  # P^T's 32-byte rows, and the values to match
  smem = _Smem(q=plgpu.SMEM((ROWS, dims.d), eight, transforms=operand),  # quantized
               k=plgpu.SMEM((st, bk, dims.d), eight, transforms=operand),
               k_scale=plgpu.SMEM((st, bk), jnp.float32),
               v_scale=plgpu.SMEM((st, bk), jnp.float32),
               v8=plgpu.SMEM((nl, bk, dims.d), eight, transforms=landed),  # as stored
               v=plgpu.SMEM((st, bk, dims.d), dtype, transforms=narrow),  # converted
               p=plgpu.SMEM((bk, ROWS), dtype, transforms=narrow),  # P^T
               exchange=plgpu.SMEM(EXCHANGE, jnp.float32))
  ring = lambda: plgpu.Barrier(num_barriers=st)  # noqa: E731  (one arrival each)
  barriers = _Barriers(q=plgpu.Barrier(num_barriers=1), k=ring(), k_scale=ring(),
                       v_scale=ring(), v8=plgpu.Barrier(num_barriers=nl), v=ring(),
                       k_free=ring(), v_free=ring())
  refs = (meta_ref, q_ref, c_ref, (k_ref, ks_ref, v_ref, vs_ref), o_ref, lse_ref)
  pl.run_scoped(lambda s, b: _cta(refs, _Smem(*s), _Barriers(*b), dims=dims, cfg=cfg,
                                  dtype=dtype, **kw),
                tuple(smem), tuple(barriers), collective_axes="wg")


class _Smem(NamedTuple):
  q: object
  k: object  # ring of `stages` key tiles, as stored (WGMMA's A)
  k_scale: object
  v_scale: object  # the value tiles' scales, beside their keys'
  v8: object  # ring of `landing` value tiles as they land
  v: object  # ring of `stages` value tiles converted by the TMA warpgroup (WGMMA's A, viewed)
  p: object
  exchange: object  # the column max's (DecodeOps.column_max)


class _Barriers(NamedTuple):
  q: object  # Q
  k: object  # key tile landed; its scales, the value tile's scales
  k_scale: object
  v_scale: object
  v8: object  # value tile landed
  v: object  # value tile converted (an arrival of the TMA warpgroup)
  k_free: object  # key slot and both scales read by the compute warpgroup
  v_free: object  # value slot read (its product done)


def _cta(refs, smem, barriers, *, dims, cfg, causal, native, dtype, scale, memory=None,
         **memory_kw):
  """The CTA's sequence, KV head and keys: tiles [0, whole) need no mask, [whole, tiles) do.
  memory: the body of the warpgroups past the compute one (default `_memory`, the TMA
  warpgroup's, called with memory_kw); meta rows of 3 entries bound the keys by their third too
  (a 4-bit cache's residual group, read apart)."""
  meta_ref = refs[0]
  bh, split, wg = lax.axis_index("bh"), lax.axis_index("split"), lax.axis_index("wg")
  kvh = jnp.int32(dims.kvh)
  b, h = lax.div(bh, kvh), lax.rem(bh, kvh)
  q_off, kv_len = meta_ref[b, 0], meta_ref[b, 1]
  if meta_ref.shape[1] > 2:
    kv_len = jnp.minimum(kv_len, meta_ref[b, 2])
  bk = jnp.int32(cfg.block_kv)
  start0 = split * dims.span
  end = jnp.minimum(jnp.minimum(start0 + dims.span, kv_len), dims.t)
  if causal:
    end = jnp.minimum(end, q_off + 1)
  tiles = jnp.clip(lax.div(end - start0 + bk - 1, bk), 0, dims.span // cfg.block_kv)
  whole = jnp.clip(lax.div(end - start0, bk), 0, tiles)
  where = dict(b=b, h=h, start0=start0, end=end, tiles=tiles)

  @pl.when(wg == 0)
  def _():
    compute(refs, smem, barriers, whole=whole, split=split, dims=dims, cfg=cfg,
            native=native, dtype=dtype, scale=scale, **where)

  @pl.when(wg >= 1)
  def _():
    if memory is None:
      _memory(refs, smem, barriers, dims=dims, cfg=cfg, native=native, **memory_kw, **where)
    else:  # the kernel's own warpgroups past the compute one, each told which it is
      memory(refs, smem, barriers, wg=wg, dims=dims, cfg=cfg, native=native, **memory_kw,
             **where)


def _memory(refs, smem, barriers, *, dims, cfg, kv_layout, native, b, h, start0, tiles, **_):
  """TMA warpgroup: the key tiles, their scales and the value tiles' scales by TMA into their
  rings, `stages` ahead of the scores; the value tiles by TMA into a landing ring `landing`
  ahead, each then converted to the queries' dtype into the value ring once the compute
  warpgroup's product freed its slot. Converting there took the compute warpgroup's chain from
  399 to 280 us at 512K keys when left out (experiments/mgpu_decode_costs.py); here it runs
  beside it, in the 8-bit WGMMA register layout (4-byte SMEM loads and Mosaic's byte-permute
  conversion), the scales left to the probabilities."""
  k_ref, ks_ref, v_ref, vs_ref = refs[3]
  st, nl, bk = cfg.stages, cfg.landing, cfg.block_kv

  def copy(step, streams, slot):
    start = tile_start(start0, step, bk, dims.t)
    for ref, ring, landed in streams:
      src = (keyrows(ref, kv_layout, b, h, start, bk) if ref.ndim == 4
             else ref.at[b, h, pl.ds(start, bk)])
      plgpu.copy_gmem_to_smem(src, ring.at[slot], landed.at[slot])

  keys = ((k_ref, smem.k, barriers.k), (ks_ref, smem.k_scale, barriers.k_scale),
          (vs_ref, smem.v_scale, barriers.v_scale))
  values = ((v_ref, smem.v8, barriers.v8),)
  for j, (n, streams) in itertools.product(range(max(st, nl)), ((st, keys), (nl, values))):
    if j < n:
      pl.when(j < tiles)(functools.partial(copy, j, streams, j))

  @pl.loop(0, tiles)
  def _(step):
    slot, landing = lax.rem(step, jnp.int32(st)), lax.rem(step, jnp.int32(nl))
    plgpu.barrier_wait(barriers.v8.at[landing])

    @pl.when(step >= st)
    def _():
      plgpu.barrier_wait(barriers.v_free.at[slot])  # tile step - st's product done

    _convert(smem.v8.at[landing], smem.v.at[slot], native=native)
    plgpu.commit_smem()  # visible to the WGMMA; the landed tile read before it is refilled
    plgpu.barrier_arrive(barriers.v.at[slot])
    pl.when(step + nl < tiles)(lambda: copy(step + nl, values, landing))

    @pl.when(step + st < tiles)
    def _():
      plgpu.barrier_wait(barriers.k_free.at[slot])  # tile step's scores taken
      copy(step + st, keys, slot)

  @pl.loop(jnp.maximum(tiles - st, 0), tiles)
  def _(step):  # the last releases (as fill_ring: lets the interpreter see every phase)
    slot = lax.rem(step, jnp.int32(st))
    plgpu.barrier_wait(barriers.k_free.at[slot])
    plgpu.barrier_wait(barriers.v_free.at[slot])


def _convert(x8, out, *, native: bool):
  """out [n, d] (the queries' dtype, SMEM) = x8 [n, d] (int8 SMEM, tiled (8, 64)), exactly
  (|x| <= 127 fits bf16's and fp16's significands), in 64 x 64 chunks."""
  n, d = out.shape
  for r, c in itertools.product(range(0, n, 64), range(0, d, 64)):
    chunk = x8.at[pl.ds(r, 64), pl.ds(c, 64)]
    x = plgpu.load(chunk, (), layout=plgpu.Layout.WGMMA_8BIT) if native else chunk[...]
    out.at[pl.ds(r, 64), pl.ds(c, 64)][...] = x.astype(out.dtype)
