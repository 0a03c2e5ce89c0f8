"""flash_attention and gathered_attention: GPU and TPU variants (Pallas interpret mode on CPU)
against the jnp references; their partial results merge exactly (reference.merge_attention).

Tolerances: fp32 inputs 2e-5 on outputs and LSE (the kernels accumulate in fp32 in another order);
bf16 inputs 2e-2 on outputs (one bf16 rounding of the result) and 1e-4 on the fp32 LSE.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, flash_attention, gathered_attention
from pallas_kernels.reference import merge_attention
from pallas_kernels.gpu import Tiling
from tests.kernels.inputs import keys_shape, normal

VARIANTS = ["gpu", "tpu"]
TOL = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 1e-4)}


def assert_close(got, ref, dtype):
  """dtype: the inputs' (tolerances TOL[dtype]), or (out_tol, lse_tol)."""
  (o, lse), (ro, rlse) = got, ref
  out_tol, lse_tol = dtype if isinstance(dtype, tuple) else TOL[dtype]
  assert o.shape == ro.shape and o.dtype == ro.dtype and lse.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(ro, np.float32), atol=out_tol,
                             rtol=out_tol)
  np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(rlse)))
  finite = np.isfinite(np.asarray(rlse))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(rlse)[finite], atol=lse_tol,
                             rtol=lse_tol)


# (batch, q_len, q_heads, kv_heads, kv_len, d, causal, q_offset, kv_len per seq, layout, dtype, tiling)
FLASH = {
    "chunk_causal_offset_g3": (2, 20, 6, 2, 333, 64, True, (313, 50), (333, 77), "BTHD",
                               jnp.float32, Tiling(key_splits=2, block_keys=64)),
    "decode_g4_d128_splits": (2, 1, 8, 2, 1000, 128, False, 0, (1000, 1), "BHTD", jnp.float32,
                              Tiling(key_splits=4)),
    "prefill_g1_bf16": (1, 64, 2, 2, 64, 64, True, 0, None, "BTHD", jnp.bfloat16, None),
    "decode_g4_prefetch": (2, 1, 4, 1, 517, 128, True, (516, 200), (517, 201), "BTHD",
                           jnp.bfloat16, Tiling(key_splits=2, prefetch=True)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", list(FLASH))
def test_flash_attention_matches_reference(variant, case):
  b, lq, h, kvh, t, d, causal, off, kv_len, kv_layout, dtype, tiling = FLASH[case]
  rng = np.random.default_rng(abs(hash(case)) % 2**32)
  q = normal(rng, (b, lq, h, d), dtype)
  k, v = (normal(rng, keys_shape(b, t, kvh, d, kv_layout), dtype) for _ in range(2))
  kw = dict(causal=causal, q_offset=off if isinstance(off, int) else jnp.asarray(off),
            kv_len=None if kv_len is None else jnp.asarray(kv_len), kv_layout=kv_layout)
  got = flash_attention(q, k, v, route=Route(backend=variant), tiling=tiling, **kw)
  assert_close(got, flash_attention(q, k, v, route=Route(backend="reference"), **kw), dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout,lq,h,kvh,d,n", [("BTHD", 1, 8, 2, 128, 150),
                                                 ("BHTD", 3, 6, 2, 64, 100)])
def test_gathered_attention_matches_reference(variant, layout, lq, h, kvh, d, n):
  rng = np.random.default_rng(n)
  b, t = 2, 400
  q = normal(rng, (b, lq, h, d))
  k, v = (normal(rng, keys_shape(b, t, kvh, d, layout)) for _ in range(2))
  idx = jnp.asarray(rng.integers(-5, t + 5, (b, kvh, n)))  # some out of range: invalid
  valid = jnp.asarray(rng.random((b, kvh, n)) > 0.3).at[1, 0].set(False)  # one group sees nothing
  tiling = Tiling(key_splits=2, block_keys=64) if variant == "gpu" else None
  got = gathered_attention(q, k, v, idx, valid, kv_layout=layout, route=Route(backend=variant),
                           tiling=tiling)
  ref = gathered_attention(q, k, v, idx, valid, kv_layout=layout, route=Route(backend="reference"))
  assert_close(got, ref, jnp.float32)
  assert np.all(np.isneginf(np.asarray(got[1])[1, :, : h // kvh]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_gathered_attention_reads_entries_below_extent_only(variant):
  """extent per group: entries past it count as invalid (the GPU kernel visits no tile past it,
  so later tiles and whole key splits are skipped; 0: none): the reference's answer with those
  entries masked."""
  rng = np.random.default_rng(7)
  b, t, kvh, h, d, n = 2, 300, 2, 4, 64, 256
  q = normal(rng, (b, 1, h, d))
  k, v = (normal(rng, (b, kvh, t, d)) for _ in range(2))
  idx = jnp.asarray(rng.integers(0, t, (b, kvh, n)))
  valid = jnp.asarray(rng.random((b, kvh, n)) > 0.2)
  extent = jnp.asarray([[3, 70], [0, 200]])
  tiling = Tiling(key_splits=2, block_keys=64) if variant == "gpu" else None
  got = gathered_attention(q, k, v, idx, valid, kv_layout="BHTD", extent=extent,
                           route=Route(backend=variant),
                           tiling=tiling)
  below = valid & (jnp.arange(n) < extent[..., None])
  ref = gathered_attention(q, k, v, idx, below, kv_layout="BHTD", route=Route(backend="reference"))
  assert_close(got, ref, jnp.float32)
  assert np.all(np.isneginf(np.asarray(got[1])[1, :, :h // kvh]))


ROPE_FREQS = 1.0 / 10000.0 ** (np.arange(0, 128, 2) / 128)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gathered_attention_rotates_keys_at_their_entry(variant, dtype):
  rng = np.random.default_rng(9)
  b, t, h, kvh, d, n = 2, 300, 8, 2, 128, 150
  q = normal(rng, (b, 1, h, d), dtype)
  k, v = (normal(rng, (b, kvh, t, d), dtype) for _ in range(2))
  idx = jnp.asarray(rng.integers(0, t, (b, kvh, n)))
  valid = jnp.asarray(rng.random((b, kvh, n)) > 0.2)
  freqs = jnp.asarray(ROPE_FREQS, jnp.float32)
  tiling = Tiling(key_splits=2, block_keys=64) if variant == "gpu" else None
  got = gathered_attention(q, k, v, idx, valid, kv_layout="BHTD", key_rope_freqs=freqs,
                           route=Route(backend=variant), tiling=tiling)
  ref = gathered_attention(q, k, v, idx, valid, kv_layout="BHTD", key_rope_freqs=freqs,
                           route=Route(backend="reference"))
  assert_close(got, ref, dtype)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gathered_attention_rotates_keys_at_given_positions(variant):
  """key_positions (a mesh part of a scope: ascending, with gaps, per sequence) equal the keys
  gathered at those positions and rotated there, in the reference and the kernels alike."""
  rng = np.random.default_rng(11)
  b, t, h, kvh, d, n = 2, 300, 8, 2, 128, 150
  q = normal(rng, (b, 1, h, d), jnp.float32)
  k, v = (normal(rng, (b, kvh, t, d), jnp.float32) for _ in range(2))
  idx = jnp.asarray(rng.integers(0, t, (b, kvh, n)))
  valid = jnp.asarray(rng.random((b, kvh, n)) > 0.2)
  pos = jnp.asarray(np.stack([np.sort(rng.choice(4 * n, n, replace=False)) for _ in range(b)]),
                    jnp.int32)
  freqs = jnp.asarray(ROPE_FREQS, jnp.float32)
  tiling = Tiling(key_splits=2, block_keys=64) if variant == "gpu" else None
  got = gathered_attention(q, k, v, idx, valid, kv_layout="BHTD", key_rope_freqs=freqs,
                           key_positions=pos, route=Route(backend=variant), tiling=tiling)
  # Each sequence alone, its keys spread to their positions (entry j of a wider list at
  # pos[j]) and rotated at their entry: the same scores.
  for s in range(b):
    wide_idx = jnp.zeros((1, kvh, 4 * n), jnp.int32).at[:, :, pos[s]].set(idx[s][None])
    wide_ok = jnp.zeros((1, kvh, 4 * n), bool).at[:, :, pos[s]].set(valid[s][None])
    ref = gathered_attention(q[s:s + 1], k[s:s + 1], v[s:s + 1], wide_idx, wide_ok,
                             kv_layout="BHTD", key_rope_freqs=freqs,
                             route=Route(backend="reference"))
    assert_close((got[0][s:s + 1], got[1][s:s + 1]), ref, jnp.float32)
  with pytest.raises(ValueError, match="key_positions must be"):
    gathered_attention(q, k, v, idx, valid, kv_layout="BHTD", key_rope_freqs=freqs,
                       key_positions=pos[:, :5], route=Route(backend=variant))


def test_gathered_reference_rotates_entry_j_at_position_j():
  """The reference itself, against numpy: RoPE (rotate-half) of each gathered key at its entry."""
  rng = np.random.default_rng(10)
  q, k, v = normal(rng, (1, 1, 2, 128)), normal(rng, (1, 1, 40, 128)), normal(rng, (1, 1, 40, 128))
  idx = rng.permutation(40)[:25]
  out, _ = gathered_attention(q, k, v, jnp.asarray(idx)[None, None], kv_layout="BHTD",
                              key_rope_freqs=jnp.asarray(ROPE_FREQS, jnp.float32),
                              route=Route(backend="reference"))
  kg = np.asarray(k, np.float64)[0, 0, idx]
  ang = np.arange(25)[:, None] * ROPE_FREQS[None, :]
  k1, k2 = kg[:, :64], kg[:, 64:]
  kr = np.concatenate([k1 * np.cos(ang) - k2 * np.sin(ang), k2 * np.cos(ang) + k1 * np.sin(ang)],
                      axis=1)
  s = np.asarray(q, np.float64)[0, 0] @ kr.T / np.sqrt(128)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = (p / p.sum(-1, keepdims=True)) @ np.asarray(v, np.float64)[0, 0, idx]
  np.testing.assert_allclose(np.asarray(out)[0, 0], want, atol=2e-5, rtol=2e-5)


def test_gathered_reference_equals_dense_attention_on_the_same_keys():
  """The reference itself: gathering keys 0..T-1 in order is plain attention over all keys."""
  rng = np.random.default_rng(0)
  q, k, v = normal(rng, (1, 1, 4, 64)), normal(rng, (1, 50, 2, 64)), normal(rng, (1, 50, 2, 64))
  idx = jnp.broadcast_to(jnp.arange(50), (1, 2, 50))
  assert_close(gathered_attention(q, k, v, idx, route=Route(backend="reference")),
               flash_attention(q, k, v, causal=False,
                               route=Route(backend="reference")), jnp.float32)


def test_merged_halves_equal_whole_attention():
  """Attention over two disjoint key halves, merged through the LSE, is attention over all."""
  rng = np.random.default_rng(4)
  q, k, v = normal(rng, (2, 3, 4, 64)), normal(rng, (2, 90, 2, 64)), normal(rng, (2, 90, 2, 64))
  parts = [flash_attention(q, k[:, s], v[:, s], causal=False, route=Route(backend="tpu"))
           for s in (slice(0, 40), slice(40, 90))]
  merged = merge_attention(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]))
  assert_close(merged, flash_attention(q, k, v, causal=False, route=Route(backend="reference")),
               jnp.float32)


def test_attention_kernel_errors():
  q, k = jnp.ones((1, 2, 8, 64)), jnp.ones((1, 10, 2, 64))
  with pytest.raises(ValueError, match="same shape"):
    flash_attention(q, k, jnp.ones((1, 11, 2, 64)), route=Route())
  with pytest.raises(ValueError, match="indices must be"):
    gathered_attention(q, k, k, jnp.zeros((1, 3, 4), jnp.int32), route=Route())
  with pytest.raises(ValueError, match="plus a head dim"):
    merge_attention(jnp.ones((2, 3, 64)), jnp.ones((2, 4)))


def test_triton_tiles_fit_in_shared_memory():
  """fp32 at d=128 asked the H200 for 384 KiB of shared memory (flash attention's 128-key tiles, 3
  stages; seen in RESA's fp32 error study on Qwen2.5-Coder-1.5B); the key tile now shrinks until
  it fits, and the bf16 tilings measured fastest stay as they were."""
  from pallas_kernels import gpu
  fit = gpu.fitting_block_keys
  assert fit(128, block_rows=128, d=128, itemsize=2, num_stages=3) == 128  # flash prefill bf16
  assert fit(256, block_rows=16, d=128, itemsize=2, num_stages=3, tensors=1) == 256  # top-k decode
  for rows, stages, tensors in ((128, 3, 2), (128, 2, 2), (16, 3, 1)):
    bk = fit(256, block_rows=rows, d=128, itemsize=4, num_stages=stages, tensors=tensors)
    assert (stages * tensors * bk + rows) * 128 * 4 <= gpu.SMEM_BYTES
    assert bk >= 16
