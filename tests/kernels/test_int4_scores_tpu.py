"""The TPU kernel of a decode step's top-k scores from a 4-bit cache's codes (pallas_kernels/
topk/int4_scores_tpu.py): in Pallas TPU interpret mode on the CPU against the scores over the
dequantized keys (quant4_products.key_scores), through topk_scores on the TPU variant against
the reference's selection over the dequantized keys, and lowered to Mosaic by exporting for TPU.

Inputs: test_int4_scores.py's keys with outlier channels (three sequences: the newest group open,
a group's edge, a full cache); GQA rows 4 and 8 (one and two query tokens) and MHA; one key block
and blocks of 256 (the last partial). Tolerances as the GPU kernel's: fp32 queries 1e-4 of the
largest score, bf16 queries 2e-3 (the folded query in two bf16 terms, fp32 sums; measured here
at most 9e-7 and 1e-5 of it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, quant4, read, topk_scores
from pallas_kernels.topk import int4_scores_tpu, topk_blocks
from tests.helpers.tpu_export import export_for_tpu, mosaic_calls
from tests.kernels.inputs import normal
from tests.kernels.test_int4_scores import D, _want, keys  # noqa: F401  (keys: a fixture)

TPU = Route(backend="tpu")  # interpreted on the CPU
REFERENCE = Route(backend="reference")
S = jax.ShapeDtypeStruct
ROUTING = dict(max_rows=topk_blocks.MAX_ROWS, max_k=topk_blocks.PICK_MAX_K)


def _error(got, want, lengths):
  """The largest |got - want| over written slots, and the largest |want|."""
  written = np.arange(got.shape[-1])[None, :] < np.asarray(lengths)[:, None]  # [B, T]
  err = np.abs(np.asarray(got) - np.asarray(want))
  return err[np.broadcast_to(written[:, None, None, :], err.shape)].max(), np.abs(want).max()


@pytest.mark.parametrize("lq,h", [(1, 8), (2, 8), (1, 2)])  # GQA 4 (rows 4, 8), MHA
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-3)])
def test_scores_from_the_codes_match_the_dequantized_keys(keys, lq, h, dtype, tol):
  k, lengths = keys
  q = normal(np.random.default_rng(lq + h), (3, lq, h, D), dtype)
  got = jax.block_until_ready(int4_scores_tpu.scores(q, k, scale=None,
                                                     interpret=TPU.variant().interpret_arg()))
  want = np.asarray(_want(q, k))
  assert got.shape == want.shape and got.dtype == jnp.float32
  err, top = _error(got, want, lengths)
  assert err <= tol * top, (err, top)


def test_blocks_of_whole_groups_with_a_partial_last_one():
  """T 320 in blocks of 256 keys (8 groups): the second block holds 2 groups, its scale rows
  past T undefined and its scores past T dropped; a scale multiplies every score."""
  rng = np.random.default_rng(5)
  t, lengths = 320, [301, 320]
  pos = np.stack([np.where(np.arange(t) < n, np.arange(t), t) for n in lengths])
  k = quant4.write_grouped_keys(quant4.zeros_grouped_keys((2, 2, t, D), jnp.float32),
                                jnp.asarray(pos, jnp.int32), normal(rng, (2, t, 2, D)))
  q = normal(rng, (2, 1, 8, D), jnp.float32)
  got = jax.block_until_ready(int4_scores_tpu.scores(
      q, k, scale=0.125, interpret=TPU.variant().interpret_arg(), block=256))
  err, top = _error(got, 0.125 * np.asarray(_want(q, k)), lengths)
  assert err <= 1e-4 * top, (err, top)
  with pytest.raises(ValueError, match="whole blocks of 8 groups"):
    int4_scores_tpu.scores(q, k, scale=None, interpret=True, block=128)


def test_topk_on_the_tpu_variant_picks_the_dequantized_keys_best(keys):
  k, lengths = keys
  q = normal(np.random.default_rng(3), (3, 1, 8, D), jnp.float32)
  kw = dict(valid_len=lengths, exclude_prefix=4, kv_layout="BHTD")
  assert read.four_bit_scores(q, k, TPU.variant(), TPU.kernels, 5, tiled=False, **ROUTING)
  got = jax.block_until_ready(topk_scores(q, k, 5, route=TPU, **kw))
  want = topk_scores(q, quant4.load_grouped_keys(k), 5, route=REFERENCE, **kw)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]),
                             atol=1e-4 * float(jnp.max(jnp.abs(want[0]))))


def test_the_kernel_serves_a_decode_steps_top_k_on_the_tpu_variant_where_enabled():
  k = jax.eval_shape(lambda: quant4.zeros_grouped_keys((1, 2, 256, 128), jnp.bfloat16))
  q1, q32 = S((1, 1, 8, 128), jnp.bfloat16), S((1, 32, 8, 128), jnp.bfloat16)
  tpu, opts = TPU.variant(), TPU.kernels
  assert read.four_bit_scores(q1, k, tpu, opts, 4, tiled=False, **ROUTING)
  assert read.four_bit_scores(S(q1.shape, jnp.float32), k, tpu, opts, 4, tiled=False, **ROUTING)
  assert not read.four_bit_scores(S(q1.shape, jnp.float16), k, tpu, opts, 4, tiled=False,
                                  **ROUTING)  # no fp16 on a TPU
  assert not read.four_bit_scores(q32, k, tpu, opts, 4, tiled=False, **ROUTING)  # prefill rows
  assert not read.four_bit_scores(q1, k, tpu, opts, 4, tiled=True, **ROUTING)
  assert not read.four_bit_scores(q1, k, tpu, KernelOptions(int4_topk_scores=False), 4,
                                  tiled=False, **ROUTING)


@pytest.mark.parametrize("b,h,kvh,t,d,dtype", [
    (2, 8, 2, 4096, 128, jnp.bfloat16),  # GQA 4, 8 blocks of 512
    (1, 2, 2, 224, 64, jnp.float32),  # MHA, one block of 7 groups (the whole axis)
    (2, 32, 2, 992, 128, jnp.bfloat16),  # GQA 16: blocks of 256, the last partial
])
def test_the_kernel_lowers_for_tpu(b, h, kvh, t, d, dtype):
  """topk_scores of a decode step over 4-bit keys exports for TPU with this kernel's one
  Mosaic call (the copy route would export no kernel over the codes)."""
  k = jax.eval_shape(lambda: quant4.zeros_grouped_keys((b, kvh, t, d), dtype))

  def step(q, k, valid_len):
    return topk_scores(q, k, 4, valid_len=valid_len, kv_layout="BHTD", route=Route())

  exported = export_for_tpu(step, S((b, 1, h, d), dtype), k, S((b,), jnp.int32))
  assert mosaic_calls(exported) == 1
  assert f'kernel_name = "{int4_scores_tpu.KERNEL_NAME}"' in exported.mlir_module()
