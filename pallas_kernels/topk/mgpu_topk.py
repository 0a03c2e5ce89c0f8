"""Exact top-k of q.k over a long key axis for prefill chunks on Hopper GPUs (Mosaic GPU).

The FA3 pipeline of mgpu_flash.py with the softmax replaced by selection. One CTA per
(sequence x kv head, block of 2 * block_q rows, key split); rows are query positions x the query
heads of the kv group (layout.q_rows), so one K tile serves the whole group.
- A memory warpgroup streams the split's K tiles by TMA into a ring of `stages` SMEM slots.
- Two compute warpgroups own block_q rows each: per tile S = Q K^T by WGMMA, then selection.
  Each row keeps an unsorted running set of kp = top_k (score, key) pairs in registers (kp row
  vectors). Its threshold is the worst kept score (-inf until kp keys were kept). Per tile: the
  row max of S; if no row's max beats its threshold (most tiles, once the sets fill), that is
  all. Otherwise rounds: every row's max, its lowest key among equals (a min over
  where(s == max, key, BIG)), goes into the row's set in place of the worst kept pair if it beats
  it strictly; that element of S is masked; again while some row's max beats its threshold.
- The warpgroups alternate (a shared `turn` barrier, as in FA3): one selects while the other's
  product runs. The "some row" test reduces a row vector across the warpgroup's four warps
  through an SMEM scratch that Mosaic gives both warpgroups at the same address; the turns make
  the two selections mutually exclusive, so they never use it at the same time.

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

from pallas_kernels.mgpu_common import (COMPUTE_WGS, DTYPES, HEAD_DIMS, NEG_INF, SMEM_LIMIT,
                                        Config, Ops, compiler_params, fill_ring,
                                        interpret_params, interpreter_available, keyrows, plgpu,
                                        rendezvous, returns_when_done_if_interpreted, rows,
                                        tile_start)

__all__ = ["Config", "DEFAULT_CONFIG", "MAX_TOP_K", "interpreter_available", "mgpu_topk_scores",
           "smem_bytes", "unsupported"]

DEFAULT_CONFIG = Config(block_q=64, block_kv=128, stages=4)  # not yet tuned on a GPU
MAX_TOP_K = 32  # 2 * top_k row vectors stay in registers
BIG_INDEX = 2**31 - 1
TEST_FIRST_SPAN = 262144  # keys per split past which "segments" tests before inserting
# A row vector reduced to one value across 4 warps needs 16 bytes; a little more is harmless.
REDUCTION_SCRATCH = 128


def smem_bytes(config: Config, d: int, kp: int, itemsize: int = 2) -> int:
  """Q of both compute warpgroups, the K ring, the output sets, barriers and scratch."""
  tiles = COMPUTE_WGS * config.block_q * d + config.stages * config.block_kv * d
  return tiles * itemsize + 2 * COMPUTE_WGS * kp * config.block_q * 4 + 1024 + REDUCTION_SCRATCH


def unsupported(q, k, top_k: int, *, config: Config, keys: int | None = None) -> str | None:
  """Why this kernel cannot run the call (None: it can); keys: the key count, when known."""
  d = q.shape[3]
  if plgpu is None:
    return "this jaxlib has no Mosaic GPU"
  if q.dtype not in DTYPES or k.dtype != q.dtype:
    return f"dtypes {q.dtype}/{k.dtype}: needs q and k both bf16 or both fp16"
  if d not in HEAD_DIMS:
    return f"head dim {d} not in {HEAD_DIMS}"
  if keys is not None and keys % 8:
    # TMA tiles the key axis by 8: 999 keys failed to lower for CUDA (either layout)
    return f"{keys} keys: needs a multiple of 8"
  if top_k > MAX_TOP_K:
    return f"top_k {top_k} > {MAX_TOP_K} (the running set lives in registers)"
  if smem_bytes(config, d, top_k) > SMEM_LIMIT:
    return f"{config} needs {smem_bytes(config, d, top_k)} bytes of SMEM at d={d}"
  return None


@dataclasses.dataclass(frozen=True)
class _Dims:
  t: int  # keys in the array (>= block_kv)
  d: int
  kvh: int
  span: int  # keys per split, a multiple of block_kv
  kp: int  # running set size (= top_k)


@returns_when_done_if_interpreted
@functools.partial(jax.jit, static_argnames=("kp", "span", "splits", "scale", "kv_layout",
                                             "config", "selection", "segment", "test_first",
                                             "interpret", "native"))
def mgpu_topk_scores(qr, k, bounds, *, kp: int, span: int, splits: int, scale: float | None,
                     kv_layout: str = "BTHD", config: Config = DEFAULT_CONFIG,
                     selection: str = "exact", segment: int = 16,
                     test_first: bool | None = None, interpret=False,
                     native: bool | None = None):
  """qr [B, KV, R, d] (R a multiple of 2 * block_q); k [B, T, KV, d] or [B, KV, T, d] with
  T >= block_kv; bounds int32 [B, 2]: candidates lo <= t < hi (hi <= T). span * splits >= T.
  Returns (scores fp32, keys int32) [B, KV, splits, R, kp]: each split's best kp per row,
  unordered; (-inf, a negative key) where a split has fewer candidates. scale multiplies q.k
  (None: not at all). selection: KernelOptions.topk_selection ("max_only", a benchmark
  diagnostic: slot 0 holds the row's running max, the rest stays empty; "segments": each split's
  kp best segments of `segment` keys, as (max score, first key) sorted best first, T a multiple
  of `segment`: stage 1 of topk_segments.py; test_first: see _selection, None: by span).
  interpret / native as in mgpu_flash."""
  native = (interpret is False) if native is None else native
  b, kvh, rp, d = qr.shape
  t = k.shape[1 if kv_layout == "BTHD" else 2]
  cta_rows = COMPUTE_WGS * config.block_q
  if (rp % cta_rows or t < config.block_kv or span % config.block_kv or span * splits < t
      or (selection == "segments" and (t % segment or config.block_kv % segment))):
    raise ValueError(f"mgpu_topk_scores: rows {rp} / keys {t} / span {span} x {splits} do not fit "
                     f"{config} (selection {selection!r}, segment {segment})")
  dims = _Dims(t=t, d=d, kvh=kvh, span=span, kp=kp)
  body = functools.partial(_entry, dims=dims, cfg=config, scale=scale, kv_layout=kv_layout,
                           native=native, dtype=qr.dtype,
                           select=_selection(selection, kp, segment,
                                             span > TEST_FIRST_SPAN if test_first is None
                                             else test_first))
  shape = (b, kvh, splits, kp, rp)  # rows minor: one TMA box per warpgroup and set slot
  vals, idx = plgpu.kernel(
      body,
      out_type=[jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32)],
      grid=(b * kvh, rp // cta_rows, splits), grid_names=("bh", "rblock", "split"),
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=(None if interpret is not False
                       else compiler_params(config, reduction_scratch_bytes=REDUCTION_SCRATCH)),
      interpret=interpret_params(interpret),
  )(bounds.astype(jnp.int32), qr, k)
  return jnp.swapaxes(vals, 3, 4), jnp.swapaxes(idx, 3, 4)


def _entry(bounds_ref, q_ref, k_ref, v_out, i_out, *, dims, cfg, dtype, **kw):
  """Allocates the CTA's SMEM and barriers (shared by its warpgroups) and runs them."""
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # WGMMA operand layout
  smem = (plgpu.SMEM((COMPUTE_WGS, cfg.block_q, dims.d), dtype, transforms=tiled),  # Q
          plgpu.SMEM((cfg.stages, cfg.block_kv, dims.d), dtype, transforms=tiled),  # K ring
          plgpu.SMEM((COMPUTE_WGS, dims.kp, cfg.block_q), jnp.float32),  # output scores
          plgpu.SMEM((COMPUTE_WGS, dims.kp, cfg.block_q), jnp.int32))  # output keys
  barriers = (plgpu.Barrier(num_barriers=COMPUTE_WGS),  # Q of each compute warpgroup
              plgpu.Barrier(num_barriers=cfg.stages),  # K slot filled
              plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),  # K slot freed
              plgpu.Barrier(num_arrivals=COMPUTE_WGS))  # the compute warpgroups alternate
  refs = (bounds_ref, q_ref, k_ref, v_out, i_out)
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
  g0 = lax.axis_index("split") * (dims.span // cfg.block_kv)  # the split's first tile
  end = jnp.minimum(hi, (g0 * bk) + dims.span)  # candidates of this split: [max(lo, g0*bk), end)
  first = jnp.maximum(g0, lax.div(jnp.maximum(lo, 0), bk))
  last = jnp.maximum(lax.div(end + bk - 1, bk), first)
  plain_lo = jnp.clip(lax.div(lo + bk - 1, bk), first, last)
  plain_hi = jnp.clip(lax.div(jnp.maximum(end, 0), bk), plain_lo, last)
  tiles = (first, plain_lo, plain_hi, last)

  @pl.when(wg < COMPUTE_WGS)
  def _():
    row0 = (lax.axis_index("rblock") * COMPUTE_WGS + wg) * cfg.block_q
    _consumer(refs, smem, barriers, wg=wg, row0=row0, b=b, h=h, lo=lo, hi=hi, tiles=tiles,
              dims=dims, cfg=cfg, **kw)

  @pl.when(wg == COMPUTE_WGS)
  def _():
    _, k_smem, _, _ = smem
    _, k_loaded, k_free, _ = barriers
    if kw["native"]:
      plgpu.set_max_registers(40, action="decrease")  # registers go to the compute warpgroups

    def load(step, slot):
      start = tile_start(first + step, cfg.block_kv, dims.t)
      plgpu.copy_gmem_to_smem(keyrows(refs[2], kw["kv_layout"], b, h, start, cfg.block_kv),
                              k_smem.at[slot], k_loaded.at[slot])

    fill_ring(last - first, cfg.stages, [(load, k_free)])


def _consumer(refs, smem, barriers, *, wg, row0, b, h, lo, hi, tiles, dims, cfg, scale,
              kv_layout, native, dtype, select):
  """Compute warpgroup: its rows' running sets over the CTA's tiles, then written out."""
  del kv_layout, dtype
  _, q_ref, _, v_out, i_out = refs
  q_smem, k_smem, v_smem, i_smem = smem
  q_loaded, k_loaded, k_free, turn = barriers
  if native:
    plgpu.set_max_registers(232, action="increase")
  q_tile = q_smem.at[wg]
  plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(row0, cfg.block_q)], q_tile, q_loaded.at[wg])
  plgpu.barrier_wait(q_loaded.at[wg])
  ops = Ops(native, cfg, dims.d)
  row = plgpu.Layout.WGMMA.reduce(1)
  state = ([ops.layout(jnp.full((cfg.block_q,), NEG_INF, jnp.float32), row)] * dims.kp,
           [ops.layout(jnp.full((cfg.block_q,), -1 - j, jnp.int32), row)
            for j in range(dims.kp)])  # empty: distinct negative keys, so one slot is the worst
  sync_turn = functools.partial(rendezvous, turn)
  pl.when(wg == 1)(sync_turn)  # warpgroup 0 goes first; from here on they alternate
  first, plain_lo, plain_hi, last = tiles
  step = functools.partial(_step, first=first, q_tile=q_tile, k_smem=k_smem, k_loaded=k_loaded,
                           k_free=k_free, sync_turn=sync_turn, ops=ops, scale=scale, lo=lo, hi=hi,
                           t=dims.t, cfg=cfg, select=select)
  for a, z, masked in ((first, plain_lo, True), (plain_lo, plain_hi, False),
                       (plain_hi, last, True)):
    # The cond only skips an empty loop (as mgpu_flash's masked loop; see there).
    state = lax.cond(a < z, functools.partial(lax.fori_loop, a, z,
                                              functools.partial(step, masked=masked)),
                     lambda s: s, state)
  pl.when(wg == 0)(sync_turn)
  for j in range(dims.kp):
    v_smem.at[wg, j][...] = state[0][j]
    i_smem.at[wg, j][...] = state[1][j]
  plgpu.commit_smem()
  split = lax.axis_index("split")
  for src, dst in ((v_smem, v_out), (i_smem, i_out)):
    plgpu.copy_smem_to_gmem(src.at[wg], dst.at[b, h, split, :, pl.ds(row0, cfg.block_q)])
  plgpu.wait_smem_to_gmem(0)


def _step(g, state, *, masked: bool, first, q_tile, k_smem, k_loaded, k_free, sync_turn, ops,
          scale, lo, hi, t, cfg, select):
  """Key tile g: S = Q K^T (the other warpgroup selects meanwhile), then the selection."""
  slot = lax.rem(g - first, jnp.int32(cfg.stages))
  plgpu.barrier_wait(k_loaded.at[slot])
  s = ops.scores(q_tile, k_smem.at[slot], after_issue=sync_turn)  # [bq, bk] fp32
  plgpu.barrier_arrive(k_free.at[slot])
  if scale is not None:
    s = s * scale
  start = tile_start(g, cfg.block_kv, t)
  key = start + ops.iota(1)
  if masked:  # outside [lo, hi), or seen already (the clamped last tile)
    s = jnp.where((key >= g * cfg.block_kv) & (key >= lo) & (key < hi), s, NEG_INF)
  state = select(state, s, key, start, ops)
  sync_turn()  # selection done: the other warpgroup's turn
  return state


def _select(state, s, key, start, ops):
  """The running sets ([kp] row vectors of scores, of keys) after the tile s [bq, bk] of keys
  `key` (all above those kept): see the module doc."""
  def threshold(vals):
    return functools.reduce(jnp.minimum, vals)

  def pending(carry):
    _, vals, _, best = carry
    return jnp.max(jnp.where(best > threshold(vals), 1, 0)) > 0  # across the warpgroup

  def take_best(carry):
    s, vals, keys, best = carry
    worst = threshold(vals)
    worst_key = functools.reduce(jnp.maximum, [jnp.where(v == worst, i, -BIG_INDEX)
                                               for v, i in zip(vals, keys)])
    best_key = jnp.min(jnp.where(s == rows(best, s.shape), key, BIG_INDEX), axis=1)
    take = best > worst
    hits = [take & (i == worst_key) for i in keys]
    vals = [jnp.where(hit, best, v) for hit, v in zip(hits, vals)]
    keys = [jnp.where(hit, best_key, i) for hit, i in zip(hits, keys)]
    s = jnp.where(key == rows(best_key, s.shape), NEG_INF, s)
    return s, vals, keys, s.max(axis=1)

  del start, ops
  vals, keys = state
  _, vals, keys, _ = lax.while_loop(pending, take_best, (s, vals, keys, s.max(axis=1)))
  return vals, keys


def _select_one(state, s, key, start, ops):
  """kp = 1, a running argmax: a row changes only where the tile's max beats its kept score
  strictly, to the lowest key among the tile's equal maxima. At most one round, so no masking,
  no second max and no second test across the warpgroup; the round runs only when some row
  gains (running it on every tile measured slower at 512K keys: BENCHMARKS.md)."""
  del start, ops
  (val,), (kept,) = state
  best = s.max(axis=1)
  take = best > val

  def update(_):
    best_key = jnp.min(jnp.where(s == rows(best, s.shape), key, BIG_INDEX), axis=1)
    return [jnp.where(take, best, val)], [jnp.where(take, best_key, kept)]

  return lax.cond(jnp.max(jnp.where(take, 1, 0)) > 0, update, lambda _: ([val], [kept]), None)


def _select_segments(state, s, key, start, ops, *, segment: int, test_first: bool):
  """selection="segments" (topk_segments.py, stage 1): each row keeps its kp best segments of
  `segment` consecutive keys, ranked by their max score, as a sorted set: (maxima descending,
  first keys), equal maxima in key order. Per tile: every segment's row max (slices of S, about
  one row reduction's work). If some row's best segment beats its worst kept one, that segment
  (the first of equal maxima) goes in; if then some row's next best also beats its worst kept
  one, the tile's other segments go in one by one in key order (rare once the sets fill). A
  segment goes in after the kept ones it does not beat strictly, so of equal maxima the earlier
  segment stays ahead. Row-vector work, no rounds over S. The clamped last tile starts on a
  segment boundary (topk_segments needs T % segment == 0); its masked part holds -inf, which
  never goes in."""
  del key
  row = plgpu.Layout.WGMMA.reduce(1)
  maxima = [s[:, j:j + segment].max(axis=1) for j in range(0, s.shape[1], segment)]
  best = functools.reduce(jnp.maximum, maxima)
  n = len(maxima)

  def some_row(gains):  # across the warpgroup
    return jnp.max(jnp.where(gains, 1, 0)) > 0

  def keep(state):
    return tuple(list(x) for x in state)

  def insert_best(state):
    j_best = functools.reduce(jnp.minimum, [jnp.where(m == best, j, n)
                                            for j, m in enumerate(maxima)])
    vals, firsts = _insert(*state, best, start + j_best * segment)
    rest = [jnp.where(j_best == j, NEG_INF, m) for j, m in enumerate(maxima)]

    def insert_rest(state):
      for j, m in enumerate(rest):
        state = _insert(*state, m, ops.layout(jnp.full(m.shape, start + j * segment, jnp.int32),
                                              row))
      return state

    gains = some_row(functools.reduce(jnp.maximum, rest) > vals[-1])
    return lax.cond(gains, insert_rest, keep, (vals, firsts))

  if not test_first:
    return insert_best(state)
  return lax.cond(some_row(best > state[0][-1]), insert_best, keep, state)


def _insert(vals, firsts, m, first):
  """The sorted set (vals descending, their firsts) with (m, first) after every kept value >= m,
  the last one dropped."""
  stays = [x >= m for x in vals]  # a prefix
  def shifted(xs, new):
    return [jnp.where(stays[0], xs[0], new)] + [
        jnp.where(stays[i], xs[i], jnp.where(stays[i - 1], new, xs[i - 1]))
        for i in range(1, len(xs))]
  return shifted(vals, m), shifted(firsts, first)


def _running_max(state, s, key, start, ops):
  """selection="max_only" (a benchmark diagnostic, results meaningless): slot 0 of each row's set
  keeps the running max of s; no keys, no rounds."""
  del key, start, ops
  vals, keys = state
  return [jnp.maximum(vals[0], s.max(axis=1)), *vals[1:]], keys


_SELECTIONS = {"max_only": _running_max}


def _selection(selection: str, kp: int, segment: int, test_first: bool):
  """The tile update: "exact" is the running argmax for kp = 1 (measured 1.19x faster than
  the rounds at 128K keys, H200), the rounds otherwise; "segments": see _select_segments, whose
  best segment goes in on every tile up to TEST_FIRST_SPAN keys per split (no test across the
  warpgroup: 1.10-1.25x faster at 16K-128K keys on an H200) and after the test beyond (1.01x
  faster at 512K keys, where most tiles no longer gain)."""
  if selection == "exact":
    return _select_one if kp == 1 else _select
  if selection == "segments":
    return functools.partial(_select_segments, segment=segment, test_first=test_first)
  return _SELECTIONS[selection]
