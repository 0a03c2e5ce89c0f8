"""The radix select against `lax.top_k`: the same entries, ties to the lower index."""

import functools

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


# (bits a pass, counting, one cumsum): the default, wide digits counted as rows, widths that leave a
# narrow last digit (32 = 3 x 11 - 1 = 7 x 5 - 3), and 16-bit digits counted by scatter.
PLANS = [(4, "compare", False), (8, "rows", True), (11, "scatter", True),
         (16, "scatter", False), (5, "compare", True)]


# every seed under the default plan; the other plans each over a quarter of the first 16 seeds,
# which still gives each of them plateaus, +-inf entries and tiny values
CASES = [(s, PLANS[0]) for s in range(24)] + [(s, PLANS[1 + s % 4]) for s in range(16)]


@pytest.mark.parametrize("seed,plan", CASES, ids=[f"{s}-b{p[0]}_{p[1]}_{p[2]}" for s, p in CASES])
def test_top_n_selects_what_top_k_selects(seed, plan):
  x, n = _case(seed)
  bits, counting, one_cumsum = plan
  pick = jax.jit(functools.partial(top_n, n=n, bits=bits, counting=counting,
                                   one_cumsum=one_cumsum))
  values, idx = pick(jnp.asarray(x))
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


def test_bad_radix_plan_is_named():
  with pytest.raises(ValueError, match="bits must be in 1..16"):
    top_n(jnp.ones((1, 10)), 4, bits=17)
  with pytest.raises(ValueError, match="counting 'compare', 'rows' or 'scatter'"):
    top_n(jnp.ones((1, 10)), 4, counting="sort")
