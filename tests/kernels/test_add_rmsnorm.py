"""add_rmsnorm (residual add + RMSNorm in one kernel): the GPU variant in interpret mode against
the reference, and lowered to Triton for CUDA.

Tolerances: the sum x + h exactly (the same one rounding); fp32 y 1e-6 relative (the mean of
squares summed in another order); bf16 y one bf16 ulp (8e-3 relative).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode import add_rmsnorm
from pallas_kernels import Route
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 8e-3)])
def test_add_rms_norm_matches_reference(dtype, tol):
  rng = np.random.default_rng(1)
  n, d = 3, 256
  x, h = normal(rng, (n, d), dtype) * 4, normal(rng, (n, d), dtype)
  scale = jnp.asarray(rng.uniform(0.5, 1.5, d), dtype)
  s, y = add_rmsnorm.add_rms_norm(x, h, scale, eps=1e-5, route=Route(backend="gpu"))
  rs, ry = add_rmsnorm.reference(x, h, scale, 1e-5)
  assert s.dtype == dtype and y.dtype == ry.dtype and y.shape == ry.shape
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(rs, np.float32))
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ry, np.float32), rtol=tol,
                             atol=tol * float(np.abs(np.asarray(ry, np.float32)).max()))


def test_unsupported_widths_and_bad_shapes():
  assert add_rmsnorm.supported(4096) and not add_rmsnorm.supported(3584)
  x = jnp.ones((2, 48))  # not a power of two: the reference answers
  scale = jnp.full((48,), 3.0)
  s, y = add_rmsnorm.add_rms_norm(x, x, scale, eps=1e-5, route=Route(backend="gpu"))
  np.testing.assert_allclose(np.asarray(y), 3 * 2 / np.sqrt(4 + 1e-5), rtol=1e-6)
  with pytest.raises(ValueError, match="must be"):
    add_rmsnorm.add_rms_norm(x, jnp.ones((2, 47)), scale, eps=1e-5, route=Route())


def test_add_rms_norm_lowers_to_triton():
  x = jnp.ones((1, 4096), jnp.bfloat16)
  scale = x[0]

  def call(x, h):
    return add_rmsnorm._call(x, h, scale, eps=1e-5, interpret=False)
  assert "triton" in cuda_text(call, x, x)
