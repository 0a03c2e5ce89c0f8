"""One-token decode over a 4-bit cache on the Mosaic GPU kernel (attention/mgpu_int4_decode.py) on
CPU: interpreted against the reference over the dequantized cache (fp32), with the route it
replaces (the cache's bf16 copy, then the bf16 kernel) as the yardstick, as int4_decode's tests
do; the native code lowered to Mosaic GPU; the route's choice and the refusals. On an H200 the
kernel's largest errors against the fp32 reference were 0.0098 (outputs) / 0.020 (LSE), the
Triton kernel's 0.0098 / 0.012, the copy route's 0.063 / 0.054
(benchmarks/results/int4_mosaic_decode_h200.json).

Inputs: keys with outlier channels, three sequences (the newest key group open: the residual,
read apart; a length on a group's edge: none open; a full cache), one query before its last
written key; GQA 4; several key splits merged by the kernel or by jnp; tiles of 128 keys (the
default) and of 64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, Tiling, flash_attention, mgpu_common, quant4
from pallas_kernels import backend as backend_lib
from pallas_kernels.attention import flash as fa_module
from pallas_kernels.attention import mgpu_int4_decode, mgpu_int4_tiles
from pallas_kernels.attention.mgpu_decode import DecodeConfig
from pallas_kernels.backend import Variant
from tests.kernels.inputs import normal
from tests.kernels.test_int4_decode import _cache, _error
from tests.kernels.test_mgpu_decode import key_splits_reaching

NO_INTERPRETER = mgpu_common.interpreter_available()
needs_interpreter = pytest.mark.skipif(NO_INTERPRETER is not None, reason=str(NO_INTERPRETER))
REFERENCE = Route(backend="reference")


@pytest.fixture(autouse=True)
def _reset_interpreter():
  yield
  if NO_INTERPRETER is None:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()


@needs_interpreter
@pytest.mark.parametrize("block_keys,merge", [(128, True), (64, False)])
def test_interpreted_kernel_matches_the_dequantized_cache(block_keys, merge):
  t, h, kvh, d = 320, 8, 2, 128
  rng = np.random.default_rng(block_keys)
  lengths = [t - 21, 64, t]  # open residual; a group's edge (none open); a full cache
  keys, values = _cache(rng, 3, kvh, t, d, lengths)
  q = normal(rng, (3, 1, h, d), jnp.bfloat16)
  kw = dict(q_offset=jnp.asarray([t - 22, 40, t - 1]), kv_len=jnp.asarray(lengths),
            kv_layout="BHTD")
  route = Route(backend="gpu", kernels=KernelOptions(decode_merge_kernel=merge))
  got = flash_attention(q, keys, values, route=route, **kw,
                        tiling=Tiling(impl="mosaic", block_keys=block_keys, key_splits=2))
  jax.block_until_ready(got)  # interpreted calls one after another (see tests/conftest.py)
  want = flash_attention(q.astype(jnp.float32), quant4.load(keys, jnp.float32),
                         quant4.dequantize(values), route=REFERENCE, **kw)
  copy = flash_attention(q, keys, values, route=REFERENCE, **kw)
  assert got[0].dtype == q.dtype and got[0].shape == q.shape
  # outputs, LSE: the kernel rounds each key group's scales and zero points to fp16 (an outlier
  # channel's zero point of ~50 is 0.03 off there), the copy rounds every key to bf16. Outputs
  # moved by that rounding: 0.018-0.049 over five draws of these inputs (0.049 this one under
  # numpy 2.4; the Triton kernel, whose scales stay fp32, 0.013-0.025; the copy 0.053-0.128)
  for i, tol in ((0, 6e-2), (1, 3e-2)):
    assert _error(got[i], want[i]) <= min(tol, _error(copy[i], want[i])), i


def test_codes_are_exact():
  """Every byte's two nibbles come out as their codes in fp16 (the 1024 + code trick)."""
  x = jnp.arange(256, dtype=jnp.uint8).reshape(64, 4)
  for nib, want in ((0, x & 15), (1, x >> 4)):
    got = mgpu_int4_tiles._codes(x, nib, jnp.float16)
    assert got.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _abstract_cache(b, kvh, t, d, group=32):
  s = jax.ShapeDtypeStruct
  return (s((b, kvh, t, d // 2), jnp.uint8), s((b, kvh, t // group, d), jnp.float32),
          s((b, kvh, group, d), jnp.bfloat16), s((b, kvh, t, d // 2), jnp.uint8),
          s((b, kvh, t, d // 32), jnp.float32))


def _lowered(config, stage="none", t=131072):
  """The 8B's attention shape (32 / 8 heads, d 128) at t keys, lowered for CUDA."""
  from experiments import mgpu_decode_costs
  b, h, kvh, d, g = 1, 32, 8, 128, 32

  def f(q, kc, ks, kr, vc, vs, pos):  # a function of its own each call: jit's cache
    k = quant4.GroupedKeys(quant4.Int4(kc, ks, ks, 2, g), kr, pos // g)
    v = quant4.Int4(vc, vs, vs, 3, 32)
    return mgpu_int4_decode.attention(q, k, v, pos, pos + 1, causal=True, scale=d ** -0.5,
                                      merge_kernel=True, config=config)

  args = (jax.ShapeDtypeStruct((b, 1, h, d), jnp.bfloat16), *_abstract_cache(b, kvh, t, d),
          jax.ShapeDtypeStruct((b,), jnp.int32))
  with mgpu_decode_costs.leaving_out(stage):
    mgpu_int4_decode._kernel.__wrapped__.clear_cache()  # else it serves another variant's
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  mgpu_int4_decode._kernel.__wrapped__.clear_cache()
  return text


@pytest.mark.parametrize("config", [mgpu_int4_decode.DEFAULT_CONFIG, DecodeConfig(64, 2, 2, 2)])
def test_native_kernel_lowers_to_mosaic_gpu(config):
  """The codes' TMA boxes and swizzles, the warps' key-group rows (inline Mosaic GPU), the fp16
  operands and three warpgroups, at the 8B's shape and 128K keys."""
  assert "mosaic_gpu" in _lowered(config)


def test_each_cost_variant_lowers_to_a_kernel_of_its_own():
  """experiments/mgpu_decode_costs.py --cache int4: each stage left out reaches the kernel."""
  texts = {stage: _lowered(mgpu_int4_decode.DEFAULT_CONFIG, stage, t=4096)
           for stage in ("none", "keys", "values", "keys+values", "residual", "compute")}
  assert all("mosaic_gpu" in x for x in texts.values())
  assert len(set(texts.values())) == len(texts)


def test_route_takes_the_kernel_only_where_asked(monkeypatch):
  """One-token decode over a 4-bit cache runs the Triton kernel by default (faster on an H200)
  and this one for a Tiling(impl="mosaic") it can take, its block_keys / num_stages applied."""
  monkeypatch.setattr(backend_lib, "is_hopper", lambda: True)  # a pretended native Hopper GPU
  rng = np.random.default_rng(0)
  keys, values = _cache(rng, 1, 2, 256, 128, [200])
  q = normal(rng, (1, 1, 8, 128), jnp.bfloat16)
  choose = fa_module._mosaic_int4_decode
  hopper, options = Variant("gpu", interpret=False), KernelOptions()
  assert choose(hopper, q, keys, values, None, options) is None
  assert choose(hopper, q, keys, values, Tiling(key_splits=4), options) is None
  mosaic = Tiling(impl="mosaic")
  assert choose(hopper, q, keys, values, mosaic, options) == mgpu_int4_decode.DEFAULT_CONFIG
  assert choose(Variant("gpu", interpret=True), q, keys, values, mosaic, options)
  asked = choose(hopper, q, keys, values, Tiling(impl="mosaic", block_keys=64), options)
  assert asked.block_kv == 64
  assert choose(Variant("tpu", interpret=True), q, keys, values, mosaic, options) is None
  fp16_keys, fp16_values = _cache(rng, 1, 2, 256, 128, [200], fmt="int4_fp16")
  assert choose(hopper, q, fp16_keys, fp16_values, mosaic, options) is None  # runs Triton's
  assert key_splits_reaching(mgpu_int4_decode, monkeypatch, q, keys, values, 200) == [3]


@pytest.mark.parametrize("case,why", [
    (dict(fmt="int4_fp16"), "fp32 scales"),
    (dict(d=64), "head dim"),
    (dict(lq=2), "one-token"),
    (dict(h=36), "at most 16"),
    (dict(t=96), "keys"),
    (dict(q_dtype=jnp.float32), "bf16 or both fp16"),
])
def test_unsupported_says_why(case, why):
  rng = np.random.default_rng(1)
  t, d = case.get("t", 256), case.get("d", 128)
  keys, values = _cache(rng, 1, 2, t, d, [t - 5], fmt=case.get("fmt", "int4"))
  q = normal(rng, (1, case.get("lq", 1), case.get("h", 8), d), case.get("q_dtype", jnp.bfloat16))
  reason = mgpu_int4_decode.unsupported(q, keys, values)
  assert reason and why in reason, reason
  with pytest.raises(ValueError, match="mgpu_int4_decode"):
    mgpu_int4_decode.attention(q, keys, values, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                               causal=True, scale=1.0, merge_kernel=False)
