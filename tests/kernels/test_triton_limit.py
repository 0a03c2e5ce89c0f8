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


@pytest.mark.parametrize("stored", ["int8", "bfloat16", "float8_e4m3fn"])
def test_rescoring_reads_the_keys_as_words_past_the_limit(stored, monkeypatch):
  """topk_segments' stage 2 over keys of 2^31 elements or more: with KernelOptions'
  topk_rescore_words, the Triton kernel over the keys as int32 words (int8, bf16: 4 / 2 times
  fewer elements), which equals the kernel over the keys as stored (interpreted; integer keys:
  every score exact) and lowers for CUDA; without it, or for E4M3, XLA's gathers."""
  from pallas_kernels import gpu, layout
  from pallas_kernels.topk import topk_segments as ts

  rng = np.random.default_rng(37)
  b, kvh, r, t, d = 2, 2, 8, 96, 64
  ints = jnp.asarray(rng.integers(-5, 6, (b, t, kvh, d)), jnp.float32)
  k = (ints.astype(jnp.bfloat16) if stored == "bfloat16" else  # 8-bit, scale 1: exact
       quant.Quantized(ints.astype(stored), jnp.ones((b, t, kvh, 1), jnp.float32)))
  qr = jnp.asarray(rng.integers(-3, 4, (b, kvh, r, d)), jnp.bfloat16)
  keys = jnp.asarray(np.argsort(rng.random((b, kvh, r, t)), -1)[..., :16], jnp.int32)
  keys = keys.at[..., 5].set(-1)  # no candidate (best_keys alone, below)
  kw = dict(scale=0.5, kv_layout="BTHD", interpret=True)
  monkeypatch.setattr(gpu, "MAX_TRITON_ELEMENTS", layout.parts(k)[0].size - 1)
  routes = []
  for name in ("best_keys", "best_keys_xla"):
    monkeypatch.setattr(ts, name, spy(getattr(ts, name), routes, name))
  # stage 1's output: 4 contiguous segments of 16 keys a row, some past the candidates' end
  firsts = jnp.asarray(np.argsort(rng.random((b, kvh, 1, r, t // 16)), -1)[..., :4] * 16,
                       jnp.int32)
  got = [ts.keys_of_segments(qr, k, jnp.asarray([[0, t - 8]] * b), -firsts.astype(jnp.float32),
                             firsts, 4, words=words, **kw) for words in (True, False)]
  for g, w in zip(*got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  packable = stored != "float8_e4m3fn"
  assert routes == [("best_keys", packable)] * packable + [("best_keys_xla", None)] * (
      2 - packable)
  if packable:
    plain = ts.best_keys(qr, k, keys, 4, **kw)
    words = ts.best_keys(qr, k, keys, 4, packed=True, **kw)
    for p, w in zip(plain, words):
      np.testing.assert_array_equal(np.asarray(p), np.asarray(w))
    lowered = jax.jit(lambda q, k, c: ts.best_keys(
        q, k, c, 4, scale=0.5, kv_layout="BTHD", interpret=False, packed=True)).trace(
            qr, k, keys).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in lowered.lower()


def spy(fn, calls, name):
  def wrapped(*a, **kw):
    calls.append((name, kw.get("packed") if name == "best_keys" else None))
    return fn(*a, **kw)
  return wrapped
