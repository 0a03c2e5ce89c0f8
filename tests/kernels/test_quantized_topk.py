"""topk_scores over 8-bit keys (pallas_kernels.quant.Quantized) against the reference.

The reference's definition: a key scores its scale times q . its values (q . dequantize(k)),
fp32. Every variant reads the 8-bit values and the scales (GPU Triton kernel, decode's block
path with its pick kernel, TPU kernel; interpreted here) and must select exactly the reference's
indices, ties to the lowest index: the inputs are small integers and the scales powers of two,
so every product is exact and equal scores are truly equal (many are, from only 11 key values).
Holes (candidates cut by valid_len / exclude_prefix), a key count that is no multiple of the
tile, GQA (2 query heads a KV head), both layouts, int8 and E4M3 (TPU: int8 only).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, quant, topk_scores
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions

B, LQ, H, KV, T, D = 2, 3, 4, 2, 333, 16
BOUNDS = dict(valid_len=jnp.asarray([300, 200]), exclude_prefix=7)


def _inputs(dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.integers(-3, 4, (B, LQ, H, D)), jnp.float32)
  values = jnp.asarray(rng.integers(-5, 6, (B, KV, T, D))).astype(dtype)
  scale = jnp.asarray(2.0 ** rng.integers(-3, 3, (B, KV, T, 1)), jnp.float32)
  return q, quant.Quantized(values, scale)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_quantized_keys_select_what_the_reference_does(dtype):
  q, k = _inputs(dtype)
  want = topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="reference"), **BOUNDS)
  # the reference is q . dequantize(k): the same selection as the float keys
  floats = topk_scores(q, k.dequantize(), 5, kv_layout="BHTD", route=Route(backend="reference"),
                       **BOUNDS)
  np.testing.assert_array_equal(floats[1], want[1])
  runs = {"gpu": dict(route=Route(backend="gpu")),
          "gpu_tiles": dict(route=Route(backend="gpu"), tiling=Tiling(block_keys=64))}
  if dtype == "int8":  # keys converted to q's dtype (the int8 products: test below)
    runs["tpu"] = dict(route=Route(backend="tpu"))
  for name, kw in runs.items():
    got = topk_scores(q, k, 5, kv_layout="BHTD", **BOUNDS, **kw)
    np.testing.assert_array_equal(got[1], want[1], err_msg=f"{dtype} {name}")
    np.testing.assert_array_equal(got[0], want[0], err_msg=f"{dtype} {name}")
  # decode rows (the block maxima and the pick kernel), and keys [B, T, KV, d]
  one = topk_scores(q[:, :1], k, 4, kv_layout="BHTD", route=Route(backend="gpu"), **BOUNDS)
  np.testing.assert_array_equal(
      one[1], topk_scores(q[:, :1], k, 4, kv_layout="BHTD", route=Route(backend="reference"),
                          **BOUNDS)[1])
  bthd = quant.per_row(lambda x: jnp.swapaxes(x, 1, 2), k)
  got = topk_scores(q, bthd, 5, kv_layout="BTHD", route=Route(backend="gpu"),
                    tiling=Tiling(block_keys=64),
                    **BOUNDS)
  np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("rows", [LQ, 40])
def test_tpu_int8_products_on_exact_inputs(rows):
  """The TPU kernel over int8 keys with KernelOptions(topk_eight_bit="products"): queries
  quantized per row to int8 and multiplied
  on the MXU (int8 x int8 -> int32), the rows' scales after. Queries whose rows hold 127 besides
  small integers quantize with scale 1, so the selection and the scores must be the
  reference's exactly (decode rows and a chunk's)."""
  _, k = _inputs("int8", seed=5)
  rng = np.random.default_rng(6)
  q = np.asarray(rng.integers(-3, 4, (B, rows, H, D)), np.float32)
  q[..., 2] = 127 * rng.choice([-1, 1], (B, rows, H))
  q = jnp.asarray(q)
  want = topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="reference"), **BOUNDS)
  products = Route(backend="tpu", kernels=KernelOptions(topk_eight_bit="products"))
  got = topk_scores(q, k, 5, kv_layout="BHTD", route=products, **BOUNDS)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])


def _normal_inputs(rows, seed):
  """Normal queries and int8 keys with scales of a few magnitudes: nothing exact, near-ties
  where the quantized queries may pick other keys than q . dequantize(k)."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, rows, H, D)), jnp.float32)
  keys = rng.normal(size=(B, KV, T, D)) * rng.uniform(0.5, 4, (B, KV, T, 1))
  k = quant.quantize(jnp.asarray(keys, jnp.float32), "int8")
  return q, k


def test_the_reference_products_are_the_quantized_queries_int8_sums():
  """reference.product_scores against numpy: each (token, head) row of q quantized to int8 by
  its own max |q| / 127, integer sums with the stored key values, times both scales."""
  from pallas_kernels import reference
  q, k = _normal_inputs(LQ, seed=8)
  got = reference.product_scores(q, k, "BHTD", 0.25)  # [B, LQ, KV, G, T]
  qn = np.asarray(q, np.float64)
  qs = np.abs(qn).max(-1, keepdims=True) / 127
  qv = np.clip(np.round(qn / qs), -127, 127).astype(np.int64)
  sums = np.einsum("bqkgd,bktd->bqkgt", qv.reshape(B, LQ, KV, H // KV, D),
                   np.asarray(k.values, np.int64))
  want = sums * np.asarray(k.scale)[:, None, :, None, :, 0] * qs.reshape(B, LQ, KV, H // KV, 1)
  np.testing.assert_allclose(np.asarray(got), want * 0.25, rtol=1e-6)


def test_the_reference_e4m3_products_are_the_stored_values_sums():
  """E4M3 keys: q rounded per row to E4M3 (its own max |q| / 448) and summed with the stored
  values in fp32, against the same sums in float64 of the rounded values (fp32 rounding only)."""
  from pallas_kernels import reference
  q, _ = _normal_inputs(LQ, seed=10)
  k = quant.quantize(jnp.asarray(np.random.default_rng(11).normal(size=(B, KV, T, D)),
                                 jnp.float32), "float8_e4m3fn")
  got = reference.product_scores(q, k, "BHTD", None)
  qq = quant.quantize(q, "float8_e4m3fn")
  qv = np.asarray(qq.values.astype(jnp.float32), np.float64).reshape(B, LQ, KV, H // KV, D)
  sums = np.einsum("bqkgd,bktd->bqkgt", qv, np.asarray(k.values.astype(jnp.float32), np.float64))
  want = (sums * np.asarray(k.scale)[:, None, :, None, :, 0]
          * np.asarray(qq.scale).reshape(B, LQ, KV, H // KV, 1))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(got) - np.asarray(reference.key_scores(q, k, "BHTD", None))).max() > 0


@pytest.mark.parametrize("rows", [LQ, 40])
def test_tpu_int8_products_equal_the_reference_products_on_normal_inputs(rows):
  """On inputs where quantizing the queries moves picks, the TPU kernel's products select and
  score exactly what the reference's products definition does (the same rounding of q, exact
  int32 sums, the scales multiplied in the same order), and the CPU reference route honours
  the option (it no longer scores dequantized keys when products are asked)."""
  q, k = _normal_inputs(rows, seed=9)
  options = KernelOptions(topk_eight_bit="products")
  want = topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="reference", kernels=options),
                     **BOUNDS)
  got = topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="tpu", kernels=options),
                    **BOUNDS)
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])
  dequantized = topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="reference"), **BOUNDS)
  assert not np.array_equal(np.asarray(dequantized[0]), np.asarray(want[0]))


def test_auto_takes_the_dequantize_route_off_hoppers_mosaic_kernel(monkeypatch):
  """KernelOptions' default topk_eight_bit="auto" runs the 8-bit products only in Hopper's
  Mosaic kernel: the reference scores dequantized keys, exactly as "dequantize" does, on inputs
  where the products pick otherwise; the TPU kernel gets the queries as they are (its products
  would quantize them to int8 first). The TPU call is stopped before the interpreter runs (that
  path's numbers are test_tpu_int8_products_*'s)."""
  from pallas_kernels.topk import topk as topk_module
  q, k = _normal_inputs(LQ, seed=9)
  assert KernelOptions().topk_eight_bit == "auto"
  got, want, products = (
      topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="reference", kernels=KernelOptions(
          topk_eight_bit=choice)), **BOUNDS) for choice in ("auto", "dequantize", "products"))
  np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_array_equal(got[0], want[0])
  assert not np.array_equal(np.asarray(got[0]), np.asarray(products[0]))

  class Reached(Exception):
    pass

  def spy(qr, *a, **kw):
    raise Reached(qr.dtype)

  monkeypatch.setattr(topk_module, "_tpu", spy)
  for choice, dtype in (("auto", q.dtype), ("dequantize", q.dtype), ("products", jnp.int8)):
    with pytest.raises(Reached) as e:
      topk_scores(q, k, 5, kv_layout="BHTD", route=Route(
          backend="tpu", kernels=KernelOptions(topk_eight_bit=choice)), **BOUNDS)
    assert e.value.args[0] == dtype, choice


def test_fp8_keys_on_a_tpu_are_refused():
  q, k = _inputs("float8_e4m3fn")
  with pytest.raises(ValueError, match="int8"):
    topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="tpu"))


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_many_rows_over_8bit_keys_score_a_dequantized_copy_within_the_cap(monkeypatch, dtype):
  """On a native GPU, query rows past decode's (a prefill chunk) score a copy of the 8-bit keys
  in the queries' dtype while it fits `topk_dequantize_bytes` (the jaxpr makes it), a segment
  of keys at a time where only a part fits, and read the 8-bit keys otherwise. Both select what
  the reference does, as decode's rows do. The interpreter stands in for the GPU."""
  import jax
  from pallas_kernels import read
  from pallas_kernels.backend import Variant
  from pallas_kernels.options import KernelOptions
  _, k = _inputs(dtype, seed=3)
  rows = 12  # query tokens: 24 rows a KV head, past decode's topk_blocks.MAX_ROWS
  q = jnp.asarray(np.random.default_rng(4).integers(-3, 4, (B, rows, H, D)), jnp.float32)
  want = topk_scores(q, k, 5, kv_layout="BHTD", route=Route(backend="reference"), **BOUNDS)
  copy = k.values.size * 4  # K in fp32, q's dtype
  native = Variant("gpu", False)
  assert read.dequantized_copy_fits(k, q.dtype, native, copy)
  assert not read.dequantized_copy_fits(k, q.dtype, native, copy - 1)
  assert not read.dequantized_copy_fits(k, q.dtype, Variant("gpu", True), copy)  # interpreter
  assert not read.dequantized_copy_fits(k, q.dtype, Variant("tpu", False), copy)
  real = read.dequantized_rows_fitting
  assert real(k, q.dtype, native, copy, 2) == T and real(k, q.dtype, native, copy - 1, 2) == T - 1
  assert real(k, q.dtype, Variant("gpu", True), copy, 2) == 0
  monkeypatch.setattr(read, "dequantized_rows_fitting",
                      lambda x, dtype, variant, budget, axis: real(x, dtype, native, budget, axis))
  copy_shape = f"f32[{B},{KV},{T},{D}]"
  with pytest.raises(ValueError, match="topk_dequantize_bytes=-1 must be a byte count"):
    KernelOptions(topk_dequantize_bytes=-1)
  for cap, copied in ((copy, True), (copy - 1, False), (0, False), (None, True)):  # the default
    kernels = KernelOptions() if cap is None else KernelOptions(topk_dequantize_bytes=cap)
    fn = lambda q, k, lq: topk_scores(  # noqa: E731
        q[:, :lq], k, 5, kv_layout="BHTD", route=Route(backend="gpu", kernels=kernels), **BOUNDS)
    text = str(jax.make_jaxpr(lambda q, k: fn(q, k, rows))(q, k))
    assert (copy_shape in text) == copied, cap
    for lq in (rows, 1):  # decode's row (topk_blocks) takes no part in the route
      got = fn(q, k, lq)
      np.testing.assert_array_equal(got[1], want[1][:, :lq], err_msg=f"{dtype} cap {cap} {lq}")
  # A cap below the whole copy: segments of keys, each copied and scored alone, merged. Here
  # 100 keys fit, so 4 segments of 96 (the last starts at 237 and skips the keys before 288).
  monkeypatch.setattr(read, "COPY_SEGMENT_ALIGN", 16)
  monkeypatch.setattr(read, "COPY_SEGMENT_MIN", 16)
  per_key = copy // T
  assert [read.copy_segment(n, T) for n in (T, 100, 15)] == [T, 96, 0]
  capped = Route(backend="gpu", kernels=KernelOptions(topk_dequantize_bytes=100 * per_key))
  fn = lambda q, k: topk_scores(q, k, 5, kv_layout="BHTD", route=capped, **BOUNDS)  # noqa: E731
  text = str(jax.make_jaxpr(fn)(q, k))
  assert f"f32[{B},{KV},96,{D}]" in text and "scan" in text
  got = fn(q, k)
  np.testing.assert_array_equal(got[1], want[1], err_msg=f"{dtype} segments")
  np.testing.assert_array_equal(got[0], want[0], err_msg=f"{dtype} segments")
