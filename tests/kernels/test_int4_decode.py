"""The split-K decode kernel that reads a 4-bit cache's tiles (pallas_kernels/attention/
int4_decode.py): interpreted on CPU against the reference over the dequantized cache, which is
what every other route computes (read.four_bit_copies), and lowered to Triton for CUDA.

Inputs: keys with outlier channels (KIVI's hard case), sequences of different lengths with
their newest key group open (the residual, read whole), one ending on a group's edge (no
residual) and one shorter than its query position's causal edge; GQA and MHA rows, head dims 32
(value pieces of 16 bytes, both nibbles in one value group), 64 and 128; one key group a step
and several, with the last step past the buffer's end; many key splits, merged by the kernel
or by jnp; KIVI's groups of 32 with fp32 scales and the compact format (groups of 64, fp16
scales). Tolerances: fp32 queries 1e-5 of the largest output, LSE 2e-5 (another summation
order); bf16 queries no further
from the fp32 reference than the route the kernel replaces (the dequantized cache in bf16, then
the bf16 kernel: several times the kernel's error here) and within 4e-2 (outputs) / 2e-2 (LSE): the
kernel rounds q a, the dequantized values and p to fp16 where the copy rounds every key and
value to bf16 (here 0.024 / 0.005 against the copy's 0.114 / 0.142).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, Tiling, flash_attention, nibbles, quant4, read
from pallas_kernels.attention import int4_decode
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal, with_outliers

KERNEL = Route(backend="gpu", kernels=KernelOptions(int4_decode_kernel=True))
REFERENCE = Route(backend="reference")


def _cache(rng, b, kvh, t, d, lengths, dtype=jnp.bfloat16, fmt="int4"):
  """(keys GroupedKeys written up to `lengths` [b], values Int4) [b, kvh, t, d] in the 4-bit
  format `fmt` (quant4.FORMATS)."""
  g, scales = quant4.format_of(fmt).group, quant4.format_of(fmt).scale_dtype
  pos = np.stack([np.where(np.arange(t) < n, np.arange(t), t) for n in lengths])
  k = with_outliers(rng, normal(rng, (b, t, kvh, d)))
  keys = quant4.write_grouped_keys(quant4.zeros_grouped_keys((b, kvh, t, d), dtype, g, scales),
                                   jnp.asarray(pos, jnp.int32), k)
  values = quant4.quantize(normal(rng, (b, kvh, t, d)) * 2, min(g, d), scale_dtype=scales)
  return keys, values


@pytest.mark.parametrize("h,kvh,d,t,tiling,merge,fmt", [
    (8, 2, 64, 256, None, True, "int4"),  # GQA 4, the default tiling (one group a step)
    # MHA; steps past T; jnp merge
    (3, 3, 128, 224, Tiling(block_keys=96, key_splits=3), False, "int4"),
    (4, 1, 32, 160, Tiling(block_keys=32, key_splits=4), True, "int4"),  # 16-byte value pieces
    (8, 2, 128, 256, None, True, "int4_g64_fp16"),  # groups of 64, fp16 scales
])
def test_decode_over_4_bit_tiles_matches_the_dequantized_cache(h, kvh, d, t, tiling, merge, fmt):
  rng = np.random.default_rng(d + t)
  lengths = [t - 21, 64, t]  # open residual; a group's edge (residual empty); a full cache
  keys, values = _cache(rng, 3, kvh, t, d, lengths, fmt=fmt)
  if tiling is not None and tiling.key_splits:
    assert (t - 21) // 32 >= tiling.key_splits  # the splits hold keys
  q_pos = jnp.asarray([t - 22, 40, t - 1])  # the second stops short of its written keys
  kv_len = jnp.asarray(lengths)
  kernel = KERNEL.replace(kernels=KernelOptions(int4_decode_kernel=True,
                                                decode_merge_kernel=merge))
  kw = dict(q_offset=q_pos, kv_len=kv_len, kv_layout="BHTD")
  for dtype in (jnp.float32, jnp.bfloat16):
    q = normal(rng, (3, 1, h, d), dtype)
    got = flash_attention(q, keys, values, route=kernel, tiling=tiling, **kw)
    jax.block_until_ready(got)  # interpreted calls one after another (see tests/conftest.py)
    want = flash_attention(q.astype(jnp.float32), quant4.load(keys, jnp.float32),
                           quant4.dequantize(values), route=REFERENCE, **kw)
    assert got[0].dtype == dtype and got[0].shape == q.shape
    errors = [_error(got[i], want[i]) for i in (0, 1)]
    if dtype == jnp.float32:
      largest = float(np.max(np.abs(np.asarray(want[0]))))
      assert errors[0] < 1e-5 * max(largest, 1.0) and errors[1] < 2e-5, (errors, largest)
    else:  # no worse than the route it replaces: the cache's bf16 copy, then the bf16 kernel
      copy = flash_attention(q, keys, values, route=REFERENCE, **kw)
      assert errors[0] <= min(4e-2, _error(copy[0], want[0])), errors
      assert errors[1] <= min(2e-2, _error(copy[1], want[1])), errors


def _error(got, want) -> float:
  return float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))


def test_the_kernel_serves_one_token_decode_on_the_gpu_variant_where_enabled():
  rng = np.random.default_rng(0)
  keys, values = _cache(rng, 1, 2, 64, 64, [50])
  q1, q4 = normal(rng, (1, 1, 4, 64)), normal(rng, (1, 4, 4, 64))
  gpu = Route(backend="gpu").variant()
  assert read.four_bit_tiles(q1, keys, values, gpu)  # on by default
  assert not read.four_bit_tiles(q4, keys, values, gpu)  # prefill rows: the copy route
  assert not read.four_bit_tiles(q1, keys, values, REFERENCE.variant())
  assert not read.four_bit_tiles(q1, keys, values, gpu, KernelOptions(int4_decode_kernel=False))
  dense = quant4.load(keys, jnp.float32)
  assert not read.four_bit_tiles(q1, dense, values, gpu)  # only a 4-bit cache


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_nibbles_give_every_code_exactly(dtype):
  byte = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
  low, high = nibbles.nibbles(byte, dtype)
  assert low.dtype == dtype and high.dtype == dtype
  np.testing.assert_array_equal(np.asarray(low, np.float32), np.arange(256).reshape(16, 16) % 16)
  np.testing.assert_array_equal(np.asarray(high, np.float32),
                                np.arange(256).reshape(16, 16) // 16)


def test_kernel_lowers_to_triton_with_the_ptx_unpacking():
  b, kvh, t, d = 1, 8, 4096, 128
  keys = quant4.zeros_grouped_keys((b, kvh, t, d), jnp.bfloat16)
  values = quant4.zeros_values((b, kvh, t, d))
  tl = Tiling(block_rows=16, block_keys=128, num_warps=4, num_stages=3, prefetch=False)

  def call(meta, qr, k, v):
    return int4_decode._gpu(meta, qr, k.main.codes, k.main.scale,
                            jnp.zeros((b, kvh, 4, t // 32)), k.residual, v.codes, v.scale,
                            v.zero, span=1024, splits=4, parts=4, causal=True, scale=0.088,
                            value_group=32, tiling=tl, interpret=False)
  text = cuda_text(call, jnp.zeros((b, 3), jnp.int32), jnp.ones((b, kvh, 4, d), jnp.bfloat16),
                   keys, values)
  assert "triton" in text
