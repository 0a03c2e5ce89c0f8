"""A prefill chunk's attention reading a 4-bit cache's tiles (pallas_kernels/attention/
int4_chunk.py, KernelOptions.int4_chunk_kernel): interpreted on CPU against the copy route it
replaces (read.four_bit_copies: the cache dequantized to the queries' dtype, then the
reference), and lowered to Triton for CUDA.

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
from pallas_kernels.attention import int4_chunk
from pallas_kernels.backend import Variant
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import normal
from tests.kernels.test_int4_decode import _cache, _error

KERNEL = Route(backend="gpu", kernels=KernelOptions(int4_chunk_kernel=True))
REFERENCE = Route(backend="reference")


@pytest.mark.parametrize("h,kvh,d,t,fmt", [(8, 2, 64, 256, "int4"), (3, 3, 128, 192, "int4"),
                                           (8, 2, 128, 256, "int4_g64_fp16")])
def test_chunk_over_4_bit_tiles_matches_the_copy_route(h, kvh, d, t, fmt):
  rng = np.random.default_rng(d + t)
  c = 24
  ends = [t - 21, 128, 70]  # an open residual; a group's edge; a chunk past its keys' end
  keys, values = _cache(rng, 3, kvh, t, d, ends, fmt=fmt)
  q_off = jnp.asarray([e - c for e in ends])
  for dtype in (jnp.float32, jnp.bfloat16):
    q = normal(rng, (3, c, h, d), dtype)
    kw = dict(causal=True, q_offset=q_off, kv_len=q_off + c, kv_layout="BHTD")
    got = jax.block_until_ready(flash_attention(q, keys, values, route=KERNEL, **kw))
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


def test_the_kernel_lowers_for_cuda():
  """The nibbles' unpacking, the gathered scale rows and the products lowered for an H200, at
  the 8B's attention shape and a 512-token chunk."""
  S = jax.ShapeDtypeStruct
  b, kvh, t, d, g = 1, 8, 4096, 128, 32
  k = quant4.GroupedKeys(quant4.Int4(S((b, kvh, t, d // 2), jnp.uint8),
                                     S((b, kvh, t // g, d), jnp.float32),
                                     S((b, kvh, t // g, d), jnp.float32), axis=2, group=g),
                         S((b, kvh, g, d), jnp.bfloat16), S((b,), jnp.int32))
  v = quant4.Int4(S((b, kvh, t, d // 2), jnp.uint8), S((b, kvh, t, d // 32), jnp.float32),
                  S((b, kvh, t, d // 32), jnp.float32), axis=3, group=32)
  ints = S((b,), jnp.int32)

  def f(q, k, v, off, kv_len):
    return int4_chunk.attention(q, k, v, q_offset=off, kv_len=kv_len, scale=d ** -0.5,
                                variant=Variant("gpu", False))  # compiled, not interpreted

  assert "triton" in cuda_text(f, S((b, 512, 32, d), jnp.bfloat16), k, v, ints, ints).lower()
