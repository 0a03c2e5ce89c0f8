"""One-token decode attention over a 4-bit cache (quant4: KIVI's layout) on Hopper (Mosaic GPU).

mgpu_decode.py's design with the 4-bit tiles dequantized beside the products. A CTA is one
compute warpgroup and two stream warpgroups, one for the keys and one for the values: each
streams its tiles' codes (two a byte) and their scales and zero points (per channel over a key
group of G tokens; per row and value group) by TMA into its landing ring and dequantizes each
tile into its ring in fp16 (code * scale + zero, one packed fma: mgpu_int4_tiles.py). The
compute warpgroup's chain is then 16-bit decode (S^T = K Q^T, the softmax, O^T += V^T P^T on
WGMMA), mgpu_decode_compute's, with the queries rounded to fp16 and no quantization launch.

Why dequantize rather than fold the scales into the query as int4_decode.py does: a tile of
keys spans key groups, each its own folded query, and a value tile's channels four value
groups, each its own probabilities; on WGMMA that is a stacked operand per group.

The residual group (each sequence's newest, unfilled key group, kept whole) is read apart, in
XLA (`_residual`, 9 us of the call at 128K keys): its (out, lse) go in as one more split of the
merge. Off a GPU the kernel runs in jax's Mosaic GPU interpreter, as mgpu_decode's (both
streams on one warpgroup there).

On an H200 at the 8B's attention shape (BENCHMARKS.md "A Mosaic GPU kernel for the 4-bit
decode"), the call at 128K keys takes 0.120-0.132 ms against int4_decode's 0.115-0.117 and the
int8 kernel's 0.108-0.111 in the same runs (14 sequences: 1.52 ms, the int8 kernel 1.24), so
int4_decode stays the default and this runs where a Tiling(impl="mosaic") asks for it. Its TMA
streams alone (compute and dequantization left out) take 80 us at batch 1 (2.5 TB/s: bound by
the latency of 48 KiB landing a core), the dequantization 37 us more, the compute 6; at 14
sequences the dequantization 583 of 1,516 us.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant4
from pallas_kernels.attention import mgpu_decode, mgpu_decode_ops
from pallas_kernels.attention import mgpu_int4_tiles
from pallas_kernels.attention.mgpu_decode_ops import ROWS
from pallas_kernels.decode import split_merge
from pallas_kernels.mgpu_common import (DTYPES, NEG_INF, operand_transforms,
                                        plgpu, returns_when_done_if_interpreted)

__all__ = ["DEFAULT_CONFIG", "attention", "smem_bytes", "unsupported"]

# One CTA a core, tiles of 128 keys: the best of a sweep at 128K keys on an H200 (the 8B's
# attention shape: 0.127 ms, 64-key tiles at 1-2 CTAs a core 0.139-0.160; BENCHMARKS.md).
DEFAULT_CONFIG = mgpu_decode.DecodeConfig(block_kv=128, stages=2, landing=2, per_core=1)


def smem_bytes(config: mgpu_decode.DecodeConfig, d: int, nv: int, itemsize: int = 2) -> int:
  """Q, the landing ring (both tiles' codes, the key groups' and value rows' fp32 scales and
  zero points), the dequantized key and value rings, P^T, reduction scratch and barriers."""
  bk, st, nl = config.block_kv, config.stages, config.landing
  landing = nl * (bk * d + 2 * 4 * (d * bk // 32 + bk * nv))  # key groups of >= 32 tokens
  return (ROWS * d * itemsize + landing + 2 * st * bk * d * itemsize + bk * ROWS * itemsize
          + mgpu_decode_ops.REDUCTION_SCRATCH + 4 * math.prod(mgpu_decode_ops.EXCHANGE) + 512)


def unsupported(q, k, v, *, config: mgpu_decode.DecodeConfig = DEFAULT_CONFIG) -> str | None:
  """Why this kernel cannot run the call (None: it can). k, v: the 4-bit cache (BHTD)."""
  if plgpu is None:
    return "this jaxlib has no Mosaic GPU"
  if not (isinstance(k, quant4.GroupedKeys) and isinstance(v, quant4.Int4)
          and v.axis == v.codes.ndim - 1):
    return "needs a 4-bit cache (keys grouped along tokens, values along channels)"
  _, lq, h, d = q.shape
  _, kvh, t, _ = k.shape
  g, vg, nv = k.main.group, v.group, d // v.group
  scales = (k.main.scale, k.main.zero, v.scale, v.zero)
  if q.dtype not in DTYPES or k.residual.dtype != q.dtype:
    return f"q {q.dtype}, residual keys {k.residual.dtype}: needs both bf16 or both fp16"
  if any(x.dtype != jnp.float32 for x in scales):
    return "needs fp32 scales and zero points (the 'int4' format)"
  if lq != 1:
    return f"{lq} queries: one-token decode only"
  if h // kvh > ROWS:
    return f"{h // kvh} query heads a KV head: at most {ROWS}"
  if d != 128:
    return f"head dim {d}: 128 only (a byte row of 64 fills a 64-byte swizzle)"
  if config.block_kv % g or g < 32 or vg % 32 or nv % 4:
    return (f"key groups of {g}, value groups of {vg}: key groups of >= 32 dividing "
            f"{config.block_kv}, value groups of 32 channels (a TMA row of 16 bytes of scales)")
  if t < config.block_kv or t % 8:
    return f"{t} keys: needs at least {config.block_kv} and a multiple of 8 (TMA)"
  fits = min(mgpu_decode.SMEM_PER_CORE // config.per_core, 227 * 1024 + 1024) - 1024
  if (need := smem_bytes(config, d, nv, q.dtype.itemsize)) > fits:
    return f"{config} needs {need} bytes of SMEM a CTA; {config.per_core} a core fit {fits}"
  return None


def attention(q, k: quant4.GroupedKeys, v: quant4.Int4, q_offset, kv_len, *, causal: bool,
              scale: float, merge_kernel: bool, key_splits: int | None = None,
              config: mgpu_decode.DecodeConfig = DEFAULT_CONFIG, interpret=False):
  """flash_attention for one query token over a 4-bit cache [B, KV, T, d]: q [B, 1, H, d];
  q_offset, kv_len int32 [B]. Returns (out [B, 1, H, d] in q's dtype, lse [B, 1, H] fp32)."""
  b, _, h, d = q.shape
  _, kvh, t, _ = k.shape
  if why := unsupported(q, k, v, config=config):
    raise ValueError(f"mgpu_int4_decode: {why}")
  group = h // kvh
  span, splits = gpu.split_plan(b * kvh, t, config.block_kv, key_splits,
                                per_core=config.per_core)
  res_start = k.residual_group * k.main.group  # [B]; T: none
  meta = jnp.stack([q_offset, kv_len, res_start], axis=1).astype(jnp.int32)
  # [B, KV, ROWS, d] in the tiles' dtype, zero rows past the group's
  qr = layout.q_rows(q, kvh, ROWS).astype(mgpu_int4_tiles.TILE_DTYPE)
  parts = split_merge.parts(splits + 1, merge_kernel)
  outs, lses = _kernel(meta, qr, k.main.codes, k.main.scale, k.main.zero, v.codes, v.scale,
                       v.zero, span=span, parts=parts, scale=scale, causal=causal,
                       key_group=k.main.group, config=config, interpret=interpret)
  # The residual group goes in as split `splits` (the kernel leaves it unwritten).
  r_out, r_lse = _residual(qr, k, v, q_offset, kv_len, res_start, causal=causal, scale=scale)
  outs = lax.dynamic_update_slice_in_dim(outs, r_out[:, :, None], splits, axis=2)
  lses = lax.dynamic_update_slice_in_dim(lses, r_lse[:, :, None], splits, axis=2)
  if not merge_kernel:
    outs, lses = outs[:, :, :splits + 1], lses[:, :, :splits + 1]
  out, lse = split_merge.merge(outs, lses, splits=splits + 1, rows=group, dtype=q.dtype,
                               kernel=merge_kernel, interpret=interpret is not False,
                               rows_minor=True)
  return (layout.from_rows(out, 1, h).astype(q.dtype), layout.from_rows(lse, 1, h))


def _residual(qr, k: quant4.GroupedKeys, v: quant4.Int4, q_offset, kv_len, res_start, *,
              causal: bool, scale: float):
  """(out^T [B, KV, d, ROWS], lse [B, KV, ROWS]) fp32 of the query rows over the residual
  group's keys (whole) and values (their codes at its slots); (0, -inf) where none is read."""
  t, g = k.shape[2], k.main.group
  slots = jnp.minimum(res_start, t - g)[:, None] + jnp.arange(g)  # [B, G]
  want = res_start[:, None] + jnp.arange(g)
  ok = (want < kv_len[:, None]) & (want < t)
  if causal:
    ok &= want <= q_offset[:, None]
  at = slots[:, None, :, None]  # [B, 1, G, 1] along the token axis
  rows = quant4.per_row(lambda x: jnp.take_along_axis(x, at, axis=2), v)
  vals = quant4.dequantize(rows, qr.dtype).astype(jnp.float32)  # [B, KV, G, d]
  keys = k.residual.astype(jnp.float32)
  s = jnp.einsum("bhrd,bhgd->bhrg", qr.astype(jnp.float32), keys) * scale
  s = jnp.where(ok[:, None, None, :], s, NEG_INF)
  m = s.max(axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(m == NEG_INF, 0.0, m))
  total = p.sum(axis=-1)
  out = jnp.einsum("bhrg,bhgd->bhdr", p, vals) / jnp.where(total > 0, total, 1.0)[:, :, None]
  lse = jnp.where(total > 0, m[..., 0] + jnp.log(jnp.where(total > 0, total, 1.0)), NEG_INF)
  return out, lse


@returns_when_done_if_interpreted
@functools.partial(jax.jit, static_argnames=("span", "parts", "scale", "causal", "key_group",
                                             "config", "interpret"))
def _kernel(meta, qr, kc, ka, kz, vc, va, vz, *, span, parts, scale, causal, key_group, config,
            interpret=False):
  """Per-split (out^T [B, KV, parts, d, ROWS], lse [B, KV, parts, ROWS]) fp32 of the keys below
  each sequence's residual group; entries past the grid's splits are left unwritten."""
  b, kvh, _, d = qr.shape
  t = kc.shape[2]
  dims = mgpu_decode._Dims(t=t, d=d, kvh=kvh, span=span)
  native = interpret is False
  body = functools.partial(_entry, dims=dims, cfg=config, causal=causal, native=native,
                           scale=scale, key_group=key_group)
  # Natively the compute warpgroup and one for each stream; interpreted, two (see _memory).
  return mgpu_decode_ops.launch(body, b, dims, parts, config, interpret, 3 if native else 2)(
      meta, qr, kc, ka, kz, vc, va, vz)


class _Landing(NamedTuple):
  """A landing ring: one tile's codes and its scales and zero points as stored."""
  codes: object  # [nl, bk, d / 2] uint8
  scale: object  # keys [nl, bk / G, d] (their groups'), values [nl, bk, d / vg] (their rows')
  zero: object


def _entry(meta_ref, q_ref, kc_ref, ka_ref, kz_ref, vc_ref, va_ref, vz_ref, o_ref, lse_ref, *,
           dims, cfg, key_group, **kw):
  """Allocates the CTA's SMEM and barriers and runs its warpgroups (mgpu_decode._cta): compute,
  then the keys' and the values' streams."""
  bk, st, nl, d = cfg.block_kv, cfg.stages, cfg.landing, dims.d
  tile = mgpu_int4_tiles.TILE_DTYPE
  # Key codes read 64 bytes a row at a time, value codes 32 (one value group in each nibble).
  codes = [(plgpu.TilingTransform((8, w)), plgpu.SwizzleTransform(w)) for w in (64, 32)]
  narrow = operand_transforms(tile, ROWS)  # P^T's 32-byte rows, and the values to match
  f32 = jnp.float32
  smem = dict(q=plgpu.SMEM((ROWS, d), tile, transforms=operand_transforms(tile, d)),
              k=plgpu.SMEM((st, bk, d), tile, transforms=operand_transforms(tile, d)),
              v=plgpu.SMEM((st, bk, d), tile, transforms=narrow),
              p=plgpu.SMEM((bk, ROWS), tile, transforms=narrow),
              exchange=plgpu.SMEM(mgpu_decode_ops.EXCHANGE, jnp.float32))
  key_scales = (nl, bk // key_group, d)
  value_scales = (nl, bk, va_ref.shape[-1])
  landing = tuple(_Landing(plgpu.SMEM((nl, bk, d // 2), jnp.uint8, transforms=tr),
                           plgpu.SMEM(shape, f32), plgpu.SMEM(shape, f32))
                  for shape, tr in zip((key_scales, value_scales), codes))
  ring = lambda n: plgpu.Barrier(num_barriers=n)  # noqa: E731  (one arrival each)
  barriers = dict(q=ring(1), k=ring(st), v=ring(st), k_free=ring(st), v_free=ring(st))
  landed = tuple(_Landing(ring(nl), ring(nl), ring(nl)) for _ in range(2))
  refs = (meta_ref, q_ref, None, ((kc_ref, ka_ref, kz_ref), (vc_ref, va_ref, vz_ref)), o_ref,
          lse_ref)

  def run(s, b):
    full = mgpu_decode._Smem(**{f: s[0].get(f) for f in mgpu_decode._Smem._fields})
    barr = mgpu_decode._Barriers(**{f: b[0].get(f) for f in mgpu_decode._Barriers._fields})
    mgpu_decode._cta(refs, full, barr, dims=dims, cfg=cfg, dtype=tile, memory=_memory,
                     landing=[_Landing(*x) for x in s[1]], landed=[_Landing(*x) for x in b[1]],
                     key_group=key_group, **kw)

  pl.run_scoped(run, (smem, landing), (barriers, landed), collective_axes="wg")


def _memory(refs, smem, barriers, *, wg, landing, landed, key_group, dims, cfg, native, b, h,
            start0, tiles, **_):
  """Warpgroup 1 the keys, warpgroup 2 the values: each streams its tiles' codes and scales by
  TMA into its landing ring `landing` tiles ahead and dequantizes each, once the compute
  warpgroup freed the slot, into its ring in the tiles' dtype. (Two warpgroups a stream, a chunk
  of 64 rows each, measured no faster: 0.129 against 0.123 ms at 128K keys on an H200.)"""
  (kc, ka, kz), (vc, va, vz) = refs[3]
  g = key_group

  def keys(start):
    return (kc.at[b, h, pl.ds(start, cfg.block_kv)],
            ka.at[b, h, pl.ds(lax.div(start, g), cfg.block_kv // g)],
            kz.at[b, h, pl.ds(lax.div(start, g), cfg.block_kv // g)])

  def values(start):
    return tuple(x.at[b, h, pl.ds(start, cfg.block_kv)] for x in (vc, va, vz))

  streams = ((keys, landing[0], landed[0], smem.k, barriers.k, barriers.k_free,
              functools.partial(mgpu_int4_tiles.dequantize_keys, key_group=g)),
             (values, landing[1], landed[1], smem.v, barriers.v, barriers.v_free,
              mgpu_int4_tiles.dequantize_values))
  # Interpreted, one warpgroup runs both streams (each warpgroup is a thread of the CPU client,
  # and three of them, two blocked in barrier waits, starved the third on a 2-core machine).
  mine = [[s] for s in streams] if native else [list(streams)]
  for i, own in enumerate(mine):
    pl.when(wg == i + 1)(functools.partial(_streams, own, cfg=cfg, t=dims.t, start0=start0,
                                           tiles=tiles, native=native))


def _streams(streams, *, cfg, t, start0, tiles, native):
  """A warpgroup's streams of tiles, each (sources, landing, landed, ring, ready, free,
  dequantize): TMA `landing` tiles ahead; each dequantized into ring's slot once the compute
  warpgroup released it (`free`), then `ready` arrived."""
  st, nl, bk = cfg.stages, cfg.landing, cfg.block_kv

  def copy(step, slot, sources, landing, landed, *_):
    for src, dst, bar in zip(sources(mgpu_decode_ops.tile_start(start0, step, bk, t)), landing,
                             landed):
      plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])

  for j, stream in itertools.product(range(nl), streams):
    pl.when(j < tiles)(functools.partial(copy, j, j, *stream))

  @pl.loop(0, tiles)
  def _(step):
    slot, at = lax.rem(step, jnp.int32(st)), lax.rem(step, jnp.int32(nl))
    for stream in streams:
      _, landing, landed, ring, ready, free, dequantize = stream
      for bar in landed:
        plgpu.barrier_wait(bar.at[at])
      pl.when(step >= st)(lambda free=free: plgpu.barrier_wait(free.at[slot]))  # step - st's
      dequantize(*(x.at[at] for x in landing), ring.at[slot], native=native)
      plgpu.commit_smem()  # visible to the WGMMA; the landed tile read before it is refilled
      plgpu.barrier_arrive(ready.at[slot])
      pl.when(step + nl < tiles)(functools.partial(copy, step + nl, at, *stream))

  @pl.loop(jnp.maximum(tiles - st, 0), tiles)
  def _(step):  # the last releases (lets the interpreter see every phase)
    for stream in streams:
      plgpu.barrier_wait(stream[5].at[lax.rem(step, jnp.int32(st))])
