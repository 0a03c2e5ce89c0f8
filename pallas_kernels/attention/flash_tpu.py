"""flash_attention's TPU kernel: key tiles as the innermost grid axis with the online softmax's
state in VMEM (pallas_kernels.tpu's grid spec and scratch), 8-bit K/V converted tile by tile, the
int8 products on the MXU where asked (KernelOptions.decode_int8_products). Checked in the TPU
interpreter and by the Pallas-to-Mosaic export on CPU; no TPU has run it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import layout, tpu
from pallas_kernels import online_softmax as osm

SQ = pl.squeezed


@functools.partial(jax.jit, static_argnames=("group", "bm", "bk", "causal", "scale", "values",
                                             "interpret"))
def attention(qr, k, v, meta, k_scale=None, v_scale=None, q_scale=None, *, group, bm, bk,
              causal, scale, interpret, values=None):
  """k, v [B, KV, T, d]; with 8-bit k, v their scales as rows [B, KV, 1, T] (tpu.scale_rows).
  q_scale [B, KV, R_padded, 1]: qr holds int8 rows multiplied with the int8 keys as stored on
  the MXU (KernelOptions.decode_int8_products), scaled after; values: the dtype the value
  tiles convert to (default q's)."""
  from jax.experimental.pallas import tpu as pltpu
  b, kvh, rp, d = qr.shape
  t = k.shape[2]
  nk = pl.cdiv(t, bk)
  quantized = k_scale is not None
  eight_bit_q = q_scale is not None
  values = values or qr.dtype

  def kernel(meta_ref, q_ref, k_ref, v_ref, *refs):
    if eight_bit_q:
      ks_ref, vs_ref, qs_ref, o_ref, lse_ref, m_s, l_s, acc_s = refs
    else:
      ks_ref, vs_ref, o_ref, lse_ref, m_s, l_s, acc_s = refs if quantized else (None, None, *refs)
    bi, j = tpu.div(pl.program_id(0), kvh), pl.program_id(2)
    q_off, kv_len = meta_ref[2 * bi], meta_ref[2 * bi + 1]
    first_row = pl.program_id(1) * bm
    end = kv_len
    if causal:
      end = jnp.minimum(end, q_off + tpu.div(first_row + bm - 1, group) + 1)

    @pl.when(j == 0)
    def _():
      m_s[...], l_s[...], acc_s[...] = osm.init(bm, d)

    @pl.when(j * bk < end)
    def _():
      idx = j * bk + lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
      ok = idx < kv_len
      if causal:
        ok = ok & (idx <= layout.row_positions(first_row, bm, group, q_off))
      # The last tile may run past t: those rows of v (and scales) are undefined and 0 * NaN
      # would spread.
      v_rows = j * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
      v = jnp.where(v_rows < kv_len, v_ref[...], jnp.zeros((), v_ref.dtype))
      ks = vs = None
      if quantized:
        cols = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        ks, vs = ks_ref[...], jnp.where(cols < kv_len, vs_ref[...], 0.0)
      (kt, ks), (vt, vs) = osm.converted(k_ref[...], ks, qr.dtype), osm.converted(v, vs, values)
      if eight_bit_q:
        s = osm.scores(q_ref[...], kt, None, ks) * (qs_ref[...] * scale)
      else:
        s = osm.scores(q_ref[...], kt, scale, ks)
      s = jnp.where(ok, s, osm.NEG_INF)
      m_s[...], l_s[...], acc_s[...] = osm.update(m_s[...], l_s[...], acc_s[...], s, vt, vs)

    @pl.when(j == nk - 1)
    def _():
      o_ref[...], lse_ref[...] = osm.finish(m_s[...], l_s[...], acc_s[...])

  row = lambda bh, r, j, meta: (*tpu.batch_head(bh, kvh), r, 0)  # noqa: E731
  key = pl.BlockSpec((SQ, SQ, bk, d), lambda bh, r, j, meta: (*tpu.batch_head(bh, kvh), j, 0))
  scales = [pl.BlockSpec((SQ, SQ, 1, bk), lambda bh, r, j, meta: (*tpu.batch_head(bh, kvh), 0, j))
            ] * 2 if quantized else []
  if eight_bit_q:
    scales.append(pl.BlockSpec((SQ, SQ, bm, 1), row))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b * kvh, rp // bm, nk),
      in_specs=[pl.BlockSpec((SQ, SQ, bm, d), row), key, key, *scales],
      out_specs=[pl.BlockSpec((SQ, SQ, bm, d), row), pl.BlockSpec((SQ, SQ, bm, 1), row)],
      scratch_shapes=tpu.softmax_scratch(bm, d))
  return tpu.attention_call(kernel, grid_spec, qr.shape, interpret)(
      meta.reshape(-1), qr, k, v, *([k_scale, v_scale] if quantized else []),
      *([q_scale] if eight_bit_q else []))
