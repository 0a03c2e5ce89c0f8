"""split_merge (split-K decode's merge in one kernel) and flash_attention's and
gathered_attention's decode through it (KernelOptions.decode_merge_kernel) and/or with the query
rows read unpadded (KernelOptions.decode_q_in_kernel): interpret
mode against the jnp references, and lowered to Triton for CUDA.

Tolerances: fp32 2e-5 (another summation order), bf16 outputs 2e-2 (one rounding), LSE 1e-4.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Tiling, flash_attention, gathered_attention, reference
from pallas_kernels import Route
from pallas_kernels.decode import split_merge
from pallas_kernels.attention import flash as fa_module
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal
from tests.kernels.test_attention_kernels import assert_close


def _partials(rng, b, kvh, splits, parts, rp, d):
  """Random per-split (out, lse) with NaN in the unwritten entries p >= splits, a few splits
  empty (-inf) and row 1 of sequence 0 empty in every split."""
  outs = np.full((b, kvh, parts, rp, d), np.nan, np.float32)
  lses = np.full((b, kvh, parts, rp, 1), np.nan, np.float32)
  outs[:, :, :splits] = rng.standard_normal((b, kvh, splits, rp, d))
  lses[:, :, :splits] = rng.standard_normal((b, kvh, splits, rp, 1)) * 3
  lses[:, :, :splits][rng.random((b, kvh, splits, rp, 1)) < 0.2] = -np.inf
  lses[0, :, :splits, 1] = -np.inf
  return outs, lses


@pytest.mark.parametrize("splits,parts,dtype", [(5, 8, jnp.float32), (8, 8, jnp.bfloat16),
                                                (33, 64, jnp.bfloat16), (1, 1, jnp.float32)])
def test_merge_splits_matches_reference(splits, parts, dtype):
  b, kvh, rp, rows, d = 2, 3, 16, 4, 64
  outs, lses = _partials(np.random.default_rng(splits), b, kvh, splits, parts, rp, d)
  out, lse = split_merge.merge_splits(jnp.asarray(outs), jnp.asarray(lses), splits=splits,
                                      rows=rows, dtype=dtype, interpret=True)
  assert out.shape == (b, kvh, rows, d) and out.dtype == dtype and lse.shape == (b, kvh, rows, 1)
  ro, rlse = reference.merge_attention(
      jnp.moveaxis(jnp.asarray(outs[:, :, :splits, :rows]), 2, 0),
      jnp.moveaxis(jnp.asarray(lses[:, :, :splits, :rows, 0]), 2, 0))
  assert_close((out, lse[..., 0]), (ro.astype(dtype), rlse), dtype)
  assert np.isneginf(np.asarray(lse[0, :, 1])).all() and not np.asarray(out[0, :, 1]).any()


# (batch, q heads, kv heads, keys, d, positions, dtype, tiling)
DECODE = {
    "g4_bf16_default_plan": (2, 8, 2, 1100, 128, (1037, 300), jnp.bfloat16, None),
    "g4_bf16_splits5": (2, 8, 2, 1100, 128, (1099, 64), jnp.bfloat16, Tiling(key_splits=5)),
    "g3_fp32_splits3_bk64": (1, 6, 2, 700, 64, (650,), jnp.float32,
                             Tiling(key_splits=3, block_keys=64)),
    "g1_fp32": (2, 2, 2, 300, 64, (0, 299), jnp.float32, Tiling(key_splits=4)),
}


@pytest.mark.parametrize("switches", [("decode_merge_kernel",), ("decode_q_in_kernel",),
                                      ("decode_merge_kernel", "decode_q_in_kernel")])
@pytest.mark.parametrize("case", list(DECODE))
def test_decode_switches_match_reference(case, switches):
  b, h, kvh, t, d, pos, dtype, tiling = DECODE[case]
  options = KernelOptions(**{name: True for name in switches})
  rng = np.random.default_rng(len(case))
  q = normal(rng, (b, 1, h, d), dtype)
  k, v = (normal(rng, (b, kvh, t, d), dtype) for _ in range(2))
  pos = jnp.asarray(pos)
  kw = dict(causal=True, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD")
  got = flash_attention(q, k, v, route=Route(backend="gpu", kernels=options), tiling=tiling, **kw)
  assert_close(got, flash_attention(q, k, v, route=Route(backend="reference"), **kw), dtype)


@pytest.mark.parametrize("switches", [("decode_merge_kernel",), ("decode_q_in_kernel",),
                                      ("decode_merge_kernel", "decode_q_in_kernel")])
@pytest.mark.parametrize("rope,dtype", [(False, jnp.float32), (True, jnp.bfloat16)])
def test_gathered_decode_switches_match_reference(switches, rope, dtype):
  """Gathered decode (ReAttention's: keys rotated in the kernel) through the same switches, with
  invalid entries, 3 key splits (merged in a power-of-two buffer of 4) and 4 rows of 16."""
  options = KernelOptions(**{name: True for name in switches})
  rng = np.random.default_rng(7)
  b, t, h, kvh, d, n = 2, 300, 8, 2, 128, 150
  q = normal(rng, (b, 1, h, d), dtype)
  k, v = (normal(rng, (b, kvh, t, d), dtype) for _ in range(2))
  idx = jnp.asarray(rng.integers(0, t, (b, kvh, n)))
  valid = jnp.asarray(rng.random((b, kvh, n)) > 0.2)
  kw = dict(kv_layout="BHTD", key_rope_freqs=(
      jnp.asarray(1.0 / 10000.0 ** (np.arange(0, d, 2) / d), jnp.float32) if rope else None))
  got = gathered_attention(q, k, v, idx, valid, route=Route(backend="gpu", kernels=options),
                           tiling=Tiling(key_splits=3, block_keys=32), **kw)
  assert_close(got, gathered_attention(q, k, v, idx, valid, route=Route(backend="reference"),
                                       **kw), dtype)


def test_decode_switches_see_rows_with_no_key():
  """kv_len 0 (an empty sequence in a batch): (0, -inf) as the reference."""
  options = KernelOptions(decode_merge_kernel=True, decode_q_in_kernel=True)
  rng = np.random.default_rng(0)
  q, k, v = (normal(rng, s, jnp.float32) for s in ((2, 1, 4, 64), (2, 2, 256, 64), (2, 2, 256, 64)))
  kw = dict(causal=False, kv_len=jnp.asarray([0, 200]), kv_layout="BHTD")
  got = flash_attention(q, k, v, route=Route(backend="gpu", kernels=options),
                        tiling=Tiling(key_splits=2),
                        **kw)
  assert_close(got, flash_attention(q, k, v, route=Route(backend="reference"), **kw), jnp.float32)
  assert np.isneginf(np.asarray(got[1][0])).all()


@pytest.mark.parametrize("splits,parts", [(33, 64), (1, 1)])
def test_merge_kernel_lowers_to_triton(splits, parts):
  outs = jnp.ones((1, 8, parts, 16, 128), jnp.float32)
  lses = jnp.ones((1, 8, parts, 16, 1), jnp.float32)

  def call(o, s):
    return split_merge._merge(o, s, splits=splits, rows=4, dtype=jnp.dtype(jnp.bfloat16),
                              interpret=False)
  assert "triton" in cuda_text(call, outs, lses)


def test_unpadded_q_reaches_the_kernel(monkeypatch):
  """With decode_q_in_kernel (the default) the kernel gets the group's 4 real rows, not a 16-row
  padded tile."""
  seen = []
  gpu_kernel = fa_module._gpu
  monkeypatch.setattr(fa_module, "_gpu", lambda qr, *a, **kw: seen.append(qr.shape) or
                      gpu_kernel(qr, *a, **kw))
  rng = np.random.default_rng(1)
  q, k = normal(rng, (1, 1, 8, 64), jnp.float32), normal(rng, (1, 2, 100, 64), jnp.float32)
  padded = Route(backend="gpu", kernels=KernelOptions(decode_q_in_kernel=False))
  flash_attention(q, k, k, kv_layout="BHTD", route=padded)
  flash_attention(q, k, k, kv_layout="BHTD", route=Route(backend="gpu"))
  assert seen == [(1, 2, 16, 64), (1, 2, 4, 64)]


def test_unpadded_q_kernel_lowers_to_triton():
  qr, k = jnp.ones((1, 8, 4, 128), jnp.bfloat16), jnp.ones((1, 8, 2048, 128), jnp.bfloat16)
  tl = Tiling(block_rows=16, block_keys=128, num_warps=4, num_stages=2, prefetch=False)

  def call(qr, k, meta):
    return fa_module._gpu(qr, k, k, meta, group=4, span=512, splits=4, parts=4, causal=True,
                          scale=0.088, kv_layout="BHTD", tiling=tl, interpret=False)
  assert "triton" in cuda_text(call, qr, k, jnp.zeros((1, 2), jnp.int32))
