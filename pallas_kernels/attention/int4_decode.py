"""Decode attention reading a 4-bit cache's tiles (quant4: KIVI's layout), split-K, on the GPU.

The cache is read as stored, never copied: per program (batch x kv head, row block, key split,
as flash_attention's decode) whole key groups of G tokens a step (Tiling.block_keys, default one
group), each group's codes unpacked in registers (nibbles.py), its per-channel scales folded
into the query (q . (a c + z) = (q a) . c + q . z, quant4_products.key_scores) and its zero
points' share q . z taken from one fused reduction XLA computes for every group before the
call; the values dequantized in registers piece by piece (`dequantize`: their token's scale and
zero point, one packed fma a pair, in fp16 under bf16 queries) and multiplied by the
probabilities as flash attention's are. The residual group (each sequence's newest, unfilled
group, kept whole) is one more step of split 0, its keys read as they are. The splits merge as
flash_attention's do (split_merge).

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
from pallas_kernels.decode import split_merge

SQ = gpu.SQ

# The default tiling, from a sweep of the kernel alone (8B attention shape, batch 1, H200;
# BENCHMARKS.md): one key group (32 keys) a step on one warp, ~8 programs a GPU core (132 key
# splits a sequence at 8 KV heads): 0.115 ms at 128K keys where 4 groups a step on 4 warps at 2
# a core took 0.203 (bf16's kernel 0.144, int8's 0.107 in the same run); the 8B's decode step at
# 128K 7.78 ms against 10.40. A one-warp program holds the whole row block, so the layout changes
# between its products stay within a warp, and many small programs hide each other's latency
# (the profile: latency at low occupancy, not HBM, held the 4-warp form).
BLOCK_GROUPS = 1
NUM_WARPS = 1
PROGRAMS_PER_CORE = 8

def dequantize(codes, scale, zero, native_gpu: bool = False):
  """codes [n, w] in a 16-bit float (exact), scale and zero [n] fp32 (one a row) -> codes *
  scale + zero [n, w] in codes' dtype: scale and zero rounded to it, then one fma a value
  rounded once (native_gpu: one packed fma a pair of values, by PTX, as the codes' unpacking)."""
  dtype = codes.dtype
  s, z = (jnp.broadcast_to(x.astype(dtype)[:, None], codes.shape) for x in (scale, zero))
  if native_gpu and dtype in unpack.PTX_CONSTANTS:
    from jax.experimental.pallas import triton as pltriton
    return pltriton.elementwise_inline_asm(
        f"fma.rn.{unpack.PTX_CONSTANTS[dtype]['t']} $0, $1, $2, $3;", args=[codes, s, z],
        constraints="=r,r,r,r", pack=2,
        result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, dtype)])[0]
  f32 = jnp.float32
  return (codes.astype(f32) * s.astype(f32) + z.astype(f32)).astype(dtype)


def attention(q, k: quant4.GroupedKeys, v: quant4.Int4, *, causal: bool, q_offset, kv_len,
              scale: float, variant, merge_kernel: bool, tiling: gpu.Tiling | None = None):
  """flash_attention for one query token over a 4-bit cache [B, KV, T, d] (BHTD) -> (out
  [B, 1, H, d] in q's dtype, lse [B, 1, H] fp32). q_offset, kv_len: [B] int32. tiling:
  block_keys the keys a loop step reads (whole key groups; default BLOCK_GROUPS), key_splits,
  num_warps, num_stages as flash_attention's."""
  b, _, h, d = q.shape
  _, kvh, t, _ = k.shape
  g = k.main.group
  rows = h // kvh
  bm = max(16, layout.next_pow2(rows))
  tl = (tiling or gpu.Tiling()).pick(block_rows=bm, block_keys=min(BLOCK_GROUPS * g, t),
                                     num_warps=NUM_WARPS, num_stages=3, prefetch=False)
  if tl.block_rows != bm or tl.block_keys % g:
    raise ValueError(f"int4 decode: {tl.block_rows} rows a block ({bm}: the group's query "
                     f"heads) and {tl.block_keys} keys a step (whole groups of {g}) asked")
  span, splits = gpu.split_plan(b * kvh, t, tl.block_keys, tl.key_splits,
                                per_core=PROGRAMS_PER_CORE)
  meta = jnp.stack([q_offset, kv_len, k.residual_group * g], axis=1).astype(jnp.int32)
  qr = layout.q_rows(q, kvh, rows)  # [B, KV, rows, d]
  # Each group's zero points' share of its scores, scale * q . z, for every group at once,
  # read by XLA before the call (the kernel would read the zero points too), so the kernel adds
  # one number a row and group instead of a reduction over d a step. A multiply and a sum, one
  # fused reduction in fp32: the matrix-vector product at HIGHEST precision ran as a GEMM of
  # fp32 passes (5.8 us a layer at 32K on an H200, three times the zero points' read).
  qs = qr.astype(jnp.float32) * scale  # [B, KV, rows, d]
  zero_scores = jnp.sum(qs[:, :, :, None, :] * k.main.zero[:, :, None], axis=-1)  # [.., T / G]
  outs, lses = _gpu(meta, qr, k.main.codes, k.main.scale, zero_scores, k.residual, v.codes,
                    v.scale, v.zero, span=span, splits=splits,
                    parts=split_merge.parts(splits, merge_kernel), causal=causal, scale=scale,
                    value_group=v.group, tiling=tl, interpret=variant.interpret_arg())
  out, lse = split_merge.merge(outs, lses, splits=splits, rows=rows, dtype=q.dtype,
                               kernel=merge_kernel, interpret=variant.interpret_arg())
  return (layout.from_rows(out, 1, h).astype(q.dtype), layout.from_rows(lse, 1, h))


@functools.partial(jax.jit, static_argnames=("span", "splits", "parts", "causal", "scale",
                                             "value_group", "tiling", "interpret"))
def _gpu(meta, qr, kc, ka, zero_scores, kres, vc, vs, vz, *, span, splits, parts, causal, scale,
         value_group, tiling, interpret):
  """Per-split (out, lse) [B, KV, parts, bm, d | 1] fp32 (rows past qr's repeat them).
  meta [B, 3]: (query position, keys, the residual group's first slot); zero_scores [B, KV,
  rows, T / G]: scale * q . z of each key group."""
  b, kvh, rq, d = qr.shape
  t, g = kc.shape[2], kres.shape[2]
  bm, per_step = tiling.block_rows, tiling.block_keys // g
  half = d // 2
  w = min(value_group, half)
  nv = d // value_group
  dtype = qr.dtype
  # The key products in fp16 under bf16 queries: the folded query q a is rounded once, to 11
  # significant bits rather than bf16's 8 (the codes are exact in either; |q a| stays far
  # inside fp16's range).
  key_dtype = jnp.dtype(jnp.float16) if dtype == jnp.bfloat16 else dtype
  # The values dequantized in fp16 too: a value's scale and zero point rounded to 11 significant
  # bits, where bf16's 8 cost the outputs 4x the error when a group's zero point is far larger
  # than its values' spread (a value of magnitude beyond 65504 is out of this path's range);
  # the probabilities with them, p = exp(s - max) <= 1, those below 2^-24 of the row's largest
  # flushed to zero.
  value_dtype = key_dtype
  native = not interpret  # a Triton kernel compiled for CUDA
  # value pieces: (first byte column, nibble, first channel) of each piece
  pieces = [(c, nib, c + nib * half) for c in range(0, half, w) for nib in (0, 1)]

  def kernel(meta_ref, q_ref, kc_ref, ka_ref, qz_ref, kr_ref, vc_ref, vs_ref, vz_ref, o_ref,
             lse_ref):
    q_off, kv_len, res_start = meta_ref[0], meta_ref[1], meta_ref[2]
    split = pl.program_id(2)
    start0 = split * span
    rows = lax.broadcasted_iota(jnp.int32, (bm,), 0) % rq  # the real rows, repeated
    q1, q2 = (q_ref[rows, pl.ds(c, half)] for c in (0, half))  # [bm, d / 2]
    q1s, q2s = (x.astype(jnp.float32) * scale for x in (q1, q2))

    def mask(first, limit):
      idx = first + lax.broadcasted_iota(jnp.int32, (1, g), 1)
      ok = idx < limit
      return ok & (idx <= q_off) if causal else ok  # one query token, at q_off

    def dot(x, y, dims):
      return lax.dot_general(x, y, (dims, ((), ())), preferred_element_type=jnp.float32)

    def fold(carry, tiles):
      """Folds score tiles [(slots, s [bm, G]), ...] (-inf: masked) and their values into the
      state: the running max, the elementwise sum of p (reduced once, at the end) and the
      output pieces. Each value piece is dequantized in registers (its token's scale and zero
      point, one packed fma a pair) and multiplied by p as it is: the probabilities go to the
      tensor cores once a tile, where folding the values' scales into them took one product,
      a layout change and a zero point sum a value group."""
      m, l_acc, accs = carry
      top = functools.reduce(jnp.maximum, [s for _, s in tiles])
      m_new = jnp.maximum(m, jnp.max(top, axis=1, keepdims=True))
      m_safe = jnp.where(m_new == osm.NEG_INF, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      ps = [jnp.exp(s - m_safe) for _, s in tiles]  # [bm, G] each
      l_acc = l_acc * alpha + functools.reduce(jnp.add, ps)
      accs = [acc * alpha for acc in accs]
      for (at, _), p in zip(tiles, ps):
        p = p.astype(value_dtype)
        codes = {c: unpack.nibbles(vc_ref[at, pl.ds(c, w)], value_dtype, native)
                 for c in range(0, half, w)}
        for i, (c, nib, ch) in enumerate(pieces):
          j = ch // value_group
          vals = dequantize(codes[c][nib], vs_ref[at, j], vz_ref[at, j], native)  # [G, w]
          accs[i] = accs[i] + dot(p, vals, ((1,), (0,)))
      return m_new, l_acc, accs

    def key_scores(first):
      """Scores [bm, G] of the key group starting at slot `first` (< T), its codes unpacked,
      its scales folded into the query and its zero points' share added."""
      grp = first // g
      a1, a2 = (ka_ref[grp, pl.ds(c, half)][None, :] for c in (0, half))  # [1, d / 2]
      lo, hi = unpack.nibbles(kc_ref[pl.ds(first, g), :], key_dtype, native)  # [G, d / 2]
      s = (dot((q1s * a1).astype(key_dtype), lo, ((1,), (1,)))
           + dot((q2s * a2).astype(key_dtype), hi, ((1,), (1,))))
      return s + qz_ref[rows, grp][:, None]

    def group_step(j, carry):
      tiles = []
      for i in range(per_step):
        nominal = start0 + (j * per_step + i) * g
        first = jnp.minimum(nominal, t - g)  # past T: a group read again, all masked
        s = jnp.where(mask(nominal, jnp.minimum(kv_len, res_start)), key_scores(first),
                      osm.NEG_INF)
        tiles.append((pl.ds(first, g), s))
      return fold(carry, tiles)

    def residual_step(_, carry):
      k1, k2 = (kr_ref[:, pl.ds(c, half)].astype(dtype) for c in (0, half))  # [G, d / 2]
      s = (dot(q1, k1, ((1,), (1,))) + dot(q2, k2, ((1,), (1,)))) * scale  # keys whole
      s = jnp.where(mask(res_start, kv_len), s, osm.NEG_INF)
      return fold(carry, [(pl.ds(res_start, g), s)])

    end = jnp.minimum(jnp.minimum(start0 + span, kv_len), res_start)
    if causal:
      end = jnp.minimum(end, q_off + 1)
    zeros = lambda n: jnp.zeros((bm, n), jnp.float32)  # noqa: E731
    carry = (jnp.full((bm, 1), osm.NEG_INF, jnp.float32), zeros(g), [zeros(w) for _ in pieces])
    steps = jnp.clip(pl.cdiv(end - start0, per_step * g), 0, span // (per_step * g))
    carry = lax.fori_loop(0, steps, group_step, carry)
    # split 0 also reads the residual group (none when the cache is full: it lies past T)
    has_residual = ((split == 0) & (res_start < t)).astype(jnp.int32)
    m, l_acc, accs = lax.fori_loop(0, has_residual, residual_step, carry)
    l = jnp.sum(l_acc, axis=1, keepdims=True)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    for acc, (_, _, ch) in zip(accs, pieces):
      o_ref[:, pl.ds(ch, w)] = jnp.where(seen, acc / safe_l, 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe_l), osm.NEG_INF)

  index = lambda bh, r, s: (bh // kvh, bh % kvh, s, r, 0)  # noqa: E731

  def whole(rows_, cols):  # one (batch, kv head)'s [rows_, cols] of a [B, KV, ...] buffer
    return pl.BlockSpec((SQ, SQ, rows_, cols), lambda bh, *_: (bh // kvh, bh % kvh, 0, 0))

  return gpu.pallas_call(
      kernel, interpret, num_warps=tiling.num_warps, num_stages=tiling.num_stages,
      grid=(b * kvh, 1, splits),
      in_specs=[gpu.per_batch_spec(kvh, 3), gpu.row_spec(kvh, rq, d), whole(t, half),
                whole(t // g, d), whole(rq, t // g), whole(g, d), whole(t, half), whole(t, nv),
                whole(t, nv)],
      out_specs=[pl.BlockSpec((SQ, SQ, SQ, bm, d), index),
                 pl.BlockSpec((SQ, SQ, SQ, bm, 1), index)],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, parts, bm, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, parts, bm, 1), jnp.float32)],
  )(meta, qr, kc, ka, zero_scores, kres, vc, vs, vz)
