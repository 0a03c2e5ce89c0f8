"""One-token decode over int8 keys on the int8 products (KernelOptions.decode_int8_products):
the queries quantized per row, q . k as int8 x int8 -> int32, then the key's and the row's
scales. Each kernel variant against the reference computing the same products in jnp, the
option seen to act (it moves the outputs from the dequantize-first ones, by the queries'
rounding only), its default (on for the native GPU kernel only), and the GPU kernel lowered
for CUDA, where the int8 dot is Triton's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, backend, flash_attention, quant, read
from pallas_kernels.attention import flash as fa_module
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import keys_shape, normal, with_outliers

PRODUCTS = KernelOptions(decode_int8_products=True)
B, H, KV, T, D = 2, 12, 2, 517, 128  # 6 query heads a KV head, split-K over a ragged key axis
OFFSETS, LENGTHS = (516, 200), (517, 201)


def _inputs(dtype, kv_layout, seed=0):
  rng = np.random.default_rng(seed)
  q = normal(rng, (B, 1, H, D), dtype)
  k = with_outliers(rng, normal(rng, keys_shape(B, T, KV, D, kv_layout), dtype))
  v = normal(rng, keys_shape(B, T, KV, D, kv_layout), dtype)
  return q, quant.quantize(k, jnp.int8), quant.quantize(v, jnp.int8)


def _decode(q, k, v, backend, kv_layout, options=KernelOptions(), tiling=None):
  out, lse = flash_attention(q, k, v, causal=True, q_offset=jnp.asarray(OFFSETS),
                             kv_len=jnp.asarray(LENGTHS), kv_layout=kv_layout,
                             route=Route(backend=backend, kernels=options), tiling=tiling)
  return jax.block_until_ready((out.astype(jnp.float32), lse))  # one interpreted call at a time


@pytest.mark.parametrize("variant,dtype,kv_layout", [("gpu", jnp.bfloat16, "BHTD"),
                                                     ("gpu", jnp.float32, "BTHD"),
                                                     ("tpu", jnp.bfloat16, "BHTD")])
def test_kernels_match_the_reference_products(variant, dtype, kv_layout):
  q, k, v = _inputs(dtype, kv_layout)
  tiling = Tiling(key_splits=4) if variant == "gpu" else None
  got = _decode(q, k, v, variant, kv_layout, PRODUCTS, tiling)
  ref = _decode(q, k, v, "reference", kv_layout, PRODUCTS)
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5  # bf16: the values' and outputs' rounding
  np.testing.assert_allclose(got[0], ref[0], atol=tol, rtol=tol)
  np.testing.assert_allclose(got[1], ref[1], atol=tol, rtol=tol)


def test_the_products_are_the_reference_definition_and_act():
  """The reference's products equal attention over scores computed from the quantized queries
  in numpy (exact int sums); they differ from the dequantize-first outputs, within what the
  queries' per-row rounding (1/254 of a row's largest entry) can move."""
  q, k, v = _inputs(jnp.float32, "BHTD", seed=1)
  got = _decode(q, k, v, "reference", "BHTD", PRODUCTS)
  deq = _decode(q, k, v, "reference", "BHTD")
  qq = quant.quantize(q, jnp.int8)  # [B, 1, H, d] int8, [B, 1, H, 1]
  qv, qs = np.asarray(qq.values, np.float64), np.asarray(qq.scale, np.float64)
  kv_, ks = np.asarray(k.values, np.float64), np.asarray(k.scale, np.float64)  # [B, KV, T, d|1]
  vd = np.asarray(quant.dequantize(v, jnp.float32), np.float64)
  g = H // KV
  for b in range(B):
    n = LENGTHS[b]
    for h in range(H):
      s = kv_[b, h // g, :n] @ qv[b, 0, h] * ks[b, h // g, :n, 0] * qs[b, 0, h, 0] / np.sqrt(D)
      p = np.exp(s - s.max())
      want = p @ vd[b, h // g, :n] / p.sum()
      np.testing.assert_allclose(got[0][b, 0, h], want, atol=2e-5, rtol=2e-5)
  moved = np.abs(got[0] - deq[0])
  assert moved.max() > 1e-6, "the products left the outputs as the dequantize route's"
  assert moved.max() < 5e-2


def test_only_int8_one_token_decode_takes_the_products():
  q, k, v = _inputs(jnp.bfloat16, "BHTD")
  native = Variant("gpu", False)
  assert read.decode_products(q, k, native, PRODUCTS)
  assert not read.decode_products(q, k, native, KernelOptions(decode_int8_products=False))
  assert not read.decode_products(jnp.concatenate([q, q], axis=1), k, native, PRODUCTS)  # a chunk
  assert not read.decode_products(q, quant.quantize(k.values.astype(jnp.float32),
                                                    jnp.float8_e4m3fn), native, PRODUCTS)
  assert not read.decode_products(q, quant.dequantize(k, jnp.bfloat16), native, PRODUCTS)


def test_by_default_only_the_native_gpu_kernel_takes_the_products():
  """None (the default): the products where the GPU's Triton kernel runs natively (measured
  there), the dequantize route on the reference, the TPU kernel and interpreted kernels; asked
  (True), every variant."""
  q, k, v = _inputs(jnp.bfloat16, "BHTD")
  auto = KernelOptions()
  assert auto.decode_int8_products is None
  assert read.decode_products(q, k, Variant("gpu", False), auto)
  for other in (Variant("gpu", True), Variant("tpu", False), Variant("tpu", True),
                Variant("reference", False)):
    assert not read.decode_products(q, k, other, auto), other
    assert read.decode_products(q, k, other, PRODUCTS), other
  assert not Route(backend="reference").fused_decode  # the CPU's jnp decode path, as before
  assert Route(backend="reference", kernels=PRODUCTS).fused_decode


def test_the_default_route_on_a_gpu_runs_int8_products(monkeypatch):
  """Traced as the native GPU variant, the default options give the kernel an int8 x int8 ->
  int32 product (its query rows quantized inside it); with the option off, none."""
  monkeypatch.setattr(backend, "resolve", lambda _: Variant("gpu", False))
  S = jax.ShapeDtypeStruct
  q = S((B, 1, H, D), jnp.bfloat16)
  kv = quant.Quantized(S((B, KV, 1024, D), jnp.int8), S((B, KV, 1024, 1), jnp.float32))
  per_seq = S((B,), jnp.int32)
  for options, want in ((KernelOptions(), True),
                        (KernelOptions(decode_int8_products=False), False)):
    def decode(q, k, v, q_offset, kv_len, options=options):
      return flash_attention(q, k, v, causal=True, q_offset=q_offset, kv_len=kv_len,
                             kv_layout="BHTD", route=Route(kernels=options))
    text = str(jax.make_jaxpr(decode)(q, kv, kv, per_seq, per_seq))
    assert ("preferred_element_type=int32" in text) == want, options


@pytest.mark.parametrize("int8_rows,row_groups,int8_values", [(True, 1, False), (True, 4, False),
                                                               (False, 4, False), (True, 1, True),
                                                               (True, 4, True)])
def test_the_gpu_kernel_lowers_for_cuda_with_int8_queries(int8_rows, row_groups, int8_values):
  """Triton's int8 x int8 -> int32 dot after the rows' quantization in the kernel, the row
  groups' key parts, gathered scales and grouped products (test_decode_row_groups), and the
  probabilities' int8 products with the values as stored (test_decode_int8_values), lowered
  for an H200."""
  b, kvh, t, d = 1, 8, 4096, 128
  tl = Tiling().pick(block_rows=16, block_keys=128, num_warps=4, num_stages=3, prefetch=False)
  span, splits = fa_module.gpu.split_plan(kvh, t, 128, 8)
  S = jax.ShapeDtypeStruct

  def flash(qr, k, v, meta, ks, vs):
    return fa_module._gpu(qr, k, v, meta, ks, vs, group=4, span=span, splits=splits,
                          causal=True, scale=0.088, kv_layout="BHTD", tiling=tl, interpret=False,
                          products=jnp.bfloat16, int8_rows=int8_rows, row_groups=row_groups,
                          int8_values=int8_values)

  args = (S((b, kvh, 4, d), jnp.bfloat16), S((b, kvh, t, d), jnp.int8),
          S((b, kvh, t, d), jnp.int8), S((b, 2), jnp.int32), S((b, kvh, t), jnp.float32),
          S((b, kvh, t), jnp.float32))
  text = cuda_text(flash, *args)
  assert "triton" in text.lower()


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_the_kernels_row_quantization_is_quantize(dtype):
  """quant.kernel_quantize (int8's rounding from floor), jitted as the interpreter runs it,
  equals quant.quantize on random rows with halves and zeros among them."""
  rng = np.random.default_rng(3)
  x = normal(rng, (64, D), jnp.float32) * 3.0
  x = x.at[0].set(0.0).at[1, :4].set(jnp.asarray([127.0, 0.5, -1.5, 2.5]))
  values, scale = jax.jit(quant.kernel_quantize, static_argnums=1)(x, dtype)
  want = quant.quantize(x, dtype)
  np.testing.assert_array_equal(np.asarray(values, np.float32),
                                np.asarray(want.values, np.float32))
  np.testing.assert_array_equal(scale, want.scale)


def test_the_tpu_kernel_exports_with_int8_queries():
  """The TPU kernel's int8 x int8 -> int32 product (the MXU's) and the row scales' block pass
  the real Pallas-to-Mosaic lowering on this CPU."""
  from tests.helpers.tpu_export import export_for_tpu, mosaic_calls
  S = jax.ShapeDtypeStruct
  q = S((B, 1, H, D), jnp.bfloat16)
  kv = quant.Quantized(S((B, KV, 1024, D), jnp.int8), S((B, KV, 1024, 1), jnp.float32))
  per_seq = S((B,), jnp.int32)

  def decode(q, k, v, q_offset, kv_len):
    return flash_attention(q, k, v, causal=True, q_offset=q_offset, kv_len=kv_len,
                           kv_layout="BHTD", route=Route(kernels=PRODUCTS))

  exported = export_for_tpu(decode, q, kv, kv, per_seq, per_seq)
  assert mosaic_calls(exported) >= 1
  # the int8 query rows (16 a block) reach the kernel
  assert f"tensor<{B}x{KV}x16x{D}xi8>" in exported.mlir_module()
