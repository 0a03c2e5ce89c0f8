"""One-token decode over an int8 cache on the Mosaic GPU kernel (attention/mgpu_decode.py) on CPU.

The kernel multiplies the keys as stored with the query rows quantized per row, as
KernelOptions.decode_int8_products does, so the reference is the jnp route computing those
products (reference.product_scores): scores exact in int32, the values converted exactly and
their scales folded into the probabilities, which round to bf16 as the outputs do. In jax's
Mosaic GPU interpreter (plain dot products of the SMEM tiles for WGMMA); the native code lowers
to Mosaic GPU on this CPU-only jaxlib and ran on an H200 (benchmarks/results/
mgpu_decode_check_h200.txt: LSE within 2e-6, outputs within one bf16 step).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, flash_attention, mgpu_common, quant
from pallas_kernels import backend as backend_lib
from pallas_kernels.attention import flash as fa_module
from pallas_kernels.attention import mgpu_decode, mgpu_decode_compute
from pallas_kernels.backend import Variant
from pallas_kernels.decode import split_merge
from pallas_kernels.gpu import Tiling
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import keys_shape, normal, with_outliers

NO_INTERPRETER = mgpu_common.interpreter_available()
needs_interpreter = pytest.mark.skipif(NO_INTERPRETER is not None, reason=str(NO_INTERPRETER))
MOSAIC = Tiling(impl="mosaic")
PRODUCTS = KernelOptions(decode_int8_products=True)


@pytest.fixture(autouse=True)
def _reset_interpreter():
  yield
  if NO_INTERPRETER is None:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _inputs(b, h, kvh, t, d, kv_layout, seed=0, kv_dtype=jnp.int8):
  rng = np.random.default_rng(seed)
  q = normal(rng, (b, 1, h, d), jnp.bfloat16)
  k = with_outliers(rng, normal(rng, keys_shape(b, t, kvh, d, kv_layout)))
  v = normal(rng, keys_shape(b, t, kvh, d, kv_layout))
  return q, quant.quantize(k, kv_dtype), quant.quantize(v, kv_dtype)


def _decode(q, k, v, route, kv_layout, *, causal, q_offset, kv_len, tiling=None):
  out, lse = flash_attention(q, k, v, causal=causal, q_offset=jnp.asarray(q_offset),
                             kv_len=jnp.asarray(kv_len), kv_layout=kv_layout, route=route,
                             tiling=tiling)
  return jax.block_until_ready((out.astype(jnp.float32), lse))  # one interpreted call at a time


@needs_interpreter
@pytest.mark.parametrize("h,kvh,d,kv_layout,causal,merge_kernel", [
    (12, 2, 128, "BHTD", True, True),  # 6 query heads a KV head (10 zero rows), the merge kernel
    (6, 3, 64, "BTHD", False, False),  # d 64 (its own swizzles), jnp's merge
])
def test_interpreted_kernel_matches_the_reference_products(h, kvh, d, kv_layout, causal,
                                                           merge_kernel):
  """Ragged lengths over two key splits: a sequence whose keys end inside a split's last tile
  (the clamped, masked tile), one whose keys end before the second split starts (an empty
  split), the query before the last key (causal) or not."""
  t = 520
  q, k, v = _inputs(2, h, kvh, t, d, kv_layout)
  where = dict(causal=causal, q_offset=(518, 200), kv_len=(520, 201))
  options = KernelOptions(decode_merge_kernel=merge_kernel)
  got = _decode(q, k, v, Route(backend="gpu", kernels=options), kv_layout,
                tiling=Tiling(impl="mosaic", key_splits=2), **where)
  ref = _decode(q, k, v, Route(backend="reference", kernels=PRODUCTS), kv_layout, **where)
  np.testing.assert_allclose(got[0], ref[0], atol=2e-2, rtol=2e-2)  # bf16 outputs
  np.testing.assert_allclose(got[1], ref[1], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kv_layout,d,h", [("BHTD", 128, 32), ("BTHD", 64, 16 * 8)])
def test_native_kernel_lowers_to_mosaic_gpu(kv_layout, d, h):
  """The transposed 8-bit and 16-bit WGMMA operands, their matching swizzles, the 8-bit
  register layout of the values' conversion and the SMEM check, at the 8B's shape (128K keys)
  and at 16 query heads a KV head with d 64."""
  b, kvh, t = 1, 8, 131072
  shape = keys_shape(b, t, kvh, d, kv_layout)
  args = (jax.ShapeDtypeStruct((b, 1, h, d), jnp.bfloat16), jax.ShapeDtypeStruct(shape, jnp.int8),
          jax.ShapeDtypeStruct(shape[:3] + (1,), jnp.float32),
          jax.ShapeDtypeStruct((b,), jnp.int32))

  def f(q, values, scale, pos):
    x = quant.Quantized(values, scale)
    return mgpu_decode.attention(q, x, x, pos, pos + 1, causal=True, scale=d ** -0.5,
                                 kv_layout=kv_layout, merge_kernel=True)

  assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_route_takes_the_kernel_where_asked_and_it_applies(monkeypatch):
  """flash_attention runs mgpu_decode for one-token decode over int8 K/V where the variant asks
  for Mosaic (a native Hopper GPU by KernelOptions.decode_impl, or a call's Tiling(impl=
  "mosaic"), whose block_keys / num_stages configure it), not for E4M3, several queries, or
  options and tilings only the Triton kernel has."""
  monkeypatch.setattr(backend_lib, "is_hopper", lambda: True)  # a pretended native Hopper GPU
  q, k, v = _inputs(1, 8, 2, 256, 64, "BHTD")
  hopper = Variant("gpu", interpret=False)
  choose = fa_module._mosaic_decode
  assert choose(hopper, q, k, v, "BHTD", None, KernelOptions())  # the default: decode_impl
  assert not choose(hopper, q, k, v, "BHTD", None, KernelOptions(decode_impl="triton"))
  assert choose(hopper, q, k, v, "BHTD", MOSAIC, KernelOptions(decode_impl="triton"))
  interpreted = Variant("gpu", interpret=True)
  assert not choose(interpreted, q, k, v, "BHTD", None, KernelOptions())
  assert choose(interpreted, q, k, v, "BHTD", MOSAIC, KernelOptions())
  for options in (KernelOptions(decode_int8_products=False),
                  KernelOptions(decode_int8_values=True), KernelOptions(decode_row_groups=True)):
    assert not choose(hopper, q, k, v, "BHTD", None, options), options
  assert not choose(hopper, q, k, v, "BHTD", Tiling(block_keys=32), KernelOptions())  # Triton's
  assert choose(hopper, q, k, v, "BHTD", Tiling(key_splits=4), KernelOptions())
  asked = Tiling(impl="mosaic", block_keys=128, num_stages=2)
  assert choose(hopper, q, k, v, "BHTD", asked, KernelOptions()) == mgpu_decode.DecodeConfig(
      block_kv=128, stages=2)
  # as the prefill kernels: a call the Mosaic kernel cannot take (here its SMEM) runs Triton's
  assert not choose(hopper, q, k, v, "BHTD", Tiling(impl="mosaic", block_keys=256),
                    KernelOptions())
  with pytest.raises(ValueError, match="block_keys, num_stages and key_splits"):
    choose(hopper, q, k, v, "BHTD", Tiling(impl="mosaic", num_warps=2), KernelOptions())
  _, k8, v8 = _inputs(1, 8, 2, 256, 64, "BHTD", kv_dtype=jnp.float8_e4m3fn)
  assert not choose(hopper, q, k8, v8, "BHTD", None, KernelOptions())
  assert not choose(hopper, jnp.concatenate([q, q], 1), k, v, "BHTD", None, KernelOptions())

  assert key_splits_reaching(mgpu_decode, monkeypatch, q, k, v, 256) == [3]


def key_splits_reaching(module, monkeypatch, q, k, v, t: int):
  """The key_splits each call of module.attention got from flash_attention asked for 3 by a
  Tiling(impl="mosaic") (a one-token decode at the last of t keys, BHTD)."""
  calls = []
  monkeypatch.setattr(module, "attention", lambda *a, **kw: calls.append(kw) or (
      jnp.zeros_like(q), jnp.zeros(q.shape[:3], jnp.float32)))
  flash_attention(q, k, v, causal=True, q_offset=t - 1, kv_len=t, kv_layout="BHTD",
                  route=Route(backend="gpu"), tiling=Tiling(impl="mosaic", key_splits=3))
  return [c["key_splits"] for c in calls]


@pytest.mark.parametrize("case,why", [
    (dict(kv_dtype=jnp.float8_e4m3fn), "int8"),
    (dict(lq=2), "one-token"),
    (dict(h=34), "at most 16"),
    (dict(d=96), "head dim"),
    (dict(t=100), "keys"),
    (dict(t=260), "multiple of 8"),
])
def test_unsupported_says_why(case, why):
  b, h, kvh, t, d = 1, case.get("h", 8), 2, case.get("t", 256), case.get("d", 64)
  q, k, v = _inputs(b, h, kvh, t, d, "BHTD", kv_dtype=case.get("kv_dtype", jnp.int8))
  q = jnp.concatenate([q] * case.get("lq", 1), axis=1)
  reason = mgpu_decode.unsupported(q, k, v, kv_layout="BHTD")
  assert reason and why in reason, reason
  with pytest.raises(ValueError, match="mgpu_decode"):
    mgpu_decode.attention(q, k, v, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), causal=True,
                          scale=1.0, kv_layout="BHTD", merge_kernel=False)


def test_config_is_checked():
  with pytest.raises(ValueError, match="block_kv"):
    mgpu_decode.DecodeConfig(block_kv=100)
  with pytest.raises(ValueError, match="stages"):
    mgpu_decode.DecodeConfig(stages=1)
  q, k, v = _inputs(1, 8, 2, 256, 128, "BHTD")
  big = mgpu_decode.DecodeConfig(block_kv=128, stages=4, landing=4, per_core=2)
  assert "SMEM" in mgpu_decode.unsupported(q, k, v, kv_layout="BHTD", config=big)


@pytest.mark.parametrize("rows,d,splits,parts,dtype", [(5, 32, 3, 4, jnp.float32),
                                                      (4, 128, 49, 64, jnp.bfloat16),
                                                      (16, 64, 1, 1, jnp.float32)])
def test_merge_reads_the_rows_minor_partials(rows, d, splits, parts, dtype):
  """split_merge with rows_minor (the kernel's [.., d, rows] partials) equals the merge of the
  same partials laid out rows-major, by the merge kernel (interpreted) and by jnp: NaN in the
  unwritten splits, empty splits, a row empty in every split, channels in several blocks."""
  rng = np.random.default_rng(rows + d)
  outs = np.full((2, 3, parts, 16, d), np.nan, np.float32)  # [B, KV, P, R, d]
  lses = np.full((2, 3, parts, 16, 1), np.nan, np.float32)
  outs[:, :, :splits] = rng.standard_normal((2, 3, splits, 16, d))
  lses[:, :, :splits] = rng.standard_normal((2, 3, splits, 16, 1)) * 3
  lses[:, :, :splits][rng.random((2, 3, splits, 16, 1)) < 0.2] = -np.inf
  lses[0, :, :splits, 1] = -np.inf
  outs, lses = jnp.asarray(outs), jnp.asarray(lses)
  # jnp's merge takes only the written splits (split_merge.parts(splits, False) of them)
  written = outs[:, :, :splits], lses[:, :, :splits]
  want = split_merge.merge(*written, splits=splits, rows=rows, dtype=jnp.float32, kernel=False,
                           interpret=True)
  for kernel in (True, False):
    o, s = (outs, lses) if kernel else written
    got = split_merge.merge(jnp.swapaxes(o, 3, 4), s[..., 0], splits=splits, rows=rows,
                            dtype=dtype, kernel=kernel, interpret=True, rows_minor=True)
    tol = 2e-2 if kernel and dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got[0][:, :, :rows], np.float32),
                               want[0][:, :, :rows], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[1][:, :, :rows], want[1][:, :, :rows], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(got[1][0, :, 1])).all()


def test_rows_minor_merge_lowers_to_triton():
  def call(o, s):
    return split_merge.merge(o, s, splits=49, rows=4, dtype=jnp.bfloat16, kernel=True,
                             interpret=False, rows_minor=True)
  assert "triton" in cuda_text(call, jnp.ones((1, 8, 64, 128, 16)), jnp.ones((1, 8, 64, 16)))


def test_each_cost_variant_lowers():
  """experiments/mgpu_decode_costs.py's variants (a stage left out, or several joined by +)
  lower to Mosaic GPU, each to a kernel of its own (a variant that no longer compiles, or
  whose patch no longer reaches the kernel, would time nothing or the wrong thing)."""
  from experiments import mgpu_decode_costs
  b, h, kvh, t, d = 1, 32, 8, 4096, 128
  shape = keys_shape(b, t, kvh, d, "BHTD")
  x = quant.Quantized(jax.ShapeDtypeStruct(shape, jnp.int8),
                      jax.ShapeDtypeStruct(shape[:3] + (1,), jnp.float32))

  texts = {}
  for stage in ("none", *mgpu_decode_costs.STAGES, "compute+convert"):
    def f(q, k, pos):  # a function of its own each time: jit's cache is keyed on it
      return mgpu_decode.attention(q, k, k, pos, pos + 1, causal=True, scale=d ** -0.5,
                                   kv_layout="BHTD", merge_kernel=True)

    with mgpu_decode_costs.leaving_out(stage):
      mgpu_decode._kernel.__wrapped__.clear_cache()  # else it serves another variant's trace
      texts[stage] = jax.jit(f).trace(jax.ShapeDtypeStruct((b, 1, h, d), jnp.bfloat16), x,
                                      jax.ShapeDtypeStruct((b,), jnp.int32)).lower(
                                          lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in texts[stage], stage
  mgpu_decode._kernel.__wrapped__.clear_cache()
  assert len(set(texts.values())) == len(texts)
  step = mgpu_decode_compute._step
  with pytest.raises(ValueError, match="not one of"):
    mgpu_decode_costs.leaving_out("compute+nothing")
  assert mgpu_decode_compute._step is step  # refused before patching anything


def test_column_max_reads_the_wgmma_layout_as_it_is():
  """DecodeOps.column_max's native code (inline Mosaic GPU, run only on a GPU) indexes the score
  tile's registers by the WGMMA layout's structure: a [64, 16] tile's registers (1, 2 column
  blocks, ..., 2 row blocks, ...), 2 floats each, lanes 4 to a row with lane % 4 the column pair,
  warps on the rows; its [16] result 2 registers of 2. A jax whose layout differs fails here,
  not silently on the GPU."""
  import jax.experimental.mosaic.gpu as mgpu
  layout = mgpu.WGMMA_LAYOUT
  assert layout.registers_shape((64, 16)) == (1, 2, 1, 1, 2, 1, 1, 1, 1)
  assert layout.tiling.tiles == ((64, 8), (16, 8), (8, 8), (2,))
  assert (layout.warp_dims, layout.lane_dims, layout.vector_dim) == ((-7,), (-3, -2), -1)
  assert layout.reduce((0,)).registers_shape((mgpu_decode.ROWS,)) == (2, 1, 1)
