"""A decode step's top-k scores over 4-bit keys, read as stored (GPU; int4_scores_tpu.py: TPU).

The few-row top-k (topk_blocks: a decode step's query rows) keeps every score, [B, KV, rows, T]
fp32, and selects from their block maxima. Over a 4-bit cache its scores came from a copy of
the keys in the queries' dtype made first, in segments past `topk_dequantize_bytes`: each step
wrote and read back 2 bytes a channel and key where the codes are half a byte (at 2M keys of
the 3B shape, ~8 GB a layer against the keys' 1.6 GB). Here one Triton kernel reads each key
group's codes and per-channel scales (quant4.GroupedKeys) and writes the scores, the algebra of
quant4_products.key_scores and of attention/int4_decode.py's key steps: the group's scales
folded into the query (products in fp16 under bf16 queries, fp32 sums), its zero points' share
q . z from one fused reduction XLA computes for every group before the call. Each program scores
`BLOCK_GROUPS` groups of one (sequence, KV head) on one warp (many small programs, as the decode
kernel's measured tiling); the query rows are repeated to a tensor-core product's 16 and every
copy of a row stores the same scores to that row. The residual group (each sequence's newest,
unfilled group, kept whole) is scored in jnp and written over its slots; slots past a sequence's
keys hold what their codes give, and the selection's bounds drop them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu, layout, quant4
from pallas_kernels.nibbles import nibbles

SQ = gpu.SQ
BLOCK_GROUPS = 16  # key groups a program scores (512 keys at G 32)


def scores(q, k: quant4.GroupedKeys, *, scale: float | None, interpret) -> jax.Array:
  """q [B, Lq, H, d] (H a multiple of the KV heads) over 4-bit keys [B, KV, T, d] -> fp32 scores
  [B, KV, rows, T] (rows = Lq * H / KV, a sequence's query rows of one KV head, as
  layout.q_rows orders them), times `scale` (None: raw q . k)."""
  b, lq, h, d = q.shape
  _, kvh, t, _ = k.shape
  g = k.main.group
  rows = lq * (h // kvh)
  qr = layout.q_rows(q, kvh, rows)  # [B, KV, rows, d]
  qs = qr.astype(jnp.float32) * (1.0 if scale is None else scale)
  # each group's zero points' share, scale * q . z, for every group at once (int4_decode's)
  zero_scores = jnp.sum(qs[:, :, :, None, :] * k.main.zero[:, :, None], axis=-1)  # [.., T / G]
  groups = t // g
  per_program = max(n for n in range(1, min(BLOCK_GROUPS, groups) + 1) if groups % n == 0)
  s = _gpu(qr, k.main.codes, k.main.scale, zero_scores, scale=scale, group=g,
           per_program=per_program, interpret=interpret)
  return with_residual(s, qs, k)


def with_residual(s, qs, k: quant4.GroupedKeys):
  """The scores s [B, KV, rows, T] fp32 with each sequence's residual group's slots scored from
  its keys whole (qs [B, KV, rows, d] fp32: the query rows times the scale), in jnp: the
  kernels (this GPU one, int4_scores_tpu's) score every slot from the codes."""
  g = k.main.group
  whole = jnp.einsum("bkrd,bkjd->bjkr", qs, k.residual.astype(jnp.float32))  # [B, G, KV, rows]
  slots = k.residual_group[:, None] * g + jnp.arange(g)  # [B, G]; past T: dropped
  return s.at[jnp.arange(s.shape[0])[:, None], :, :, slots].set(whole, mode="drop")


@functools.partial(jax.jit, static_argnames=("scale", "group", "per_program", "interpret"))
def _gpu(qr, kc, ka, zero_scores, *, scale, group, per_program, interpret):
  """[B, KV, rows, T] fp32 scores of qr [B, KV, rows, d] over the codes kc [B, KV, T, d / 2]
  with per-group scales ka [B, KV, T / G, d] and zero points' shares zero_scores [B, KV, rows,
  T / G] (already times `scale`)."""
  b, kvh, rq, d = qr.shape
  t, g = kc.shape[2], group
  bm = max(16, layout.next_pow2(rq))
  half = d // 2
  bk = per_program * g
  # products in fp16 under bf16 queries: q a rounded once, to 11 significant bits (int4_decode)
  key_dtype = jnp.dtype(jnp.float16) if qr.dtype == jnp.bfloat16 else qr.dtype
  factor = 1.0 if scale is None else scale
  native = not interpret  # a Triton kernel compiled for CUDA

  def kernel(q_ref, kc_ref, ka_ref, qz_ref, o_ref):
    rows = lax.broadcasted_iota(jnp.int32, (bm,), 0) % rq  # the real rows, repeated
    q1s, q2s = (q_ref[rows, pl.ds(c, half)].astype(jnp.float32) * factor for c in (0, half))

    def dot(x, y):
      return lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def group_step(j, carry):
      first = j * g  # within the program's keys
      a1, a2 = (ka_ref[j, pl.ds(c, half)][None, :] for c in (0, half))  # [1, d / 2]
      lo, hi = nibbles(kc_ref[pl.ds(first, g), :], key_dtype, native)  # [G, d / 2]
      s = dot((q1s * a1).astype(key_dtype), lo) + dot((q2s * a2).astype(key_dtype), hi)
      o_ref[rows, pl.ds(first, g)] = s + qz_ref[rows, j][:, None]  # copies of a row: the same
      return carry

    lax.fori_loop(0, per_program, group_step, 0)

  def per_program_block(rows_, cols):
    return pl.BlockSpec((SQ, SQ, rows_, cols), lambda bh, i: (bh // kvh, bh % kvh, 0, i))

  whole_rows = pl.BlockSpec((SQ, SQ, rq, d), lambda bh, i: (bh // kvh, bh % kvh, 0, 0))
  return gpu.pallas_call(
      kernel, interpret, num_warps=1, num_stages=3, grid=(b * kvh, t // bk),
      in_specs=[whole_rows,
                pl.BlockSpec((SQ, SQ, bk, half), lambda bh, i: (bh // kvh, bh % kvh, i, 0)),
                pl.BlockSpec((SQ, SQ, per_program, d), lambda bh, i: (bh // kvh, bh % kvh, i, 0)),
                per_program_block(rq, per_program)],
      out_specs=per_program_block(rq, bk),
      out_shape=jax.ShapeDtypeStruct((b, kvh, rq, t), jnp.float32),
  )(qr, kc, ka, zero_scores)
