"""The Mosaic GPU top-k over 8-bit keys on the 8-bit tensor cores (mgpu_topk.py) on CPU.

The kernel quantizes each query row as the keys are (one symmetric scale per row) and selects by
q8.k8 times each key's scale. Two kinds of check:
- exact: keys and queries whose every row holds the 8-bit format's largest value (127 for int8,
  448 for E4M3) besides small integers quantize with scale 1, so every score is an integer and
  the kernel must equal the dequantize-first reference bit for bit, ties included;
- random: on normal inputs the quantized queries may reorder near-ties. A differing pick is
  allowed only where the reference's scores of the two keys differ by less than what rounding q
  can move them (a score by at most sum_c |q8_c s_q - q_c| |k_c|, each of the two keys), and
  the share of rows that differ at all is bounded.
The native code lowers to Mosaic GPU on this CPU-only jaxlib; it runs in benchmarks/topk8.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import Route, mgpu_common, quant, topk_scores
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from pallas_kernels.topk import mgpu_topk
from pallas_kernels.topk import topk as ts_module
from tests.kernels.inputs import keys_shape, normal, small_ints

NO_INTERPRETER = mgpu_common.interpreter_available()
needs_interpreter = pytest.mark.skipif(NO_INTERPRETER is not None, reason=str(NO_INTERPRETER))
# jax's Mosaic GPU interpreter ran these and passed, but hung now and then on a 2-core machine
# (its warpgroup threads waiting at a barrier; four runs of nine, under load), which the
# bf16 kernel's interpreted tests do not: not yet explained, so the 8-bit kernel stays opt-in.
# Its selection is checked here through the TPU kernel (the same quantized-query products) and
# on the GPU by benchmarks/topk8.py (check_exact / agree cases, passed on an H200).
INTERPRETER_HANGS = pytest.mark.skip(reason="the Mosaic GPU interpreter hangs intermittently on "
                                            "the 8-bit top-k kernel (see above)")
QMAX = {"int8": 127, "float8_e4m3fn": 448}
DTYPES = list(QMAX)
MOSAIC = Tiling(impl="mosaic", block_rows=64, block_keys=64, num_stages=2)


@pytest.fixture(autouse=True)
def _reset_interpreter():
  yield
  if NO_INTERPRETER is None:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def exact_rows(rng, shape, dtype_name, channel):
  """Small nonzero integers with one channel of each row at the format's largest value: the
  row's scale is 1 and its 8-bit values are the integers themselves. Queries and keys put it
  in different channels, so every partial sum stays below 2^12: exact also in the E4M3
  products' accumulators, which on Hopper keep fewer bits than fp32 (a 448 x 448 term made the
  GPU's sums inexact)."""
  x = np.asarray(small_ints(rng, shape), np.float32)
  x[..., channel] = QMAX[dtype_name] * rng.choice([-1, 1], shape[:-1])
  return jnp.asarray(x)


def run(q, k, top_k, options=KernelOptions(topk_eight_bit="products"), tiling=MOSAIC, **kw):
  bhtd = kw.get("kv_layout") == "BHTD"
  rows = q.shape[1] * q.shape[2] // k.shape[1 if bhtd else 2]
  # the 8-bit Mosaic kernel takes the call (not the copy or the Triton kernel)
  assert ts_module._mosaic_config(Variant("gpu", True), q, k, rows, top_k, tiling,
                                  keys=k.shape[2 if bhtd else 1]) is not None
  got = topk_scores(q, k, top_k, route=Route(backend="gpu", kernels=options), tiling=tiling, **kw)
  want = topk_scores(q, k, top_k, route=Route(backend="reference"), **kw)
  return [np.asarray(x) for x in (*got, *want)]


@INTERPRETER_HANGS
@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k,many_rows", [(1, "segments"), (4, "segments"), (4, "columns"),
                                            (4, "kernel")])
def test_exact_scores_equal_the_reference(dtype, top_k, many_rows):
  rng = np.random.default_rng(top_k + len(dtype))
  b, lq, h, kvh, t, d = 2, 16, 4, 1, 304, 64
  q = exact_rows(rng, (b, lq, h, d), dtype, 5).astype(jnp.bfloat16)
  k = quant.quantize(exact_rows(rng, (b, t, kvh, d), dtype, 6), dtype)
  assert np.all(np.asarray(k.scale) == 1.0)
  v, i, rv, ri = run(q, k, top_k, KernelOptions(topk_many_rows=many_rows,
                                                topk_eight_bit="products"),
                     valid_len=jnp.asarray([304, 171]), exclude_prefix=5, exclude_suffix=17)
  np.testing.assert_array_equal(i, ri)
  np.testing.assert_array_equal(v, rv)


@pytest.mark.parametrize("backend,dtype", [
    ("tpu", "int8"),
    pytest.param("gpu", "int8", marks=[INTERPRETER_HANGS, needs_interpreter]),
    pytest.param("gpu", "float8_e4m3fn", marks=[INTERPRETER_HANGS, needs_interpreter])])
@pytest.mark.parametrize("top_k", [1, 4])
def test_random_inputs_differ_only_at_near_ties(backend, dtype, top_k):
  rng = np.random.default_rng(11 + top_k)
  b, lq, h, kvh, t, d = 1, 32, 4, 1, 304, 64
  q = normal(rng, (b, lq, h, d), jnp.bfloat16)
  k = quant.quantize(normal(rng, keys_shape(b, t, kvh, d, "BTHD")), dtype)
  if backend == "tpu":  # interpreted Pallas TPU: int8 x int8 -> int32, the same selection
    i = np.asarray(topk_scores(q, k, top_k, scale=d ** -0.5, route=Route(
        backend="tpu", kernels=KernelOptions(topk_eight_bit="products")))[1])
    rv, ri = [np.asarray(x) for x in topk_scores(q, k, top_k, scale=d ** -0.5,
                                                 route=Route(backend="reference"))]
  else:
    _, i, rv, ri = run(q, k, top_k, scale=d ** -0.5)
  # the reference's scores of every key, [B, Lq, H, T], and how far rounding q moves each
  kf = np.asarray(quant.dequantize(k, jnp.float32), np.float64)[:, :, 0]  # [B, T, d]
  qf = np.asarray(q, np.float64)
  s = np.einsum("bqhd,btd->bqht", qf, kf) * d ** -0.5
  rounded = np.abs(np.asarray(quant.dequantize(quant.quantize(q, dtype)), np.float64) - qf)
  moved = np.einsum("bqhd,btd->bqht", rounded, np.abs(kf)) * d ** -0.5  # [B, Lq, H, T]
  picked = np.take_along_axis(s, i, -1)
  kth = rv[..., -1:]
  slack = np.take_along_axis(moved, i, -1) + np.take_along_axis(moved, ri[..., -1:], -1)
  assert np.all(picked >= kth - slack - 1e-5), "a pick no rounding of q explains"
  same = np.all(np.sort(i, -1) == np.sort(ri, -1), -1)
  # measured on these inputs (128 rows): int8 98.4% / 99.2% of rows at top-1 / top-4; E4M3
  # (3 mantissa bits: each channel of q moves by up to 1/16 of itself) 92.2% / 93.0%. (d=128
  # over BHTD keys ran here too, but jax's Mosaic GPU interpreter hung in it now and then: its
  # threads waiting at a barrier on a 2-core machine; d=128 runs on the GPU in benchmarks/topk8.py.)
  floor = {"int8": 0.95, "float8_e4m3fn": 0.8}[dtype]
  assert same.mean() >= floor, f"only {same.mean():.1%} of rows chose the reference's keys"


@needs_interpreter
@pytest.mark.parametrize("choice,calls", [("products", 1), ("auto", 1), ("dequantize", 0)])
def test_the_option_picks_the_route(monkeypatch, choice, calls):
  """KernelOptions.topk_eight_bit: "products" and "auto" (the default) run the 8-bit kernel
  where the Mosaic kernel serves the call, "dequantize" never does (in the interpreter it then
  reads the 8-bit tiles in the Triton kernel)."""
  seen = []

  class Ran(Exception):
    pass

  def spy(*a, **kw):  # the 8-bit kernel was reached; stop before the interpreter runs it
    seen.append(1)
    raise Ran

  monkeypatch.setattr(mgpu_topk, "mgpu_topk_scores", spy)
  rng = np.random.default_rng(5)
  q = normal(rng, (1, 16, 4, 64), jnp.bfloat16)
  k = quant.quantize(normal(rng, (1, 128, 1, 64)), "int8")
  try:
    topk_scores(q, k, 2, route=Route(backend="gpu",
                                     kernels=KernelOptions(topk_eight_bit=choice)), tiling=MOSAIC)
  except Ran:
    pass
  assert len(seen) == calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,kv_layout,kp,selection", [(128, "BTHD", 1, "exact"),
                                                      (128, "BHTD", 4, "segments"),
                                                      (64, "BTHD", 4, "exact"),
                                                      (128, "BTHD", 4, "columns"),
                                                      (128, "BHTD", 8, "columns"),
                                                      (128, "BTHD", 4, "columns3")])
def test_native_kernel_lowers_to_mosaic_gpu(dtype, d, kv_layout, kp, selection):
  """8-bit WGMMA operands (tiling and swizzle by the byte width), the s32 accumulator and its
  conversion, the scale ring: lowered at the benchmark's shapes; Mosaic's SMEM check runs.
  columns3: three compute warpgroups, each 256-key tile's products and scales in 128-key parts."""
  config = mgpu_topk.EIGHT_BIT_CONFIG
  if selection == "columns3":
    config, selection = mgpu_topk.THREE_WARPGROUPS[True], "columns"
  b, kvh, rows, t = 1, 8, 192 * 11 if config.warpgroups == 3 else 2048, 131072
  shape = keys_shape(b, t, kvh, d, kv_layout)
  args = (jax.ShapeDtypeStruct((b, kvh, rows, d), jnp.bfloat16), jax.ShapeDtypeStruct(shape, dtype),
          jax.ShapeDtypeStruct(shape[:3] + (1,), jnp.float32),
          jax.ShapeDtypeStruct((b, 2), jnp.int32))

  def f(qr, values, scale, bounds):
    return mgpu_topk.mgpu_topk_scores(qr, quant.Quantized(values, scale), bounds, kp=kp,
                                      span=t // 2, splits=2, scale=d ** -0.5,
                                      kv_layout=kv_layout, config=config,
                                      selection=selection,
                                      segment=128 if selection == "columns" else 16)

  assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_int_to_f32_is_exact():
  x = jnp.asarray(np.random.default_rng(0).integers(-(1 << 22) + 1, 1 << 22, 4096), jnp.int32)
  np.testing.assert_array_equal(np.asarray(mgpu_common.int_to_f32(x)), np.asarray(x, np.float32))
