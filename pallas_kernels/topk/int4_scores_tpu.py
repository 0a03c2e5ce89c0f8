"""A decode step's top-k scores over 4-bit keys, read as stored, on a TPU (Mosaic).

The TPU form of int4_scores.py: the scores [B, KV, rows, T] fp32 of a decode step's few query
rows over keys `quant4.GroupedKeys` [B, KV, T, d] from their codes and per-channel group scales,
never a copy of the keys in the queries' dtype. Its speed has not been measured: no TPU was
available. It is checked in Pallas TPU interpret mode on a CPU against the scores over the
dequantized keys, and lowered to Mosaic by exporting for TPU on a CPU
(tests/kernels/test_int4_scores_tpu.py).

Per (sequence x KV head) the query rows (padded to a sublane tile) stay in VMEM; a grid step
takes a block of whole key groups (tpu_int4.block_keys: 512 keys at up to 8 rows), unpacks its
codes into channel order and scores them with the decode kernel's stacked fold
(tpu_int4.key_scores: the groups' folded query rows in one MXU product, fp32 sums, two bf16
terms under bf16 queries). Steps are independent (both grid axes parallel). The residual group's
slots are then scored from its whole keys in jnp (int4_scores.with_residual); slots past a
sequence's keys hold what their codes give, and the selection's bounds drop them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import layout, quant4, tpu, tpu_int4
from pallas_kernels.topk import int4_scores

SQ = pl.squeezed
KERNEL_NAME = "int4_scores_tpu"  # the Mosaic call's kernel_name in a lowered module


def scores(q, k: quant4.GroupedKeys, *, scale: float | None, interpret,
           block: int | None = None) -> jax.Array:
  """int4_scores.scores on a TPU: q [B, Lq, H, d] over 4-bit keys [B, KV, T, d] -> fp32 scores
  [B, KV, rows, T] (rows = Lq * H / KV, layout.q_rows' order), times `scale` (None: raw q . k).
  block: keys a step (None: tpu_int4.block_keys' choice)."""
  b, lq, h, d = q.shape
  kvh, t = k.shape[1], k.shape[2]
  g = k.main.group
  rows = lq * (h // kvh)
  bm = layout.round_up(rows, 8)  # a sublane tile
  bk = tpu_int4.block_keys(bm, t, g, block, name="int4 scores")
  qr = layout.q_rows(q, kvh, bm)  # [B, KV, bm, d]
  factor = 1.0 if scale is None else scale
  s = _tpu(qr, k.main.codes, k.main.scale, k.main.zero, factor=factor, group=g, bk=bk,
           interpret=interpret)[:, :, :rows]
  return int4_scores.with_residual(s, qr[:, :, :rows].astype(jnp.float32) * factor, k)


@functools.partial(jax.jit, static_argnames=("factor", "group", "bk", "interpret"))
def _tpu(qr, kc, ka, kz, *, factor: float, group: int, bk: int, interpret):
  """[B, KV, bm, T] fp32 scores of qr [B, KV, bm, d] times `factor` over the codes kc [B, KV, T,
  d / 2] with per-group scales ka and zero points kz [B, KV, T / G, d]."""
  from jax.experimental.pallas import tpu as pltpu
  b, kvh, bm, d = qr.shape
  t = kc.shape[2]
  groups = bk // group
  product = qr.dtype  # the MXU's operand dtype: codes exact in it

  def kernel(q_ref, kc_ref, ka_ref, kz_ref, o_ref, k_buf):
    qs = q_ref[...].astype(jnp.float32) * factor  # [bm, d]
    o_ref[...] = tpu_int4.key_scores(qs, ka_ref[...], kz_ref[...], kc_ref, k_buf, group)

  def spec(shape, whole: bool):  # a [B, KV, ...] input's block: bh's, key block j or the first
    return pl.BlockSpec((SQ, SQ, *shape),
                        lambda bh, j: (*tpu.batch_head(bh, kvh), 0 if whole else j, 0))

  return pl.pallas_call(
      kernel, grid=(b * kvh, pl.cdiv(t, bk)), interpret=interpret, name=KERNEL_NAME,
      in_specs=[spec((bm, d), True), spec((bk, d // 2), False), spec((groups, d), False),
                spec((groups, d), False)],
      out_specs=pl.BlockSpec((SQ, SQ, bm, bk),
                             lambda bh, j: (*tpu.batch_head(bh, kvh), 0, j)),
      scratch_shapes=[pltpu.VMEM((bk, d), product)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      out_shape=jax.ShapeDtypeStruct((b, kvh, bm, t), jnp.float32),
  )(qr, kc, ka, kz)
