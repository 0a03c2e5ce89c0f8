"""A decode step's top-k scores read from a 4-bit cache's codes (pallas_kernels/topk/
int4_scores.py), interpreted on CPU against the scores over the dequantized keys
(quant4_products.key_scores, which tests/kernels/test_quant4.py holds equal to the
dequantize-first definition), through topk_scores on the GPU variant against the reference's
selection over the dequantized keys, and lowered to Triton for CUDA.

Inputs: keys with outlier channels; three sequences, one with its newest group open (the
residual, scored whole), one ending on a group's edge, one full; GQA rows (one and two query
tokens) and MHA. Tolerances: fp32 queries 1e-4 of the largest score (another summation order);
bf16 queries 2e-3 of it (the folded query q a rounded to fp16, 11 significant bits, as the decode
kernel's). Top-k: the indices the reference picks (fp32; random scores hold no near-ties at that
tolerance), and under bf16 queries scores within the tolerance of the reference's k best.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, quant4, quant4_products, read, topk_scores
from pallas_kernels.topk import int4_scores, topk_blocks
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal, with_outliers

GPU = Route(backend="gpu")
REFERENCE = Route(backend="reference")
T, D = 192, 64


@pytest.fixture(scope="module", params=["int4", "int4_g64_fp16"])
def keys(request):
  """GroupedKeys [3, 2, T, D] written up to 171, 128 and T tokens (the first's last group open),
  in KIVI's groups of 32 with fp32 scales or the compact format (groups of 64, fp16 scales)."""
  fmt = quant4.format_of(request.param)
  rng = np.random.default_rng(11)
  lengths = [T - 21, 128, T]
  pos = np.stack([np.where(np.arange(T) < n, np.arange(T), T) for n in lengths])
  k = with_outliers(rng, normal(rng, (3, T, 2, D)))
  empty = quant4.zeros_grouped_keys((3, 2, T, D), jnp.float32, fmt.group, fmt.scale_dtype)
  return quant4.write_grouped_keys(empty, jnp.asarray(pos, jnp.int32), k), jnp.asarray(lengths)


def _want(q, keys):
  """fp32 scores [B, KV, rows, T] over the dequantized keys, in layout.q_rows' row order."""
  b, lq, h, _ = q.shape
  kvh = keys.shape[1]
  s = quant4_products.key_scores(q.astype(jnp.float32), keys)  # [B, Lq, H, T]
  s = s.reshape(b, lq, kvh, h // kvh, -1).transpose(0, 2, 1, 3, 4)
  return s.reshape(b, kvh, lq * (h // kvh), -1)


@pytest.mark.parametrize("lq,h", [(1, 8), (2, 8), (1, 2)])  # GQA 4 (rows 4, 8), MHA
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-3)])
def test_scores_from_the_codes_match_the_dequantized_keys(keys, lq, h, dtype, tol):
  k, lengths = keys
  q = normal(np.random.default_rng(lq + h), (3, lq, h, D), dtype)
  got = int4_scores.scores(q, k, scale=None, interpret=True)
  want = _want(q, k)
  assert got.shape == want.shape and got.dtype == jnp.float32
  written = np.arange(T)[None, :] < np.asarray(lengths)[:, None]  # slots past the keys: any
  err = np.abs(np.asarray(got) - np.asarray(want))[written[:, None, None, :].repeat(2, 1)
                                                  .repeat(got.shape[2], 2)]
  assert err.max() <= tol * np.abs(np.asarray(want)).max(), err.max()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_topk_over_4_bit_keys_picks_the_dequantized_keys_best(keys, dtype):
  k, lengths = keys
  q = normal(np.random.default_rng(3), (3, 1, 8, D), dtype)
  kw = dict(valid_len=lengths, exclude_prefix=4, kv_layout="BHTD")
  assert read.four_bit_scores(q, k, GPU.variant(), GPU.kernels, 5, tiled=False,
                              max_rows=topk_blocks.MAX_ROWS, max_k=topk_blocks.PICK_MAX_K)
  got = topk_scores(q, k, 5, route=GPU, **kw)
  want = topk_scores(q.astype(jnp.float32), quant4.load_grouped_keys(k), 5, route=REFERENCE, **kw)
  if dtype == jnp.float32:
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]),
                             atol=2e-3 * float(jnp.max(jnp.abs(want[0]))))


def test_the_kernel_serves_a_decode_steps_top_k_on_the_gpu_variant_where_enabled(keys):
  k, _ = keys
  q1, q32 = (jnp.ones((3, n, 8, D), jnp.bfloat16) for n in (1, 32))
  gpu, opts = GPU.variant(), GPU.kernels
  kw = dict(max_rows=topk_blocks.MAX_ROWS, max_k=topk_blocks.PICK_MAX_K)
  assert read.four_bit_scores(q1, k, gpu, opts, 4, tiled=False, **kw)
  assert not read.four_bit_scores(q32, k, gpu, opts, 4, tiled=False, **kw)  # a prefill chunk
  assert not read.four_bit_scores(q1, k, gpu, opts, 4, tiled=True, **kw)
  assert not read.four_bit_scores(q1, k, gpu, opts, 64, tiled=False, **kw)  # the jnp pick's k
  assert not read.four_bit_scores(q1, k, gpu, KernelOptions(int4_topk_scores=False), 4,
                                  tiled=False, **kw)
  assert not read.four_bit_scores(q1, k, REFERENCE.variant(), opts, 4, tiled=False, **kw)


def test_scores_kernel_lowers_to_triton():
  k = quant4.zeros_grouped_keys((1, 8, 4096, 128), jnp.bfloat16)
  text = cuda_text(lambda q, k: int4_scores.scores(q, k, scale=None, interpret=False),
                   jnp.ones((1, 1, 32, 128), jnp.bfloat16), k)
  assert "triton" in text
