"""Exact top-k of q.k over a long key axis for prefill chunks on Hopper GPUs (Mosaic GPU).

The FA3 pipeline of mgpu_flash.py with the softmax replaced by selection. One CTA per
(sequence x kv head, block of warpgroups * block_q rows, key split); rows are query positions x
the query heads of the kv group (layout.q_rows), so one K tile serves the whole group.
- A memory warpgroup streams the split's K tiles by TMA into a ring of `stages` SMEM slots.
- Two compute warpgroups (Config.warpgroups) own block_q rows each: per tile S = Q K^T by WGMMA,
  then selection. Each row keeps an unsorted running set of kp = top_k (score, key) pairs in
  registers (kp row vectors). Its threshold is the worst kept score (-inf until kp keys were
  kept). Per tile: the row max of S; if no row's max beats its threshold (most tiles, once the
  sets fill), that is all. Otherwise rounds: every row's max, its lowest key among equals (a min
  over where(s == max, key, BIG)), goes into the row's set in place of the worst kept pair if it
  beats it strictly; that element of S is masked; again while some row's max beats its
  threshold.
- The warpgroups alternate (a shared `turn` barrier, as in FA3): one selects while the other's
  product runs. The "some row" test reduces a row vector across the warpgroup's four warps
  through an SMEM scratch that Mosaic gives both warpgroups at the same address; the turns make
  the two selections mutually exclusive, so they never use it at the same time. The strided
  "columns" selection uses no scratch, yet without turns it ran slower (1M keys on an H200:
  bf16 14%, int8 4%, E4M3 7%): the alternation is the schedule, not only the scratch's guard.
- Config.warpgroups = 3 (selections without cross-warp reductions: "columns", "max_only"):
  three compute warpgroups of block_q rows issue their products in turn (a token passed round
  them at each issue), and their selections run free of each other: two select while the
  third's product runs. On an H200 bf16 ran 1.12-1.16x faster so; the 8-bit kernels, whose
  products take half the time but whose issue slots are already 48-65% busy, level to 1.15x
  slower, so they keep two (KernelOptions.topk_warpgroups). A thread's 152 registers then hold
  128-key score tiles: a longer tile is multiplied in parts (product_keys).

Exactness (ties to the lowest key, as the reference's lax.top_k): a CTA visits its keys in
increasing order (tiles in order, and within a tile equal maxima leave by increasing key), and a
newcomer must beat the worst kept score strictly, so of equal scores the earlier key stays; the
pair evicted is the worst score with the highest key. Hence each split's set is exactly its
top kp by (score desc, key asc), and topk_tile.finish merges the splits (topk.py).
Candidates are keys lo[b] <= t < hi[b]; tiles crossing lo or hi, or the clamped last tile of T
(keys before its nominal start were seen), are masked; the tiles between are not.

Off a GPU the kernel runs in jax's Mosaic GPU interpreter (`interpret=True`, native=False: Ops in
mgpu_common stands in for WGMMA and layout casts); the native code is lowered on a CPU by the
tests and runs on the GPU in benchmarks/mgpu_topk.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import layout, quant
from pallas_kernels.mgpu_common import (DTYPES, EIGHT_BIT, HEAD_DIMS, NEG_INF,
                                        SMEM_LIMIT, Config, Ops, Turns, compiler_params, fill_ring,
                                        interpret_params, interpreter_available, keyrows,
                                        operand_transforms, plgpu,
                                        returns_when_done_if_interpreted, scale_rows, tile_start)
from pallas_kernels.topk import mgpu_select

__all__ = ["Config", "DEFAULT_CONFIG", "EIGHT_BIT_CONFIG", "FREE_SELECTIONS", "MAX_TOP_K",
           "THREE_WARPGROUPS", "interpreter_available",
           "mgpu_topk_scores", "smem_bytes", "unsupported"]

DEFAULT_CONFIG = Config(block_q=64, block_kv=128, stages=4)  # not yet tuned on a GPU
# 8-bit keys: twice the keys a tile in the same SMEM, so the per-tile costs (turns, the
# warpgroup-wide tests) spread over twice the products. 512 queries x 128K keys on an H200 (int8 /
# E4M3, top-4): 1.52 / 1.38 ms at 64 x 128 x 4, 1.26 / 1.21 at 64 x 256 x 4, 1.33 / 1.23 at
# 128 x 128 x 4; top-1: 1.27 / 1.09, 1.08 / 0.96, 1.09 / 0.84 (experiments/topk8_costs.py).
EIGHT_BIT_CONFIG = Config(block_q=64, block_kv=256, stages=4)
# Three compute warpgroups under "columns" (KernelOptions.topk_warpgroups), by 16-bit / 8-bit
# keys: 256-key tiles multiplied in 128-key parts (product_keys). 512 queries, top 4, on an
# H200 (BENCHMARKS.md "Three compute warpgroups in the top-k"): bf16 at 128K / 1M keys 1.069 /
# 6.32 ms against 1.17-1.18 / 7.27-7.68 on two (128-key tiles, 4 stages), 1.099 / 6.84 at
# 128-key tiles; int8 1.01 / 5.66 against 0.95 / 5.65, E4M3 0.96 / 5.53 against 0.84 /
# 5.08-5.25: 8-bit keys keep two.
THREE_WARPGROUPS = {False: Config(block_q=64, block_kv=256, stages=2, warpgroups=3),
                    True: Config(block_q=64, block_kv=256, stages=4, warpgroups=3)}
MAX_TOP_K = 32  # 2 * top_k row vectors stay in registers
TEST_FIRST_SPAN = 262144  # keys per split past which "segments" tests before inserting
# A row vector reduced to one value across 4 warps needs 16 bytes; a little more is harmless.
REDUCTION_SCRATCH = 128
# Selections whose warpgroups never reduce across warps (Mosaic's one scratch): the only ones
# three compute warpgroups may run, their selections overlapping.
FREE_SELECTIONS = ("columns", "max_only")
# Registers a thread (setmaxnreg) of the TMA warpgroup and of each compute warpgroup, by the
# compute warpgroups a CTA: 128 threads x (memory + n x compute) within a core's 65,536.
MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = {2: 232, 3: 152}
# Keys a product of three compute warpgroups: the 64 registers a thread of a 128-key score tile
# fit their 152 beside the "columns" sets; a longer key tile is multiplied in parts of it.
THREE_WARPGROUP_PRODUCT = 128


def product_keys(config: Config) -> int:
  """Keys each WGMMA of a compute warpgroup multiplies: the tile's, or a part of it."""
  return (config.block_kv if config.warpgroups == 2
          else min(config.block_kv, THREE_WARPGROUP_PRODUCT))


def smem_bytes(config: Config, d: int, kp: int, itemsize: int = 2, width: int = 1) -> int:
  """Q of both compute warpgroups, the K ring (with 8-bit keys, itemsize 1, their scales' ring),
  the output sets (`width` a row: mgpu_select.set_width), barriers and scratch."""
  wgs = config.warpgroups
  tiles = wgs * config.block_q * d + config.stages * config.block_kv * d
  scales = config.stages * config.block_kv * 4 if itemsize == 1 else 0
  return (tiles * itemsize + scales + 2 * wgs * kp * config.block_q * 4 * width + 1024
          + REDUCTION_SCRATCH)


def unsupported(q, k, top_k: int, *, config: Config, keys: int | None = None) -> str | None:
  """Why this kernel cannot run the call (None: it can); keys: the key count, when known."""
  d = q.shape[3]
  eight_bit = quant.is_quantized(k)
  if plgpu is None:
    return "this jaxlib has no Mosaic GPU"
  if eight_bit and (q.dtype not in DTYPES or k.dtype not in EIGHT_BIT):
    return f"dtypes {q.dtype}/{k.dtype}: needs bf16 or fp16 q and int8 or E4M3 keys"
  if not eight_bit and (q.dtype not in DTYPES or k.dtype != q.dtype):
    return f"dtypes {q.dtype}/{k.dtype}: needs q and k both bf16 or both fp16"
  if d not in HEAD_DIMS:
    return f"head dim {d} not in {HEAD_DIMS}"
  if keys is not None and keys % 8:
    # TMA tiles the key axis by 8: 999 keys failed to lower for CUDA (either layout)
    return f"{keys} keys: needs a multiple of 8"
  if top_k > MAX_TOP_K:
    return f"top_k {top_k} > {MAX_TOP_K} (the running set lives in registers)"
  if (need := smem_bytes(config, d, top_k, 1 if eight_bit else 2)) > SMEM_LIMIT:
    return f"{config} needs {need} bytes of SMEM at d={d}"
  return None


@dataclasses.dataclass(frozen=True)
class _Dims:
  t: int  # keys in the array (>= block_kv)
  d: int
  kvh: int
  span: int  # keys per split, a multiple of block_kv (balanced: unused)
  kp: int  # running set size (= top_k)
  width: int  # a row's sets (mgpu_select.set_width)
  splits: int
  balanced: bool  # the splits share each sequence's candidates' tiles, not the key axis


@returns_when_done_if_interpreted
@functools.partial(jax.jit, static_argnames=("kp", "span", "splits", "scale", "kv_layout",
                                             "config", "selection", "segment", "test_first",
                                             "balanced", "interpret", "native"))
def mgpu_topk_scores(qr, k, bounds, *, kp: int, span: int, splits: int, scale: float | None,
                     kv_layout: str = "BTHD", config: Config = DEFAULT_CONFIG,
                     selection: str = "exact", segment: int = 16,
                     test_first: bool | None = None, balanced: bool = False, interpret=False,
                     native: bool | None = None):
  """qr [B, KV, R, d] (R a multiple of warpgroups * block_q); k [B, T, KV, d] or [B, KV, T, d] with
  T >= block_kv; bounds int32 [B, 2]: candidates lo <= t < hi (hi <= T). span * splits >= T.
  Returns (scores fp32, keys int32) [B, KV, splits, R, kp]: each split's best kp per row,
  unordered; (-inf, a negative key) where a split has fewer candidates. scale multiplies q.k
  (None: not at all). selection: KernelOptions.topk_selection ("max_only", a benchmark
  diagnostic: slot 0 holds the row's running max, the rest stays empty; "segments": each split's
  kp best segments of `segment` keys, as (max score, first key) sorted best first, T a multiple
  of `segment`: stage 1 of topk_segments.py; test_first: see mgpu_select.selection, None: by
  span); "columns": each split's kp best strided segments (mgpu_select._select_columns, windows
  of `segment` keys) of each of a row's 8 columns, the returned last axis kp * 8, T a multiple
  of `segment`. balanced: split s takes the s-th of `splits` equal runs of the tiles holding
  its sequence's candidates [lo, hi) (span unused), rather than keys [s * span, (s + 1) * span):
  as many CTAs as asked share whatever candidates a call has. interpret / native as in
  mgpu_flash.

  8-bit keys (quant.Quantized, int8 or E4M3): the rows of qr are quantized alike (one scale per
  row, as the keys) and the tiles multiply on the 8-bit tensor cores (int8 into exact int32,
  E4M3 into fp32); the kernel selects by q8.k8 times each key's scale, and the kept scores are
  multiplied by the row's scale and `scale` after (a positive factor per row changes no row's
  order). The selection is then that of the quantized queries: it equals the dequantize-first
  reference's where the rounding of q moves no score past a neighbour (tests/kernels say how
  often it did)."""
  native = (interpret is False) if native is None else native
  b, kvh, rp, d = qr.shape
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  eight_bit = quant.is_quantized(k)
  if eight_bit:
    k, k_scale = layout.parts(k)
    qr, q_scale = layout.parts(quant.quantize(qr, k.dtype))
    inputs = (qr, k, scale_rows(k_scale, kv_layout))
  else:
    inputs = (qr, k)
  cta_rows = config.warpgroups * config.block_q
  segmented = selection in ("segments", "columns")
  part = product_keys(config)
  if config.warpgroups > 2 and selection not in FREE_SELECTIONS:
    raise ValueError(f"mgpu_topk_scores: {config.warpgroups} compute warpgroups run only the "
                     f"selections {FREE_SELECTIONS}, whose warpgroups never reduce across warps "
                     f"(Mosaic gives them one scratch); {selection!r} asked")
  if (rp % cta_rows or t < config.block_kv or span % config.block_kv or span * splits < t
      or (segmented and (t % segment or part % segment)) or config.block_kv % part):
    raise ValueError(f"mgpu_topk_scores: rows {rp} / keys {t} / span {span} x {splits} do not fit "
                     f"{config} (selection {selection!r}, segment {segment})")
  width = mgpu_select.set_width(selection)
  dims = _Dims(t=t, d=d, kvh=kvh, span=span, kp=kp, width=width, splits=splits,
               balanced=balanced)
  body = functools.partial(_entry, dims=dims, cfg=config,
                           scale=None if eight_bit else scale, kv_layout=kv_layout,
                           native=native, dtype=qr.dtype,
                           select=mgpu_select.selection(selection, kp, segment,
                                                        span > TEST_FIRST_SPAN
                                                        if test_first is None else test_first))
  # rows minor (then a row's sets): one TMA box per warpgroup
  shape = (b, kvh, splits, kp, rp) + ((width,) if width > 1 else ())
  vals, idx = plgpu.kernel(
      body,
      out_type=[jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)],
      grid=(b * kvh, rp // cta_rows, splits), grid_names=("bh", "rblock", "split"),
      num_threads=config.warpgroups + 1, thread_name="wg",
      compiler_params=(None if interpret is not False
                       else compiler_params(config, reduction_scratch_bytes=REDUCTION_SCRATCH)),
      interpret=interpret_params(interpret),
  )(bounds.astype(jnp.int32), *inputs)
  vals, idx = (jnp.moveaxis(x, 3, -1).reshape(b, kvh, splits, rp, kp * width)
               for x in (vals, idx))
  if eight_bit:  # the rows' own factors, left out of the selection
    vals = vals * (q_scale if scale is None else q_scale * scale)[:, :, None, :, None]
  return vals, idx


def _entry(bounds_ref, q_ref, k_ref, *refs, dims, cfg, dtype, **kw):
  """Allocates the CTA's SMEM and barriers (shared by its warpgroups) and runs them. refs:
  (key scales [B, KV, T'] with 8-bit keys,) the output scores and keys."""
  tiled = operand_transforms(dtype, dims.d)  # WGMMA operand layout
  eight_bit = len(refs) == 3
  wgs = cfg.warpgroups
  smem = (plgpu.SMEM((wgs, cfg.block_q, dims.d), dtype, transforms=tiled),  # Q
          plgpu.SMEM((cfg.stages, cfg.block_kv, dims.d), dtype, transforms=tiled),  # K ring
          plgpu.SMEM(out := (wgs, dims.kp, cfg.block_q) + ((dims.width,) if
                             dims.width > 1 else ()), jnp.float32),  # output scores
          plgpu.SMEM(out, jnp.int32),  # output keys
          *([plgpu.SMEM((cfg.stages, cfg.block_kv), jnp.float32)] if eight_bit else []))
  barriers = (plgpu.Barrier(num_barriers=wgs),  # Q of each compute warpgroup
              plgpu.Barrier(num_barriers=cfg.stages),  # K slot filled
              plgpu.Barrier(num_arrivals=wgs, num_barriers=cfg.stages),  # K slot freed
              Turns.barrier(wgs),  # the compute warpgroups' order on the tensor cores
              *([plgpu.Barrier(num_barriers=cfg.stages)] if eight_bit else []))  # scales filled
  refs = (bounds_ref, q_ref, k_ref, *refs[-2:], *refs[:-2])
  pl.run_scoped(lambda *scoped: _cta(refs, *scoped, dims=dims, cfg=cfg, dtype=dtype, **kw),
                smem, barriers, collective_axes="wg")


def _cta(refs, smem, barriers, *, dims, cfg, **kw):
  """One CTA: which sequence, kv head, rows and split; the key tiles it visits, in global tile
  numbers: [first, last), of which [plain_lo, plain_hi) lie wholly among the candidates."""
  bh, wg = lax.axis_index("bh"), lax.axis_index("wg")
  kvh = jnp.int32(dims.kvh)
  b, h = lax.div(bh, kvh), lax.rem(bh, kvh)
  lo, hi = refs[0][b, 0], refs[0][b, 1]
  bk = jnp.int32(cfg.block_kv)
  split = lax.axis_index("split")
  lo_tile = lax.div(jnp.maximum(lo, 0), bk)
  if dims.balanced:  # the split's share of the tiles holding candidates
    per = lax.div(jnp.maximum(lax.div(hi + bk - 1, bk) - lo_tile, 0) + dims.splits - 1,
                  jnp.int32(dims.splits))
    g0 = lo_tile + split * per
  else:
    per = jnp.int32(dims.span // cfg.block_kv)
    g0 = split * per  # the split's first tile
  end = jnp.minimum(hi, (g0 + per) * bk)  # candidates of this split: [max(lo, g0*bk), end)
  first = jnp.maximum(g0, lo_tile)
  last = jnp.maximum(lax.div(end + bk - 1, bk), first)
  plain_lo = jnp.clip(lax.div(lo + bk - 1, bk), first, last)
  plain_hi = jnp.clip(lax.div(jnp.maximum(end, 0), bk), plain_lo, last)
  tiles = (first, plain_lo, plain_hi, last)

  @pl.when(wg < cfg.warpgroups)
  def _():
    row0 = (lax.axis_index("rblock") * cfg.warpgroups + wg) * cfg.block_q
    _consumer(refs, smem, barriers, wg=wg, row0=row0, b=b, h=h, lo=lo, hi=hi, tiles=tiles,
              dims=dims, cfg=cfg, **kw)

  @pl.when(wg == cfg.warpgroups)
  def _():
    _, k_smem, _, _, *ks_smem = smem
    _, k_loaded, k_free, _, *ks_loaded = barriers
    if kw["native"]:  # registers go to the compute warpgroups
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

    def load(step, slot):
      start = tile_start(first + step, cfg.block_kv, dims.t)
      plgpu.copy_gmem_to_smem(keyrows(refs[2], kw["kv_layout"], b, h, start, cfg.block_kv),
                              k_smem.at[slot], k_loaded.at[slot])
      if ks_smem:  # the keys' scales (8-bit keys), one row of [B, KV, T']
        plgpu.copy_gmem_to_smem(refs[5].at[b, h, pl.ds(start, cfg.block_kv)],
                                ks_smem[0].at[slot], ks_loaded[0].at[slot])

    fill_ring(last - first, cfg.stages, [(load, k_free)])


def _consumer(refs, smem, barriers, *, wg, row0, b, h, lo, hi, tiles, dims, cfg, scale,
              kv_layout, native, dtype, select):
  """Compute warpgroup: its rows' running sets over the CTA's tiles, then written out."""
  del kv_layout, dtype
  _, q_ref, _, v_out, i_out, *_ = refs
  q_smem, k_smem, v_smem, i_smem, *ks_smem = smem
  q_loaded, k_loaded, k_free, turn, *ks_loaded = barriers
  key_scales = (ks_smem[0], ks_loaded[0]) if ks_smem else None
  if native:
    plgpu.set_max_registers(COMPUTE_REGISTERS[cfg.warpgroups], action="increase")
  q_tile = q_smem.at[wg]
  plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(row0, cfg.block_q)], q_tile, q_loaded.at[wg])
  plgpu.barrier_wait(q_loaded.at[wg])
  ops = Ops(native, dataclasses.replace(cfg, block_kv=product_keys(cfg)), dims.d)
  sets, where = (((cfg.block_q, dims.width), plgpu.Layout.WGMMA) if dims.width > 1
                 else ((cfg.block_q,), plgpu.Layout.WGMMA.reduce(1)))
  state = ([ops.layout(jnp.full(sets, NEG_INF, jnp.float32), where)] * dims.kp,
           [ops.layout(jnp.full(sets, -1 - j, jnp.int32), where)
            for j in range(dims.kp)])  # empty: distinct negative keys, so one slot is the worst
  turns = Turns(turn, wg, cfg.warpgroups)
  turns.start()
  first, plain_lo, plain_hi, last = tiles
  step = functools.partial(_step, first=first, q_tile=q_tile, k_smem=k_smem, k_loaded=k_loaded,
                           k_free=k_free, key_scales=key_scales, turns=turns, ops=ops,
                           scale=scale, lo=lo, hi=hi, t=dims.t, cfg=cfg, select=select)
  for a, z, masked in ((first, plain_lo, True), (plain_lo, plain_hi, False),
                       (plain_hi, last, True)):
    # The cond only skips an empty loop (as mgpu_flash's masked loop; see there).
    state = lax.cond(a < z, functools.partial(lax.fori_loop, a, z,
                                              functools.partial(step, masked=masked)),
                     lambda s: s, state)
  turns.end()
  for j in range(dims.kp):
    v_smem.at[wg, j][...] = state[0][j]
    i_smem.at[wg, j][...] = state[1][j]
  plgpu.commit_smem()
  split = lax.axis_index("split")
  for src, dst in ((v_smem, v_out), (i_smem, i_out)):
    plgpu.copy_smem_to_gmem(src.at[wg], dst.at[b, h, split, :, pl.ds(row0, cfg.block_q)])
  plgpu.wait_smem_to_gmem(0)


def _step(g, state, *, masked: bool, first, q_tile, k_smem, k_loaded, k_free, key_scales,
          turns, ops, scale, lo, hi, t, cfg, select):
  """Key tile g: S = Q K^T (the other warpgroup selects meanwhile), then the selection, in
  parts of product_keys(cfg) keys, each its own product and selection (three warpgroups). With
  8-bit keys (key_scales: their scales' ring and its barriers) the products run on the 8-bit
  tensor cores and each key's scores are multiplied by its scale (scale is then None: applied
  after the kernel). A test that skipped the scaling and selection of 8-bit tiles where no row
  could gain (a row's max product times the tile's largest key scale against its worst kept
  score) ran 1.4x slower at 512 queries x 128K keys on an H200: with 64 rows a warpgroup, some
  row gains on most tiles, and the test and its branch cost more."""
  slot = lax.rem(g - first, jnp.int32(cfg.stages))
  plgpu.barrier_wait(k_loaded.at[slot])
  start = tile_start(g, cfg.block_kv, t)
  width = ops.bk  # keys a product: the tile, or a part of it (product_keys)
  for p0 in range(0, cfg.block_kv, width):
    at = (slot,) if width == cfg.block_kv else (slot, pl.ds(p0, width))
    turns.before_issue()
    s = ops.scores(q_tile, k_smem.at[at], after_issue=turns.after_issue)  # [bq, width] fp32
    if key_scales is not None:
      ks_smem, ks_loaded = key_scales
      if p0 == 0:
        plgpu.barrier_wait(ks_loaded.at[slot])
      s = s * ops.columns(ops.column_vector(ks_smem.at[at]), s.shape)
    if p0 + width == cfg.block_kv:  # the tile's keys and scales all read
      plgpu.barrier_arrive(k_free.at[slot])
    if scale is not None:
      s = s * scale
    key = start + p0 + ops.iota(1)
    if masked:  # outside [lo, hi), or seen already (the clamped last tile)
      s = jnp.where((key >= g * cfg.block_kv) & (key >= lo) & (key < hi), s, NEG_INF)
    state = select(state, s, key, start + p0, ops)
    turns.after_selection()
  return state

