"""Every TPU kernel lowers to Mosaic for real on this CPU machine (jax.export for TPU under
pallas_kernels.lowering_for), so a Mosaic lowering error (block shapes breaking TPU tiling, an
op without a Mosaic rule) fails here and not first on a TPU. Interpret-mode tests
(test_attention_kernels, test_topk_scores, test_chunk_attention) check the results; this file
checks only that each kernel lowers, for decode- and chunk-shaped calls, both key layouts, GQA
groups 1, 3 and 4, bf16 and fp32, head dims 8 (the tiny test models) to 128. Shapes only: no
data, nothing runs.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import chunk_attention, flash_attention, gathered_attention, quant, topk_scores
from pallas_kernels import Route
from pallas_kernels.options import KernelOptions
from tests.kernels.inputs import keys_shape
from tests.helpers.tpu_export import MOSAIC_CALL, export_for_tpu, mosaic_calls

S = jax.ShapeDtypeStruct
# (batch, q_len, q_heads, kv_heads, kv_len, head_dim, kv_layout, dtype): decode (q_len 1) and
# prefill chunks; kv_len below, at and past one key tile (256), not a multiple of it.
SHAPES = {
    "decode_g4_bf16": (2, 1, 8, 2, 1000, 128, "BHTD", jnp.bfloat16),
    "decode_g1_tiny": (1, 1, 2, 2, 48, 8, "BTHD", jnp.float32),
    "chunk_g3_fp32": (2, 16, 6, 2, 333, 64, "BTHD", jnp.float32),
    "chunk_g4_bf16": (1, 64, 8, 2, 256, 128, "BHTD", jnp.bfloat16),
    "chunk_g3_tiny": (2, 8, 6, 2, 48, 8, "BHTD", jnp.float32),
}


def _qkv(case):
  b, lq, h, kvh, t, d, kv_layout, dtype = SHAPES[case]
  kv = S(keys_shape(b, t, kvh, d, kv_layout), dtype)
  return S((b, lq, h, d), dtype), kv, kv, kv_layout


def _assert_lowered(exported, calls=1):
  assert mosaic_calls(exported) == calls, f"expected {calls} Mosaic kernel(s) in the export"


@pytest.mark.parametrize("backend", ["auto", "tpu"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_flash_attention_lowers_for_tpu(case, backend):
  q, k, v, kv_layout = _qkv(case)
  b, lq = q.shape[:2]
  per_seq = S((b,), jnp.int32)

  def fn(q, k, v, q_offset, kv_len):
    return flash_attention(q, k, v, causal=lq > 1, q_offset=q_offset, kv_len=kv_len,
                           kv_layout=kv_layout, route=Route(backend=backend))

  _assert_lowered(export_for_tpu(fn, q, k, v, per_seq, per_seq))


@pytest.mark.parametrize("case", ["chunk_g3_fp32", "chunk_g4_bf16", "chunk_g3_tiny"])
def test_chunk_attention_lowers_for_tpu(case):
  q, k, v, kv_layout = _qkv(case)
  b, c, _, d = q.shape
  own = S((b, c, k.shape[2 if kv_layout == "BTHD" else 1], d), k.dtype)

  def fn(q, k, v, k_chunk, v_chunk, q_offset):
    return chunk_attention(q, k, v, k_chunk, v_chunk, q_offset, kv_layout=kv_layout, route=Route())

  _assert_lowered(export_for_tpu(fn, q, k, v, own, own, S((b,), jnp.int32)))


@pytest.mark.parametrize("case,top_k", [(c, k) for c in SHAPES for k in (1, 4, 16, 128)
                                         if k <= SHAPES[c][4]])  # top_k up to the keys
def test_topk_scores_lowers_for_tpu(case, top_k):
  q, k, _, kv_layout = _qkv(case)

  def fn(q, k, valid_len):  # ReAttention's call: unscaled, a global prefix and a local suffix
    return topk_scores(q, k, top_k, scale=1.0, valid_len=valid_len, exclude_prefix=2,
                       exclude_suffix=8, kv_layout=kv_layout, route=Route())

  _assert_lowered(export_for_tpu(fn, q, k, S((q.shape[0],), jnp.int32)))


@pytest.mark.parametrize("case", ["decode_g4_bf16", "chunk_g4_bf16", "chunk_g3_fp32"])
def test_int8_topk_products_lower_for_tpu(case):
  """topk_scores over int8 keys: the queries quantized per row and multiplied int8 x int8 ->
  int32 (the MXU's int8 products), the keys' scales on the score columns."""
  q, k, _, kv_layout = _qkv(case)

  def fn(q, k, valid_len):
    return topk_scores(q, k, 4, scale=1.0, valid_len=valid_len, exclude_prefix=2,
                       exclude_suffix=8, kv_layout=kv_layout,
                       route=Route(kernels=KernelOptions(topk_eight_bit="products")))

  _assert_lowered(export_for_tpu(fn, q, _int8(k), S((q.shape[0],), jnp.int32)))


@pytest.mark.parametrize("rope", ["plain", "rope", "ranked"])
@pytest.mark.parametrize("n", [40, 300])
@pytest.mark.parametrize("case", list(SHAPES))
def test_gathered_attention_lowers_for_tpu(case, n, rope):
  q, k, v, kv_layout = _qkv(case)
  b, _, _, kvh = SHAPES[case][:4]
  d = q.shape[-1]
  picked = S((b, kvh, n), jnp.int32)

  def fn(q, k, v, indices, valid, ranks):
    # ReAttention: keys rotated inside, at their entry or (a mesh part of a scope) their rank.
    freqs = jnp.linspace(1.0, 1e-3, d // 2) if rope != "plain" else None
    return gathered_attention(q, k, v, indices, valid, kv_layout=kv_layout, key_rope_freqs=freqs,
                              key_positions=ranks if rope == "ranked" else None, route=Route())

  _assert_lowered(export_for_tpu(fn, q, k, v, picked, S((b, kvh, n), jnp.bool_),
                                 S((b, n), jnp.int32)))


def test_lowering_for_is_trace_time_only_and_keys_the_jit_cache():
  """A function traced for CPU before the block is traced again inside it (a plain contextvar
  would hand the export the cached reference trace), and the Mosaic trace never leaks out: the
  same jitted function still runs on the CPU afterwards."""
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(1, 1, 4, 8), (1, 40, 2, 8)])
  step = jax.jit(lambda q, k: flash_attention(q, k, k, route=Route())[0])
  before = step(q, k)
  assert mosaic_calls(jax.export.export(step)(q, k)) == 0  # on CPU "auto" is the reference
  assert mosaic_calls(export_for_tpu(step, q, k)) == 1
  np.testing.assert_array_equal(step(q, k), before)
  assert pallas_kernels.resolve("auto").kind == "reference"
  assert pallas_kernels.resolve("tpu").interpret


def test_lowering_for_sets_the_platform_and_only_in_its_thread():
  seen = {}
  with pallas_kernels.lowering_for("tpu"):
    seen["inside"] = (pallas_kernels.platform(), pallas_kernels.resolve("auto"),
                      pallas_kernels.resolve("tpu"), pallas_kernels.backend.num_cores())
    other = threading.Thread(target=lambda: seen.setdefault("thread", pallas_kernels.platform()))
    other.start()
    other.join()
  tpu = pallas_kernels.backend.Variant("tpu", False)
  assert seen["inside"] == ("tpu", tpu, tpu, 1)
  assert seen["thread"] == pallas_kernels.platform() == jax.devices()[0].platform
  with pytest.raises(ValueError, match=r"lowering_for\('gpu'\): expected one of \('tpu',\)"):
    with pallas_kernels.lowering_for("gpu"):
      pass


def test_the_mosaic_call_name_is_what_the_export_holds():
  """Guards the check above against a renamed custom call (it would then count zero kernels)."""
  exported = export_for_tpu(lambda q, k: flash_attention(q, k, k, route=Route()), S((1, 1, 2, 8),
                                                                                    jnp.float32),
                            S((1, 40, 2, 8), jnp.float32))
  assert f"stablehlo.custom_call @{MOSAIC_CALL}(" in exported.mlir_module()


def _int8(kv):
  """int8 quant.Quantized K or V of kv's shape (TPU v5e has no FP8: int8 is the TPU's 8 bits)."""
  return quant.Quantized(S(kv.shape, jnp.int8), S((*kv.shape[:-1], 1), jnp.float32))


@pytest.mark.parametrize("case", ["decode_g4_bf16", "decode_g1_tiny", "chunk_g4_bf16",
                                  "chunk_g3_fp32"])
def test_quantized_attention_lowers_for_tpu(case):
  """int8 K/V read by the TPU kernels: flash attention (decode or a chunk at an offset),
  gathered attention rotating its keys, and (chunks) chunk_attention over an int8 cache."""
  q, k, v, kv_layout = _qkv(case)
  k, v = _int8(k), _int8(v)
  b, lq, _, d = q.shape
  kvh = SHAPES[case][3]
  per_seq = S((b,), jnp.int32)

  def flash(q, k, v, q_offset, kv_len):
    return flash_attention(q, k, v, causal=lq > 1, q_offset=q_offset, kv_len=kv_len,
                           kv_layout=kv_layout, route=Route())

  _assert_lowered(export_for_tpu(flash, q, k, v, per_seq, per_seq))

  def gathered(q, k, v, indices, valid, ranks):
    return gathered_attention(q, k, v, indices, valid, kv_layout=kv_layout,
                              key_rope_freqs=jnp.linspace(1.0, 1e-3,
                                                          d // 2), key_positions=ranks, route=Route())

  picked = S((b, kvh, 40), jnp.int32)
  _assert_lowered(export_for_tpu(gathered, q, k, v, picked, S(picked.shape, jnp.bool_),
                                 S((b, 40), jnp.int32)))
  if lq > 1:
    own = S((b, lq, kvh, d), q.dtype)
    chunk = lambda q, k, v, kc, vc, off: chunk_attention(q, k, v, kc, vc, off,  # noqa: E731
                                                         kv_layout=kv_layout, route=Route())
    _assert_lowered(export_for_tpu(chunk, q, k, v, own, own, per_seq))
