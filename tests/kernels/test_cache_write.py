"""cache_write.write_one_token (a decode step's K/V write as one in-place kernel): the GPU
variant in interpret mode equals the reference scatter exactly (per-sequence positions, out of
range dropped), and lowers to Triton for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, quant
from pallas_kernels.decode import cache_write
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("positions", [(5, 0, 99), (-1, 100, 37), (99, 99, 3), (-101, 150, -100)])
def test_write_one_token_equals_reference(dtype, positions):
  rng = np.random.default_rng(sum(positions) % 97)
  b, kvh, t, d = 3, 2, 100, 64
  k, v = (normal(rng, (b, kvh, t, d), dtype) for _ in range(2))
  kn, vn = (normal(rng, (b, kvh, d), jnp.float32) for _ in range(2))  # cast to the cache's dtype
  pos = jnp.asarray(positions, jnp.int32)
  got = jax.jit(lambda *a: cache_write.write_one_token(*a, route=Route(backend="gpu")))(k, v, pos,
                                                                                        kn, vn)
  ref = cache_write.reference(k, v, pos, kn, vn)
  for g, r, old in zip(got, ref, (k, v)):
    assert g.dtype == old.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
  changed = np.asarray((got[0] != k).any(axis=(1, 3)))  # [B, T]: slots written
  for i, p in enumerate(positions):
    slot = p + t if p < 0 else p  # jnp's negative indices count from the end
    assert changed[i].sum() == (0 <= slot < t) and (not 0 <= slot < t or changed[i, slot])


def test_write_one_token_checks_shapes():
  k = jnp.ones((2, 2, 8, 4))
  with pytest.raises(ValueError, match="must be"):
    cache_write.write_one_token(k, k, jnp.zeros((2,), jnp.int32), jnp.ones((2, 1, 2, 4)),
                                jnp.ones((2, 1, 2, 4)), route=Route())


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_write_into_a_quantized_cache_equals_reference(kv_dtype):
  """An 8-bit cache: the new rows are quantized alone (one scale per row) and written with their
  scales; exactly the reference's scatter of quantize(row)."""
  rng = np.random.default_rng(3)
  b, kvh, t, d = 3, 2, 50, 64
  k, v = (quant.quantize(normal(rng, (b, kvh, t, d)), kv_dtype) for _ in range(2))
  kn, vn = (normal(rng, (b, kvh, d), jnp.bfloat16) for _ in range(2))
  pos = jnp.asarray((7, -1, 50), jnp.int32)  # the last out of range: dropped
  got = jax.jit(lambda *a: cache_write.write_one_token(*a, route=Route(backend="gpu")))(k, v, pos,
                                                                                        kn, vn)
  ref = cache_write.reference(k, v, pos, kn, vn)
  for g, r, new in zip(got, ref, (kn, vn)):
    assert isinstance(g, quant.Quantized) and g.dtype == kv_dtype
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_array_equal(f32(g.values), f32(r.values))
    np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(r.scale))
    row = quant.quantize(new[0, 1], kv_dtype)
    # the row's own scale (quantized alone; 1e-6: XLA may fuse the division differently)
    np.testing.assert_allclose(np.asarray(g.scale[0, 1, 7]), np.asarray(row.scale), rtol=1e-6)
  assert np.array_equal(np.asarray(got[0].scale[2]), np.asarray(k.scale[2]))  # nothing written


def test_write_into_a_cache_holding_a_key_offset_equals_reference():
  """Key smoothing's buffer: the rows less its offset, quantized by jnp first, then written."""
  rng = np.random.default_rng(4)
  b, kvh, t, d = 2, 2, 40, 64
  k = quant.quantize(normal(rng, (b, kvh, t, d)), jnp.int8)
  k = quant.Quantized(k.values, k.scale, offset=normal(rng, (1, kvh, 1, d)))
  v = quant.quantize(normal(rng, (b, kvh, t, d)), jnp.int8)
  kn, vn = (normal(rng, (b, kvh, d), jnp.bfloat16) for _ in range(2))
  pos = jnp.asarray((3, 39), jnp.int32)
  got = jax.jit(lambda *a: cache_write.write_one_token(*a, route=Route(backend="gpu")))(k, v, pos,
                                                                                        kn, vn)
  ref = cache_write.reference(k, v, pos, kn, vn)
  for g, r in zip(got, ref):
    np.testing.assert_array_equal(np.asarray(g.values), np.asarray(r.values))
    np.testing.assert_array_equal(np.asarray(g.scale), np.asarray(r.scale))


@pytest.mark.parametrize("quantized", [None, jnp.int8, jnp.float8_e4m3fn])
def test_write_kernel_lowers_to_triton(quantized):
  k = jnp.ones((1, 8, 1000, 128), jnp.bfloat16)
  row = jnp.ones((1, 8, 128), jnp.bfloat16)
  rows, caches = (row, row), (k, k)
  if quantized:  # quantized in the kernel; values and scales: four buffers written in place
    k = quant.quantize(k, quantized)
    caches = (k.values, k.values, k.scale, k.scale)

  def call(pos, rows, caches):
    return cache_write._write(pos, rows, caches, interpret=False, quantize=bool(quantized))
  text = cuda_text(call, jnp.zeros((1, 1), jnp.int32), rows, caches)
  assert "triton" in text and text.count("#stablehlo.output_operand_alias<") == len(caches)

