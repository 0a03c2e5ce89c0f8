"""The 4-bit storage format (pallas_kernels/quant4.py) against numpy: packing round-trips and
pairs channel j with j + d / 2 in one byte; each kind's error is at most half its step inside its
range; per-channel key ranges hold normal channels beside outlier ones, where a range per row
does not; row ops move row-level arrays and carry the buffer's ranges."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quant4

B, KV, T, D = 2, 3, 40, 128


def _keys(seed=0, outliers=(5, 77)):
  """Normal keys [B, KV, T, D] whose `outliers` channels are ~40x larger for every token (the
  pattern per-token 4-bit grids lose to: KIVI's and KVQuant's observation)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, KV, T, D)).astype(np.float32)
  x[..., list(outliers)] = 40 + 5 * rng.normal(size=(B, KV, T, len(outliers)))
  return jnp.asarray(x)


def test_packing_round_trips_and_pairs_rotate_half_channels():
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 16, (B, KV, T, D)).astype(np.uint8)
  packed = quant4.pack(jnp.asarray(codes))
  assert packed.dtype == jnp.uint8 and packed.shape == (B, KV, T, D // 2)
  np.testing.assert_array_equal(np.asarray(packed) & 15, codes[..., : D // 2])
  np.testing.assert_array_equal(np.asarray(packed) >> 4, codes[..., D // 2:])
  np.testing.assert_array_equal(np.asarray(quant4.unpack(packed)), codes)
  with pytest.raises(ValueError, match="must be even"):
    quant4.pack(jnp.zeros((3, 5), jnp.uint8))


def test_rows_are_within_half_a_step_and_hit_their_ends():
  x = np.asarray(_keys(2, outliers=()))
  q = quant4.quantize_rows(jnp.asarray(x))
  assert q.shape == x.shape and q.scale.shape == (B, KV, T, 1)
  back = np.asarray(quant4.dequantize(q))
  step = (x.max(-1, keepdims=True) - x.min(-1, keepdims=True)) / 15
  assert np.all(np.abs(back - x) <= step / 2 + 1e-5 * np.abs(x).max())
  # each row's min and max are levels 0 and 15 exactly (asymmetric: no level wasted)
  np.testing.assert_allclose(back.min(-1), x.min(-1), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(back.max(-1), x.max(-1), rtol=1e-6, atol=1e-5)
  # a constant row: scale 1, finite, exact
  flat = quant4.quantize_rows(jnp.full((1, D), 2.5))
  np.testing.assert_array_equal(np.asarray(quant4.dequantize(flat)), np.full((1, D), 2.5))


def test_channels_hold_normal_channels_beside_outliers_where_rows_do_not():
  x = _keys(3)
  lo, hi = quant4.channel_ranges(x, heads_axis=1)
  assert lo.shape == hi.shape == (1, KV, 1, D)
  q = quant4.quantize_channels(x, lo, hi)
  jitted = jax.jit(quant4.quantize_channels)(x, lo, hi)  # ranges traced: a jitted cache write
  np.testing.assert_array_equal(np.asarray(jitted.codes), np.asarray(q.codes))
  back = np.asarray(quant4.dequantize(q))
  xn, step = np.asarray(x), np.asarray(hi - lo) / 15
  assert np.all(np.abs(back - xn) <= step / 2 + 1e-4)
  normal = [c for c in range(D) if c not in (5, 77)]
  err_channels = np.abs(back - xn)[..., normal].mean()
  err_rows = np.abs(np.asarray(quant4.dequantize(quant4.quantize_rows(x))) - xn)[..., normal].mean()
  assert err_channels * 4 < err_rows, (err_channels, err_rows)
  # values outside the calibrated range are clipped to it
  clipped = np.asarray(quant4.dequantize(quant4.quantize_channels(x * 3, lo, hi)))
  assert np.all(clipped >= np.asarray(lo) - 1e-5) and np.all(clipped <= np.asarray(hi) + 1e-4)
  with pytest.raises(ValueError, match="do not broadcast per channel"):
    quant4.quantize_channels(x, lo[..., :64], hi[..., :64])


def test_row_ops_move_rows_and_carry_the_ranges():
  x = _keys(4)
  lo, hi = quant4.channel_ranges(x, heads_axis=1)
  keys, values = quant4.quantize_channels(x, lo, hi), quant4.quantize_rows(x)
  slots = jnp.array([7, 0, 39, 7])
  pick = lambda a: a[:, :, slots]  # noqa: E731
  for stored in (keys, values):
    moved = quant4.per_row(pick, stored)
    np.testing.assert_array_equal(np.asarray(quant4.dequantize(moved)),
                                  np.asarray(quant4.dequantize(stored))[:, :, slots])
  assert quant4.per_row(pick, keys).scale is keys.scale
  with pytest.raises(TypeError, match="a mix of per-row and per-channel"):
    quant4.per_row(lambda a, b: a, keys, values)
  # a 128-channel row: 64 bytes of codes; values add 8 bytes of scale and zero a row
  assert quant4.nbytes(values) == B * KV * T * (64 + 8)
  assert quant4.nbytes(keys) == B * KV * T * 64 + 2 * KV * D * 4
