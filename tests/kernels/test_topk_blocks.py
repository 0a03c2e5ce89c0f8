"""topk_blocks (decode's exact top-k from block maxima) against the jnp reference.

Indices must equal the reference's exactly, ties included (integer inputs make every score
exact and ties frequent); small blocks force many blocks, partial last blocks and top-k larger
than the number of blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, reference, topk_scores
from pallas_kernels.topk import topk_blocks
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import keys_shape, normal, small_ints

# (batch, q_len, q_heads, kv_heads, kv_len, d, top_k, layout, lo, hi, block)
CASES = {
    "decode_g4": (2, 1, 8, 2, 1000, 64, 4, "BHTD", (3, 40), (995, 600), 256),
    "decode_g1_partial_block": (1, 1, 4, 4, 777, 64, 4, "BTHD", (0,), (777,), 64),
    "top_k_over_blocks": (2, 1, 6, 2, 300, 64, 16, "BHTD", (5, 0), (300, 290), 8),
    "two_queries_g3": (2, 2, 6, 2, 520, 128, 1, "BTHD", (32, 0), (400, 520), 16),
    "one_block": (1, 1, 2, 1, 100, 64, 8, "BHTD", (0,), (100,), 256),
}


@pytest.mark.parametrize("pick", ["jnp", "kernel"])
@pytest.mark.parametrize("case", list(CASES))
def test_blocks_match_reference(case, pick):
  """Both picks after the block maxima (the kernel in interpret mode; top_k 16 over blocks of 8:
  16 blocks picked) give the reference's indices and scores, ties included."""
  b, lq, h, kvh, t, d, top_k, kv_layout, lo, hi, block = CASES[case]
  rng = np.random.default_rng(len(case))
  q = small_ints(rng, (b, lq, h, d))
  k = small_ints(rng, keys_shape(b, t, kvh, d, kv_layout))
  lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
  v, i = jax.jit(lambda q, k, lo, hi: topk_blocks.topk_scores(
      q, k, top_k, lo, hi, kv_layout=kv_layout, block=block, pick=pick, interpret=True))(
          q, k, lo, hi)
  rv, ri = reference.topk_scores(q, k, top_k, lo, hi, kv_layout=kv_layout)
  assert v.shape == i.shape == (b, lq, h, top_k) and i.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))


@pytest.mark.parametrize("pick", ["jnp", "kernel"])
def test_blocks_ties_across_blocks_go_to_lowest_index(pick):
  """13 distinct keys repeated: every block holds the row's maximum, so the k blocks chosen are
  the first ones and each score is tied within and across them."""
  rng = np.random.default_rng(11)
  k = jnp.tile(small_ints(rng, (1, 13, 2, 64)), (1, 40, 1, 1))  # [1, 520, 2, 64]
  q = small_ints(rng, (1, 1, 4, 64))
  lo, hi = jnp.array([0]), jnp.array([520])
  v, i = topk_blocks.topk_scores(q, k, 8, lo, hi, block=32, pick=pick, interpret=True)
  rv, ri = reference.topk_scores(q, k, 8, lo, hi)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  vv, ii = np.asarray(v), np.asarray(i)
  tied = vv[..., 1:] == vv[..., :-1]
  assert tied.any() and np.all(ii[..., 1:][tied] > ii[..., :-1][tied])


@pytest.mark.parametrize("pick", ["jnp", "kernel"])
def test_blocks_float_scores_and_holes(pick):
  rng = np.random.default_rng(2)
  q, k = normal(rng, (2, 1, 8, 128)), normal(rng, (2, 2000, 2, 128))
  lo, hi = jnp.array([4, 0]), jnp.array([2000, 6])  # sequence 1: 6 candidates for top 8
  v, i = topk_blocks.topk_scores(q, k, 8, lo, hi, scale=0.125, pick=pick, interpret=True)
  rv, ri = reference.topk_scores(q, k, 8, lo, hi, scale=0.125)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  # Two fp32 products laid out apart (the kernel's einsum, the reference's grouped one) sum the
  # 128 terms in orders XLA picks per CPU: 3e-6 apart on one machine, equal on another.
  np.testing.assert_allclose(np.asarray(v), np.asarray(rv), rtol=1e-5)
  assert np.all(np.asarray(i)[1, ..., 6:] == -1) and np.all(np.isneginf(np.asarray(v)[1, ..., 6:]))


def test_gpu_decode_routes_here_unless_asked(monkeypatch):
  """topk_scores(backend="gpu") sends few rows to the blocks, their pick in the kernel unless
  "blocks_jnp" is asked, and prefill-sized rows or topk_few_rows="kernel" to a fused kernel."""
  q1 = jax.ShapeDtypeStruct((1, 1, 8, 64), jnp.bfloat16)
  q64 = jax.ShapeDtypeStruct((1, 32, 8, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
  picks = []
  routed = topk_blocks.topk_scores
  monkeypatch.setattr(topk_blocks, "topk_scores",
                      lambda *a, pick, **kw: picks.append(pick) or routed(*a, pick=pick, **kw))

  def route(q, options=KernelOptions()):
    picks.clear()
    jaxpr = str(jax.make_jaxpr(lambda q, k: topk_scores(q, k, 4, route=Route(backend="gpu",
                                                                             kernels=options)))(q,
                                                                                                k))
    return picks[0] if picks else "fused" if "pallas_call" in jaxpr else "none"

  assert route(q1) == "kernel"
  assert route(q1, KernelOptions(topk_few_rows="blocks_jnp")) == "jnp"
  assert route(q1, KernelOptions(topk_few_rows="kernel")) == "fused"
  assert route(q64) == "fused"


def test_pick_kernel_lowers_to_triton():
  """The pick kernel at a decode step's shapes (8 kv heads x 4 rows, 32K keys in 128 blocks)."""
  x, maxima = jnp.ones((8, 4 * 32768), jnp.float32), jnp.ones((8, 4, 128), jnp.float32)

  def call(x, maxima, bounds):
    return topk_blocks._pick(x, maxima, bounds, k=4, kb=4, block=256, kvh=8, t=32768,
                             interpret=False)
  assert "triton" in cuda_text(call, x, maxima, jnp.ones((1, 2), jnp.int32))


def test_pick_kernel_leaves_large_k_to_jnp(monkeypatch):
  """A top-k past PICK_MAX_K (its passes unroll) takes the jnp pick, with the same result."""
  picked = []
  monkeypatch.setattr(topk_blocks, "pick_from_blocks", lambda *a, **kw: picked.append(1))
  rng = np.random.default_rng(5)
  q, k = small_ints(rng, (1, 1, 4, 64)), small_ints(rng, (1, 600, 2, 64))
  lo, hi = jnp.array([0]), jnp.array([600])
  k_large = topk_blocks.PICK_MAX_K + 1
  v, i = topk_blocks.topk_scores(q, k, k_large, lo, hi, pick="kernel", interpret=True)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(reference.topk_scores(q, k, k_large,
                                                                                 lo, hi)[1]))
  assert not picked

