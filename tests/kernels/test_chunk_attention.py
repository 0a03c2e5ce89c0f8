"""chunk_attention: a prefill chunk at an offset as two dense calls merged by LSE (the cuDNN
route, with cuDNN's definition written in jnp) and as one flash_attention call, against the jnp
reference of causal attention at that offset.

Tolerances as the other attention kernels: fp32 2e-5 on outputs and LSE; bf16 2e-2 on outputs and
1e-4 on the fp32 LSE. On a GPU the real cuDNN route is checked against one causal cuDNN call
over the whole prompt, before it is timed, in benchmarks/prefill_attention.py.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from pallas_kernels.attention import chunk as ca
from pallas_kernels import Route, reference
from tests.kernels.inputs import keys_shape, normal
from tests.kernels.test_attention_kernels import assert_close

# (batch, chunk, q heads, kv heads, cache slots, d, offsets per sequence, layout, dtype)
CASES = {
    "first_chunk_and_later_g3": (2, 16, 6, 2, 96, 64, (0, 37), "BHTD", jnp.float32),
    "mid_cache_g1_bthd": (1, 24, 4, 4, 200, 32, (101,), "BTHD", jnp.float32),
    "g4_bf16": (3, 8, 8, 2, 64, 64, (8, 0, 50), "BHTD", jnp.bfloat16),
}


def _inputs(b, c, h, kvh, t, d, offsets, kv_layout, dtype, seed=0):
  """q, a cache holding random keys everywhere (past the chunk too: never visible) with the
  chunk's own keys written at its slots, and those keys apart."""
  rng = np.random.default_rng(seed)
  q = normal(rng, (b, c, h, d), dtype)
  k = normal(rng, keys_shape(b, t, kvh, d, kv_layout), dtype)
  v = normal(rng, keys_shape(b, t, kvh, d, kv_layout), dtype)
  kc, vc = normal(rng, (b, c, kvh, d), dtype), normal(rng, (b, c, kvh, d), dtype)
  off = jnp.asarray(offsets, jnp.int32)
  write = jax.vmap(lambda cache, new, o: jax.lax.dynamic_update_slice_in_dim(
      cache, new if kv_layout == "BTHD" else jnp.swapaxes(new, 0, 1), o,
      axis=0 if kv_layout == "BTHD" else 1))
  return q, write(k, kc, off), write(v, vc, off), kc, vc, off


def _expected(q, k, v, off, kv_layout):
  return reference.flash_attention(q, k, v, causal=True, q_offset=off, kv_len=off + q.shape[1],
                                   scale=q.shape[-1] ** -0.5, kv_layout=kv_layout)


@pytest.mark.parametrize("case", CASES)
def test_two_calls_merged_by_lse_equal_causal_attention_at_the_offset(case):
  b, c, h, kvh, t, d, offsets, kv_layout, dtype = CASES[case]
  q, k, v, kc, vc, off = _inputs(b, c, h, kvh, t, d, offsets, kv_layout, dtype)
  got = ca.chunk_attention_composed(q, k, v, kc, vc, off, scale=d ** -0.5, kv_layout=kv_layout,
                                    dense=ca.reference_dense)
  assert_close(got, _expected(q, k, v, off, kv_layout), dtype)


@pytest.mark.parametrize("case", CASES)
def test_other_routes_equal_the_reference(case):
  b, c, h, kvh, t, d, offsets, kv_layout, dtype = CASES[case]
  q, k, v, kc, vc, off = _inputs(b, c, h, kvh, t, d, offsets, kv_layout, dtype, seed=1)
  ref = _expected(q, k, v, off, kv_layout)
  assert_close(ca.chunk_attention(q, k, v, kc, vc, off, kv_layout=kv_layout, route=Route()), ref,
               dtype)
  got = ca.chunk_attention(q, k, v, kc, vc, off, kv_layout=kv_layout, route=Route(backend="gpu"),
                           use_cudnn=False)  # the Pallas kernel, interpreted
  assert_close(got, ref, dtype)


def test_cudnn_route_is_taken_only_where_it_can_run():
  q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
  assert not ca.cudnn_route(q, q, Route())  # CPU
  assert not ca.cudnn_route(q, q, Route(backend="gpu"))  # interpreted: no cuDNN
  # The guard finds jax's private entry in the jax versions the project supports (0.10, 0.11);
  # if a later jax drops it, chunks fall back to the Pallas kernel instead of failing.
  assert ca.cudnn_available()
