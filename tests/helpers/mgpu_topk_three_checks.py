"""The Mosaic top-k kernel on three compute warpgroups in jax's Mosaic GPU interpreter, run by
tests/kernels/test_mgpu_topk.py in a process of 8 fake CPU devices (`python -m
tests.helpers.mgpu_topk_three_checks NAME...`): the interpreter runs each warpgroup as a thread
whose barrier waits hold one of the CPU client's workers, and one device's workers on a 2-core
machine let a CTA of four starve. Integer inputs make every score exact: indices and scores must
equal the reference's.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import Route, layout, quant, topk_scores
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from pallas_kernels.topk import mgpu_topk, topk_segments
from pallas_kernels.topk import topk as ts_module
from tests.helpers import check_main
from tests.kernels.inputs import small_ints

COLUMNS = KernelOptions(topk_many_rows="columns", topk_eight_bit="products")


def three(block_kv: int, key_splits: int | None = None) -> Tiling:
  return Tiling(impl="mosaic", block_rows=64, block_keys=block_kv, num_stages=2,
                key_splits=key_splits, num_warps=12)


def exact(q, k, top_k: int, tiling: Tiling, options: KernelOptions = COLUMNS, **kw):
  """The kernel on three warpgroups (checked: not the Triton kernel, not two) against the
  reference; (scores, indices) as numpy."""
  keys = k.shape[1]
  config = ts_module._mosaic_config(Variant("gpu", True), q, k, q.shape[1] * q.shape[2]
                                    // k.shape[2], top_k, tiling, keys=keys, options=options)
  assert config is not None and config.warpgroups == 3, config
  v, i = topk_scores(q, k, top_k, route=Route(backend="gpu", kernels=options), tiling=tiling,
                     **kw)
  rv, ri = topk_scores(q, k, top_k, route=Route(backend="reference"), **kw)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
  np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
  return np.asarray(v), np.asarray(i)


def _ragged(dtype: str, block_kv: int, window: int):
  """192 rows a CTA (48 queries x 4 heads; 16 x 4 padded), two sequences of different lengths,
  a prefix and a suffix excluded, 2 key splits; int8 keys and the queries' 8-bit rows at scale
  1 (one query channel at +-127), so the 8-bit products are exact too."""
  rng = np.random.default_rng(29)
  for lq in (48, 16):
    q = small_ints(rng, (2, lq, 4, 64))
    q = q.at[..., 5].set(127 * jnp.sign(q[..., 5]))
    k = small_ints(rng, (2, 1024, 1, 64))
    if dtype == "int8":
      k = quant.Quantized(k.astype(jnp.int8), jnp.ones((2, 1024, 1, 1), jnp.float32))
    exact(q, k, 4, three(block_kv, key_splits=2),
          KernelOptions(topk_many_rows="columns", topk_column_window=window,
                        topk_eight_bit="products"),
          valid_len=jnp.asarray([1024, 700]), exclude_prefix=5, exclude_suffix=17)


def bf16():
  """bf16 keys, whole 128-key tiles, windows of 64."""
  _ragged("bfloat16", 128, 64)


def int8_parts():
  """int8 keys on the 8-bit products, 256-key tiles multiplied in 128-key parts with their
  scales, windows of 128."""
  _ragged("int8", 256, 128)


def ties():
  """Strided segments over 29 distinct keys repeated (test_columns_ties_go_to_lowest_index's
  case, 2 splits): equal maxima within a window's columns, across windows, splits and the
  three warpgroups' rows; top 8, the most "columns" keeps."""
  rng = np.random.default_rng(19)
  k = jnp.tile(small_ints(rng, (1, 29, 1, 64)), (1, 18, 1, 1))[:, :512]
  q = small_ints(rng, (1, 48, 4, 64))
  v, i = exact(q, k, 8, three(128, key_splits=2), KernelOptions(topk_many_rows="columns"),
               exclude_prefix=2)
  tied = v[..., 1:] == v[..., :-1]
  assert tied.any() and np.all(i[..., 1:][tied] > i[..., :-1][tied])


def races():
  """The race detector over the K ring: 256-key tiles in 128-key parts, 4 tiles through 2
  slots, the token passed at each issue, "columns" selecting at once."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  rng = np.random.default_rng(13)
  q, k = small_ints(rng, (1, 48, 4, 64)), small_ints(rng, (1, 1024, 1, 64))
  _, firsts = mgpu_topk.mgpu_topk_scores(
      layout.q_rows(q, 1, 192), k, jnp.array([[3, 1000]], jnp.int32), kp=4, span=1024,
      splits=1, scale=None, config=mgpu_topk.Config(64, 256, 2, warpgroups=3),
      selection="columns", segment=topk_segments.COLUMN_WINDOW,
      interpret=InterpretGPUParams(detect_races=True))
  jax.block_until_ready(firsts)
  assert not interpret_pallas_call.get_races().races_found


def _reset_after(check):
  """jax's GPU interpreter must be reset after a kernel raised, or the next check fails too."""
  def run():
    try:
      check()
    except Exception:
      from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
      interpret_pallas_call.reset_gpu_interpret_mode_state()
      raise
  return run


CHECKS = {name: _reset_after(fn) for name, fn in
          (("bf16", bf16), ("int8_parts", int8_parts), ("ties", ties), ("races", races))}

if __name__ == "__main__":
  assert len(jax.devices()) >= 8, f"needs 8 devices, got {len(jax.devices())}"
  check_main.main(CHECKS, sys.argv[1:])
