"""Flash-attention forward for prefill on Hopper GPUs, through Pallas' Mosaic GPU lowering.

The structure follows FlashAttention-3 (and jax's port of it, `pallas/ops/gpu/attention_mgpu.py`):
one CTA per (query head, block of 2 * block_q queries, sequence) runs three warpgroups.
- A memory warpgroup streams the K and V tiles of the CTA's kv head by TMA into a ring of
  `stages` SMEM slots; a slot is refilled once both compute warpgroups released it (barriers).
- Two compute warpgroups own block_q query rows each. Per key tile: S = Q K^T by WGMMA (Q and K
  from SMEM), the online-softmax update in registers, then O += P V by WGMMA (P from registers,
  V from SMEM). A shared `turn` barrier makes them alternate, so one's softmax (CUDA cores)
  overlaps the other's matrix products (tensor cores).
- Key tiles past what a warpgroup's rows can see are never loaded or computed: the causal edge
  and kv_len[b] bound the loop, so the cost follows the visible keys. Tiles every row sees fully
  skip the mask; only the tiles on the causal edge or across kv_len are masked.

Positions (bottom-right causal): query i of sequence b sits at q_offset[b] + i and sees key j iff
j <= q_offset[b] + i and j < kv_len[b]. Neither Lq nor T needs to be a multiple of a block: the
last query block and the last key tile are clamped to end at Lq and T (never out of bounds);
overlapped query rows are computed twice, identically, and overlapped keys are masked.
Requires Lq >= block_q and T >= block_kv (`unsupported` says why a call does not apply).

Off a GPU the same kernel runs in jax's Mosaic GPU interpreter (`interpret=True`), which (JAX
0.10 and 0.11) cannot run three things of the native kernel: `layout_cast` (no CPU rule), WGMMA with a
transposed SMEM operand or a register operand, and `run_state`. With `native=False` those become
identity casts and plain dot products of the SMEM tiles; everything else (TMA copies, barriers,
the pipeline, masks, block skipping, the epilogue) is the code that runs on the GPU. The native
path is checked by lowering it to Mosaic GPU MLIR on a CPU (tests) and on the GPU by
`benchmarks/mgpu_attention.py`.

Quantized K/V (quant.Quantized: int8 or E4M3 values, an fp32 scale per key): WGMMA multiplies
bf16 by bf16 only (no mixed 8-bit x bf16 operands), so each 8-bit tile and its scales land by TMA
in SMEM and the memory warpgroup writes the tile dequantized into the same bf16 ring the compute
warpgroups read (`mgpu_common.dequantize_tile`; FlashInfer's FP8 prefill gained 1.2-1.4x by
dequantizing each tile once into SMEM instead of per use). The compute warpgroups are unchanged;
the memory warpgroup gets more registers for it (64, the compute ones 224 each).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import layout, quant
from pallas_kernels.mgpu_common import (COMPUTE_WGS, LOG2E, NEG_INF, Config, Ops,
                                        compiler_params, dequantize_tile, fill_ring,
                                        interpret_params, interpreter_available, keyrows, plgpu,
                                        rendezvous, returns_when_done_if_interpreted, rows,
                                        scale_rows, smem_bytes, tile_start, unsupported)

__all__ = ["Config", "DEFAULT_CONFIG", "interpreter_available", "mgpu_flash_attention",
           "smem_bytes", "unsupported"]

DEFAULT_CONFIG = Config()  # what flash_attention uses (set from the device sweep's best)
# Registers per thread (memory warpgroup, each compute warpgroup) without and with quantized K/V:
# at most 512 together (64K registers over 3 x 128 threads); dequantizing a 64 x 64 chunk holds
# 32 fp32 or bf16 values per thread beside its 8-bit ones.
_REGISTERS = {False: (40, 232), True: (64, 224)}


@returns_when_done_if_interpreted
@functools.partial(jax.jit, static_argnames=("causal", "scale", "kv_layout", "config",
                                             "interpret", "native"))
def mgpu_flash_attention(q, k, v, q_offset, kv_len, *, causal: bool, scale: float,
                         kv_layout: str = "BTHD", config: Config = Config(),
                         interpret=False, native: bool | None = None):
  """q [B, Lq, H, d]; k, v [B, T, KV, d] (BTHD) or [B, KV, T, d] (BHTD), arrays or
  quant.Quantized; q_offset, kv_len int32 [B] (kv_len <= T, q_offset >= 0). Returns (out
  [B, Lq, H, d] in q's dtype, lse [B, Lq, H] fp32, natural log; rows that see no key give (0, -inf)). interpret: True or an InterpretGPUParams:
  run in jax's Mosaic GPU interpreter on CPU; native (default: not interpret) selects the
  GPU-only code paths (see the module doc)."""
  native = (interpret is False) if native is None else native
  b, lq, h, d = q.shape
  t, kvh = (k.shape[1], k.shape[2]) if kv_layout == "BTHD" else (k.shape[2], k.shape[1])
  why = unsupported(q, k, v, kv_layout=kv_layout, config=config)
  if why:
    raise ValueError(f"mgpu_flash_attention: {why}")
  dims = _Dims(lq=lq, t=t, d=d, group=h // kvh, q_blocks=-(-lq // (COMPUTE_WGS * config.block_q)))
  meta = jnp.stack([q_offset.astype(jnp.int32), jnp.minimum(kv_len.astype(jnp.int32), t)], 1)
  kv = (k, v)
  if quant.is_quantized(k):
    kv = (k.values, v.values, *(scale_rows(layout.parts(x)[1], kv_layout) for x in (k, v)))
  body = functools.partial(_entry, dims=dims, causal=causal, scale=scale, kv_layout=kv_layout,
                           cfg=config, native=native, dtype=q.dtype)
  out, lse = plgpu.kernel(
      body,
      # LSE with the queries minor (each warpgroup's rows: one 1-D TMA store), padded to a
      # multiple of 4 floats: a TMA stride must be a multiple of 16 bytes.
      out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct((b, h, -(-lq // 4) * 4), jnp.float32)],
      grid=(h, dims.q_blocks, b), grid_names=("head", "qblock", "batch"),
      num_threads=COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=None if interpret is not False else compiler_params(config),
      interpret=interpret_params(interpret),
  )(meta, q, *kv)
  return out, jnp.swapaxes(lse[..., :lq], 1, 2)


@dataclasses.dataclass(frozen=True)
class _Dims:
  lq: int  # queries
  t: int  # keys in the arrays (kv_len[b] <= t visible)
  d: int
  group: int  # query heads per kv head
  q_blocks: int  # CTAs along the queries


def _entry(meta_ref, q_ref, *refs, dims, cfg, dtype, **kw):
  """Allocates the CTA's SMEM and barriers (shared by its warpgroups) and runs them. refs: K, V
  (and with 8-bit K, V their scale rows), out, LSE."""
  *kv_refs, out_ref, lse_ref = refs
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))  # WGMMA operand layout
  smem = (
      plgpu.SMEM((COMPUTE_WGS, cfg.block_q, dims.d), dtype, transforms=tiled),  # Q, then O
      plgpu.SMEM((cfg.stages, cfg.block_kv, dims.d), dtype, transforms=tiled),  # K ring
      plgpu.SMEM((cfg.stages, cfg.block_kv, dims.d), dtype, transforms=tiled),  # V ring
      plgpu.SMEM((COMPUTE_WGS, cfg.block_q), jnp.float32),  # LSE rows
  )
  loaded = (plgpu.Barrier(num_barriers=COMPUTE_WGS),  # Q of each compute warpgroup
            plgpu.Barrier(num_barriers=cfg.stages),  # K slot filled
            plgpu.Barrier(num_barriers=cfg.stages))  # V slot filled
  if len(kv_refs) == 4:  # 8-bit K, V: one tile of each and its scales land here by TMA
    tiled8 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))  # 64-byte rows at d 64
    smem += ((plgpu.SMEM((cfg.block_kv, dims.d), kv_refs[0].dtype, transforms=tiled8),) * 2
             + (plgpu.SMEM((cfg.block_kv,), jnp.float32),) * 2,)
    loaded += (plgpu.Barrier(num_barriers=4),)  # K tile, K scales, V tile, V scales landed
  freed = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=cfg.stages),) * 2  # K, V slot
  turn = plgpu.Barrier(num_arrivals=COMPUTE_WGS)  # the compute warpgroups alternate
  refs = (meta_ref, q_ref, tuple(kv_refs), out_ref, lse_ref)
  pl.run_scoped(lambda *scoped: _cta(refs, *scoped, dims=dims, cfg=cfg, dtype=dtype, **kw),
                smem, loaded, freed, turn, collective_axes="wg")


def _cta(refs, smem, loaded, freed, turn, *, dims, cfg, causal, **kw):
  """One CTA: which sequence, head and query block, how many key tiles its rows see in all
  (cta_steps: the memory warpgroup loads those), then each warpgroup's role."""
  meta_ref = refs[0]
  b, h, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
  blk = lax.axis_index("qblock")
  if causal:  # the last query blocks see the most keys: launch them first (better tail balance)
    blk = dims.q_blocks - 1 - blk
  q_off, kv_len = meta_ref[b, 0], meta_ref[b, 1]
  last_wg_base = _q_base(blk, COMPUTE_WGS - 1, cfg.block_q, dims.lq)
  cta_steps = _key_bounds(last_wg_base, q_off, kv_len, causal=causal, cfg=cfg)[1]
  scalars = dict(b=b, h=h, kvh=lax.div(h, jnp.int32(dims.group)), q_off=q_off, kv_len=kv_len,
                 cta_steps=cta_steps)
  args = (refs, smem, loaded, freed, turn)

  @pl.when(wg < COMPUTE_WGS)
  def _():
    _consumer(*args, wg=wg, q_base=_q_base(blk, wg, cfg.block_q, dims.lq), dims=dims, cfg=cfg,
              causal=causal, **scalars, **kw)

  @pl.when(wg == COMPUTE_WGS)
  def _():
    _producer(*args, dims=dims, cfg=cfg, **scalars, kv_layout=kw["kv_layout"],
              native=kw["native"], dtype=kw["dtype"])


def _q_base(blk, wg, bq: int, lq: int):
  """First query row of warpgroup wg in CTA blk: the last ones are clamped to end at Lq (their
  rows overlap the previous warpgroup's and are computed twice, bit-identically)."""
  return jnp.minimum(blk * (COMPUTE_WGS * bq) + wg * bq, lq - bq)


def _key_bounds(q_base, q_off, kv_len, *, causal: bool, cfg: Config):
  """(unmasked, steps) for query rows q_base..q_base + block_q - 1: key tiles [0, unmasked) are
  visible to every row (no mask needed), tiles [unmasked, steps) to some, later ones to none."""
  seen_by_all, seen_by_some = kv_len, kv_len
  if causal:  # row r sees keys <= q_off + r: the first row bounds "all", the last "some"
    seen_by_all = jnp.minimum(seen_by_all, q_off + q_base + 1)
    seen_by_some = jnp.minimum(seen_by_some, q_off + q_base + cfg.block_q)
  bk = jnp.int32(cfg.block_kv)
  steps = lax.div(jnp.maximum(seen_by_some, 0) + bk - 1, bk)
  unmasked = jnp.minimum(lax.div(jnp.maximum(seen_by_all, 0), bk), steps)
  return unmasked, steps


def _producer(refs, smem, loaded, freed, turn, *, dims, cfg, kv_layout, native, dtype, b, kvh,
              cta_steps, **_):
  """Memory warpgroup: fills the K/V ring, each slot once both compute warpgroups freed it."""
  del turn, dtype
  k_ref, v_ref, *scale_refs = refs[2]
  _, k_smem, v_smem, _, *landed = smem
  _, k_loaded, v_loaded, *landed_at = loaded
  k_free, v_free = freed
  if native:  # registers go to the compute warpgroups
    plgpu.set_max_registers(_REGISTERS[bool(scale_refs)][0], action="decrease")

  def load(x_ref, x_smem, barrier, step, slot):
    start = tile_start(step, cfg.block_kv, dims.t)
    plgpu.copy_gmem_to_smem(keyrows(x_ref, kv_layout, b, kvh, start, cfg.block_kv),
                            x_smem.at[slot], barrier.at[slot])

  if scale_refs:
    _fill_dequantized((k_ref, v_ref), scale_refs, (k_smem, v_smem), landed[0], landed_at[0],
                      (k_loaded, v_loaded), freed, dims=dims, cfg=cfg, kv_layout=kv_layout,
                      native=native, b=b, kvh=kvh, cta_steps=cta_steps)
    return
  fill_ring(cta_steps, cfg.stages,
            [(functools.partial(load, k_ref, k_smem, k_loaded), k_free),
             (functools.partial(load, v_ref, v_smem, v_loaded), v_free)])


def _fill_dequantized(x_refs, scale_refs, rings, landed, landed_at, filled, freed, *, dims, cfg,
                      kv_layout, native, b, kvh, cta_steps):
  """Memory warpgroup with 8-bit K, V: tile `step` of each and its scales land by TMA in SMEM
  (the next one's copy starts as soon as this one is read), then this warpgroup writes it
  dequantized into ring slot step % stages once both compute warpgroups freed that slot, and
  marks the slot filled (an arrival where TMA would have completed it)."""
  stages = cfg.stages
  tiles, scales = landed[:2], landed[2:]

  def land(i, step):  # stream i: 0 = K, 1 = V
    start = tile_start(step, cfg.block_kv, dims.t)
    plgpu.copy_gmem_to_smem(keyrows(x_refs[i], kv_layout, b, kvh, start, cfg.block_kv),
                            tiles[i], landed_at.at[2 * i])
    plgpu.copy_gmem_to_smem(scale_refs[i].at[b, kvh, pl.ds(start, cfg.block_kv)], scales[i],
                            landed_at.at[2 * i + 1])

  @pl.when(cta_steps > 0)
  def _():
    for i in range(2):
      land(i, 0)

  @pl.loop(0, cta_steps)
  def _(step):
    slot = lax.rem(step, jnp.int32(stages))
    for i in range(2):
      plgpu.barrier_wait(landed_at.at[2 * i])
      plgpu.barrier_wait(landed_at.at[2 * i + 1])

      @pl.when(step >= stages)
      def _():
        plgpu.barrier_wait(freed[i].at[slot])  # tile step - stages released

      dequantize_tile(tiles[i], scales[i], rings[i].at[slot], native=native)
      # (a fence and a warpgroup barrier:) the dequantized tile is visible to the WGMMAs, and the
      # landed one read by all threads before the next copy overwrites it
      plgpu.commit_smem()
      plgpu.barrier_arrive(filled[i].at[slot])

      @pl.when(step + 1 < cta_steps)
      def _():
        land(i, step + 1)

  @pl.loop(jnp.maximum(cta_steps - stages, 0), cta_steps)
  def _(step):  # the last tiles' release (as fill_ring: lets the interpreter see every phase)
    for i in range(2):
      plgpu.barrier_wait(freed[i].at[lax.rem(step, jnp.int32(stages))])


def _consumer(refs, smem, loaded, freed, turn, *, wg, q_base, dims, cfg, causal, scale,
              kv_layout, native, dtype, b, h, kvh, q_off, kv_len, cta_steps):
  """Compute warpgroup: online softmax over the key tiles its rows see, then O and LSE out."""
  del kvh, kv_layout
  _, q_ref, kv_refs, out_ref, lse_ref = refs
  qo_smem, _, _, lse_smem, *_ = smem
  q_loaded, k_loaded, *_ = loaded
  if native:
    plgpu.set_max_registers(_REGISTERS[len(kv_refs) == 4][1], action="increase")
  qo = qo_smem.at[wg]
  plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, cfg.block_q), h], qo, q_loaded.at[wg])
  plgpu.barrier_wait(q_loaded.at[wg])
  unmasked, steps = _key_bounds(q_base, q_off, kv_len, causal=causal, cfg=cfg)
  ops = Ops(native, cfg, dims.d)
  state = ops.init_state()

  sync_turn = functools.partial(rendezvous, turn)

  @pl.when(steps > 0)
  def _():
    plgpu.barrier_wait(k_loaded.at[0])

  pl.when(wg == 1)(sync_turn)  # warpgroup 0 goes first; from here on they alternate
  step = functools.partial(
      _step, qo=qo, smem=smem, loaded=loaded, freed=freed, turn=turn, sync_turn=sync_turn,
      ops=ops, steps=steps, c=scale * LOG2E, dtype=dtype, t=dims.t, cfg=cfg, causal=causal,
      q_pos0=q_off + q_base, kv_len=kv_len)
  state = lax.fori_loop(0, unmasked, functools.partial(step, masked=False), state)
  # The cond only skips an empty loop; tokamax's FA3 guards its masked loop the same way ("a weird
  # compiler bug" without it).
  state = lax.cond(unmasked < steps,
                   lambda: lax.fori_loop(unmasked, steps, functools.partial(step, masked=True),
                                         state),
                   lambda: state)

  @pl.loop(steps, cta_steps)
  def _(i):  # the other warpgroup's rows see more tiles: keep the ring and the turns in step
    slot = lax.rem(i, jnp.int32(cfg.stages))
    plgpu.barrier_wait(k_loaded.at[slot])  # (not needed on the GPU, whose barriers track
    plgpu.barrier_wait(loaded[2].at[slot])  # phases by parity; the interpreter checks them all)
    plgpu.barrier_arrive(freed[0].at[slot])
    plgpu.barrier_arrive(freed[1].at[slot])
    sync_turn()
    sync_turn()

  pl.when(wg == 0)(sync_turn)
  out, lse = ops.finish(*state)
  qo[...] = out.astype(dtype)  # Q's slot is free: the last WGMMA reading it has completed
  lse_smem.at[wg][...] = lse
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(qo, out_ref.at[b, pl.ds(q_base, cfg.block_q), h])
  plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q_base, cfg.block_q)])
  plgpu.wait_smem_to_gmem(0)


def _step(i, state, *, masked: bool, qo, smem, loaded, freed, turn, sync_turn, ops, steps, c,
          dtype, t, cfg, causal, q_pos0, kv_len):
  """One key tile: S = Q K^T, mask (edge tiles only), softmax update, O += P V."""
  acc, m, l = state  # [bq, d] fp32; row max of S * c (base-2 domain); row sum of 2^(S c - m)
  _, k_smem, v_smem, *_ = smem
  _, k_loaded, v_loaded, *_ = loaded
  k_free, v_free = freed
  slot = lax.rem(i, jnp.int32(cfg.stages))
  s = ops.scores(qo, k_smem.at[slot], after_issue=sync_turn)  # [bq, bk] fp32
  plgpu.barrier_arrive(k_free.at[slot])
  if masked:
    s = jnp.where(_visible(ops, i, t=t, cfg=cfg, causal=causal, q_pos0=q_pos0, kv_len=kv_len),
                  s, NEG_INF)
  m_new = jnp.maximum(m, s.max(axis=1) * c)
  # A row that has seen no key yet keeps m = -inf; subtract 0 then (its p are all 0), not -inf.
  m_sub = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
  alpha = jnp.exp2(m - m_sub)
  p = jnp.exp2(s * c - rows(m_sub, s.shape))
  acc = acc * rows(alpha, acc.shape)
  l = l * alpha + p.sum(axis=1)
  p16 = p.astype(dtype)
  # FA3's order at d <= 128 (measured faster there): the row sum before the barriers below.
  acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
  plgpu.barrier_arrive(turn)  # softmax done: the other warpgroup may use the tensor cores
  plgpu.barrier_wait(v_loaded.at[slot])
  plgpu.barrier_wait(turn)  # ... and has issued its products: our turn

  def wait_next_k():  # while P V runs, the next K tile (already in flight) lands
    @pl.when(i + 1 < steps)
    def _():
      plgpu.barrier_wait(k_loaded.at[lax.rem(i + 1, jnp.int32(cfg.stages))])

  acc = ops.accumulate(acc, p16, v_smem.at[slot], after_issue=wait_next_k)
  plgpu.barrier_arrive(v_free.at[slot])
  return acc, m_new, l


def _visible(ops, i, *, t, cfg, causal, q_pos0, kv_len):
  """[bq, bk] bool: key (column) visible to query row (row) in tile i, whose keys start at the
  clamped tile_start; keys below i * bk in a clamped tile were already seen."""
  nominal = i * cfg.block_kv
  key = tile_start(i, cfg.block_kv, t) + ops.iota(1)
  ok = (key >= nominal) & (key < kv_len)
  if causal:
    ok = ok & (key <= q_pos0 + ops.iota(0))
  return ok





