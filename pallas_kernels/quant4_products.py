"""What a kernel reading 4-bit tiles computes, in jnp: the products over codes, never a
dequantized copy of the keys or values (quant4.py's storage; the dequantize-first definitions
are quant4.load_grouped_keys / quant4.dequantize, which tests/kernels/test_quant4.py holds these
equal to).

Keys (quant4.GroupedKeys, one (a, z) [d] per KV head and group of G tokens): a query's score of
key t in group g is q . (a_g * c_t + z_g) = (q * a_g) . c_t + q . z_g: the group's scales fold
into the query (one multiply of d values per group, not per key) and its zero points into one
dot product per group, added to each of its G scores; the residual group's keys are whole.
Values (quant4.Int4, a scale and zero point per token and channel group) have no such fold that
pays: attention/int4_decode.py dequantizes a tile of them in registers (folding the scales into
the probabilities, sum_t (p_t s_th) c_tj + sum_t p_t m_th, took a product, a layout change and
a sum a channel group, and ran no faster). Products in fp32 (codes 0..15 are exact in any float
type a kernel may use).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quant4


def key_scores(q, keys: quant4.GroupedKeys) -> jax.Array:
  """q [B, Lq, H, d] (H a multiple of the KV heads) over keys [B, KV, T, d] -> [B, Lq, H, T]
  fp32 raw scores q . k (no softmax scale)."""
  b, lq, h, d = q.shape
  _, kvh, t, _ = keys.shape
  g = keys.main.group
  qg = q.astype(jnp.float32).reshape(b, lq, kvh, h // kvh, d)
  codes = quant4.unpack(keys.main.codes).astype(jnp.float32).reshape(b, kvh, t // g, g, d)
  folded = jnp.einsum("bqkhd,bkgd->bqkhgd", qg, keys.main.scale)  # q * a per group
  scores = jnp.einsum("bqkhgd,bkgjd->bqkhgj", folded, codes)
  scores = scores + jnp.einsum("bqkhd,bkgd->bqkhg", qg, keys.main.zero)[..., None]
  scores = scores.reshape(b, lq, kvh, h // kvh, t)
  # the residual group's slots: its keys whole
  whole = jnp.einsum("bqkhd,bkjd->bqkhj", qg, keys.residual.astype(jnp.float32))  # [.., G]
  slots = keys.residual_group[:, None] * g + jnp.arange(g)  # [B, G], past the end: dropped
  scores = jnp.moveaxis(scores, -1, 1).at[jnp.arange(b)[:, None], slots].set(
      jnp.moveaxis(whole, -1, 1), mode="drop")  # [B, T, Lq, KV, H / KV]
  return jnp.moveaxis(scores, 1, -1).reshape(b, lq, h, t)

