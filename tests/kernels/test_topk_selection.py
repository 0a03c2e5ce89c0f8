"""KernelOptions.topk_selection reaches every top-k kernel (Pallas interpret mode on CPU).

"exact" must equal the reference. "max_only" (a benchmark diagnostic) must put each row's best
candidate score in its top slot and keep no candidate key at all, which only its running max
does: so the option is threaded to the kernel as a static argument, not dropped on the way, and
the two compile apart (exact, then max_only, then exact again on the same shapes).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, mgpu_common, topk_scores
from pallas_kernels.topk import mgpu_topk
from pallas_kernels.topk import topk as ts_module
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from tests.kernels.inputs import small_ints

NO_INTERPRETER = mgpu_common.interpreter_available()
MOSAIC = Tiling(impl="mosaic", block_rows=64, block_keys=64, num_stages=2)
# backend, tiling: Triton over 2 key splits; TPU; Mosaic GPU (jax's interpreter)
KERNELS = {
    "gpu": ("gpu", Tiling(key_splits=2)),
    "tpu": ("tpu", None),
    "mosaic": pytest.param(("gpu", MOSAIC), marks=pytest.mark.skipif(
        NO_INTERPRETER is not None, reason=str(NO_INTERPRETER))),
}
# 2 sequences of 264 keys (a multiple of 8, as Mosaic's TMA needs; a clamped last tile), 16
# queries x 4 heads on 1 kv head (64 rows: enough for Mosaic), d 64, top 4
B, LQ, H, KV, T, D, TOP_K = 2, 16, 4, 1, 264, 64, 4
VALID, PREFIX, SUFFIX = (264, 150), 3, 5


def best_scores(q, k):
  """Each row's maximum q.k over its candidates, [B, Lq, H] (numpy, exact on small integers)."""
  qf = np.asarray(q, np.float32).reshape(B, LQ, KV, H // KV, D)
  s = np.einsum("bqkgd,btkd->bqkgt", qf, np.asarray(k, np.float32)).reshape(B, LQ, H, T)
  t = np.arange(T)
  ok = (t >= PREFIX) & (t < np.asarray(VALID)[:, None, None, None] - SUFFIX)
  return np.where(ok, s, -np.inf).max(axis=-1)


@pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))
def test_topk_selection_reaches_the_kernel(kernel):
  backend, tiling = kernel
  rng = np.random.default_rng(17)
  q, k = small_ints(rng, (B, LQ, H, D)), small_ints(rng, (B, T, KV, D))
  if tiling is MOSAIC:  # not a silent fallback to Triton
    assert ts_module._mosaic_config(Variant("gpu", True), q, k, LQ * H // KV, TOP_K, tiling,
                                    keys=T) is not None
  kw = dict(valid_len=jnp.asarray(VALID), exclude_prefix=PREFIX, exclude_suffix=SUFFIX,
            tiling=tiling)

  def run(selection):
    route = Route(backend=backend, kernels=KernelOptions(topk_selection=selection))
    v, i = topk_scores(q, k, TOP_K, route=route, **kw)
    return np.asarray(v), np.asarray(i)

  want = topk_scores(q, k, TOP_K, valid_len=kw["valid_len"], exclude_prefix=PREFIX,
                     exclude_suffix=SUFFIX, route=Route(backend="reference"))
  for selection in ("exact", "max_only", "exact"):
    v, i = run(selection)
    if selection == "exact":
      np.testing.assert_array_equal(i, np.asarray(want[1]))
      np.testing.assert_array_equal(v, np.asarray(want[0]))
    else:
      np.testing.assert_array_equal(v[..., 0], best_scores(q, k))
      hi = np.asarray(VALID)[:, None, None, None] - SUFFIX
      assert not np.any((i >= PREFIX) & (i < hi)), "max_only kept a key: the selection ran"


def test_max_only_lowers_to_mosaic_gpu():
  """The native Mosaic code of "max_only" (what benchmarks/mgpu_topk.py times) lowers on this
  CPU-only jaxlib at the benchmark's shapes, and differs from the exact kernel's."""
  t, d = 131072, 128
  args = (jax.ShapeDtypeStruct((1, 8, 2048, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, t, 8, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, 2), jnp.int32))

  def lowered(selection):
    f = lambda qr, k, bounds: mgpu_topk.mgpu_topk_scores(
        qr, k, bounds, kp=4, span=t // 2, splits=2, scale=d ** -0.5, selection=selection)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

  diagnostic = lowered("max_only")
  assert "mosaic_gpu" in diagnostic and diagnostic != lowered("exact")


def test_topk_selection_is_validated():
  assert KernelOptions().topk_selection == "exact"
  with pytest.raises(ValueError, match="topk_selection"):
    KernelOptions(topk_selection="max")
  with pytest.raises(ValueError, match="topk_many_rows"):
    KernelOptions(topk_many_rows="rounds")
