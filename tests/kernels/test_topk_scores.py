"""topk_scores: GPU and TPU variants (Pallas interpret mode on CPU) against the jnp reference.

Top-k indices must equal the reference's exactly (integer-valued inputs make every score exact);
scores within 1e-5 (float inputs) or exactly (integer inputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route
from pallas_kernels import topk_scores as _topk_scores
from pallas_kernels.gpu import Tiling
from tests.kernels.inputs import keys_shape, normal, small_ints

VARIANTS = ["gpu", "tpu"]
# The kernels themselves: few-row GPU calls would otherwise go to topk_blocks (test_topk_blocks).
KERNEL = KernelOptions(topk_few_rows="kernel")


def topk_scores(*args, route, **kw):
  return _topk_scores(*args, route=route.replace(kernels=KERNEL), **kw)

# (batch, q_len, q_heads, kv_heads, kv_len, d, top_k, layout, valid, prefix, suffix, tiling)
CASES = {
    "decode_g4_d64_split": (2, 1, 8, 2, 1000, 64, 4, "BHTD", (1000, 613), 3, 5, Tiling(key_splits=3)),
    "chunk_g3_d128_top1": (2, 24, 6, 2, 700, 128, 1, "BTHD", (700, 333), 0, 0, None),
    "g1_top128": (1, 5, 4, 4, 452, 64, 128, "BHTD", None, 17, 40, Tiling(block_keys=128)),
    "chunk_g4_rowblocks": (2, 20, 8, 2, 389, 64, 4, "BTHD", (389, 200), 5, 64,
                           Tiling(block_rows=16, block_keys=128)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(CASES))
def test_topk_matches_reference(variant, case):
  b, lq, h, kvh, t, d, top_k, kv_layout, valid, prefix, suffix, tiling = CASES[case]
  rng = np.random.default_rng(abs(hash(case)) % 2**32)
  q = small_ints(rng, (b, lq, h, d))
  k = small_ints(rng, keys_shape(b, t, kvh, d, kv_layout))
  kw = dict(valid_len=None if valid is None else jnp.asarray(valid), exclude_prefix=prefix,
            exclude_suffix=suffix, kv_layout=kv_layout)
  v, i = topk_scores(q, k, top_k, route=Route(backend=variant), tiling=tiling, **kw)
  rv, ri = topk_scores(q, k, top_k, route=Route(backend="reference"), **kw)
  assert v.shape == i.shape == (b, lq, h, top_k)
  assert v.dtype == jnp.float32 and i.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
  lo, hi = prefix, (t if valid is None else np.asarray(valid)[:, None, None, None]) - suffix
  ii = np.asarray(i)
  assert np.all((ii == -1) | ((ii >= lo) & (ii < hi))), "an excluded key was selected"


@pytest.mark.parametrize("variant", VARIANTS)
def test_topk_ties_go_to_lowest_index(variant):
  """37 distinct keys repeated along the key axis: every score is tied many times over."""
  rng = np.random.default_rng(7)
  distinct = small_ints(rng, (1, 37, 2, 64))
  k = jnp.tile(distinct, (1, 20, 1, 1))[:, :700]  # [1, 700, 2, 64]
  q = small_ints(rng, (1, 3, 4, 64))
  v, i = topk_scores(q, k, 16, route=Route(backend=variant), tiling=Tiling(key_splits=2))
  rv, ri = topk_scores(q, k, 16, route=Route(backend="reference"))
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
  ii, vv = np.asarray(i), np.asarray(v)
  tied = vv[..., 1:] == vv[..., :-1]
  assert tied.any() and np.all(ii[..., 1:][tied] > ii[..., :-1][tied])


@pytest.mark.parametrize("variant", VARIANTS)
def test_topk_float_inputs(variant):
  rng = np.random.default_rng(3)
  q, k = normal(rng, (2, 4, 6, 128)), normal(rng, (2, 500, 3, 128))
  v, i = topk_scores(q, k, 8, scale=0.125, route=Route(backend=variant))
  rv, ri = topk_scores(q, k, 8, scale=0.125, route=Route(backend="reference"))
  np.testing.assert_allclose(np.asarray(v), np.asarray(rv), rtol=1e-5, atol=1e-5)
  # Indices agree wherever the reference's neighbouring scores are not within rounding.
  gap = np.abs(np.diff(np.asarray(rv), axis=-1)).min(axis=-1) > 1e-4
  np.testing.assert_array_equal(np.asarray(i)[gap], np.asarray(ri)[gap])


@pytest.mark.parametrize("variant", VARIANTS)
def test_topk_fewer_candidates_than_k(variant):
  rng = np.random.default_rng(5)
  q, k = small_ints(rng, (2, 1, 4, 64)), small_ints(rng, (2, 300, 2, 64))
  v, i = topk_scores(q, k, 8, valid_len=jnp.array([300, 10]), exclude_prefix=4,
                     route=Route(backend=variant))
  assert np.all(np.asarray(i)[1, ..., 6:] == -1) and np.all(np.isneginf(np.asarray(v)[1, ..., 6:]))
  assert np.all(np.asarray(i)[1, ..., :6] >= 4)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(
      topk_scores(q, k, 8, valid_len=jnp.array([300, 10]), exclude_prefix=4,
                  route=Route(backend="reference"))[1]))


def test_topk_no_score_matrix_in_memory():
  """At 64K keys and a 512-query chunk the score matrix would be 512 x 32 x 64K x 4 B = 4 GiB;
  the compiled kernel call's temporaries must stay far below it (bounded by 256 MiB here)."""
  q = jax.ShapeDtypeStruct((1, 512, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 65536, 8, 128), jnp.bfloat16)
  temp = {}
  for variant in ("gpu", "tpu", "reference"):
    fn = jax.jit(lambda q, k, v=variant: topk_scores(q, k, 4, route=Route(backend=v)))
    temp[variant] = fn.lower(q, k).compile().memory_analysis().temp_size_in_bytes
  score_matrix = 512 * 32 * 65536 * 4
  assert temp["reference"] >= score_matrix  # the check can fail: the einsum path is caught
  assert temp["gpu"] < 256 * 2**20, temp
  assert temp["tpu"] < 256 * 2**20 + 65536 * 8 * 128 * 2, temp  # TPU adds a BHTD copy of k


def test_topk_errors():
  q, k = jnp.ones((1, 1, 6, 64)), jnp.ones((1, 10, 4, 64))
  with pytest.raises(ValueError, match="do not divide"):
    topk_scores(q, k, 2, route=Route())
  with pytest.raises(ValueError, match="top_k=11"):
    topk_scores(jnp.ones((1, 1, 8, 64)), k, 11, route=Route())
  with pytest.raises(ValueError, match="kv_layout"):
    topk_scores(jnp.ones((1, 1, 8, 64)), k, 2, kv_layout="THD", route=Route())
  with pytest.raises(ValueError, match="unknown kernel backend"):
    topk_scores(jnp.ones((1, 1, 8, 64)), k, 2, route=Route(backend="cuda"))
