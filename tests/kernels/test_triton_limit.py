"""Caches of 2^31 elements or more (gpu.triton_indexable): Pallas' Triton kernels compute element
offsets in int32, and on an H200 the cache-write and gathered kernels faulted over ReAttention's
int8 cache of the 3B shape at 2M tokens. Each route then takes XLA (or the rows XLA gathered);
the limit is lowered here to the tests' small caches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, quant
from pallas_kernels.decode import cache_write
from tests.kernels.inputs import normal


def test_cache_write_and_gathered_reads_take_xla(monkeypatch):
  """A cache of 2^31 elements or more (gpu.triton_indexable: the Triton kernels' int32 offsets
  faulted on an H200 at ReAttention's 2M-token int8 cache): the write by XLA (no Triton kernel),
  the gathered read over rows XLA gathered first (the kernel sees only them); both equal the
  reference's. The limit is lowered here to the test's caches."""
  from pallas_kernels import gathered_attention, gpu
  from pallas_kernels.attention import gathered

  def no_triton(*a, **kw):
    raise AssertionError("a Triton kernel ran past the limit")

  rng = np.random.default_rng(29)
  b, kvh, t, d = 2, 2, 64, 32
  k, v = (quant.quantize(normal(rng, (b, kvh, t, d)), jnp.int8) for _ in range(2))
  monkeypatch.setattr(gpu, "MAX_TRITON_ELEMENTS", k.values.size - 1)
  monkeypatch.setattr(cache_write, "_write", no_triton)
  gathered_kernel = gathered._gpu

  def small_only(qr, k, v, *a, **kw):  # the kernel, over the gathered rows only
    assert k.shape[2] == 16, k.shape
    return gathered_kernel(qr, k, v, *a, **kw)

  monkeypatch.setattr(gathered, "_gpu", small_only)
  kn, vn = (normal(rng, (b, kvh, d), jnp.bfloat16) for _ in range(2))
  pos = jnp.asarray((7, 63), jnp.int32)
  got = cache_write.write_one_token(k, v, pos, kn, vn,
                                   route=Route(backend="gpu", cache_write_backend="gpu"))
  for g, r in zip(got, cache_write.reference(k, v, pos, kn, vn)):
    np.testing.assert_array_equal(np.asarray(g.values), np.asarray(r.values))
  q = normal(rng, (b, 1, 4, d), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(-3, t + 3, (b, kvh, 16)), jnp.int32)  # some outside [0, T)
  valid = jnp.asarray(rng.random((b, kvh, 16)) < 0.8)
  for layout_name, kk, vv in (("BHTD", k, v), ("BTHD", *(jax.tree.map(
      lambda x: jnp.swapaxes(x, 1, 2), x) for x in (k, v)))):
    # the kernel reads the rows XLA gathered (interpreted: the limit counts the whole caches)
    out = gathered_attention(q, kk, vv, idx, valid, kv_layout=layout_name,
                             route=Route(backend="gpu"))
    ref = gathered_attention(q, kk, vv, idx, valid, kv_layout=layout_name,
                             route=Route(backend="reference"))
    for g, r in zip(out, ref):
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                 rtol=2e-2, atol=2e-2)
  # keys rotated at their own positions as they are read (ReAttention's scope)
  rope = dict(key_rope_freqs=1.0 / 10000.0 ** (jnp.arange(d // 2) / (d // 2)),
              key_positions=jnp.asarray(rng.integers(0, 100, (b, 16)), jnp.int32))
  out = gathered_attention(q, k, v, idx, valid, kv_layout="BHTD", route=Route(backend="gpu"),
                           **rope)
  ref = gathered_attention(q, k, v, idx, valid, kv_layout="BHTD",
                           route=Route(backend="reference"), **rope)
  for g, r in zip(out, ref):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_flash_attention_past_the_triton_limit(monkeypatch):
  """flash_attention where no Mosaic kernel takes a cache of 2^31 elements or more: one query
  token by XLA, equal to the reference; a chunk refused in one line."""
  from pallas_kernels import flash_attention, gpu
  from pallas_kernels.attention import flash

  rng = np.random.default_rng(31)
  b, kvh, t, d = 2, 2, 64, 32
  k, v = (normal(rng, (b, kvh, t, d), jnp.bfloat16) for _ in range(2))
  monkeypatch.setattr(gpu, "MAX_TRITON_ELEMENTS", k.size - 1)
  monkeypatch.setattr(flash, "_gpu", lambda *a, **kw: pytest.fail("the Triton kernel ran"))
  q = normal(rng, (b, 1, 4, d), jnp.bfloat16)
  kw = dict(causal=True, q_offset=jnp.asarray([40, 63]), kv_layout="BHTD")
  got = flash_attention(q, k, v, route=Route(backend="gpu"), **kw)
  want = flash_attention(q, k, v, route=Route(backend="reference"), **kw)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  with pytest.raises(ValueError, match="int32 offsets"):
    flash_attention(normal(rng, (b, 8, 4, d), jnp.bfloat16), k, v, route=Route(backend="gpu"),
                    causal=True, kv_layout="BHTD")
