"""Run options of the decode step that benchmarks/decode_profile.py's variants set (issue 21,
point 3): each reaches the code it is meant to change, and changes no result."""

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jax_longctx.ops.cache import KVCache
from jax_longctx.methods import full
from jax_longctx.model import random_params
from jax_longctx.core.options import RunOptions
from pallas_kernels import KernelOptions, Route, Tiling
from tests.conftest import TINY_LLAMA3, chunked_then_decoded_logits, tiny_config


def test_full_passes_decode_tiling(monkeypatch):
  """Full.attend_cache hands the run's decode tiling to the kernel on one-token steps."""
  seen = []
  monkeypatch.setattr(full.pallas_kernels, "flash_attention",
                      lambda *a, tiling=None, **kw: seen.append(tiling) or (None, None))
  state = full.KVCache(jnp.ones((1, 2, 8, 4)), jnp.ones((1, 2, 8, 4)))
  ctx = type("Ctx", (), {"q_pos": jnp.asarray([[3]]),
                         "options": RunOptions(route=Route(decode_tiling=Tiling(key_splits=64),
                                                           decode_kernel=True))})()
  full.Full().attend_cache(state, jnp.ones((1, 1, 4, 4)), ctx)
  assert seen == [Tiling(key_splits=64)]


def test_one_token_write_kernel_equals_scatter():
  """KVCache.write of one token per sequence through the kernel (interpreted): the same caches
  as the scatter, per-sequence positions, an out-of-range one dropped."""
  rng = np.random.default_rng(0)
  k, v = (jnp.asarray(rng.standard_normal((3, 2, 16, 8)), jnp.float32) for _ in range(2))
  kn, vn = (jnp.asarray(rng.standard_normal((3, 1, 2, 8)), jnp.float32) for _ in range(2))
  pos = jnp.asarray([[4], [15], [16]], jnp.int32)
  ref = KVCache(k, v).write(pos, kn, vn, route=Route(cache_write_backend=None))
  got = jax.jit(lambda c: c.write(pos, kn, vn, route=Route(cache_write_backend="gpu")))(
      KVCache(k, v))
  np.testing.assert_array_equal(np.asarray(got.k), np.asarray(ref.k))
  np.testing.assert_array_equal(np.asarray(got.v), np.asarray(ref.v))
  assert not np.array_equal(np.asarray(got.k), np.asarray(k))


def test_all_decode_switches_keep_the_logits():
  """Every switch of decode_profile's variants at once, with the GPU kernels interpreted on CPU
  (flash decode with 3 splits, unpadded query rows and the merge kernel, the write kernel, the
  add + norm kernel): fp32 logits of a prefill and 5 decode steps as the plain model's,
  within 1e-4 of the largest (the kernel's fp32 softmax sums in another order)."""
  cfg = tiny_config(**TINY_LLAMA3, hidden_size=64)  # a power of two: add_rmsnorm's kernel runs
  params = random_params(cfg, seed=11)
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x * 1.3 if str(p[-1]).endswith("'scale']") else x, params)
  ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 13))
  ref = chunked_then_decoded_logits(cfg, params, ids, 8, 4, 32)[0]
  options = RunOptions(route=Route(  # prefill stays on the jnp path, as on CPU by default
      kernels=KernelOptions(decode_merge_kernel=True, decode_q_in_kernel=True),
      decode_tiling=Tiling(key_splits=3, block_keys=16), cache_write_backend="gpu",
      add_norm_backend="gpu", backend="gpu", prefill_kernel=False, decode_kernel=True))
  got = chunked_then_decoded_logits(cfg, params, ids, 8, 4, 32, options)[0]
  np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
