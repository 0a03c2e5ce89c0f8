"""Decode attention reading a 4-bit cache's tiles (quant4: KIVI's layout) on a TPU (Mosaic).

The TPU form of attention/int4_decode.py: flash_attention's one-token decode over keys
`quant4.GroupedKeys` and values `quant4.Int4` laid out [B, KV, T, d], read as stored, never
copied in the queries' dtype. Its speed has not been measured: no TPU was available. It is
checked in Pallas TPU interpret mode on a CPU against the reference over the dequantized cache,
and lowered to Mosaic by exporting for TPU on a CPU (tests/kernels/test_int4_decode_tpu.py).

The structure is flash_tpu.attention's: per (sequence x KV head) one row block of the group's
query heads, key blocks of whole groups on the innermost (sequential) grid axis, the online-softmax
state in VMEM scratch. A step (its key half shared with topk/int4_scores_tpu.py: tpu_int4.py):
- unpacks the block's key and value codes (uint8 [bk, d / 2]; byte j holds channel j in its low
  nibble and j + d / 2 in its high one) by a mask and a shift on int32, each nibble's half
  stored at its channels of a VMEM tile [bk, d], so every later operation sees channels in order;
- folds each group's key scales into the query (quant4_products.key_scores: q . (a c + z) =
  (q a) . c + q . z): the block's groups' folded query rows q a_g (fp32; under bf16 queries two
  bf16 terms) are stacked into one operand [groups x rows, d] multiplied by the block's codes in
  one MXU product (fp32 accumulation), and each key takes its own group's rows of it, plus its
  group's zero points' share q . z_g, summed in fp32;
- dequantizes the value tile (each token's scale and zero point over its groups of channels, in
  fp32, rounded to q's dtype as the copy route rounds them) and folds scores and values into the
  softmax state (online_softmax.update).
Each sequence's residual group (the newest, still open, kept whole) is folded in at the first
step from `residual` and its slots' value rows (blocks of one group, indexed by the prefetched
group number); the main blocks mask its slots. A key block past a sequence's last visible key
maps to that last block, so the pipeline fetches nothing new for it.

Layouts stay as stored: on a TPU a reshape that changes an array's last two axes is a copy, so
the codes keep their d / 2 lanes (the whole axis, which Mosaic's block rule allows) and the
value scales their d / 32 (whole, but sparse on lanes: a layout question for the format on
TPU, not measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import layout, quant4, tpu, tpu_int4
from pallas_kernels import online_softmax as osm

SQ = pl.squeezed
KERNEL_NAME = "int4_decode_tpu"  # the Mosaic call's kernel_name in a lowered module

# Keys a step: tpu_int4's stacked fold (512 at up to 8 rows, 256 above). VMEM: about 2.5 MB a
# step by our count (inputs double-buffered, the value scales padded to 128 lanes).
MIN_GROUPS = tpu_int4.MIN_GROUPS


def block_keys(rows: int, t: int, g: int, asked: int | None = None) -> int:
  """Keys a step (tpu_int4.block_keys) for `rows` query rows (padded) over T keys in groups of
  g; asked: whole blocks of MIN_GROUPS groups."""
  return tpu_int4.block_keys(rows, t, g, asked, name="int4 decode")


def attention(q, k: quant4.GroupedKeys, v: quant4.Int4, *, causal: bool, q_offset, kv_len,
              scale: float, variant, block: int | None = None):
  """flash_attention for one query token over a 4-bit cache [B, KV, T, d] (BHTD) -> (out
  [B, 1, H, d] in q's dtype, lse [B, 1, H] fp32). q_offset, kv_len: [B] int32. block: keys a
  step (None: block_keys' choice)."""
  b, _, h, d = q.shape
  _, kvh, t, _ = k.shape
  g = k.main.group
  rows = h // kvh
  bm = layout.round_up(rows, 8)  # a sublane tile
  bk = block_keys(bm, t, g, block)
  meta = jnp.stack([q_offset, kv_len, k.residual_group], axis=1).astype(jnp.int32)
  out, lse = _tpu(meta.reshape(-1), layout.q_rows(q, kvh, bm), k.main.codes, k.main.scale,
                  k.main.zero, k.residual, v.codes, v.scale, v.zero, bk=bk, causal=causal,
                  scale=scale, value_group=v.group, interpret=variant.interpret_arg())
  return (layout.from_rows(out, 1, h).astype(q.dtype), layout.from_rows(lse[..., 0], 1, h))


def value_tile(codes_ref, scale_ref, zero_ref, buf, first, kv_len, dtype, value_group: int):
  """A value tile [n, d] of slots first.. in `dtype`: codes * scale + zero in fp32 with each
  token's (scale, zero) of each group of `value_group` channels ([n, d / value_group]), rows at
  and past kv_len 0 (stale or, past T, undefined: 0 x NaN would spread)."""
  codes = tpu_int4.unpacked(codes_ref, buf)  # [n, d] fp32
  n, d = codes.shape
  group = tpu.div(lax.broadcasted_iota(jnp.int32, (1, d), 1), value_group)  # each channel's

  def spread(ref):  # [n, d / value_group] -> [n, d]: each channel its group's column
    cols = ref[...]
    out = cols[:, :1]
    for j in range(1, d // value_group):
      out = jnp.where(group == j, cols[:, j:j + 1], out)
    return out

  vals = codes * spread(scale_ref) + spread(zero_ref)
  live = first + lax.broadcasted_iota(jnp.int32, (n, 1), 0) < kv_len
  return jnp.where(live, vals, 0.0).astype(dtype)


def start_with_residual(state, q_ref, kr_ref, value_refs, v_buf, *, res, end, kv_len, scale,
                        value_group: int, visible):
  """A kernel's first key step: the softmax state (VMEM refs m, l, acc) reset, then the residual
  group `res` (its keys kr_ref whole, its value rows value_refs: codes, scales, zero points)
  folded in where it holds a key below `end`; visible(idx [1, G]) masks its slots per row."""
  m_s, l_s, acc_s = state
  m_s[...], l_s[...], acc_s[...] = osm.init(*acc_s.shape)
  g = kr_ref.shape[0]
  product = q_ref.dtype
  first = res * g

  @pl.when((res >= 0) & (first < end))  # the residual group holds a visible key
  def _():
    idx = first + lax.broadcasted_iota(jnp.int32, (1, g), 1)
    s = osm.scores(q_ref[...], kr_ref[...].astype(product), scale)  # its keys whole
    v = value_tile(*value_refs, v_buf.at[pl.ds(0, g)], first, kv_len, product, value_group)
    m_s[...], l_s[...], acc_s[...] = osm.update(m_s[...], l_s[...], acc_s[...],
                                                jnp.where(visible(idx), s, osm.NEG_INF), v)


def key_block_maps(bounds, bk: int, g: int, t: int):
  """(block_of, residual_of) index maps (bh, r, j, meta) of a 4-bit attention kernel's key
  blocks, from bounds(bh, r, meta) -> (last visible key + 1, residual group): key block j, or
  the last holding a visible key (so the pipeline fetches nothing new), and the residual group
  (clamped: past T there is none to read)."""
  def block_of(bh, r, j, meta):
    end = bounds(bh, r, meta)[0]
    return jnp.minimum(j, jnp.maximum(tpu.div(end + bk - 1, bk) - 1, 0))

  def residual_of(bh, r, j, meta):
    return jnp.clip(bounds(bh, r, meta)[1], 0, t // g - 1)
  return block_of, residual_of


def fold_key_block(state, s, ok, value_refs, v_buf, first, kv_len, dtype, value_group: int):
  """Scores s [bm, bk] of the key block at slot `first` where ok (-inf elsewhere) and its value
  rows (value_refs: codes, scales, zero points; value_tile in `dtype`) into the softmax state
  (VMEM refs m, l, acc)."""
  m_s, l_s, acc_s = state
  v = value_tile(*value_refs, v_buf, first, kv_len, dtype, value_group)
  m_s[...], l_s[...], acc_s[...] = osm.update(m_s[...], l_s[...], acc_s[...],
                                              jnp.where(ok, s, osm.NEG_INF), v)


def cache_grid_spec(b, kvh, row_blocks, nk, *, bm, bk, g, d, value_group, rows, block_of,
                    residual_of, key_buffer):
  """The grid (b x kvh, row_blocks, nk key blocks) and blocks of a 4-bit attention kernel's
  inputs (qr, kc, ka, kz, kres, vc, vs, vz, and vc, vs, vz again for the residual group's value
  rows) and outputs, indexed by rows / block_of / residual_of (bh, r, j, meta), with scratch:
  the softmax state, a key tile [bk, d] in `key_buffer` and a value tile in fp32."""
  from jax.experimental.pallas import tpu as pltpu
  half, groups, nv = d // 2, bk // g, d // value_group

  def spec(shape, index):  # a [B, KV, ...] input's block of `shape` at (bh's, index(...))
    return pl.BlockSpec((SQ, SQ, *shape), lambda bh, r, j, meta: (*tpu.batch_head(bh, kvh),
                                                                   index(bh, r, j, meta), 0))

  first = lambda *_: 0  # noqa: E731  (inputs of one block a sequence and KV head)
  return pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(b * kvh, row_blocks, nk),
      in_specs=[spec((bm, d), rows), spec((bk, half), block_of), spec((groups, d), block_of),
                spec((groups, d), block_of), spec((g, d), first), spec((bk, half), block_of),
                spec((bk, nv), block_of), spec((bk, nv), block_of), spec((g, half), residual_of),
                spec((g, nv), residual_of), spec((g, nv), residual_of)],
      out_specs=[spec((bm, d), rows), spec((bm, 1), rows)],
      scratch_shapes=[*tpu.softmax_scratch(bm, d), pltpu.VMEM((bk, d), key_buffer),
                      pltpu.VMEM((bk, d), jnp.float32)])


@functools.partial(jax.jit, static_argnames=("bk", "causal", "scale", "value_group",
                                             "interpret"))
def _tpu(meta, qr, kc, ka, kz, kres, vc, vs, vz, *, bk, causal, scale, value_group, interpret):
  """(out [B, KV, bm, d], lse [B, KV, bm, 1]) fp32. meta [B * 3]: each sequence's query
  position, keys and residual group; qr [B, KV, bm, d] (rows padded to a sublane tile)."""
  b, kvh, bm, d = qr.shape
  t, g = kc.shape[2], kres.shape[2]
  groups = bk // g
  nk = pl.cdiv(t, bk)
  product = qr.dtype  # the MXU's operand dtype: codes exact in it, values rounded to it
  f32 = jnp.float32

  def seq(bh, meta):  # (query position, keys, residual group, last visible key + 1) of bh's row
    bi = tpu.div(bh, kvh)
    q_off, kv_len, res = meta[3 * bi], meta[3 * bi + 1], meta[3 * bi + 2]
    return q_off, kv_len, res, jnp.minimum(kv_len, q_off + 1) if causal else kv_len

  def visible(idx, q_off, kv_len):
    ok = idx < kv_len
    return ok & (idx <= q_off) if causal else ok

  def kernel(meta_ref, q_ref, kc_ref, ka_ref, kz_ref, kr_ref, vc_ref, vs_ref, vz_ref, rc_ref,
             rs_ref, rz_ref, o_ref, lse_ref, m_s, l_s, acc_s, k_buf, v_buf):
    j = pl.program_id(2)
    q_off, kv_len, res, end = seq(pl.program_id(0), meta_ref)

    @pl.when(j == 0)
    def _():
      start_with_residual((m_s, l_s, acc_s), q_ref, kr_ref, (rc_ref, rs_ref, rz_ref), v_buf,
                          res=res, end=end, kv_len=kv_len, scale=scale, value_group=value_group,
                          visible=lambda idx: visible(idx, q_off, kv_len))

    @pl.when(j * bk < end)
    def _():
      qs = q_ref[...].astype(f32) * scale  # [bm, d]
      s = tpu_int4.key_scores(qs, ka_ref[...], kz_ref[...], kc_ref, k_buf, g)  # [bm, bk]
      lane = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
      own = tpu.div(lane, g)  # each key's group in the block
      ok = visible(j * bk + lane, q_off, kv_len) & (j * groups + own != res)
      fold_key_block((m_s, l_s, acc_s), s, ok, (vc_ref, vs_ref, vz_ref), v_buf, j * bk, kv_len,
                     product, value_group)

    @pl.when(j == nk - 1)
    def _():
      o_ref[...], lse_ref[...] = osm.finish(m_s[...], l_s[...], acc_s[...])

  block_of, residual_of = key_block_maps(lambda bh, r, meta: seq(bh, meta)[3:1:-1], bk, g, t)
  grid_spec = cache_grid_spec(b, kvh, 1, nk, bm=bm, bk=bk, g=g, d=d, value_group=value_group,
                              rows=lambda *_: 0, block_of=block_of, residual_of=residual_of,
                              key_buffer=product)
  return tpu.attention_call(kernel, grid_spec, qr.shape, interpret, name=KERNEL_NAME)(
      meta, qr, kc, ka, kz, kres, vc, vs, vz, vc, vs, vz)
