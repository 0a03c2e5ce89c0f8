"""The Mosaic GPU flash-attention kernel (pallas_kernels/attention/mgpu_flash.py) on CPU.

What runs where: jax's Mosaic GPU interpreter (private: jax._src.pallas.mosaic_gpu.interpret)
runs the kernel's warpgroups as threads with simulated SMEM, TMA copies and barriers, so the
pipeline protocol, the masks, the block skipping and the clamped edge blocks run here as on the
GPU. It cannot run `layout_cast`, WGMMA with a transposed or register operand, or `run_state`
(JAX 0.10); those GPU-only lines (`native=True`) are instead lowered to Mosaic GPU MLIR on this
CPU-only jaxlib, which builds the WGMMA / TMA / register-layout program and catches shape, layout
and API errors, and they run on the GPU in benchmarks/mgpu_attention.py.

Tolerances against the fp32 jnp reference: out 2e-2 (bf16 output, and P rounded to bf16 before
P.V as on the GPU: a relative 2^-8 per term); LSE 1e-4 (fp32 throughout; the interpreter has no
approximate exp2, so it is tighter than the 1e-3 the GPU check allows). One key too many or too
few moves the LSE of a row with n visible keys by about 1/n (> 3e-3 here): both catch masking
errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend as backend_lib
from pallas_kernels import Route, flash_attention, mgpu_common, reference
from pallas_kernels.attention import mgpu_flash
from pallas_kernels.attention import flash as fa_module
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from pallas_kernels.attention.mgpu_flash import Config, mgpu_flash_attention
from tests.kernels.inputs import keys_shape, normal

GPU_INTERPRETED = Variant("gpu", True)

NO_INTERPRETER = mgpu_flash.interpreter_available()
needs_interpreter = pytest.mark.skipif(NO_INTERPRETER is not None, reason=str(NO_INTERPRETER))
OUT_TOL, LSE_TOL = 2e-2, 1e-4


@pytest.fixture(autouse=True)
def _reset_interpreter():
  """jax's GPU interpreter must be reset after a kernel raised, or the next run fails too."""
  yield
  if NO_INTERPRETER is None:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def inputs(seed, b, lq, h, kvh, t, d, kv_layout="BTHD", dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  q = normal(rng, (b, lq, h, d), dtype)
  k, v = (normal(rng, keys_shape(b, t, kvh, d, kv_layout), dtype) for _ in range(2))
  return q, k, v


def assert_matches_reference(got, q, k, v, *, causal, q_off, kv_len, kv_layout="BTHD"):
  out, lse = got
  ro, rl = reference.flash_attention(q, k, v, causal=causal, q_offset=q_off, kv_len=kv_len,
                                     scale=q.shape[-1] ** -0.5, kv_layout=kv_layout)
  assert out.shape == ro.shape and out.dtype == q.dtype and lse.shape == rl.shape
  assert lse.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ro, np.float32),
                             atol=OUT_TOL, rtol=OUT_TOL)
  lse, rl = np.asarray(lse), np.asarray(rl)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rl))
  finite = np.isfinite(rl)
  np.testing.assert_allclose(lse[finite], rl[finite], atol=LSE_TOL, rtol=LSE_TOL)


# name: (batch, q_len, q_heads, kv_heads, keys, d, causal, q_offset, kv_len, layout, Config)
CASES = {
    # a whole prompt: square, offset 0; 4 key tiles through a 2-slot ring
    "causal_square_g1_d64": (1, 256, 2, 2, 256, 64, True, (0,), (256,), "BTHD",
                             Config(64, 64, 2)),
    # a chunk at an offset into a cache, per sequence; neither 152 queries nor 320 keys are
    # multiples of a block (clamped last query block and key tile; counts must be multiples of
    # 8, `unsupported`); the second sequence's kv_len cuts the chunk's causal range. Head
    # dim 128 (the interpreter's one case of it: two 64-wide tiles a row) with 2 query heads: its
    # time grows with the CTAs (4 heads: 119 s, 2: 31 s on 2 cores); a group of 4 runs below
    "chunk_offset_g2_d128": (2, 152, 2, 1, 320, 128, True, (163, 7), (320, 150), "BTHD",
                             Config(64, 128, 2)),
    # non-causal with per-sequence lengths, the cache layout, a 3-slot ring
    "noncausal_kvlen_g4_bhtd": (2, 128, 4, 1, 296, 64, False, (0, 0), (296, 77), "BHTD",
                                Config(64, 64, 3)),
    # negative query offsets (mesh ReAttention: a device's part of the scope starts after some
    # of the chunk's queries): rows before the part see nothing; the third sequence no key
    "negative_offset_bhtd": (3, 128, 4, 2, 192, 64, True, (-40, -200, 5), (150, 192, 0), "BHTD",
                             Config(64, 64, 2)),
    # the second sequence has no key at all: its rows are (0, -inf)
    "no_visible_key": (2, 128, 2, 1, 128, 64, True, (0, 0), (128, 0), "BTHD",
                       Config(64, 64, 2)),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_mgpu_kernel_matches_reference_in_interpreter(case):
  b, lq, h, kvh, t, d, causal, q_off, kv_len, kv_layout, config = CASES[case]
  q, k, v = inputs(len(case), b, lq, h, kvh, t, d, kv_layout)
  q_off, kv_len = jnp.asarray(q_off, jnp.int32), jnp.asarray(kv_len, jnp.int32)
  got = mgpu_flash_attention(q, k, v, q_off, kv_len, causal=causal, scale=d ** -0.5,
                             kv_layout=kv_layout, config=config, interpret=True)
  assert_matches_reference(got, q, k, v, causal=causal, q_off=q_off, kv_len=kv_len,
                           kv_layout=kv_layout)
  if case == "no_visible_key":
    assert np.all(np.isneginf(np.asarray(got[1])[1])) and not np.any(np.asarray(got[0])[1])


@needs_interpreter
def test_flash_attention_routes_to_mosaic_when_asked():
  """flash_attention(backend="gpu", tiling=Tiling(impl="mosaic")) runs this kernel (interpreted
  off GPU), fp16 too; decode (one query) falls back to the Triton kernel."""
  q, k, v = inputs(7, 1, 128, 4, 2, 192, 64, dtype=jnp.float16)
  kw = dict(causal=True, q_offset=64, kv_len=192)
  tiling = Tiling(impl="mosaic", block_rows=64, block_keys=64, num_stages=2)
  got = flash_attention(q, k, v, route=Route(backend="gpu"), tiling=tiling, **kw)
  assert_matches_reference(got, q, k, v, causal=True, q_off=jnp.array([64]),
                           kv_len=jnp.array([192]))
  assert fa_module._mosaic_config(GPU_INTERPRETED, q[:, :1], k, v, "BTHD", tiling) is None


def test_routing_defaults():
  """Off GPU, "gpu" stays on the Triton kernel unless asked; what Mosaic cannot run falls back."""
  q, k, v = inputs(8, 1, 128, 4, 2, 192, 64)
  variant = GPU_INTERPRETED
  assert fa_module._mosaic_config(variant, q, k, v, "BTHD", None) is None
  asked = Tiling(impl="mosaic")
  assert fa_module._mosaic_config(variant, q, k, v, "BTHD", asked) == mgpu_flash.DEFAULT_CONFIG
  for why, args in {"fp32": (q.astype(jnp.float32), k.astype(jnp.float32),
                             v.astype(jnp.float32)),
                    "decode": (q[:, :1], k, v),
                    "head dim 32": (q[..., :32], k[..., :32], v[..., :32])}.items():
    assert fa_module._mosaic_config(variant, *args, "BTHD", asked) is None, why
  with pytest.raises(ValueError, match="impl"):
    fa_module._mosaic_config(variant, q, k, v, "BTHD", Tiling(impl="cuda"))


def test_unsupported_and_config_errors():
  q, k, v = inputs(9, 1, 32, 2, 2, 100, 128)
  assert "at least block_q" in mgpu_flash.unsupported(q, k, v, kv_layout="BTHD",
                                                          config=Config())
  big = Config(block_q=64, block_kv=128, stages=4)
  q, k, v = inputs(9, 1, 128, 2, 2, 512, 128)
  assert "SMEM" in mgpu_flash.unsupported(q, k, v, kv_layout="BTHD", config=big)
  q, k, v = inputs(9, 1, 300, 2, 2, 512, 128)  # TMA tiles by 8: found on the H200
  assert "multiple of 8" in mgpu_flash.unsupported(q, k, v, kv_layout="BTHD",
                                                        config=Config())
  q, k, v = inputs(9, 1, 128, 2, 2, 999, 128)
  kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  assert "multiple of 8" in mgpu_flash.unsupported(q, kt, vt, kv_layout="BHTD",
                                                        config=Config())
  assert mgpu_flash.unsupported(q, k, v, kv_layout="BTHD", config=Config()) is None
  with pytest.raises(ValueError, match="multiples of 64"):
    Config(block_q=32)
  with pytest.raises(ValueError, match="at least 2"):
    Config(stages=1)
  with pytest.raises(ValueError, match="at least block_q"):
    mgpu_flash_attention(q[:, :32], k, v, jnp.zeros(1, jnp.int32), jnp.full(1, 512, jnp.int32),
                         causal=True, scale=0.1)


@needs_interpreter
def test_pipeline_has_no_races():
  """The interpreter's race detector over the K/V ring (4 tiles through 2 slots, both warpgroups,
  causal so that one warpgroup runs the epilogue): every refill is ordered after both releases.
  (Lq is a multiple of 2 * block_q here: clamped edge blocks write some rows twice, on purpose.)"""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  q, k, v = inputs(10, 1, 128, 1, 1, 256, 64)
  off, kv_len = jnp.array([128], jnp.int32), jnp.array([256], jnp.int32)
  got = mgpu_flash_attention(q, k, v, off, kv_len, causal=True, scale=0.125,
                             config=Config(64, 64, 2),
                             interpret=InterpretGPUParams(detect_races=True))
  jax.block_until_ready(got)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_reference(got, q, k, v, causal=True, q_off=off, kv_len=kv_len)


LOWERINGS = [(128, True, "BTHD", None), (64, False, "BHTD", None), (128, True, "BHTD", "lane"),
             (64, True, "BTHD", "warpgroup")]


@pytest.mark.parametrize("lq,t,kv_layout", [(304, 5000, "BTHD"), (136, 1000, "BHTD")])
def test_lengths_that_pass_unsupported_lower(lq, t, kv_layout):
  """Query and key counts off the block sizes that `unsupported` accepts lower for CUDA (the
  interpreter has no TMA, so it cannot find what the tiling of 8 rejects)."""
  q = jax.ShapeDtypeStruct((2, lq, 32, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct(keys_shape(2, t, 8, 128, kv_layout), jnp.bfloat16)
  ints = jax.ShapeDtypeStruct((2,), jnp.int32)
  assert mgpu_flash.unsupported(q, k, k, kv_layout=kv_layout, config=Config()) is None

  def f(q, k, v, off, kv_len):
    return mgpu_flash_attention(q, k, v, off, kv_len, causal=True, scale=0.1,
                                kv_layout=kv_layout, config=Config())

  assert "mosaic_gpu" in jax.jit(f).trace(q, k, k, ints, ints).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("d,causal,kv_layout,semantics", LOWERINGS)
def test_native_kernel_lowers_to_mosaic_gpu(d, causal, kv_layout, semantics):
  """The GPU-only code (WGMMA from SMEM and registers, layout casts, run_state) lowers to a Mosaic
  GPU custom call on this CPU-only jaxlib, at the shapes of the device benchmark."""
  b, lq, h, kvh, t = 1, 2048, 32, 8, 4096
  q = jax.ShapeDtypeStruct((b, lq, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct(keys_shape(b, t, kvh, d, kv_layout), jnp.bfloat16)
  ints = jax.ShapeDtypeStruct((b,), jnp.int32)
  config = Config(64, 128, 2, semantics=semantics)

  def f(q, k, v, off, kv_len):
    return mgpu_flash_attention(q, k, v, off, kv_len, causal=causal, scale=d ** -0.5,
                                kv_layout=kv_layout, config=config)

  text = jax.jit(f).trace(q, k, k, ints, ints).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_smem_estimate_agrees_with_mosaic_lowering(monkeypatch):
  """At d=128, 3 stages of 128 keys fit in a CTA's 227 KiB and 4 do not: `unsupported` says so,
  and Mosaic's own check at lowering agrees when the estimate is bypassed."""
  q = jax.ShapeDtypeStruct((1, 256, 8, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
  ints = jax.ShapeDtypeStruct((1,), jnp.int32)

  def lower(config):
    f = lambda q, k, v, o, n: mgpu_flash_attention(q, k, v, o, n, causal=True, scale=0.1,  # noqa
                                                   config=config)
    return jax.jit(f).trace(q, k, k, ints, ints).lower(lowering_platforms=("cuda",))

  fits, too_big = Config(64, 128, 3), Config(64, 128, 4)
  assert mgpu_flash.unsupported(q, k, k, kv_layout="BTHD", config=fits) is None
  assert "SMEM" in mgpu_flash.unsupported(q, k, k, kv_layout="BTHD", config=too_big)
  lower(fits)
  monkeypatch.setattr(mgpu_common, "SMEM_LIMIT", 1 << 30)
  with pytest.raises(Exception, match="exceeds available shared memory"):
    lower(too_big)


def test_routing_on_a_hopper_gpu(monkeypatch):
  """With a (pretended) native Hopper GPU: prefill goes to Mosaic unless cuDNN can express it
  (offset 0, BTHD) and mosaic_before_cudnn is off; prefill_impl="triton" and decode keep the
  Triton kernel. The kernels themselves are stubbed (returning an (out, lse) pair as they do):
  this checks only which one is called."""
  calls = []
  options = KernelOptions(prefill_impl="mosaic", mosaic_before_cudnn=False)
  monkeypatch.setattr(backend_lib, "resolve", lambda backend: Variant("gpu", False))
  monkeypatch.setattr(backend_lib, "is_hopper", lambda: True)
  monkeypatch.setattr(fa_module, "_cudnn",
                      lambda *a, **kw: calls.append("cudnn") or ("cudnn", None))
  monkeypatch.setattr(fa_module.mgpu_flash, "mgpu_flash_attention",
                      lambda *a, **kw: calls.append("mosaic") or ("mosaic", None))
  monkeypatch.setattr(fa_module, "_gpu", lambda *a, **kw: calls.append("triton") or 1 / 0)
  q, k, v = inputs(11, 1, 128, 4, 2, 256, 128)

  def route(q, k, v, **kw):
    calls.clear()
    try:
      flash_attention(q, k, v, route=Route(backend="gpu", kernels=options), **kw)
    except ZeroDivisionError:  # the stubbed Triton kernel
      pass
    return calls[0]

  assert route(q, k, v) == "cudnn"
  assert route(q, k, v, q_offset=5) == "mosaic"
  assert route(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), kv_layout="BHTD") == "mosaic"
  assert route(q, k, v, tiling=Tiling(impl="mosaic")) == "mosaic"
  assert route(q[:, :1], k, v, q_offset=255) == "triton"
  options = KernelOptions(prefill_impl="mosaic", mosaic_before_cudnn=True)
  assert route(q, k, v) == "mosaic"
  options = KernelOptions(prefill_impl="triton", mosaic_before_cudnn=True)
  assert route(q, k, v, q_offset=5) == "triton"
