"""experiments/int4_quality.py's stand-in quantizer: the 4-bit levels it claims to store."""

import jax
import jax.numpy as jnp
import numpy as np

from experiments.int4_quality import GROUP, int4_quantize
from pallas_kernels import quant


def _keys():
  """[2, 3, 5, 128] with channel magnitudes from 0.01 to 30 (outlier channels, as Qwen's)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5, 128))
  return x * jnp.geomspace(0.01, 30.0, 128)


def test_row_levels_are_4_bit_with_one_scale_a_row():
  x = _keys()
  q = int4_quantize("row")(x, "int8")
  assert q.values.dtype == jnp.int8 and q.scale.shape == (*x.shape[:-1], 1)
  assert int(jnp.max(jnp.abs(q.values))) == 7
  step = np.asarray(jnp.max(jnp.abs(x), -1) / 7)[..., None]
  err = np.abs(np.asarray(quant.dequantize(q)) - np.asarray(x))
  assert (err <= step / 2 * (1 + 1e-5)).all()
  assert err.max() > step.max() / 4  # rounding to 15 levels, not to int8's 255


def test_grouped_levels_bound_the_error_by_each_groups_step_plus_int8s():
  x = _keys()
  q = int4_quantize("g32")(x, "int8")
  groups = np.asarray(x).reshape(*x.shape[:-1], -1, GROUP)
  group_step = (np.abs(groups).max(-1, keepdims=True) / 7)
  row_step = np.abs(np.asarray(x)).max(-1)[..., None, None] / 127
  err = np.abs(np.asarray(quant.dequantize(q)) - np.asarray(x)).reshape(groups.shape)
  assert (err <= (group_step + row_step) / 2 * (1 + 1e-5)).all()
  row = np.abs(np.asarray(quant.dequantize(int4_quantize("row")(x, "int8"))) - np.asarray(x))
  rms = lambda e: float(np.sqrt(np.mean(np.square(e))))  # noqa: E731
  assert rms(err) < 0.9 * rms(row)  # a group's scale fits it better than the row's


def test_other_dtypes_are_left_to_the_8_bit_quantizer():
  x = _keys()
  q = int4_quantize("row")(x, "float8_e4m3fn")
  ref = quant.quantize(x, "float8_e4m3fn")
  np.testing.assert_array_equal(np.asarray(q.values, np.float32), np.asarray(ref.values, np.float32))
