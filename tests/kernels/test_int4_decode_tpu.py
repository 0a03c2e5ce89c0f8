"""The TPU kernel of one-token decode over a 4-bit cache's tiles (pallas_kernels/attention/
int4_decode_tpu.py): in Pallas TPU interpret mode on the CPU against the reference over the
dequantized cache (what the copy route computes), and lowered to Mosaic by exporting for TPU.

Inputs: keys with outlier channels (KIVI's hard case: scores up to about 30), two sequences of
different lengths: a residual group open (read whole) inside a block of keys, a full cache (no
residual), a sequence ending on a group's edge whose query stops short of its keys (its later
blocks map to its last visible one), a sequence with no key; GQA 4 and 2, head dims 128 and
64, one key block and two (the last partial), causal and not. Tolerances: fp32 queries 5e-5 on
outputs and LSE (another summation order over such scores; 3.2e-5 here); bf16 queries LSE
within 1e-3 and outputs within 4e-2, each no further from the fp32 reference than the copy
route's (the dequantized cache in bf16, then the bf16 kernel): the kernel multiplies the codes
by the folded query in two bf16 terms and adds the zero points' share in fp32, so its LSE moved
by at most 3e-5 here where the copy's bf16 keys moved it by 0.02-0.05, its outputs by
0.014-0.020 against the copy's 0.04-0.08 (values rounded to bf16 in both).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, Tiling, flash_attention, quant4, read
from pallas_kernels.attention import int4_decode_tpu
from tests.helpers.tpu_export import MOSAIC_CALL, export_for_tpu, mosaic_calls
from tests.kernels.inputs import normal
from tests.kernels.test_int4_decode import _cache, _error

KERNEL = Route(backend="tpu")  # interpreted on the CPU
REFERENCE = Route(backend="reference")
S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("h,d,t,lengths,q_pos,block,causal", [
    # GQA 4, one block of all 480 keys: an open residual group (5 of its 32 slots); a full cache
    (8, 128, 480, [453, 480], [452, 479], None, True),
    # GQA 2, blocks of 256 (the second partial: 224 keys, its scale rows past T undefined): the
    # open residual inside block 1; a group's edge (empty residual), its query at 200
    (4, 128, 480, [470, 256], [469, 200], 256, True),
    # GQA 4, head dim 64 (two value groups), not causal; a sequence with no key: (0, -inf)
    (8, 64, 256, [237, 0], [236, 0], None, False),
])
def test_decode_over_4_bit_tiles_matches_the_dequantized_cache(h, d, t, lengths, q_pos, block,
                                                               causal):
  rng = np.random.default_rng(d + t + h)
  keys, values = _cache(rng, 2, 2, t, d, lengths)
  kw = dict(causal=causal, q_offset=jnp.asarray(q_pos), kv_len=jnp.asarray(lengths),
            kv_layout="BHTD")
  tiling = Tiling(block_keys=block) if block else None
  for dtype in (jnp.float32, jnp.bfloat16):
    q = normal(rng, (2, 1, h, d), dtype)
    # one interpreted call at a time: the TPU interpreter's callbacks can wait behind a call
    # dispatched after it (a hang seen here without the wait)
    got = jax.block_until_ready(flash_attention(q, keys, values, route=KERNEL, tiling=tiling,
                                                **kw))
    want = flash_attention(q.astype(jnp.float32), quant4.load(keys, jnp.float32),
                           quant4.dequantize(values), route=REFERENCE, **kw)
    assert got[0].dtype == dtype and got[0].shape == q.shape and got[1].shape == q.shape[:3]
    if 0 in lengths:  # no key: out 0 and lse -inf, as the other kernels give
      empty = lengths.index(0)
      assert not np.any(np.asarray(got[0][empty], np.float32))
      assert np.all(np.isneginf(np.asarray(got[1][empty])))
    seen = np.asarray([i for i, n in enumerate(lengths) if n])
    errors = [_error(got[i][seen], want[i][seen]) for i in (0, 1)]
    if dtype == jnp.float32:
      assert max(errors) < 5e-5, errors
    else:
      copy = flash_attention(q, keys, values, route=REFERENCE, **kw)
      assert errors[0] <= min(4e-2, _error(copy[0][seen], want[0][seen])), errors
      assert errors[1] <= min(1e-3, _error(copy[1][seen], want[1][seen])), errors


def test_the_tpu_variant_takes_one_token_decode_where_enabled():
  keys = jax.eval_shape(lambda: quant4.zeros_grouped_keys((1, 2, 256, 128), jnp.bfloat16))
  values = jax.eval_shape(lambda: quant4.zeros_values((1, 2, 256, 128)))
  q1, q4 = S((1, 1, 4, 128), jnp.bfloat16), S((1, 4, 4, 128), jnp.bfloat16)
  tpu = Route(backend="tpu").variant()
  assert read.four_bit_tiles(q1, keys, values, tpu)  # on by default
  assert read.four_bit_tiles(S(q1.shape, jnp.float32), keys, values, tpu)
  assert not read.four_bit_tiles(S(q1.shape, jnp.float16), keys, values, tpu)  # no fp16 on TPU
  assert not read.four_bit_tiles(q4, keys, values, tpu)  # prefill rows: the copy route
  assert not read.four_bit_tiles(q1, keys, values, tpu, KernelOptions(int4_decode_kernel=False))
  assert not read.four_bit_tiles(q1, S(keys.shape, jnp.bfloat16), values, tpu)  # 4 bits only
  # keys a step: the stacked fold's 128 rows (8 rows: 16 groups; more rows: 8 groups), or T
  assert int4_decode_tpu.block_keys(8, 4096, 32) == 512
  assert int4_decode_tpu.block_keys(16, 4096, 32) == int4_decode_tpu.block_keys(64, 4096, 32)
  assert int4_decode_tpu.block_keys(16, 4096, 32) == 256
  assert int4_decode_tpu.block_keys(8, 224, 32) == 224
  with pytest.raises(ValueError, match="whole blocks of 8 groups"):
    int4_decode_tpu.block_keys(8, 4096, 32, asked=128)


@pytest.mark.parametrize("b,h,kvh,t,d,dtype", [
    (2, 8, 2, 4096, 128, jnp.bfloat16),  # GQA 4, 8 blocks of 512
    (1, 2, 2, 224, 64, jnp.float32),  # MHA, one block of 7 groups (the whole axis)
    (2, 32, 2, 992, 128, jnp.bfloat16),  # GQA 16: blocks of 256, the last partial
])
def test_the_kernel_lowers_for_tpu(b, h, kvh, t, d, dtype):
  """flash_attention's decode over a 4-bit cache exports for TPU as this kernel's one Mosaic
  call (the copy route would export flash's own kernel)."""
  keys = jax.eval_shape(lambda: quant4.zeros_grouped_keys((b, kvh, t, d), dtype))
  values = jax.eval_shape(lambda: quant4.zeros_values((b, kvh, t, d), min(quant4.GROUP, d)))
  per_seq = S((b,), jnp.int32)

  def decode(q, k, v, q_offset, kv_len):
    return flash_attention(q, k, v, q_offset=q_offset, kv_len=kv_len, kv_layout="BHTD",
                           route=Route())

  exported = export_for_tpu(decode, S((b, 1, h, d), dtype), keys, values, per_seq, per_seq)
  assert mosaic_calls(exported) == 1
  assert f'kernel_name = "{int4_decode_tpu.KERNEL_NAME}"' in exported.mlir_module()
  assert f"@{MOSAIC_CALL}(" in exported.mlir_module()
