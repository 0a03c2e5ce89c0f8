"""A prefill chunk's attention reading a 4-bit cache's tiles (quant4: KIVI's layout), on the GPU.

flash_attention for many query rows (a chunk of Lq tokens, causal at per-sequence offsets) over
keys grouped along tokens and values per token, read as stored: per program (batch x KV head,
block of query rows) one key group of G tokens a step, its codes unpacked in registers
(nibbles.py) and dequantized there in fp32 (codes x scale + zero, rounded once to the queries'
dtype: the values `quant4.load` gives, so the products are the copy route's), then the
products and the online softmax as flash attention's. The residual group (each sequence's
newest, unfilled group, kept whole) is one more step. Where decode (int4_decode.py) folds the
key scales into its few query rows, a chunk's many rows share each dequantized tile, so
dequantizing it costs G x d a step against the products' rows x G x d; no copy of the layer's
cache is made (the copy route writes and reads back 2 bytes a channel and token).

A byte holds channel j in its low nibble and j + d / 2 in its high one, so a query's halves
multiply a tile's low and high nibbles; value channels come out in pieces of `w` bytes' low and
high nibbles (w = min(value group, d / 2)), each piece within one value group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant4
from pallas_kernels import nibbles as unpack
from pallas_kernels import online_softmax as osm

SQ = gpu.SQ
BLOCK_ROWS = 64  # query rows a program (16 tokens of a group of 4 query heads)
NUM_WARPS = 4


def attention(q, k: quant4.GroupedKeys, v: quant4.Int4, *, q_offset, kv_len, scale: float,
              variant):
  """Causal flash_attention of q [B, Lq, H, d] at positions q_offset[b] + i over a 4-bit cache
  [B, KV, T, d] (BHTD) whose keys below kv_len[b] are seen -> (out [B, Lq, H, d] in q's dtype,
  lse [B, Lq, H] fp32)."""
  b, lq, h, d = q.shape
  kvh = k.shape[1]
  rows = lq * (h // kvh)
  bm = min(BLOCK_ROWS, max(16, layout.next_pow2(rows)))
  rp = layout.round_up(rows, bm)
  meta = jnp.stack([q_offset, kv_len, k.residual_group * k.main.group], axis=1).astype(jnp.int32)
  out, lse = _gpu(meta, layout.q_rows(q, kvh, rp), k.main.codes, k.main.scale, k.main.zero,
                  k.residual, v.codes, v.scale, v.zero, group=h // kvh, bm=bm, scale=scale,
                  value_group=v.group, interpret=variant.interpret_arg())
  return layout.from_rows(out, lq, h).astype(q.dtype), layout.from_rows(lse[..., 0], lq, h)


@functools.partial(jax.jit, static_argnames=("group", "bm", "scale", "value_group", "interpret"))
def _gpu(meta, qr, kc, ka, kz, kres, vc, vs, vz, *, group, bm, scale, value_group, interpret):
  """(out [B, KV, R, d], lse [B, KV, R, 1]) fp32 of the rows qr [B, KV, R, d] (R a multiple of
  bm). meta [B, 3]: (the chunk's first position, keys seen, the residual group's first slot)."""
  b, kvh, rp, d = qr.shape
  t, g = kc.shape[2], kres.shape[2]
  half = d // 2
  w = min(value_group, half)
  nv = d // value_group
  dtype = qr.dtype
  pieces = [(c, nib, c + nib * half) for c in range(0, half, w) for nib in (0, 1)]

  def dequantized(codes, scale_, zero):
    """codes [n, w] (exact floats) x scale_ + zero (rows [1, w] or columns [n, 1]) in fp32,
    rounded once to the queries' dtype."""
    f32 = jnp.float32
    return (codes.astype(f32) * scale_.astype(f32) + zero.astype(f32)).astype(dtype)

  def kernel(meta_ref, q_ref, kc_ref, ka_ref, kz_ref, kr_ref, vc_ref, vs_ref, vz_ref, o_ref,
             lse_ref):
    q_off, kv_len, res_start = meta_ref[0], meta_ref[1], meta_ref[2]
    first_row = pl.program_id(1) * bm
    q_pos = q_off + (first_row + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) // group
    q1, q2 = q_ref[:, pl.ds(0, half)], q_ref[:, pl.ds(half, half)]  # [bm, d / 2]

    def dot(x, y, dims):
      return lax.dot_general(x, y, (dims, ((), ())), preferred_element_type=jnp.float32)

    def fold(carry, at, k1, k2, limit):
      """Folds the group at slots `at` (keys k1, k2: its halves [G, d / 2]) into the state."""
      m, l, accs = carry
      idx = at.start + lax.broadcasted_iota(jnp.int32, (1, g), 1)
      s = (dot(q1, k1, ((1,), (1,))) + dot(q2, k2, ((1,), (1,)))) * scale
      s = jnp.where((idx < limit) & (idx <= q_pos), s, osm.NEG_INF)
      m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
      m_safe = jnp.where(m_new == osm.NEG_INF, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe)
      l = l * alpha + jnp.sum(p, axis=1, keepdims=True)
      p = p.astype(dtype)
      codes = {c: unpack.nibbles(vc_ref[at, pl.ds(c, w)], jnp.float32, False)
               for c in range(0, half, w)}
      accs = list(accs)
      for i, (c, nib, ch) in enumerate(pieces):
        j = ch // value_group
        vals = dequantized(codes[c][nib], vs_ref[at, pl.ds(j, 1)], vz_ref[at, pl.ds(j, 1)])
        accs[i] = accs[i] * alpha + dot(p, vals, ((1,), (0,)))
      return m_new, l, accs

    def group_step(i, carry):
      first = i * g
      lo, hi = unpack.nibbles(kc_ref[pl.ds(first, g), :], jnp.float32, False)  # [G, d / 2]
      k1, k2 = (dequantized(x, ka_ref[pl.ds(i, 1), pl.ds(c, half)],
                            kz_ref[pl.ds(i, 1), pl.ds(c, half)])
                for x, c in ((lo, 0), (hi, half)))
      return fold(carry, pl.ds(first, g), k1, k2, jnp.minimum(kv_len, res_start))

    def residual_step(_, carry):
      k1, k2 = (kr_ref[:, pl.ds(c, half)].astype(dtype) for c in (0, half))
      return fold(carry, pl.ds(res_start, g), k1, k2, kv_len)

    last_pos = q_off + (first_row + bm - 1) // group
    end = jnp.minimum(jnp.minimum(kv_len, res_start), last_pos + 1)
    carry = (jnp.full((bm, 1), osm.NEG_INF, jnp.float32), jnp.zeros((bm, 1), jnp.float32),
             [jnp.zeros((bm, w), jnp.float32) for _ in pieces])
    carry = lax.fori_loop(0, jnp.clip(pl.cdiv(end, g), 0, t // g), group_step, carry)
    has_residual = ((res_start < t) & (res_start < kv_len) & (res_start <= last_pos))
    m, l, accs = lax.fori_loop(0, has_residual.astype(jnp.int32), residual_step, carry)
    out, lse = osm.finish(m, l, jnp.zeros((bm, 1), jnp.float32))
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    for acc, (_, _, ch) in zip(accs, pieces):
      o_ref[:, pl.ds(ch, w)] = jnp.where(seen, acc / safe_l, 0.0)
    lse_ref[...] = lse

  def whole(rows_, cols):  # one (batch, kv head)'s [rows_, cols] of a [B, KV, ...] buffer
    return pl.BlockSpec((SQ, SQ, rows_, cols), lambda bh, r: (bh // kvh, bh % kvh, 0, 0))

  rows_spec = lambda cols: pl.BlockSpec((SQ, SQ, bm, cols),  # noqa: E731
                                        lambda bh, r: (bh // kvh, bh % kvh, r, 0))
  return gpu.pallas_call(
      kernel, interpret, num_warps=NUM_WARPS, num_stages=2, grid=(b * kvh, rp // bm),
      in_specs=[gpu.per_batch_spec(kvh, 3), rows_spec(d), whole(t, half), whole(t // g, d),
                whole(t // g, d), whole(g, d), whole(t, half), whole(t, nv), whole(t, nv)],
      out_specs=[rows_spec(d), rows_spec(1)],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, rp, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, rp, 1), jnp.float32)],
  )(meta, qr, kc, ka, kz, kres, vc, vs, vz)
