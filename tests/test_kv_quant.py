"""The KV cache in 8 bits (RunOptions.kv_dtype: int8, float8_e4m3fn) under every method.

Quantization itself (pallas_kernels/quant.py): the round trip's error bound per dtype, and scales
that are never zero, inf or NaN. Every registered method (tiny random model, fp32, GQA 6/2, one
device, budgets as tokens; the mesh and ratio budgets: tests/helpers/tensor_parallel_checks.py
`quantized`): the prompt's last logits and the teacher-forced NLL of 4 decode steps within a
stated tolerance of the same run with the cache in the model's dtype, and the cache really held
in 8 bits (every K/V buffer a Quantized of the asked dtype, about half the bytes). Beside it,
key smoothing (random powers of two) changes no score: the same logits and NLL with the cache in
the model's dtype (tests/test_key_smoothing.py has the rest of it).

Tolerances: symmetric int8 with a scale per (token, KV head) rounds each value by at most half a
step, 1/254 of the row's largest magnitude; E4M3 keeps 3 mantissa bits, a relative 1/16 per
value. On this model (random weights, std 0.02, logits of order 1e-1) the measured largest logit
differences are 0.0005-0.0007 (int8) and 0.003-0.013 (fp8): the logit bounds below are 4x those.
The NLL (~4.5 a token) is compared relatively: a method that selects (top-k, ReAttention's
votes) may pick another token where two score alike, which moved one step's NLL by up to 0.2%
(int8) here; the bounds are 0.5% and 3%.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.core.options import RunOptions
from jax_longctx.methods import get, names
from jax_longctx.ops.cache import Quantized, load
from jax_longctx.run import generation as gen
from jax_longctx.run.key_smoothing import with_smoothing
from pallas_kernels import quant
from tests.test_methods import CACHE_LEN, _apart, _method, _prompts

TOL = {"int8": (3e-3, 5e-3), "float8_e4m3fn": (5e-2, 3e-2)}  # logits atol, NLL rtol
STEPS = 4


@pytest.mark.parametrize("dtype,bound", [("int8", 0.5 / 127), ("float8_e4m3fn", 1 / 16)])
def test_round_trip_error_is_bounded_per_row(dtype, bound):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 5, 64)).astype(np.float32)
  x[..., 7] *= 40  # an outlier channel, as keys have (KIVI)
  q = quant.quantize(jnp.asarray(x), dtype)
  assert q.values.dtype == jnp.dtype(dtype) and q.scale.shape == (*x.shape[:-1], 1)
  err = np.abs(np.asarray(q.dequantize()) - x)
  amax = np.max(np.abs(x), axis=-1, keepdims=True)
  if dtype == "int8":
    assert np.all(err <= bound * amax * (1 + 1e-6))
    assert np.max(np.abs(np.asarray(q.values, np.int32))) <= 127
  else:  # relative to each value, except values below E4M3's normal range (scaled)
    big = np.abs(x) > amax * 2.0 ** -6 / 448 * 64
    assert np.all(err[big] <= bound * np.abs(x[big]) * (1 + 1e-6))


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_scales_are_never_zero_or_inf(dtype):
  rows = jnp.asarray([[0.0] * 4, [1e38, -3e38, 1.0, 0.0], [1e-30, 0.0, 0.0, 0.0]], jnp.float32)
  q = quant.quantize(rows, dtype)
  s = np.asarray(q.scale)
  assert np.all(np.isfinite(s)) and np.all(s > 0)
  back = np.asarray(q.dequantize())
  assert np.all(back[0] == 0) and np.all(np.isfinite(back))
  np.testing.assert_allclose(back[1, :2], [1e38, -3e38], rtol=0.07)


def test_bad_kv_dtype_is_one_line():
  from jax_longctx.core.config_types import ConfigError
  for bad in ("float8", "fp4", "int2"):
    with pytest.raises(ConfigError, match=f"kv_dtype '{bad}' is not one of .*int8"):
      RunOptions(kv_dtype=bad)


def _run(params, cfg, method, kv_dtype):
  docs, ins = _apart(_prompts(cfg, (21, 33), seed=2))
  targets = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, STEPS)).astype(np.int32)
  options = RunOptions(prefill_chunk=8, kv_dtype=kv_dtype)
  cache, last = gen.prefill(params, cfg, docs, method, cache_len=CACHE_LEN,
                            decode_room=STEPS, instructions=ins, options=options)
  nll, cache = gen.teacher_forced_nll(params, cache, last, jnp.asarray(targets), cfg=cfg,
                                      method=method, options=options)
  return np.asarray(last), np.asarray(nll), cache


def _with_smoothing(params, cfg, seed=0, spread=3):
  """params with random powers of two in 2^-spread..2^spread (pair-shared) as every layer's key
  smoothing and random key (after and before RoPE) and value offsets of std 1, several times the
  keys' RMS (~0.14: std 0.02 weights over 48 unit-RMS inputs; run/key_smoothing.py);
  spread=0: factors of 1 and offsets of 0, the unsmoothed model exactly."""
  rng = np.random.default_rng(seed)
  shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
  e = rng.integers(-spread, spread + 1, shape[:-1] + (cfg.head_dim // 2,))
  offsets = [rng.normal(size=shape) * (spread > 0) for _ in ("k", "v", "k before rope")]
  return with_smoothing(params, cfg, np.exp2(np.concatenate([e, e], -1)), offsets=offsets)


def _bytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", names())
def test_every_method_runs_on_an_8_bit_cache_and_key_smoothing_changes_no_score(tiny, name):
  cfg, params = tiny
  method = _method(name, 24) if name in names("layer") else _mesh_method(name)
  # The reference: smoothing by factors of 1 and offsets of 0, which is the unsmoothed model
  # exactly (q * 1, k / 1 and x - 0 are exact), so that the smoothed run below reuses its
  # compiled programs.
  want_last, want_nll, plain = _run(*_with_smoothing(params, cfg, spread=0), method, None)
  # Key smoothing and offsets change no score: the factors reach 2^+-3 and the value offsets
  # are larger than the values, so a method that read a query or key other than through q.k,
  # or a value other than in a convex sum, would differ here unless its decision did not turn
  # on it (these 4 steps decide no RefreshKV refresh by similarity: test_key_smoothing.py
  # checks that one). A cache in the model's dtype keeps its keys whole: the key offsets are
  # the 8-bit cache's (test_an_8_bit_cache_takes_the_key_offset_out_and_reads_keys_whole).
  last, nll, _ = _run(*_with_smoothing(params, cfg), method, None)
  np.testing.assert_allclose(last, want_last, atol=1e-5, rtol=0, err_msg=f"{name} smoothed")
  np.testing.assert_allclose(nll, want_nll, atol=0, rtol=1e-5, err_msg=f"{name} smoothed")
  for dtype, (atol, rtol) in TOL.items():
    last, nll, cache = _run(params, cfg, method, dtype)
    np.testing.assert_allclose(last, want_last, atol=atol, rtol=0, err_msg=f"{name} {dtype}")
    np.testing.assert_allclose(nll, want_nll, atol=0, rtol=rtol, err_msg=f"{name} {dtype}")
    stored = [x for x in jax.tree.leaves(cache.state, is_leaf=lambda x: isinstance(x, Quantized))
              if isinstance(x, Quantized)]
    assert len(stored) >= 2 * cfg.num_layers, (name, dtype, len(stored))  # K and V per layer
    assert all(x.values.dtype == jnp.dtype(dtype) for x in stored), (name, dtype)
    assert _bytes(cache.state) < 0.75 * _bytes(plain.state), (name, dtype)


def _keys(state):
  """A layer's key buffer (a RESA state's, its inner method's) and which of its slots hold a
  token [B, KV, T]."""
  state = getattr(state, "inner", state)
  k = state.k
  if hasattr(state, "pos"):  # SlotCache: slots by position, -1 empty
    return k, np.asarray(state.pos) >= 0
  return k, None


@pytest.mark.parametrize("name", ["reattention", "streaming_llm", "resa", "full"])
def test_an_8_bit_cache_takes_the_key_offset_out_and_reads_keys_whole(tiny, name):
  """KV offsets in the weights (std 1, several times the keys' own size): an 8-bit cache of
  pre-RoPE keys holds each layer's pre-RoPE offset and reads its keys back whole, as the fp32
  cache stores them, within one int8 step of what it rounded (the key less the offset), also
  under a method wrapping it (RESA over ReAttention); a cache of keys rotated in place holds
  them less the post-RoPE offset (which every score of a query loses alike). The keys are
  compared in the first layer, whose inputs the 8-bit cache has not changed."""
  cfg, params = tiny
  if name == "resa":
    method = get("resa", base="reattention",
                 base_args=tuple(_method("reattention", 24).hparams().items()))
  else:
    method = _method(name, 24)
  rng = np.random.default_rng(4)
  shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
  offsets = [rng.normal(size=shape).astype(np.float32) for _ in ("k", "v", "k before rope")]
  params, cfg = with_smoothing(params, cfg, np.ones(shape), offsets=offsets)
  *_, whole = _run(params, cfg, method, None)
  *_, cache = _run(params, cfg, method, "int8")
  before_rope = name != "full"
  lengths = np.asarray(cache.lengths)
  for i, (got, want) in enumerate(zip(cache.state, whole.state)):
    k, filled = _keys(got)
    want = np.asarray(_keys(want)[0])
    assert (k.offset is not None) == before_rope, (name, i)
    c = offsets[2 if before_rope else 0][i][None, :, None, :]  # [1, KV, 1, d]
    if before_rope:
      np.testing.assert_array_equal(np.asarray(k.offset), c)
    if i:
      continue
    read = np.asarray(load(k, jnp.float32)) + (0 if before_rope else c)
    if filled is None:  # slot = position: the written ones
      filled = np.broadcast_to(np.arange(k.shape[2])[None, None, :] < lengths[:, None, None],
                               k.shape[:3])
    bound = np.max(np.abs(want - c), axis=-1, keepdims=True) * (0.5 / 127) * 1.01 + 1e-6
    err = np.abs(read - want)
    assert np.all((err <= bound)[filled]), (name, i, float(np.max(err[filled])))


def _mesh_method(name):
  """The mesh entries, mesh ReAttention with `reattention`'s settings of `_method(..., 24)`."""
  hp = _method("reattention", 24).hparams()
  if name == "reattention_mesh":
    return get(name, **hp)
  if name == "resa_mesh":
    return get(name, base_args=tuple(hp.items()))
  return get(name, block_size=8) if name == "star" else get(name)


def test_quantized_storage_takes_its_declaration_for_values_and_scales():
  from flax import struct

  from jax_longctx.core.axes import HEADS, ROWS, TOKENS, Axes, axes, logical_axes

  @struct.dataclass
  class Good:
    k: jnp.ndarray = axes(ROWS, HEADS, TOKENS, None)

  @struct.dataclass
  class SplitsHeadDim:
    k: jnp.ndarray = axes(ROWS, TOKENS, HEADS)

  x = quant.quantize(jnp.ones((2, 3, 5, 8)), "int8")
  got = logical_axes(Good(x)).k
  assert got.values == got.scale == Axes((ROWS, HEADS, TOKENS, None))
  with pytest.raises(ValueError, match="SplitsHeadDim.k: quantized storage splits its last axis"):
    logical_axes(SplitsHeadDim(quant.quantize(jnp.ones((2, 5, 3)), "int8")))
