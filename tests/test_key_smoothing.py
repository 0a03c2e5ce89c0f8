"""Key smoothing for the 8-bit cache (run/key_smoothing.py): powers of two per (layer, KV head,
RoPE pair) that divide the keys and multiply the queries.

- It changes no score: every registered method with the cache in the model's dtype (fp32 here)
  gives the same logits and NLL with random smoothing as without (a method that used a query or a
  key other than through q.k, such as RefreshKV's query similarity before it divided the smoothing
  out, differs by far more than the tolerance: the factors reach 2^+-3).
- It does what it is for: with keys that carry one large biased channel pair (Qwen2.5's shape
  of outlier), int8's q.k error falls several fold (on Qwen2.5-Coder-1.5B: docs/CLAIMS.md).
- Calibration: powers of two shared by a pair's two channels, finite for a dead channel; the
  default model calibrated on prose through `load`'s own path; export refuses smoothed weights.
The mesh (KV heads copied over `model`): tests/tensor_parallel_checks.py `smoothed`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.checkpoints.sources import CheckpointError
from jax_longctx.core.options import RunOptions
from jax_longctx.methods import get, names
from jax_longctx.run.driver import uncached_logits
from jax_longctx.run.key_smoothing import smooth_keys, smoothing_from_rms
from pallas_kernels import quant
from tests.test_kv_quant import _mesh_method, _run
from tests.test_methods import _method


def _with_smoothing(params, cfg, seed=0):
  """params with random powers of two in 2^-3..2^3 (pair-shared) as every layer's smoothing."""
  rng = np.random.default_rng(seed)
  layers = {}
  for i, layer in params["layers"].items():
    e = rng.integers(-3, 4, (cfg.num_kv_heads, cfg.head_dim // 2))
    s = np.exp2(np.concatenate([e, e], -1)).astype(np.float32)
    layers[i] = {**layer, "attn": {**layer["attn"], "k_smooth": jnp.asarray(s, cfg.jnp_dtype)}}
  return {**params, "layers": layers}, cfg.replace(key_smoothing=True)


def test_smoothing_is_pair_shared_powers_of_two():
  rms = np.array([[0.0, 0.3, 1.0, 323.0]])
  s = smoothing_from_rms(rms)
  assert s.shape == (1, 8) and np.all(np.isfinite(s)) and np.all(s > 0)
  np.testing.assert_array_equal(s[:, :4], s[:, 4:])
  np.testing.assert_array_equal(np.log2(s), np.round(np.log2(s)))
  np.testing.assert_array_equal(s[0, 1:4], [0.5, 1.0, 16.0])  # 2^round(0.5 log2 rms)
  np.testing.assert_array_equal(smoothing_from_rms(rms, strength=0.0), np.ones((1, 8)))


@pytest.mark.parametrize("name", names())
def test_smoothing_changes_no_score_under_any_method(tiny, name):
  cfg, params = tiny
  method = _method(name, 24) if name in names("layer") else _mesh_method(name)
  smoothed, cfg_s = _with_smoothing(params, cfg)
  want_last, want_nll, _ = _run(params, cfg, method, None)
  last, nll, _ = _run(smoothed, cfg_s, method, None)
  np.testing.assert_allclose(last, want_last, atol=1e-5, rtol=0, err_msg=name)
  np.testing.assert_allclose(nll, want_nll, atol=0, rtol=1e-5, err_msg=name)


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
  ids = np.asarray([lm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
  np.testing.assert_array_equal(uncached_logits(params, cfg, ids),
                                uncached_logits(lm.params, lm.config, ids))
  with pytest.raises(CheckpointError, match="smoothed"):
    export_hf(params, cfg, str(tmp_path / "hf"))
  with pytest.raises(Exception, match="smoothed already"):
    smooth_keys(params, cfg, ids[0])
