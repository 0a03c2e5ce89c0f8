"""Key smoothing for the 8-bit cache (run/key_smoothing.py): powers of two per (layer, KV head,
RoPE pair) that divide the keys and multiply the queries.

- It changes no score: every registered method with the cache in the model's dtype gives the
  same logits and NLL with random smoothing as without (tests/test_kv_quant.py, beside the same
  run in 8 bits, whose compiled programs it shares).
- It does what it is for: with keys that carry one large biased channel pair (Qwen2.5's shape
  of outlier), int8's q.k error falls several fold (on Qwen2.5-Coder-1.5B: docs/CLAIMS.md).
- RefreshKV's query similarity is the unsmoothed model's.
- Calibration: powers of two shared by a pair's two channels, finite for a dead channel; the
  default model calibrated on prose through `load`'s own path; export refuses smoothed weights.
The mesh (KV heads copied over `model`): tests/helpers/tensor_parallel_checks.py `smoothed`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.checkpoints.sources import CheckpointError
from jax_longctx.core.options import RunOptions
from jax_longctx.core.rope import inv_freq
from jax_longctx.methods import get
from jax_longctx.methods.base import AttnContext
from jax_longctx.run.driver import uncached_logits
from jax_longctx.run.key_smoothing import smooth_keys, smoothing_from_rms, with_smoothing
from pallas_kernels import quant


def test_smoothing_is_pair_shared_powers_of_two():
  rms = np.array([[0.0, 0.3, 1.0, 323.0]])
  s = smoothing_from_rms(rms)
  assert s.shape == (1, 8) and np.all(np.isfinite(s)) and np.all(s > 0)
  np.testing.assert_array_equal(s[:, :4], s[:, 4:])
  np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
  np.testing.assert_array_equal(s[0, 1:4], [0.5, 1.0, 16.0])  # 2^round(0.5 log2 rms)
  np.testing.assert_array_equal(smoothing_from_rms(rms, strength=0.0), np.ones((1, 8)))


def test_smoothing_cuts_int8_score_error_on_outlier_key_channels():
  rng = np.random.default_rng(0)
  k = rng.normal(size=(512, 2, 16)).astype(np.float32)  # [T, KV, hd]
  k[:, :, [3, 11]] += np.float32(60.0)  # one large biased RoPE pair per head, as Qwen2.5's
  q = rng.normal(size=(64, 2, 16)).astype(np.float32)
  rms = np.sqrt(np.mean(k[..., :8] ** 2 + k[..., 8:] ** 2, axis=0) / 2)  # [KV, hd / 2]
  s = smoothing_from_rms(rms)
  exact = np.einsum("qhd,khd->hqk", q, k)

  def score_error(q, k):
    deq = np.asarray(quant.quantize(jnp.asarray(k), "int8").dequantize())
    return np.sqrt(np.mean((np.einsum("qhd,khd->hqk", q, deq) - exact) ** 2))

  plain, smoothed = score_error(q, k), score_error(q * s, k / s)
  assert smoothed < plain / 3, (smoothed, plain)  # measured 0.149 against 0.536


def test_default_model_calibrates_on_prose_and_export_refuses_it(default_lm, tmp_path):
  from jax_longctx.app.api import smooth_keys_on_text
  from jax_longctx.checkpoints import export_hf

  lm = default_lm
  params, cfg = smooth_keys_on_text(lm.params, lm.config, lm.tokenizer, RunOptions(),
                                    n_tokens=256)
  s = np.asarray(params["layers"][0]["attn"]["k_smooth"])
  assert cfg.key_smoothing and s.shape == (cfg.num_kv_heads, cfg.head_dim)
  assert len(np.unique(s)) > 1  # calibrated, not ones
  assert cfg.kv_offsets and np.any(np.asarray(params["layers"][0]["attn"]["k_offset"]) != 0)
  ids = np.asarray([lm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
  want = uncached_logits(lm.params, lm.config, ids)
  # The smoothing alone changes no score bit for bit; the offsets up to fp32's rounding.
  factors = np.stack([np.asarray(layer["attn"]["k_smooth"]) for layer in params["layers"].values()])
  smoothed_only = with_smoothing(lm.params, lm.config, factors)
  np.testing.assert_array_equal(uncached_logits(*smoothed_only, ids), want)
  np.testing.assert_allclose(uncached_logits(params, cfg, ids), want, rtol=0, atol=2e-4)
  with pytest.raises(CheckpointError, match="smoothed"):
    export_hf(params, cfg, str(tmp_path / "hf"))
  with pytest.raises(Exception, match="smoothed already"):
    smooth_keys(params, cfg, ids[0])


@pytest.mark.parametrize("after_rope", [False, True])
def test_refreshkv_compares_the_models_own_queries(tiny, after_rope):
  """RefreshKV's similarity reads queries other than through q.k: it divides the smoothing out
  (AttnContext.query_smoothing), so its refresh decisions are the unsmoothed model's."""
  cfg, _ = tiny
  h, hd = cfg.num_heads, cfg.head_dim
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(2, 1, h, hd)), jnp.float32)
  e = rng.integers(-3, 4, (h, hd // 2))
  s = jnp.asarray(np.exp2(np.concatenate([e, e], -1)), jnp.float32)
  ctx = AttnContext(0, jnp.asarray([[30], [41]], jnp.int32), jnp.ones((2, 1), bool), inv_freq(cfg),
                    cfg)
  m = get("refreshkv", budget=24, threshold=0.9, similarity_after_rope=after_rope)
  want = m._mean_query(q, ctx)
  got = m._mean_query(q * s, ctx.replace(query_smoothing=s))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert not np.allclose(m._mean_query(q * s, ctx), want, atol=1e-3)  # what it would compare


def test_pre_rope_key_mean_is_the_mean_of_a_cache_of_pre_rope_keys(tiny):
  """cache_stats' `pre_rope_key_mean` (full attention's cached keys rotated back to position 0)
  against ReAttention's cache of the same prompt, which stores each key before RoPE at slot =
  position (its local window holding the whole prompt, so that it attends as full attention in
  every layer); and `key_mean`, the post-RoPE mean, against full attention's cache itself."""
  from jax_longctx.run import generation as gen
  from jax_longctx.run.key_smoothing import cache_stats
  from tests.test_methods import _prompts
  cfg, params = tiny
  ids = _prompts(cfg, (40,), seed=6)[0]
  stats = cache_stats(params, cfg, ids)
  whole = get("reattention", n_global=4, n_local=48, span=4, clip=1, top_k=1, chunk=8)
  for method, key in ((whole, "pre_rope_key_mean"), (get("full"), "key_mean")):
    cache, _ = gen.prefill(params, cfg, [ids], method, cache_len=64,
                           options=RunOptions(prefill_chunk=8))
    want = np.stack([np.asarray(layer.k)[0, :, :40].mean(axis=1) for layer in cache.state])
    np.testing.assert_allclose(stats[key], want, rtol=1e-4, atol=1e-6, err_msg=key)
  assert not np.allclose(stats["pre_rope_key_mean"], stats["key_mean"], atol=1e-3)
