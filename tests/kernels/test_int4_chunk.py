"""A prefill chunk's attention reading a 4-bit cache's tiles (pallas_kernels/attention/
int4_chunk.py, KernelOptions.int4_chunk_kernel): interpreted on CPU against the copy route it
replaces (read.four_bit_copies: the cache dequantized to the queries' dtype, then the
reference); the GPU kernel lowered to Triton for CUDA, the TPU one (int4_chunk_tpu.py) exported
for TPU.

The kernel dequantizes each tile in fp32 and rounds it once to the queries' dtype, as the copy
does, so they differ only by summation order and the probabilities' rounding: fp32 queries
within 1e-5 of the largest output (LSE 2e-5), bf16 within 1e-2 of it (a bf16 output's last
bit; LSE 2e-2). Inputs: keys with outlier
channels, chunks at per-sequence offsets that end in an open residual group, on a group's edge
and past a shorter sequence's keys; GQA and MHA; KIVI's groups of 32 and the compact format."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, chunk_attention, flash_attention, quant4, read
from pallas_kernels.attention import int4_chunk, int4_chunk_tpu
from pallas_kernels.backend import Variant
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal
from tests.kernels.test_int4_decode import _cache, _error

KERNEL = Route(backend="gpu", kernels=KernelOptions(int4_chunk_kernel=True))
REFERENCE = Route(backend="reference")


@pytest.mark.parametrize("variant,h,kvh,d,t,fmt", [
    ("gpu", 8, 2, 64, 256, "int4"), ("gpu", 3, 3, 128, 192, "int4"),
    ("gpu", 8, 2, 128, 256, "int4_g64_fp16"),
    ("tpu", 8, 2, 128, 512, "int4"),  # two key blocks of 8 groups
    ("tpu", 3, 3, 128, 192, "int4_g64_fp16")])  # one block, the whole key axis
def test_chunk_over_4_bit_tiles_matches_the_copy_route(variant, h, kvh, d, t, fmt):
  rng = np.random.default_rng(d + t)
  c = 24
  ends = [t - 21, 128, 70]  # an open residual; a group's edge; a chunk past its keys' end
  keys, values = _cache(rng, 3, kvh, t, d, ends, fmt=fmt)
  q_off = jnp.asarray([e - c for e in ends])
  for dtype in (jnp.float32, jnp.bfloat16):
    q = normal(rng, (3, c, h, d), dtype)
    kw = dict(causal=True, q_offset=q_off, kv_len=q_off + c, kv_layout="BHTD")
    got = jax.block_until_ready(flash_attention(q, keys, values, **kw, route=Route(
        backend=variant, kernels=KERNEL.kernels)))
    copy = flash_attention(q, keys, values, route=REFERENCE, **kw)
    assert got[0].dtype == dtype and got[0].shape == q.shape
    errors = [_error(got[i], copy[i]) for i in (0, 1)]
    largest = max(float(np.max(np.abs(np.asarray(copy[0], np.float32)))), 1.0)
    if dtype == jnp.float32:
      assert errors[0] < 1e-5 * largest and errors[1] < 2e-5, (errors, largest)
    else:  # a bf16 output's last bit (2^-8 of it) and the probabilities' rounding
      assert errors[0] < 1e-2 * largest and errors[1] < 2e-2, (errors, largest)


def test_chunk_attention_takes_the_kernel_without_a_copy(monkeypatch):
  """chunk_attention over a 4-bit cache with the option on reaches the kernel and makes no
  copy of the cache; off, it copies as before."""
  rng = np.random.default_rng(1)
  keys, values = _cache(rng, 1, 2, 128, 64, [100])
  q = normal(rng, (1, 16, 8, 64), jnp.float32)
  chunk = [normal(rng, (1, 16, 2, 64), jnp.float32)] * 2
  copies, calls = [], []
  monkeypatch.setattr(read, "four_bit_copies", lambda *a: copies.append(1) or a[1:])
  real = int4_chunk.attention
  monkeypatch.setattr(int4_chunk, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  jax.block_until_ready(chunk_attention(q, keys, values, *chunk, jnp.asarray([84]),
                                        kv_layout="BHTD", route=KERNEL))
  assert calls == [1] and copies == []
  assert not read.four_bit_chunk_tiles(q, keys, values, KERNEL.variant(), KernelOptions())
  assert not read.four_bit_chunk_tiles(q[:, :1], keys, values, KERNEL.variant(),
                                       KERNEL.kernels)  # decode has its own kernel


def _abstract_cache(b, kvh, t, d, g):
  """(keys, values) of a 4-bit cache as shapes: KIVI's groups of g, fp32 scales."""
  S = jax.ShapeDtypeStruct
  k = quant4.GroupedKeys(quant4.Int4(S((b, kvh, t, d // 2), jnp.uint8),
                                     S((b, kvh, t // g, d), jnp.float32),
                                     S((b, kvh, t // g, d), jnp.float32), axis=2, group=g),
                         S((b, kvh, g, d), jnp.bfloat16), S((b,), jnp.int32))
  v = quant4.Int4(S((b, kvh, t, d // 2), jnp.uint8), S((b, kvh, t, d // g), jnp.float32),
                  S((b, kvh, t, d // g), jnp.float32), axis=3, group=g)
  return k, v


def test_the_kernel_lowers_for_cuda():
  """The nibbles' unpacking, the gathered scale rows and the products lowered for an H200, at
  the 8B's attention shape and a 512-token chunk."""
  S = jax.ShapeDtypeStruct
  b, d = 1, 128
  k, v = _abstract_cache(b, 8, 4096, d, 32)
  ints = S((b,), jnp.int32)

  def f(q, k, v, off, kv_len):
    return int4_chunk.attention(q, k, v, q_offset=off, kv_len=kv_len, scale=d ** -0.5,
                                variant=Variant("gpu", False))  # compiled, not interpreted

  assert "triton" in cuda_text(f, S((b, 512, 32, d), jnp.bfloat16), k, v, ints, ints).lower()


def test_the_tpu_kernel_exports():
  """The TPU kernel through the real Pallas-to-Mosaic lowering on this CPU (a 512-token chunk
  of the 8B's attention shape)."""
  from tests.helpers.tpu_export import export_for_tpu
  S = jax.ShapeDtypeStruct
  b, d = 1, 128
  k, v = _abstract_cache(b, 8, 4096, d, 32)
  ints = S((b,), jnp.int32)

  def f(q, k, v, off, kv_len):
    return flash_attention(q, k, v, causal=True, q_offset=off, kv_len=kv_len, kv_layout="BHTD",
                           route=Route(kernels=KERNEL.kernels))

  module = export_for_tpu(f, S((b, 512, 32, d), jnp.bfloat16), k, v, ints, ints).mlir_module()
  assert int4_chunk_tpu.KERNEL_NAME in module
