"""What the TPU (Mosaic) kernels over a 4-bit cache's key codes share (quant4: KIVI's layout):
the codes unpacked into channel order in VMEM, and the stacked fold of each key group's scales
into the query rows, one MXU product a block of keys. attention/int4_decode_tpu.py (decode
attention) and topk/int4_scores_tpu.py (a decode step's top-k scores) call these inside their
kernels."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels import online_softmax as osm
from pallas_kernels import tpu

# The folded query rows stacked a step: groups x rows. Decode has few rows a KV head (GQA 4: 8
# once padded to a sublane tile), so a product per key group of 32 would leave the MXU mostly
# idle and load its weights once a group; stacked, 16 groups x 8 rows make one 128-row operand,
# the MXU's tile on v5e (v6e's is 256), and a step one product (the entries of other groups'
# rows are computed and dropped). Hence 512 keys a step at up to 8 rows, 8 groups (256 keys,
# the fewest whose scale rows fill a sublane tile) above. A 512-key step reads about 96 KB of
# codes and scales a KV head, enough to spread a grid step's fixed cost; larger blocks would
# only stack more rows. Not timed on a TPU.
STACKED_ROWS = 128
MIN_GROUPS = 8


def block_keys(rows: int, t: int, g: int, asked: int | None = None, name: str = "int4") -> int:
  """Keys a step for `rows` query rows (padded) over T keys in groups of g: the stacked fold's
  choice above, or `asked` (whole blocks of MIN_GROUPS groups), at most T (then the whole
  axis, which the block rule allows). name: the kernel's, for the error."""
  if asked is None:
    asked = max(MIN_GROUPS, STACKED_ROWS // rows) * g
  elif asked <= 0 or asked % (MIN_GROUPS * g):
    raise ValueError(f"{name} (TPU): {asked} keys a step are not whole blocks of "
                     f"{MIN_GROUPS} groups of {g}")
  return min(asked, t)


def unpacked(codes_ref, buf):
  """uint8 codes [n, d / 2] -> codes [n, d] in buf's dtype (exact: 0..15), written to buf (a
  VMEM tile) by halves: the low nibbles are channels 0 .. d / 2 - 1, the high ones the rest."""
  half = codes_ref.shape[-1]
  x = codes_ref[...].astype(jnp.int32)
  buf[:, :half] = (x & 15).astype(jnp.float32).astype(buf.dtype)
  buf[:, half:] = (x >> 4).astype(jnp.float32).astype(buf.dtype)
  return buf[...]


def products(folded, codes):
  """folded rows [n, d] fp32 times the codes [bk, d] (exact in their dtype) -> [n, bk] fp32.
  Under bf16 the rows go to the MXU as two bf16 terms (hi + lo: 16 significant bits), where one
  would round q a to 8 and a key group's scores with it (outlier channels make scores of tens,
  which bf16 moves by tenths of a logit: the copy route's error, which the fold is to avoid)."""
  if codes.dtype != jnp.bfloat16:
    return osm.scores(folded.astype(codes.dtype), codes, None)
  hi = folded.astype(jnp.bfloat16)
  lo = (folded - hi.astype(jnp.float32)).astype(jnp.bfloat16)
  return osm.scores(hi, codes, None) + osm.scores(lo, codes, None)


def key_scores(qs, a, z, codes_ref, buf, g: int):
  """A block's scores [bm, bk] fp32 of the query rows qs [bm, d] fp32 (already times the
  softmax scale) over its keys: codes_ref uint8 [bk, d / 2] (unpacked into buf [bk, d], the
  products' dtype), its groups' scales a and zero points z [bk / g, d] fp32
  (quant4_products.key_scores: q . (a c + z) = (q a) . c + q . z). The groups' folded rows q a_g
  are stacked into one operand [groups x bm, d] for one MXU product; each key takes its own
  group's rows of it, plus its group's zero points' share q . z_g, summed in fp32."""
  bm, d = qs.shape
  groups = a.shape[0]
  bk = groups * g
  folded = (qs[None] * a[:, None, :]).reshape(groups * bm, d)
  stacked = products(folded, unpacked(codes_ref, buf))  # [groups x bm, bk]
  own = tpu.div(lax.broadcasted_iota(jnp.int32, (1, bk), 1), g)  # each key's group in the block
  return functools.reduce(jnp.add, [
      jnp.where(own == i, stacked[i * bm:(i + 1) * bm]
                + jnp.sum(qs * z[i:i + 1], axis=1, keepdims=True), 0.0)
      for i in range(groups)])
