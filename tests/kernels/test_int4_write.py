"""int4_write.write_one_token (a decode step's write into a 4-bit cache as one in-place kernel):
interpreted on CPU, step after step, against the jnp write KVCache.write runs without a
cache-write backend (quant4.write_grouped_keys and the values' quantize and scatter); lowered to
Triton for CUDA with its buffers aliased.

Equality is exact (codes, scales, zero points, residual, residual group): the kernel's
arithmetic is quant4.quantize's in fp32 (IEEE division, rounding to nearest even). Inputs: keys
with outlier channels; sequences at different points of their groups (one closing a group on
the first step, one mid-group, one starting a group) and one not written (its position past
the cache); head dims 128 (value groups within each half of the channels), 64 (one a half)
and 32 (one group over both halves); KIVI's groups of 32 with fp32 scales and the compact
format (groups of 64, fp16 scales).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.ops.cache import KVCache
from pallas_kernels import Route, quant4
from pallas_kernels.decode import int4_write
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal, with_outliers

KERNEL = Route(backend="gpu", cache_write_backend="gpu")
JNP = Route(backend="gpu", cache_write_backend=None)


def _assert_same(got: KVCache, want: KVCache, step: int):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w)), (
        f"step {step}: {jax.tree_util.keystr(path)} differs")


@pytest.mark.parametrize("d,fmt", [(128, "int4"), (64, "int4"), (32, "int4"),
                                   (128, "int4_g64_fp16")])
def test_one_token_writes_equal_the_jnp_write_step_after_step(d, fmt):
  rng = np.random.default_rng(d)
  g, scales = quant4.format_of(fmt).group, quant4.format_of(fmt).scale_dtype
  b, kvh, t, steps = 4, 2, 192, 36 * g // 32
  lengths = np.array([31, 45, 64, 10])  # closes a group; mid-group; opens one; not written
  cache = KVCache(quant4.zeros_grouped_keys((b, kvh, t, d), jnp.bfloat16, g, scales),
                  quant4.zeros_values((b, kvh, t, d), min(g, d), scales))
  prompt = with_outliers(rng, normal(rng, (b, 64, kvh, d)))
  valid = jnp.asarray(np.arange(64)[None] < lengths[:, None])
  cache = cache.write(jnp.broadcast_to(jnp.arange(64), (b, 64)), prompt, prompt * 0.5,
                      route=JNP, valid=valid)
  assert int4_write.applies(cache.k, cache.v, KERNEL)  # the kernel's, not the jnp write again
  assert not int4_write.applies(cache.k, cache.v, JNP)
  written = jnp.asarray([True, True, True, False])
  step = jax.jit(lambda c, pos, k, v, route: c.write(pos, k, v, route=route,
                                                     valid=written[:, None]),
                 static_argnames="route")
  want = got = cache
  for i in range(steps):  # across group edges: every row closes a group within the steps
    k = with_outliers(rng, normal(rng, (b, 1, kvh, d)))
    v = normal(rng, (b, 1, kvh, d)) * 2
    pos = jnp.asarray(lengths + i)[:, None]
    want = step(want, pos, k, v, JNP)
    got = jax.block_until_ready(step(got, pos, k, v, KERNEL))
    _assert_same(got, want, i)
  groups = np.asarray(got.k.residual_group)  # every written row's moved on; the other's not
  assert (groups[:3] > lengths[:3] // g).all() and groups[3] == lengths[3] // g


def test_write_kernel_lowers_to_triton_with_its_buffers_aliased():
  keys = quant4.zeros_grouped_keys((1, 8, 1024, 128), jnp.bfloat16)
  values = quant4.zeros_values((1, 8, 1024, 128), 32)
  new = jnp.ones((1, 8, 128), jnp.bfloat16)
  bufs = (keys.main.codes, keys.main.scale, keys.main.zero, keys.residual, values.codes,
          values.scale, values.zero)

  def call(meta, new, bufs):
    return int4_write._write(meta, new, new, *bufs, group=32, value_group=32, interpret=False)
  text = cuda_text(call, jnp.zeros((1, 2), jnp.int32), new, bufs)
  assert "triton" in text and text.count("#stablehlo.output_operand_alias<") == len(bufs)
