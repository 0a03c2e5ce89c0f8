"""One-token decode on the GPU kernel with its row block holding copies of the query rows, each
over its own part of every key tile (KernelOptions.decode_row_groups), merged as more key
splits: the same attention as one copy over whole tiles, for 8-bit and bf16 caches, both
layouts, GQA groups that fill the block 4x, 2x (with rows left over) and 8x (one query head a
KV head), the int8 products, fp16 products of the values, the jnp merge and the merge kernel.
Interpreted on the CPU (lowered for CUDA: test_decode_products)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, flash_attention, quant, read
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from tests.kernels.inputs import keys_shape, normal, with_outliers

B, T, D = 2, 517, 128  # a ragged key axis: the last tile clamped
OFFSETS, LENGTHS = (516, 200), (517, 201)
TILING = Tiling(key_splits=3)


def _inputs(h, kvh, dtype, kv_layout, cache, seed=0):
  rng = np.random.default_rng(seed)
  q = normal(rng, (B, 1, h, D), dtype)
  k = with_outliers(rng, normal(rng, keys_shape(B, T, kvh, D, kv_layout), dtype))
  v = normal(rng, keys_shape(B, T, kvh, D, kv_layout), dtype)
  if cache is None:
    return q, k, v
  return q, quant.quantize(k, cache), quant.quantize(v, cache)


def _decode(q, k, v, kv_layout, options):
  out, lse = flash_attention(q, k, v, causal=True, q_offset=jnp.asarray(OFFSETS),
                             kv_len=jnp.asarray(LENGTHS), kv_layout=kv_layout,
                             route=Route(backend="gpu", kernels=options), tiling=TILING)
  return jax.block_until_ready((out.astype(jnp.float32), lse))  # one interpreted call at a time


CASES = [  # (query heads, KV heads, dtype, layout, cache, other options)
    (8, 2, jnp.float32, "BHTD", jnp.int8, {"decode_int8_products": True}),
    (8, 2, jnp.bfloat16, "BTHD", jnp.int8, {}),
    (12, 2, jnp.bfloat16, "BHTD", jnp.float8_e4m3fn, {"decode_merge_kernel": False}),
    (2, 2, jnp.float32, "BHTD", None, {}),
    (8, 2, jnp.bfloat16, "BHTD", jnp.int8, {"int8_fp16_products": True}),
]


@pytest.mark.parametrize("h,kvh,dtype,kv_layout,cache,other", CASES)
def test_row_groups_compute_the_same_attention(h, kvh, dtype, kv_layout, cache, other):
  q, k, v = _inputs(h, kvh, dtype, kv_layout, cache)
  want = _decode(q, k, v, kv_layout, KernelOptions(**other))
  got = _decode(q, k, v, kv_layout, KernelOptions(decode_row_groups=True, **other))
  # fp32: the sums' order only; bf16: the probabilities' rounding against other tile maxima
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(got[0], want[0], atol=tol, rtol=tol)
  np.testing.assert_allclose(got[1], want[1], atol=tol, rtol=tol)
  assert np.isfinite(got[1]).all()
  if dtype == jnp.float32:  # the groups ran: their sums' order moves the last bits
    assert not np.array_equal(got[0], want[0])


def test_the_groups_fill_the_block():
  tiling = Tiling().pick(block_rows=16, block_keys=128, num_warps=4, num_stages=3,
                         prefetch=False)
  on, gpu = KernelOptions(decode_row_groups=True), Variant("gpu", False)
  assert [read.decode_row_groups(r, 1, tiling, gpu, on) for r in (1, 2, 4, 6, 8, 9, 16)] == [
      8, 8, 4, 2, 2, 1, 1]  # 1 row: 8 parts of 16 keys (the least), not 16 of 8
  assert read.decode_row_groups(4, 2, tiling, gpu, on) == 1  # a chunk's rows
  assert read.decode_row_groups(4, 1, tiling, Variant("tpu", False), on) == 1
  assert read.decode_row_groups(4, 1, tiling, gpu, KernelOptions()) == 1  # off by default

