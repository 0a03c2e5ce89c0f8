"""gemv (split-K matrix-vector product): the GPU variant in interpret mode against the reference,
lowered to Triton for CUDA, the model switch model.GEMV_BACKEND, and benchmarks/gemv.py --smoke.

Tolerances: bf16 outputs within one bf16 ulp of the largest |y| (8e-3 relative: the fp32 sums
run in another order, then one rounding to bf16); fp32 outputs 1e-5 of the largest |y|.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx import model
from jax_longctx.model import fuse_projections, random_params
from pallas_kernels import gemv
from tests.conftest import TINY_LLAMA3, chunked_then_decoded_logits, tiny_config
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = gemv.GemvConfig(block_f=64, splits=2, block_k=32, num_warps=4, num_stages=2)


def _close(got, ref, tol):
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  assert got.shape == ref.shape and np.abs(ref).max() > 0
  np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("f", [64, 192])
def test_gemv_matches_reference(n, f, dot):
  rng = np.random.default_rng(n * 1000 + f)
  x, w = normal(rng, (n, 256), jnp.bfloat16), normal(rng, (256, f), jnp.bfloat16)
  cfg = dataclasses.replace(SMALL, dot=dot)
  assert gemv.tiles(256, f, cfg)
  got = gemv.gemv(x, w, backend="gpu", config=cfg)
  assert got.dtype == jnp.bfloat16
  _close(got, gemv.reference(x, w), 8e-3)


def test_gemv_fp32():
  rng = np.random.default_rng(5)
  x, w = normal(rng, (2, 128)), normal(rng, (128, 128))
  _close(gemv.gemv(x, w, backend="gpu", config=SMALL), gemv.reference(x, w), 1e-5)


@pytest.mark.parametrize("cfg", gemv.SWEEP, ids=str)
def test_each_sweep_config(cfg):
  """Every timed config on the smallest shape it tiles (K: one chunk per split; F: two tiles)."""
  k, f = cfg.splits * cfg.block_k, 2 * cfg.block_f
  rng = np.random.default_rng(7)
  x, w = normal(rng, (1, k), jnp.bfloat16), normal(rng, (k, f), jnp.bfloat16)
  _close(gemv.gemv(x, w, backend="gpu", config=cfg), gemv.reference(x, w), 8e-3)


def test_fallback_and_errors(monkeypatch):
  """K not a multiple of splits * block_k, F not of block_f, > 16 rows, the reference backend:
  the reference answers (the kernel is never called); bad shapes and dtypes raise."""
  monkeypatch.setattr(gemv, "_call", lambda *a, **kw: pytest.fail("kernel called"))
  rng = np.random.default_rng(3)
  for (n, k, f) in [(1, 96, 128), (1, 128, 96), (17, 128, 128)]:
    x, w = normal(rng, (n, k), jnp.bfloat16), normal(rng, (k, f), jnp.bfloat16)
    _close(gemv.gemv(x, w, backend="gpu", config=SMALL), gemv.reference(x, w), 0)
  x, w = normal(rng, (1, 128)), normal(rng, (128, 128))
  _close(gemv.gemv(x, w, backend="reference", config=SMALL), gemv.reference(x, w), 0)
  with pytest.raises(ValueError, match="must be"):
    gemv.gemv(x, normal(rng, (64, 128)))
  with pytest.raises(ValueError, match="must be"):
    gemv.gemv(x, w.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="must be"):
    gemv.gemv(x[0], w)


@pytest.mark.parametrize("cfg", [gemv.DEFAULT, dataclasses.replace(gemv.DEFAULT, dot=True)],
                         ids=["sum", "dot"])
@pytest.mark.parametrize("n", [1, 3])
def test_gemv_lowers_to_triton(cfg, n):
  x, w = jnp.ones((n, 4096), jnp.bfloat16), jnp.ones((4096, 6144), jnp.bfloat16)
  assert "triton" in cuda_text(lambda x, w: gemv._call(x, w, config=cfg, interpret=False), x, w)


@pytest.mark.parametrize("dot", [False, True])
def test_model_switch_keeps_the_logits(monkeypatch, dot):
  """GEMV_BACKEND="gpu" (interpreted): the fused layout's one-token q/k/v and o projections run
  the kernel (3 sequences: rows padded to 4), prefill chunks do not; fp32 logits of a prefill
  and 5 decode steps as with the switch off, within 1e-4 of the largest."""
  cfg = tiny_config(**TINY_LLAMA3, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
  params = fuse_projections(random_params(cfg, seed=2))
  ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (3, 13))
  ref = chunked_then_decoded_logits(cfg, params, ids, 8, 4, 32)[0]
  cfg_k = gemv.GemvConfig(block_f=32, splits=2, block_k=16, num_warps=4, num_stages=2, dot=dot)
  shapes, call = [], gemv._call
  monkeypatch.setattr(gemv, "_call", lambda x, w, **kw: shapes.append(w.shape) or call(x, w, **kw))
  monkeypatch.setattr(model, "GEMV_BACKEND", "gpu")
  monkeypatch.setattr(model, "GEMV_CONFIG", cfg_k)
  got = chunked_then_decoded_logits(cfg, params, ids, 8, 4, 32)[0]
  assert set(shapes) == {(64, 128), (64, 64)}, set(shapes)  # q/k/v [D, 8 x 16], o [4 x 16, D]
  assert len(shapes) == 2 * cfg.num_layers * 5
  np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_benchmark_smoke(tmp_path):
  out = tmp_path / "gemv.json"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gemv.py"), "--smoke",
                         "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  recs = json.loads(out.read_text())["records"]
  timed = [r for r in recs if r["case"] == "gemv" and "ms" in r]
  assert timed and all(r["err"] < 0.01 for r in timed), timed  # |y| ~ 0.3: a few bf16 ulps
  assert {"copy", "xla_dot"} <= {r["case"] for r in recs}
  assert "| gemv |" in proc.stdout
