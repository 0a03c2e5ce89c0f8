"""How the kernels read a 4-bit cache (pallas_kernels/read.py): a read of some key rows takes
each row with its own group's scale and zero point, or whole from the residual group; every
public kernel given 4-bit K/V returns what it returns over their dequantized copies (flash,
chunk, top-k: the copy itself, or for top-k past `topk_dequantize_bytes` segments of whole key
groups copied one at a time; gathered attention: the gathered rows alone, with out-of-range
indices, a validity mask, extents and keys rotated at given positions). Random keys with an
outlier channel, sequences of different lengths (one with an open residual group), the
reference variant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, quant4
import pallas_kernels

B, KV, H, T, D = 2, 2, 6, 96, 64
ROUTE = Route(backend="reference")


@pytest.fixture(scope="module")
def cache():
  """(keys GroupedKeys, values Int4, their dequantized copies [B, KV, T, D] fp32): 96 and 75
  tokens written (the second sequence's group 2 open: its residual)."""
  rng = np.random.default_rng(5)
  k = rng.normal(size=(B, T, KV, D))
  k[..., 3] += 25  # an outlier channel
  pos = np.stack([np.arange(T), np.r_[:75, [T] * (T - 75)]])
  keys = quant4.write_grouped_keys(quant4.zeros_grouped_keys((B, KV, T, D), jnp.float32),
                                   jnp.asarray(pos, jnp.int32), jnp.asarray(k, jnp.float32))
  values = quant4.quantize(jnp.asarray(rng.normal(size=(B, KV, T, D)) * 2, jnp.float32))
  np.testing.assert_array_equal(np.asarray(keys.residual_group), [3, 2])
  return keys, values, quant4.load_grouped_keys(keys), quant4.dequantize(values)


def test_rows_of_grouped_keys_read_each_row_with_its_groups_range_or_whole(cache):
  keys, _, whole, _ = cache
  rng = np.random.default_rng(1)
  at = jnp.asarray(rng.integers(0, T, (B, KV, 40)), jnp.int32)  # rows of closed and open groups
  take = lambda a: jnp.take_along_axis(a, at[..., None], axis=2)  # noqa: E731
  got = quant4.rows_of_grouped_keys(take, keys)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(take(whole)))
  # a gather across heads and sequences moves each row's group with it
  swap = lambda a: a[::-1, ::-1, 10:50]  # noqa: E731
  np.testing.assert_array_equal(np.asarray(quant4.rows_of_grouped_keys(swap, keys)),
                                np.asarray(swap(whole)))


def _q(rows, seed=2):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(B, rows, H, D)), jnp.float32)


def test_flash_chunk_and_topk_read_the_dequantized_copy(cache):
  keys, values, kd, vd = cache
  q = _q(4)
  lens = jnp.asarray([96, 75])
  for fn in (
      lambda k, v: pallas_kernels.flash_attention(q, k, v, q_offset=lens - 4, kv_len=lens,
                                                  kv_layout="BHTD", route=ROUTE),
      lambda k, v: pallas_kernels.chunk_attention(q, k, v, kd[:, :, :4].swapaxes(1, 2),
                                                  vd[:, :, :4].swapaxes(1, 2), lens - 4,
                                                  kv_layout="BHTD", route=ROUTE),
      lambda k, v: pallas_kernels.topk_scores(q, k, 5, valid_len=lens, kv_layout="BHTD",
                                              route=ROUTE)):
    for got, want in zip(fn(keys, values), fn(kd, vd)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gathered_attention_reads_the_gathered_rows_alone(cache):
  keys, values, kd, vd = cache
  q = _q(1, seed=3)
  rng = np.random.default_rng(4)
  idx = rng.integers(-3, T + 3, (B, KV, 24))  # some out of range: invalid
  valid = jnp.asarray(rng.random((B, KV, 24)) < 0.8)
  freqs = 1.0 / (10000.0 ** (jnp.arange(0, D, 2) / D))
  kw = dict(kv_layout="BHTD", key_rope_freqs=freqs, route=ROUTE,
            key_positions=jnp.asarray(rng.integers(0, 200, (B, 24)), jnp.int32),
            extent=jnp.asarray([[24, 20], [17, 0]]))
  got = pallas_kernels.gathered_attention(q, keys, values, jnp.asarray(idx), valid, **kw)
  want = pallas_kernels.gathered_attention(q, kd, vd, jnp.asarray(idx), valid, **kw)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
  assert np.isneginf(np.asarray(got[1])[1, :, 3:]).all()  # the extent 0 group: nothing read
  with pytest.raises(ValueError, match="BHTD"):
    pallas_kernels.gathered_attention(q, keys, values, jnp.asarray(idx), valid,
                                      kv_layout="BTHD", route=ROUTE)


def test_topk_past_its_copy_cap_scores_segments_of_whole_key_groups(cache, monkeypatch):
  """Over the cap, each segment (whole groups; the second sequence's residual in one of them)
  is copied alone in a scan and the candidates merged: the same scores and indices as the
  whole copy, for many query rows and for decode's one, with excluded ends."""
  from pallas_kernels import KernelOptions, read
  keys, _, kd, _ = cache
  monkeypatch.setattr(read, "COPY_SEGMENT_ALIGN", 32)
  monkeypatch.setattr(read, "COPY_SEGMENT_MIN", 32)
  per_key = B * KV * D * 4  # fp32 queries
  assert read.four_bit_topk_segment(_q(1), keys, KernelOptions(), T) == T  # fits: one copy
  # int4_topk_scores off: decode's rows would take the kernel over the codes (no copy), and
  # the residual keys' f32[B, KV, 32, D] and its fori_loop's scan would pass the check below
  capped = KernelOptions(topk_dequantize_bytes=40 * per_key, int4_topk_scores=False)
  assert read.four_bit_topk_segment(_q(1), keys, capped, T) == 32  # 3 segments of one group
  assert read.four_bit_topk_segment(_q(1), kd, capped, T) == 0  # not 4-bit keys
  kw = dict(valid_len=jnp.asarray([96, 75]), exclude_prefix=jnp.asarray([0, 3]),
            exclude_suffix=jnp.asarray([5, 0]), kv_layout="BHTD")
  for backend in ("gpu", "tpu"):  # interpreted
    route = Route(backend=backend, kernels=capped)
    for rows in (12, 1):
      q = _q(rows, seed=rows)
      text = str(jax.make_jaxpr(lambda q: pallas_kernels.topk_scores(q, keys, 5, route=route,
                                                                     **kw))(q))
      assert f"f32[{B},{KV},32,{D}]" in text and "scan" in text
      got = pallas_kernels.topk_scores(q, keys, 5, route=route, **kw)
      want = pallas_kernels.topk_scores(q, kd, 5, route=ROUTE, **kw)
      np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]), err_msg=backend)
      np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5,
                                 atol=1e-4)  # fp32 sums in another order

