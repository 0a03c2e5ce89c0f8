"""The products and register layouts of mgpu_decode.py's transposed products, natively (WGMMA,
Mosaic GPU's register layouts) or in jax's Mosaic GPU interpreter (dot products of the SMEM
tiles, no layout casts): mgpu_common.Ops for S^T = K Q^T and O^T += V^T P^T; and the launch the
8-bit and 4-bit decode kernels share (mgpu_decode.py, mgpu_int4_decode.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mgpu_common import LN2, NEG_INF, int_to_f32, interpret_params, plgpu

ROWS = 16  # WGMMA's N for the products: a KV head's query rows, padded with zero rows
# Mosaic's scratch for a [ROWS] column vector reduced across the warpgroup's 4 warps (the sum
# in DecodeOps.finish; the chain's column max has its own exchange): 2 KiB hold both of a
# thread's 2-float registers at once, so Mosaic syncs the warpgroup twice, not four times.
REDUCTION_SCRATCH = 2048


class DecodeOps:
  """A compute warpgroup's products and layouts over [bk, ROWS] score tiles and a [d, ROWS]
  output; native: WGMMA and Mosaic's layouts, else the interpreter's stand-ins."""

  def __init__(self, native: bool, bk: int, d: int):
    self.native, self.bk, self.d = native, bk, d

  def layout(self, x, layout):
    return plgpu.layout_cast(x, layout) if self.native else x

  def iota(self):
    x = lax.broadcasted_iota(jnp.int32, (self.bk, ROWS), 0)
    return self.layout(x, plgpu.Layout.WGMMA)

  def init_state(self):
    wgmma = plgpu.Layout.WGMMA
    return (self.layout(jnp.zeros((self.d, ROWS), jnp.float32), wgmma),
            self.layout(jnp.full((ROWS,), NEG_INF, jnp.float32), wgmma.reduce(0)),
            self.layout(jnp.zeros((self.bk, ROWS), jnp.float32), wgmma))

  def row_vector(self, ref):
    """A [bk] fp32 SMEM vector (the keys' scales) in the layout of a score tile's rows."""
    if not self.native:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))

  def column_vector(self, ref):
    """A [ROWS] fp32 SMEM vector in the layout of a score tile's columns."""
    if not self.native:
      return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))

  def rows(self, x, shape):
    return self.layout(lax.broadcast_in_dim(x, shape, [0]), plgpu.Layout.WGMMA)

  def columns(self, x, shape):
    return self.layout(lax.broadcast_in_dim(x, shape, [1]), plgpu.Layout.WGMMA)

  def scores(self, k_tile, q_smem, *, after_issue):
    """K [bk, d] . Q [ROWS, d]^T -> fp32 [bk, ROWS]; after_issue runs while the product is in
    flight: int8 into int32, exact, then fp32 (mgpu_common.int_to_f32); 16-bit tiles in fp32."""
    acc = jnp.int32 if k_tile.dtype == jnp.int8 else jnp.float32
    if not self.native:
      s = lax.dot_general(k_tile[...], q_smem[...], (((1,), (1,)), ((), ())),
                          preferred_element_type=acc)
      plgpu.commit_smem()  # the interpreter's reads before TMA refills the slot
      after_issue()
    else:
      def product(acc_ref):
        plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))  # Q^T: a view
        after_issue()
        return acc_ref[...]

      s = pl.run_scoped(product, plgpu.ACC((self.bk, ROWS), acc))
    return int_to_f32(s) if acc == jnp.int32 else s

  def column_max(self, s, exchange):
    """[bk, ROWS] -> [ROWS]: each column's max across the warpgroup's 4 warps. Natively by warp
    shuffles and one exchange through `exchange` ([4, ROWS] fp32 SMEM; consecutive calls must
    alternate two buffers): one warpgroup barrier where Mosaic's reduction, its scratch shared
    by every reduction, syncs twice, and the chain's column max is a large part of its time."""
    return _column_max(s, exchange) if self.native else s.max(axis=0)

  def accumulate(self, acc, p, v_tile, p_tile):
    """acc + V^T [d, bk] . P^T [bk, ROWS] in fp32, P^T (p) stored to p_tile first."""
    p_tile[...] = p
    plgpu.commit_smem()
    if not self.native:
      pv = lax.dot_general(v_tile[...], p_tile[...], (((0,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)
      plgpu.commit_smem()
      return acc + pv

    def product(acc_ref):
      plgpu.wgmma(acc_ref, v_tile.transpose((1, 0)), p_tile)  # V^T: a view

    return pl.run_state(product)(plgpu.ACC.init(acc))

  def finish(self, acc, m, l):
    """-> (out^T [d, ROWS] fp32, natural-log LSE [ROWS]); columns that saw no key: (0, -inf)."""
    total = l.sum(axis=0)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    inv = jnp.where(seen, 1.0 / safe, 0.0)
    lse = jnp.where(seen, m * LN2 + jnp.log(safe), NEG_INF)
    return acc * self.columns(inv, acc.shape), lse


EXCHANGE = (2, 4, ROWS)  # column_max's two alternating [warps, ROWS] fp32 buffers


def _column_max(s, exchange):
  """DecodeOps.column_max natively (inline Mosaic GPU). In the WGMMA layout a thread holds two
  adjacent columns of each 8-column block, in two rows of each 8-row block of its warp's 16;
  the 8 lanes sharing lane % 4 hold the same columns."""
  import jax.experimental.mosaic.gpu as mgpu
  import numpy as np
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, vector

  wgmma = plgpu.Layout.WGMMA
  columns = wgmma.reduce(0)

  @plgpu.inline_mgpu(arg_types=(wgmma, plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((ROWS,), jnp.float32, layout=columns))
  def column_max(ctx, x, ref):
    del ctx
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    as_index = lambda v: arith.index_cast(index, v)  # noqa: E731
    lane = arith.remui(mgpu.thread_idx(), mgpu.c(32, i32))
    warp = arith.remui(mgpu.warp_idx(sync=True), mgpu.c(4, i32))
    pair = arith.muli(arith.remui(lane, mgpu.c(4, i32)), mgpu.c(2, i32))
    blocks = {}  # column block -> this thread's max of its two columns there
    for idx, reg in np.ndenumerate(x.registers):  # idx[1]: the 8-column block
      blocks[idx[1]] = reg if idx[1] not in blocks else arith.maximumf(blocks[idx[1]], reg)
    starts = {}
    for j, reg in blocks.items():
      for distance in (4, 8, 16):  # the 8 lanes of the same columns
        reg = arith.maximumf(reg, mgpu.utils.shfl_bfly(reg, distance))
      starts[j] = as_index(arith.addi(mgpu.c(8 * j, i32), pair))
      vector.store(reg, ref, [as_index(warp), starts[j]])
    mgpu.utils.warpgroup_barrier()  # the 4 warps' maxima stored
    out_layout = mgpu.WGMMA_LAYOUT.reduce((0,))
    out = np.empty(out_layout.registers_shape((ROWS,)), dtype=object)
    vec = ir.VectorType.get((2,), ir.F32Type.get())
    for j, start in starts.items():
      parts = [vector.load(vec, ref, [as_index(mgpu.c(w, i32)), start]) for w in range(4)]
      out[j, 0, 0] = arith.maximumf(arith.maximumf(parts[0], parts[1]),
                                    arith.maximumf(parts[2], parts[3]))
    return mgpu.FragmentedArray(_registers=out, _layout=out_layout, _is_signed=None)

  return column_max(s, exchange)


def launch(body, b: int, dims, parts: int, config, interpret, num_threads: int = 2):
  """The split-K decode kernel over (batch x KV head, key split) of `num_threads` warpgroups
  running body, its per-split (out^T [B, KV, parts, d, ROWS], lse [B, KV, parts, ROWS]) fp32.
  dims: mgpu_decode's _Dims (keys, head dim, KV heads, keys a split); config a DecodeConfig."""
  params = None
  if interpret is False:
    params = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=REDUCTION_SCRATCH,
                                  lowering_semantics=plgpu.LoweringSemantics.Lane,
                                  unsafe_no_auto_barriers=not config.auto_barriers)
  kvh, d = dims.kvh, dims.d
  return plgpu.kernel(
      body,
      out_type=[jax.ShapeDtypeStruct((b, kvh, parts, d, ROWS), jnp.float32),
                jax.ShapeDtypeStruct((b, kvh, parts, ROWS), jnp.float32)],
      grid=(b * kvh, -(-dims.t // dims.span)), grid_names=("bh", "split"),
      num_threads=num_threads, thread_name="wg", compiler_params=params,
      interpret=interpret_params(interpret))


def tile_start(start0, i, bk: int, t: int):
  """The first key of a split's tile i (the split starting at key start0), clamped to end at T
  (keys below start0 + i * bk in it were seen by the tile before and are masked)."""
  return jnp.minimum(start0 + i * bk, t - bk)
