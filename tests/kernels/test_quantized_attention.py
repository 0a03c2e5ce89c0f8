"""Quantized K/V (pallas_kernels.quant.Quantized: int8 or float8_e4m3fn values, one fp32 scale per
key and kv head) in the attention kernels: each variant (GPU and TPU in Pallas interpret mode,
the Mosaic GPU kernel in jax's interpreter) against the jnp reference, which dequantizes to q's
dtype first; the decode kernel reads no dequantized copy; bad inputs fail in one line.

Inputs: keys with outlier channels (two head-dim channels 20-50x larger, as KIVI reports for
keys), key counts off the tile, GQA, both key layouts, int8 and E4M3, decode (one query,
split-K) and prefill chunks (causal, per-sequence q_offset).

Tolerances (out, LSE; absolute and relative):
- fp32 q: 2e-5, as the unquantized kernels: the reference's keys are fp32 products value x scale
  and the kernels' (q . values) x scale in fp32 differ only in rounding order.
- bf16 q, Triton / TPU flash and unrotated gathered: 2e-2 (one bf16 rounding of out) and 3e-2 on
  the LSE. The reference rounds every dequantized element to bf16 (relative 2^-9, independently);
  these kernels multiply exact int8 / E4M3 products by the fp32 scales. With 50x outlier channels
  the scores reach ~20 and that rounding moved the LSE by up to 1.4e-2 (against the fp32
  definition these kernels agree to fp32: benchmarks/quant_kernels.py records both). The fp32
  cases hold the masks to 2e-5.
- bf16 q, Mosaic GPU flash and rotated keys (gathered with key_rope_freqs): 2e-2 / 1e-4, as
  unquantized bf16: these kernels dequantize to bf16 first as the reference does (one fp32
  product, rounded once) and go on as the bf16 kernels.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_attention, flash_attention, gathered_attention, quant, reference
from pallas_kernels import Route, read
from pallas_kernels.attention import chunk as chunk_module
from pallas_kernels.attention import flash as fa_module
from pallas_kernels.attention import gathered as ga_module
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from pallas_kernels.attention.mgpu_flash import Config, interpreter_available, mgpu_flash_attention
from tests.kernels.cuda_lowering import cuda_text
from tests.kernels.inputs import keys_shape, normal, with_outliers
from tests.kernels.test_attention_kernels import assert_close as attention_assert_close

F8 = jnp.float8_e4m3fn
TOL = {"fp32": (2e-5, 2e-5), "bf16": (2e-2, 3e-2), "bf16_dequantized": (2e-2, 1e-4)}


def assert_close(got, ref, tol: str):
  attention_assert_close(got, ref, TOL[tol])


def qkv(seed, b, lq, h, kvh, t, d, kv_layout, dtype, kv_dtype):
  """q, and K (outlier channels) and V quantized to kv_dtype."""
  rng = np.random.default_rng(seed)
  q = normal(rng, (b, lq, h, d), dtype)
  k = with_outliers(rng, normal(rng, keys_shape(b, t, kvh, d, kv_layout), dtype))
  v = normal(rng, keys_shape(b, t, kvh, d, kv_layout), dtype)
  return q, quant.quantize(k, kv_dtype), quant.quantize(v, kv_dtype)


# (batch, q_len, q heads, kv heads, keys, d, q_offset, kv_len, layout, q dtype, kv dtype, tiling)
FLASH = {
    # decode: one query per sequence (group 4), split-K over 517 keys
    "decode_int8_bhtd": (2, 1, 8, 2, 517, 128, (516, 200), (517, 201), "BHTD", jnp.bfloat16,
                         jnp.int8, Tiling(key_splits=4)),
    # prefill chunks at per-sequence offsets, group 3, 333 keys in 64-key tiles
    "chunk_fp8_bthd": (2, 20, 6, 2, 333, 64, (313, 50), (333, 77), "BTHD", jnp.float32, F8,
                       Tiling(key_splits=2, block_keys=64)),
    "chunk_int8_bthd": (2, 20, 6, 2, 333, 64, (313, 50), (333, 77), "BTHD", jnp.float32, jnp.int8,
                        None),
}


@pytest.mark.parametrize("variant,case", [("gpu", "decode_int8_bhtd"), ("tpu", "decode_int8_bhtd"),
                                          ("gpu", "chunk_fp8_bthd"), ("tpu", "chunk_int8_bthd")])
def test_flash_attention_reads_quantized_kv(variant, case):
  b, lq, h, kvh, t, d, off, kv_len, kv_layout, dtype, kv_dtype, tiling = FLASH[case]
  q, k, v = qkv(len(case), b, lq, h, kvh, t, d, kv_layout, dtype, kv_dtype)
  kw = dict(causal=True, q_offset=jnp.asarray(off), kv_len=jnp.asarray(kv_len), kv_layout=kv_layout)
  got = flash_attention(q, k, v, route=Route(backend=variant), tiling=tiling, **kw)
  ref = flash_attention(q, k, v, route=Route(backend="reference"), **kw)
  assert_close(got, ref, "fp32" if dtype == jnp.float32 else "bf16")
  # the reference is the dequantize-first definition
  deq = [quant.dequantize(x, dtype) for x in (k, v)]
  assert_close(ref, flash_attention(q, *deq, route=Route(backend="reference"), **kw), "fp32")


@pytest.mark.parametrize("v_scale", [1.0, 1e-4])
def test_fp8_decode_products_in_fp16(v_scale):
  """KernelOptions.fp8_fp16_products (the default): bf16 queries over E4M3 K/V, the split-K
  kernel's products in fp16, within the bf16 tolerance of the reference; int8 keeps bf16
  products unless int8_fp16_products asks (its PTX conversion: the lowering test below). Values of 1e-4 (scales ~1e-6) would put p * scale among fp16's subnormals: the
  tile's largest scale is taken out first (the output is compared relative to that size)."""
  from pallas_kernels import KernelOptions
  b, lq, h, kvh, t, d, off, kv_len, kv_layout, dtype, _, tiling = FLASH["decode_int8_bhtd"]
  kw = dict(causal=True, q_offset=jnp.asarray(off), kv_len=jnp.asarray(kv_len), kv_layout=kv_layout)
  for kv_dtype, fp16 in ((F8, True), (jnp.int8, False), ("int8_fp16_products", True)):
    opt_in = kv_dtype == "int8_fp16_products"  # int8 in fp16 (the interpreter converts plainly)
    kv_dtype = jnp.int8 if opt_in else kv_dtype
    q, k, v = qkv(7, b, lq, h, kvh, t, d, kv_layout, dtype, kv_dtype)
    v = quant.Quantized(v.values, v.scale * v_scale)
    run = lambda q, k, v, opts: flash_attention(  # noqa: E731
        q, k, v, route=Route(backend="gpu", kernels=opts), tiling=tiling, **kw)
    asked = KernelOptions(int8_fp16_products=opt_in)
    got = run(q, k, v, asked)
    ref = flash_attention(q, k, v, route=Route(backend="reference"), **kw)
    assert_close((got[0] / v_scale, got[1]), (ref[0] / v_scale, ref[1]), "bf16")
    for opts, want in ((asked, fp16), (KernelOptions(fp8_fp16_products=False), False)):
      text = str(jax.make_jaxpr(lambda q, k, v, o=opts: run(q, k, v, o))(q, k, v))
      assert bool(re.search(r"(?<![\w])f16\[", text)) == want, (kv_dtype, opts.fp8_fp16_products)


ROPE = 1.0 / 10000.0 ** (np.arange(0, 128, 2) / 128)


# (variant, layout, q_len, d, q dtype, kv dtype, rotate)
@pytest.mark.parametrize("variant,layout,lq,d,dtype,kv_dtype,rope", [
    ("gpu", "BTHD", 1, 128, jnp.bfloat16, jnp.int8, True),
    ("tpu", "BHTD", 1, 128, jnp.bfloat16, jnp.int8, True),
    ("gpu", "BHTD", 3, 64, jnp.float32, F8, False),
    ("tpu", "BTHD", 3, 64, jnp.float32, jnp.int8, False)])
def test_gathered_attention_reads_quantized_kv(variant, layout, lq, d, dtype, kv_dtype, rope):
  b, h, kvh, t, n = 2, 8, 2, 200, 100
  q, k, v = qkv(lq + d, b, lq, h, kvh, t, d, layout, dtype, kv_dtype)
  rng = np.random.default_rng(d)
  idx = jnp.asarray(rng.integers(-5, t + 5, (b, kvh, n)))  # some out of range: invalid
  valid = jnp.asarray(rng.random((b, kvh, n)) > 0.3)
  kw = dict(kv_layout=layout, key_rope_freqs=jnp.asarray(ROPE[: d // 2], jnp.float32)
            if rope else None)
  tiling = Tiling(key_splits=2, block_keys=64) if variant == "gpu" else None
  got = gathered_attention(q, k, v, idx, valid, route=Route(backend=variant), tiling=tiling, **kw)
  ref = gathered_attention(q, k, v, idx, valid, route=Route(backend="reference"), **kw)
  assert_close(got, ref, "fp32" if dtype == jnp.float32 else "bf16_dequantized")


def test_gathered_reference_dequantizes_then_rotates():
  q, k, v = qkv(3, 1, 1, 4, 2, 40, 64, "BHTD", jnp.bfloat16, jnp.int8)
  idx = jnp.broadcast_to(jnp.arange(30)[::-1], (1, 2, 30))
  kw = dict(kv_layout="BHTD", key_rope_freqs=jnp.asarray(ROPE[:32], jnp.float32),
            route=Route(backend="reference"))
  deq = [quant.dequantize(x, jnp.bfloat16) for x in (k, v)]
  assert_close(gathered_attention(q, k, v, idx, **kw), gathered_attention(q, *deq, idx, **kw),
               "fp32")


@pytest.mark.parametrize("variant,kv_dtype", [("gpu", jnp.int8), ("gpu", F8), ("tpu", jnp.int8)])
def test_gathered_attention_adds_the_key_offset_before_rotating(variant, kv_dtype):
  """A cache of pre-RoPE keys stored less a constant c per (kv head, channel), which it holds
  (quant.Quantized.offset; model/decoder.py: the 8-bit cache's calibrated mean), attends as its
  keys plus c: each kernel as the reference, and the reference as keys + c given whole
  (dequantized, in q's dtype) and rotated."""
  b, h, kvh, t, d, n = 2, 8, 2, 200, 128, 100
  q, stored, v = qkv(5, b, 1, h, kvh, t, d, "BHTD", jnp.bfloat16, kv_dtype)
  rng = np.random.default_rng(6)
  c = normal(rng, (kvh, d), jnp.float32) * 4  # several times the keys' own size
  k = dataclasses.replace(stored, offset=c[None, :, None, :])  # BHTD: [1, KV, 1, d]
  idx = jnp.asarray(rng.integers(-5, t + 5, (b, kvh, n)))
  valid = jnp.asarray(rng.random((b, kvh, n)) > 0.3)
  kw = dict(kv_layout="BHTD", key_rope_freqs=jnp.asarray(ROPE[: d // 2], jnp.float32))
  tiling = Tiling(key_splits=2, block_keys=64) if variant == "gpu" else None
  got = gathered_attention(q, k, v, idx, valid, route=Route(backend=variant), tiling=tiling,
                           **kw)
  ref = gathered_attention(q, k, v, idx, valid, route=Route(backend="reference"), **kw)
  assert_close(got, ref, "bf16_dequantized")
  whole = reference._in_model_dtype(stored, jnp.bfloat16) + c[None, :, None].astype(jnp.bfloat16)
  plain = gathered_attention(q, whole, reference._in_model_dtype(v, jnp.bfloat16), idx, valid,
                             route=Route(backend="reference"), **kw)
  assert_close(ref, plain, "fp32")
  assert not np.allclose(ref[1], gathered_attention(q, stored, v, idx, valid,
                                                    route=Route(backend="reference"),
                                                    **kw)[1], atol=1e-2)  # c moves the scores
  with pytest.raises(ValueError, match="keys holding an offset are read here only to be rotated"):
    gathered_attention(q, k, v, idx, valid, kv_layout="BHTD", route=Route())


NO_INTERPRETER = interpreter_available()


@pytest.mark.skipif(NO_INTERPRETER is not None, reason=str(NO_INTERPRETER))
@pytest.mark.parametrize("kv_dtype,layout,t", [(jnp.int8, "BHTD", 192), (F8, "BTHD", 200)])
def test_mosaic_kernel_dequantizes_tiles_in_the_interpreter(kv_dtype, layout, t):
  """A chunk at an offset (64 queries per warpgroup, 64-key tiles through a 2-slot ring, GQA 2;
  200 BTHD keys: the last tile clamped); int8 also under the race detector (the dequantizing
  memory warpgroup against the two compute warpgroups)."""
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  q, k, v = qkv(t, 1, 128, 2, 1, t, 64, layout, jnp.bfloat16, kv_dtype)
  off, kv_len = jnp.array([64], jnp.int32), jnp.array([t - 8], jnp.int32)
  races = kv_dtype == jnp.int8
  try:
    got = mgpu_flash_attention(q, k, v, off, kv_len, causal=True, scale=0.125, kv_layout=layout,
                               config=Config(64, 64, 2),
                               interpret=InterpretGPUParams(detect_races=True) if races else True)
    jax.block_until_ready(got)
    assert not (races and interpret_pallas_call.get_races().races_found)
  finally:
    interpret_pallas_call.reset_gpu_interpret_mode_state()
  ref = reference.flash_attention(q, k, v, causal=True, q_offset=off, kv_len=kv_len, scale=0.125,
                                  kv_layout=layout)
  assert_close(got, ref, "bf16_dequantized")


@pytest.mark.parametrize("kv_dtype,d,layout,semantics", [
    (jnp.int8, 128, "BHTD", "lane"), (F8, 128, "BTHD", "warpgroup"), (jnp.int8, 64, "BTHD", None)])
def test_native_mosaic_kernel_lowers_with_quantized_kv(kv_dtype, d, layout, semantics):
  """The GPU-only code of the dequantizing producer (typed layouts of the 8-bit and scale loads,
  the conversions, the bf16 stores into the swizzled ring, its register split) lowers to Mosaic
  GPU on this CPU, at an 8B layer's shapes."""
  S = jax.ShapeDtypeStruct
  b, lq, h, kvh, t = 1, 2048, 32, 8, 4096
  shape = keys_shape(b, t, kvh, d, layout)
  kv = quant.Quantized(S(shape, kv_dtype), S((*shape[:-1], 1), jnp.float32))
  ints = S((b,), jnp.int32)
  config = Config(64, 128, 2, semantics=semantics)
  assert fa_module.mgpu_flash.unsupported(S((b, lq, h, d), jnp.bfloat16), kv, kv,
                                          kv_layout=layout, config=config) is None

  def f(q, k, v, off, kv_len):
    return mgpu_flash_attention(q, k, v, off, kv_len, causal=True, scale=d ** -0.5,
                                kv_layout=layout, config=config)

  text = jax.jit(f).trace(S((b, lq, h, d), jnp.bfloat16), kv, kv, ints, ints).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_mosaic_routing_takes_quantized_kv():
  q, k, v = qkv(5, 1, 128, 4, 2, 256, 64, "BTHD", jnp.bfloat16, jnp.int8)
  asked = Tiling(impl="mosaic")
  variant = Variant("gpu", True)
  assert fa_module._mosaic_config(variant, q, k, v, "BTHD", asked) is not None
  assert fa_module._mosaic_config(variant, q.astype(jnp.float32), k, v, "BTHD", asked) is None
  assert fa_module._mosaic_config(variant, q[:, :1], k, v, "BTHD", asked) is None  # decode


def _float_temporaries(jaxpr, min_size):
  """(op, shape) of the float arrays of at least min_size elements that ops outside the Pallas
  kernels make."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      continue
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _float_temporaries(sub.jaxpr, min_size)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found += _float_temporaries(sub, min_size)
    for var in eqn.outvars:
      aval = var.aval
      if (hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating)
          and aval.size >= min_size):
        found.append((eqn.primitive.name, aval.str_short()))
  return found


@pytest.mark.parametrize("kernel", ["flash", "gathered"])
def test_decode_reads_no_dequantized_copy(kernel):
  """Split-K decode over a quantized BHTD cache of 4096 keys: the kernel takes the 8-bit values and
  the scales; nothing outside it makes a float array of even half the cache's values (in bf16
  that would be the dequantized copy decode must not read). Traced, not run."""
  S = jax.ShapeDtypeStruct
  b, h, kvh, t, d, n = 1, 32, 8, 4096, 128, 1024
  kv = quant.Quantized(S((b, kvh, t, d), jnp.int8), S((b, kvh, t, 1), jnp.float32))
  q = S((b, 1, h, d), jnp.bfloat16)
  if kernel == "flash":
    fn = lambda q, k, v, pos: flash_attention(  # noqa: E731
        q, k, v, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD", route=Route(backend="gpu"))
    args = (q, kv, kv, S((b,), jnp.int32))
  else:
    fn = lambda q, k, v, idx: gathered_attention(  # noqa: E731
        q, k, v, idx, kv_layout="BHTD", key_rope_freqs=jnp.ones(d // 2), route=Route(backend="gpu"))
    args = (q, kv, kv, S((b, kvh, n), jnp.int32))
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  assert _float_temporaries(jaxpr, kvh * t * d // 2) == []
  assert "pallas_call" in str(jaxpr)


@pytest.mark.parametrize("kv_dtype", [jnp.int8, F8])
def test_quantized_triton_kernels_lower_for_cuda(kv_dtype):
  """flash decode and gathered decode (rotating keys) over 8-bit K/V lower to Triton for CUDA."""
  b, kvh, t, d = 1, 8, 4096, 128
  tl = Tiling().pick(block_rows=16, block_keys=128, num_warps=4, num_stages=2, prefetch=False)
  qr = jnp.ones((b, kvh, 16, d), jnp.bfloat16)
  k = jnp.ones((b, kvh, t, d), kv_dtype)
  scale = jnp.ones((b, kvh, t), jnp.float32)
  meta = jnp.zeros((b, 2), jnp.int32)
  span, splits = fa_module.gpu.split_plan(kvh, t, 128, 8)

  def flash(qr, k, v, meta, ks, vs):
    return fa_module._gpu(qr, k, v, meta, ks, vs, group=4, span=span, splits=splits, causal=True,
                          scale=0.088, kv_layout="BHTD", tiling=tl, interpret=False)

  assert "triton" in cuda_text(flash, qr, k, k, meta, scale, scale)

  def flash_fp16(qr, k, v, meta, ks, vs):  # KernelOptions.fp8_fp16_products
    return fa_module._gpu(qr, k, v, meta, ks, vs, group=4, span=span, splits=splits, causal=True,
                          scale=0.088, kv_layout="BHTD", tiling=tl, interpret=False,
                          products=jnp.float16)

  text = cuda_text(flash_fp16, qr, k, k, meta, scale, scale)
  # int8 to fp16 by PTX (KernelOptions.int8_fp16_products); E4M3 by Triton's own conversion
  assert "triton" in text and ("prmt.b32" in text) == (kv_dtype == jnp.int8)
  n = 512
  idx, ok = jnp.zeros((b, kvh, n), jnp.int32), jnp.ones((b, kvh, n), jnp.int32)
  table = jnp.ones((1, 2, n, d // 2), jnp.bfloat16)

  def gathered(qr, k, v, idx, ok, ks, vs, table, offset):  # offset: pre-RoPE keys' mean
    return ga_module._gpu(qr, k, v, idx, ok, jnp.full((b, kvh, 1), n), table, ks, vs, offset,
                          span=n // 2, splits=2, parts=2, scale=0.088, kv_layout="BHTD",
                          tiling=Tiling(block_rows=16, block_keys=64, num_warps=4, num_stages=2,
                                        prefetch=False), interpret=False)

  for offset in (None, jnp.ones((kvh, d), jnp.bfloat16)):
    assert "triton" in cuda_text(gathered, qr, k, k, idx, ok, scale, scale, table, offset)


def test_chunk_over_a_quantized_cache():
  """A prefill chunk over an int8 cache (which holds the chunk's keys, quantized, at its slots):
  the flash kernel with the offset, never cuDNN; the chunk's own keys may come as arrays."""
  b, c, h, kvh, t, d = 2, 16, 6, 2, 96, 64
  q, k, v = qkv(11, b, c, h, kvh, t, d, "BHTD", jnp.float32, jnp.int8)
  off = jnp.asarray([37, 0], jnp.int32)
  own = jnp.zeros((b, c, kvh, d), jnp.float32)  # unused off the cuDNN route
  ref = reference.flash_attention(q, k, v, causal=True, q_offset=off, kv_len=off + c,
                                  scale=d ** -0.5, kv_layout="BHTD")
  got = chunk_attention(q, k, v, own, own, off, kv_layout="BHTD", route=Route(backend="gpu"))
  assert_close(got, ref, "fp32")
  assert not chunk_module.cudnn_route(q.astype(jnp.bfloat16), k, Route(backend="gpu"), "BHTD")
  with pytest.raises(ValueError, match="cuDNN cannot read a quantized cache"):
    chunk_attention(q, k, v, own, own, off, kv_layout="BHTD", use_cudnn=True, route=Route())


@pytest.mark.parametrize("kv_dtype", [jnp.int8, F8])
def test_chunk_over_a_quantized_cache_dequantizes_it_first_within_the_cap(monkeypatch, kv_dtype):
  """On a native GPU a prefill chunk over an 8-bit cache runs the bf16 route on a dequantized
  copy while the copy fits `prefill_dequantize_bytes` (the jaxpr makes it), and reads the 8-bit
  cache otherwise; both agree with the reference. The interpreter stands in for the GPU."""
  from pallas_kernels.options import KernelOptions
  b, c, h, kvh, t, d = 2, 16, 6, 2, 96, 64
  q, k, v = qkv(12, b, c, h, kvh, t, d, "BHTD", jnp.float32, kv_dtype)
  off = jnp.asarray([37, 5], jnp.int32)
  own = jnp.zeros((b, c, kvh, d), jnp.float32)
  copy = 2 * k.values.size * 4  # K and V in fp32, q's dtype
  native = Variant("gpu", False)
  assert read.dequantize_first(q, k, native)
  assert read.dequantize_first(q, k, native, KernelOptions(prefill_dequantize_bytes=copy))
  assert not read.dequantize_first(
      q, k, native, KernelOptions(prefill_dequantize_bytes=copy - 1))
  assert not read.dequantize_first(q, k, Variant("gpu", True))  # the interpreter
  assert not read.dequantize_first(q, k, Variant("tpu", False))
  assert not read.dequantize_first(q, k.values.astype(jnp.float32), native)
  with pytest.raises(ValueError, match="prefill_dequantize_bytes=-1 must be a byte count"):
    KernelOptions(prefill_dequantize_bytes=-1)
  ref = reference.flash_attention(q, k, v, causal=True, q_offset=off, kv_len=off + c,
                                  scale=d ** -0.5, kv_layout="BHTD")
  for cap, copies in ((copy, 1), (0, 0)):
    options = KernelOptions(prefill_dequantize_bytes=cap)
    monkeypatch.setattr(read, "dequantize_first",
                        lambda q, k, variant, options=options, real=read.dequantize_first:
                        real(q, k, Variant("gpu", False), options))
    fn = lambda q, k, v, off: chunk_attention(  # noqa: E731
        q, k, v, own, own, off, kv_layout="BHTD", route=Route(backend="gpu", kernels=options))
    made = [m for m in _float_temporaries(jax.make_jaxpr(fn)(q, k, v, off).jaxpr, k.values.size)
            if m[1].startswith("float32")]  # q's dtype (the 8-bit route pads E4M3 values)
    assert len([m for m in made if m[1] == f"float32[{b},{kvh},{t},{d}]"]) >= copies, made
    assert (copies == 0) == (made == []), made
    assert_close(fn(q, k, v, off), ref, "fp32")


def test_quantized_kv_errors():
  q, k, v = qkv(2, 1, 2, 4, 2, 40, 64, "BTHD", jnp.bfloat16, jnp.int8)
  idx = jnp.zeros((1, 2, 8), jnp.int32)
  bad = {"must both be Quantized": (k, v.dequantize(jnp.bfloat16)),
         "with a head dim of 1": (quant.Quantized(k.values, k.scale[..., 0]), v),
         "quantized alike": (k, quant.quantize(v.dequantize(), F8))}
  for message, (kk, vv) in bad.items():
    for call in (lambda: flash_attention(q, kk, vv, route=Route()),
                 lambda: gathered_attention(q, kk, vv, idx, route=Route())):
      with pytest.raises(ValueError, match=message):
        call()
  kf, vf = (quant.quantize(x.dequantize(), F8) for x in (k, v))
  for backend in ("tpu",):
    with pytest.raises(ValueError, match="TPU v5e has no FP8"):
      flash_attention(q, kf, vf, route=Route(backend=backend))
    with pytest.raises(ValueError, match="TPU v5e has no FP8"):
      gathered_attention(q, kf, vf, idx, route=Route(backend=backend))
  with pytest.raises(ValueError, match="cuDNN cannot read a quantized cache"):
    flash_attention(q, k, v, use_cudnn=True, route=Route())
