"""A prefill chunk's attention reading a 4-bit cache's tiles (quant4: KIVI's layout) on a TPU.

The TPU form of attention/int4_chunk.py, on int4_decode_tpu.py's structure: per (sequence x KV
head, block of query rows) key blocks of whole groups on the innermost grid axis, the
online-softmax state in VMEM scratch. A step unpacks the block's key codes into channel order
in VMEM (tpu_int4.unpacked) and dequantizes them there group by group (codes x scale + zero
in fp32, rounded once to the queries' dtype: the values the copy route makes), so the chunk's
many rows share one dequantized tile and one MXU product; the values as int4_decode_tpu's
(value_tile). Each sequence's residual group (the newest, kept whole) is folded in at the first
step. Not run on a TPU (none was available): checked in Pallas TPU interpret mode on a CPU
against the copy route and lowered to Mosaic by exporting for TPU on a CPU
(tests/kernels/test_int4_chunk.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import layout, quant4, tpu, tpu_int4
from pallas_kernels import online_softmax as osm
from pallas_kernels.attention.int4_decode_tpu import cache_grid_spec, fold_key_block
from pallas_kernels.attention.int4_decode_tpu import key_block_maps, start_with_residual

SQ = pl.squeezed
KERNEL_NAME = "int4_chunk_tpu"
BLOCK_ROWS = 128  # query rows a program: the MXU's tile on v5e
MIN_GROUPS = tpu_int4.MIN_GROUPS  # key groups a step (a sublane tile of scale rows)


def attention(q, k: quant4.GroupedKeys, v: quant4.Int4, *, q_offset, kv_len, scale: float,
              variant):
  """As int4_chunk.attention: causal, q [B, Lq, H, d] at q_offset[b] + i over the keys below
  kv_len[b] of a 4-bit cache [B, KV, T, d] -> (out in q's dtype, lse [B, Lq, H] fp32)."""
  b, lq, h, d = q.shape
  kvh, t = k.shape[1], k.shape[2]
  rows = lq * (h // kvh)
  bm = min(BLOCK_ROWS, layout.round_up(rows, 8))
  rp = layout.round_up(rows, bm)
  bk = min(MIN_GROUPS * k.main.group, t)
  meta = jnp.stack([q_offset, kv_len, k.residual_group], axis=1).astype(jnp.int32)
  out, lse = _tpu(meta.reshape(-1), layout.q_rows(q, kvh, rp), k.main.codes, k.main.scale,
                  k.main.zero, k.residual, v.codes, v.scale, v.zero, group=h // kvh, bm=bm,
                  bk=bk, scale=scale, value_group=v.group, interpret=variant.interpret_arg())
  return layout.from_rows(out, lq, h).astype(q.dtype), layout.from_rows(lse[..., 0], lq, h)


@functools.partial(jax.jit, static_argnames=("group", "bm", "bk", "scale", "value_group",
                                             "interpret"))
def _tpu(meta, qr, kc, ka, kz, kres, vc, vs, vz, *, group, bm, bk, scale, value_group,
         interpret):
  """(out [B, KV, R, d], lse [B, KV, R, 1]) fp32 of the rows qr [B, KV, R, d]. meta [B * 3]:
  each sequence's first query position, keys seen and residual group."""
  b, kvh, rp, d = qr.shape
  t, g = kc.shape[2], kres.shape[2]
  groups = bk // g
  nk = pl.cdiv(t, bk)
  product = qr.dtype
  f32 = jnp.float32

  def seq(bh, r, meta):  # (first position, keys, residual group, last visible key + 1)
    bi = tpu.div(bh, kvh)
    q_off, kv_len, res = meta[3 * bi], meta[3 * bi + 1], meta[3 * bi + 2]
    return q_off, kv_len, res, jnp.minimum(kv_len, q_off + tpu.div(r * bm + bm - 1, group) + 1)

  def kernel(meta_ref, q_ref, kc_ref, ka_ref, kz_ref, kr_ref, vc_ref, vs_ref, vz_ref, rc_ref,
             rs_ref, rz_ref, o_ref, lse_ref, m_s, l_s, acc_s, k_buf, v_buf):
    r, j = pl.program_id(1), pl.program_id(2)
    q_off, kv_len, res, end = seq(pl.program_id(0), r, meta_ref)
    q_pos = q_off + tpu.div(r * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0), group)

    def visible(idx):
      return (idx < kv_len) & (idx <= q_pos)

    @pl.when(j == 0)
    def _():
      start_with_residual((m_s, l_s, acc_s), q_ref, kr_ref, (rc_ref, rs_ref, rz_ref), v_buf,
                          res=res, end=end, kv_len=kv_len, scale=scale, value_group=value_group,
                          visible=visible)

    @pl.when(j * bk < end)
    def _():
      codes = tpu_int4.unpacked(kc_ref, k_buf)  # [bk, d] fp32, channels in order
      a, z = ka_ref[...], kz_ref[...]  # [groups, d]
      for i in range(groups):  # each group's keys dequantized with its own scales
        k_buf[i * g:(i + 1) * g, :] = codes[i * g:(i + 1) * g] * a[i:i + 1] + z[i:i + 1]
      s = osm.scores(q_ref[...], k_buf[...].astype(product), scale)  # [bm, bk]
      lane = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
      ok = visible(j * bk + lane) & (j * groups + tpu.div(lane, g) != res)
      fold_key_block((m_s, l_s, acc_s), s, ok, (vc_ref, vs_ref, vz_ref), v_buf, j * bk, kv_len,
                     product, value_group)

    @pl.when(j == nk - 1)
    def _():
      o_ref[...], lse_ref[...] = osm.finish(m_s[...], l_s[...], acc_s[...])

  block_of, residual_of = key_block_maps(lambda bh, r, meta: seq(bh, r, meta)[3:1:-1], bk, g, t)

  grid_spec = cache_grid_spec(b, kvh, rp // bm, nk, bm=bm, bk=bk, g=g, d=d,
                              value_group=value_group, rows=lambda bh, r, j, meta: r,
                              block_of=block_of, residual_of=residual_of, key_buffer=f32)
  return tpu.attention_call(kernel, grid_spec, qr.shape, interpret, name=KERNEL_NAME)(
      meta, qr, kc, ka, kz, kres, vc, vs, vz, vc, vs, vz)
