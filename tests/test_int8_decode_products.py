"""KernelOptions.decode_int8_products in a model's decode steps on the CPU: full attention's
one-token steps go through flash_attention when it is asked (Route.fused_decode), whose
reference computes the products, so the option is never dropped by the jnp decode path."""

import numpy as np

from jax_longctx import RunOptions
from jax_longctx.methods import get
from jax_longctx.model import random_params
from jax_longctx.run.driver import continuation_nll
from pallas_kernels import KernelOptions
from tests.conftest import tiny_config


def _nll(kernels: KernelOptions, kv_dtype="int8"):
  cfg = tiny_config()
  params = random_params(cfg, seed=2)
  rng = np.random.default_rng(0)
  prefixes = [list(rng.integers(0, cfg.vocab_size, n)) for n in (20, 13)]
  targets = [list(rng.integers(0, cfg.vocab_size, 8)) for _ in prefixes]
  options = RunOptions(kv_dtype=kv_dtype).replace_route(kernels=kernels)
  nll, _ = continuation_nll(params, cfg, get("full"), prefixes, targets, cache_len=40,
                            options=options)
  return nll


def test_the_option_acts_in_the_decode_steps_and_moves_nll_by_rounding_only():
  products = _nll(KernelOptions(decode_int8_products=True))
  dequantized = _nll(KernelOptions())
  moved = np.abs(products - dequantized)
  assert moved.max() > 1e-7, "decode_int8_products left every step's NLL unchanged"
  assert moved.max() < 2e-2


def test_the_option_leaves_other_caches_alone():
  """A float cache has no int8 products: the same NLL with the option asked."""
  np.testing.assert_allclose(_nll(KernelOptions(decode_int8_products=True), None),
                             _nll(KernelOptions(), None), rtol=1e-5, atol=1e-5)
