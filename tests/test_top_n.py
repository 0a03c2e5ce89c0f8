"""The radix select against `lax.top_k`: the same entries, ties to the lower index."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.ops.top_n import top_n


def _case(seed):
  rng = np.random.default_rng(seed)
  t = int(rng.integers(1, 400))
  x = rng.standard_normal((2, 3, t)).astype(np.float32)
  if seed % 3 == 0:  # plateaus, as max-pooled scores have
    x = np.round(x * 2) / 2
  if seed % 4 == 0:  # forced (+inf) and impossible (-inf) entries, as RefreshKV's priorities
    x[..., rng.integers(0, t, 5)] = np.inf
    x[..., rng.integers(0, t, 5)] = -np.inf
  if seed % 5 == 0:
    x = np.abs(x) * 1e-30  # tiny values: every bit of the key matters
  return x, int(rng.integers(1, t + 1))


@pytest.mark.parametrize("seed", range(24))
def test_top_n_selects_what_top_k_selects(seed):
  x, n = _case(seed)
  values, idx = jax.jit(top_n, static_argnums=1)(jnp.asarray(x), n)
  _, ref = jax.lax.top_k(jnp.asarray(x), n)
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(np.asarray(ref), -1))
  assert (np.diff(np.asarray(idx), axis=-1) > 0).all()  # index order
  np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, np.asarray(idx), -1))


def test_all_equal_row_takes_the_first_n():
  _, idx = top_n(jnp.ones((1, 10)), 4)
  np.testing.assert_array_equal(np.asarray(idx), [[0, 1, 2, 3]])


@pytest.mark.parametrize("n", [0, 11])
def test_n_out_of_range_is_named(n):
  with pytest.raises(ValueError, match=f"n={n} must be in 1..10"):
    top_n(jnp.ones((1, 10)), n)
