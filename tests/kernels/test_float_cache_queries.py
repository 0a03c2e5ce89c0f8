"""Queries of one float dtype over a float cache stored in another (an fp32 model with
`--kv-dtype bfloat16`): the kernel variants take the queries in the cache's dtype
(read.kernel_queries), since their products take one operand dtype. Before, the Triton
lowering refused the call on a GPU ("a and b must have the same element type") while every
interpreted test passed: interpret mode promotes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, backend, chunk_attention, flash_attention, gathered_attention
from pallas_kernels import topk_scores
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal

B, T, KV, H, D = 2, 256, 2, 12, 64  # Qwen2.5's 6 query heads a KV head
Q_OFF, KV_LEN = np.array([100, 200]), np.array([101, 201])


def _calls(route):
  """(name, fn(q, k, v), query rows) of every public entry point reading a cache."""
  off, kv_len = jnp.asarray(Q_OFF), jnp.asarray(KV_LEN)
  idx = jnp.broadcast_to(jnp.arange(0, 64, dtype=jnp.int32) * 3, (B, KV, 64))
  return [
      ("decode", lambda q, k, v: flash_attention(q, k, v, q_offset=off, kv_len=kv_len,
                                                 route=route), 1),
      ("chunk", lambda q, k, v: chunk_attention(q, k, v, k[:, :16], v[:, :16], off,
                                                route=route, use_cudnn=False), 16),
      ("gathered", lambda q, k, v: gathered_attention(q, k, v, idx, route=route), 1),
      ("topk", lambda q, k, v: topk_scores(q, k, 4, valid_len=kv_len, route=route), 1),
  ]


def _inputs(rows, q_dtype, kv_dtype):
  rng = np.random.default_rng(3)
  q = normal(rng, (B, rows, H, D), q_dtype)
  k, v = (normal(rng, (B, T, KV, D), kv_dtype) for _ in range(2))
  return q, k, v


@pytest.mark.parametrize("q_dtype,kv_dtype", [(jnp.float32, jnp.bfloat16),
                                              (jnp.bfloat16, jnp.float32)])
def test_the_gpu_kernels_lower_for_cuda(monkeypatch, q_dtype, kv_dtype):
  """Every entry point lowers to Triton for CUDA on this CPU (the native GPU variant) with
  queries and cache of different float dtypes."""
  monkeypatch.setattr(backend, "resolve", lambda _: backend.Variant("gpu", False))
  for name, fn, rows in _calls(Route(backend="gpu")):
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs(rows, q_dtype, kv_dtype)]
    assert "triton" in cuda_text(fn, *args).lower(), name


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_the_kernels_take_the_queries_in_the_caches_dtype(variant):
  """fp32 queries over a bf16 cache on an interpreted kernel variant: the same numbers as the
  kernel given the queries in bf16 (outputs returned in fp32), and within bf16's rounding of
  the jnp reference, which promotes."""
  route, reference = Route(backend=variant), Route(backend="reference")
  calls = zip(_calls(route), _calls(Route(backend=variant)), _calls(reference))
  for (name, fn, rows), (_, same_fn, _), (_, ref_fn, _) in calls:
    if variant == "tpu" and name == "chunk":
      continue  # the TPU chunk kernel's blocks are longer than this cache
    q, k, v = _inputs(rows, jnp.float32, jnp.bfloat16)
    # one call at a time, each finished before the next: the Pallas interpreters' callbacks
    # can deadlock with calls still in flight
    got = jax.block_until_ready(fn(q, k, v))
    as_bf16 = jax.block_until_ready(same_fn(q.astype(jnp.bfloat16), k, v))
    ref = ref_fn(q, k, v)
    if name == "topk":
      np.testing.assert_array_equal(got[1], as_bf16[1], err_msg=name)
      np.testing.assert_array_equal(got[0], as_bf16[0], err_msg=name)
      np.testing.assert_allclose(got[0], ref[0], rtol=2e-2, atol=5e-2, err_msg=name)
      continue
    assert got[0].dtype == jnp.float32, name
    np.testing.assert_array_equal(got[0], as_bf16[0].astype(jnp.float32), err_msg=name)
    np.testing.assert_allclose(got[0], ref[0], atol=2e-2, err_msg=name)
    np.testing.assert_allclose(got[1], ref[1], atol=2e-2, err_msg=name)
