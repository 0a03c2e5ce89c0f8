"""One-token decode with P V on the int8 products (KernelOptions.decode_int8_values): each
tile's probabilities (times the values' scales) quantized per row to 0..127 and multiplied by
the int8 values as stored. The quantizer's bound, the interpreted GPU kernel against the fp32
reference over the dequantized cache within what that rounding can move (and seen to move it),
with and without the int8 query products and row groups, which calls take it, and the kernel
lowered for CUDA (test_decode_products.py's lowering test)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelOptions, Route, backend, flash_attention, quant, read
from pallas_kernels import online_softmax as osm
from pallas_kernels.backend import Variant
from pallas_kernels.gpu import Tiling
from tests.kernels.test_decode_products import B, D, KV, H, _decode, _inputs

VALUES = KernelOptions(decode_int8_values=True)


def test_int8_probabilities_round_each_row_to_its_own_scale():
  rng = np.random.default_rng(0)
  p = jnp.asarray(rng.exponential(size=(16, 64)) ** 3, jnp.float32)  # spread over decades
  p = p.at[3].set(0.0)
  codes, scale = jax.jit(osm.int8_probabilities)(p)
  codes, scale = np.asarray(codes, np.float64), np.asarray(scale, np.float64)
  assert codes.min() >= 0 and codes.max() == 127
  np.testing.assert_array_equal(codes.max(axis=1)[np.arange(16) != 3], 127)
  assert not codes[3].any()
  err = np.abs(codes * scale - np.asarray(p, np.float64))
  assert (err <= 0.5 * scale * (1 + 1e-5)).all()  # half a level of the row's own scale


@pytest.mark.parametrize("kv_layout,products,groups", [("BHTD", True, False),
                                                       ("BTHD", False, False),
                                                       ("BHTD", True, True)])
def test_the_kernel_is_within_the_probabilities_rounding(kv_layout, products, groups):
  """Against the same kernel with its values converted: the rounding of p moves the outputs
  (by 0.006-0.015 at most, 0.0006-0.0014 on average here, against outputs of mean size 0.65:
  the bounds below 2-4x those), the LSE not at all (computed before p is rounded); against the
  fp32 reference over the dequantized cache, within the same plus the int8 query products' own
  rounding (0.064 at most with them, 0.015 without)."""
  q, k, v = _inputs(jnp.float32, kv_layout)
  q = q * 2.0  # peaked rows: many entries far below their tile's largest
  options = KernelOptions(decode_int8_values=True, decode_int8_products=products,
                          decode_row_groups=groups)
  tiling = Tiling(key_splits=3)
  got = _decode(q, k, v, "gpu", kv_layout, options, tiling)
  plain = _decode(q, k, v, "gpu", kv_layout, KernelOptions(decode_int8_products=products,
                                                           decode_row_groups=groups), tiling)
  ref = _decode(q, k, v, "reference", kv_layout)
  size = np.abs(ref[0]).mean()
  moved = np.abs(got[0] - plain[0])
  assert 1e-3 < moved.max() < 0.03, moved.max()  # it acts, within half a level a key
  assert moved.mean() < 0.01 * size, moved.mean()
  np.testing.assert_allclose(got[1], plain[1], atol=1e-5, rtol=1e-5)
  assert np.abs(got[0] - ref[0]).max() < (0.1 if products else 0.03)
  assert np.abs(got[0] - ref[0]).mean() < 0.02 * size


def test_only_the_gpu_kernels_int8_one_token_decode_takes_it():
  q, k, v = _inputs(jnp.bfloat16, "BHTD")
  native = Variant("gpu", False)
  assert read.decode_int8_values(q, v, native, VALUES)
  assert read.decode_int8_values(q, v, Variant("gpu", True), VALUES)  # interpreted, as tested
  assert not read.decode_int8_values(q, v, native, KernelOptions())  # off by default
  assert not read.decode_int8_values(jnp.concatenate([q, q], axis=1), v, native, VALUES)
  for other in (Variant("tpu", False), Variant("reference", False)):
    assert not read.decode_int8_values(q, v, other, VALUES), other
  e4m3 = quant.quantize(v.values.astype(jnp.float32), jnp.float8_e4m3fn)
  assert not read.decode_int8_values(q, e4m3, native, VALUES)
  assert not read.decode_int8_values(q, quant.dequantize(v, jnp.bfloat16), native, VALUES)


def test_the_option_gives_the_traced_kernel_an_int8_value_product(monkeypatch):
  """Traced as the native GPU variant: int8 x int8 -> int32 appears for P V too (two such
  products with the query products on, one with them off)."""
  monkeypatch.setattr(backend, "resolve", lambda _: Variant("gpu", False))
  S = jax.ShapeDtypeStruct
  q = S((B, 1, H, D), jnp.bfloat16)
  kv = quant.Quantized(S((B, KV, 1024, D), jnp.int8), S((B, KV, 1024, 1), jnp.float32))
  per_seq = S((B,), jnp.int32)
  for options, want in ((VALUES, 2), (KernelOptions(decode_int8_products=False,
                                                    decode_int8_values=True), 1),
                        (KernelOptions(), 1)):
    def decode(q, k, v, q_offset, kv_len, options=options):
      return flash_attention(q, k, v, causal=True, q_offset=q_offset, kv_len=kv_len,
                             kv_layout="BHTD", route=Route(kernels=options))
    text = str(jax.make_jaxpr(decode)(q, kv, kv, per_seq, per_seq))
    # each dot appears twice: the whole-tile loop and the masked one
    assert text.count("preferred_element_type=int32") == 2 * want, options
