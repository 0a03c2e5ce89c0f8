"""The KV cache in 4 bits (RunOptions.kv_dtype="int4", KIVI's layout: pallas_kernels/quant4.py)
under every method: the ones that append store it, the others refuse it in one line.

Every registered per-layer method (tiny random model, fp32, GQA 6/2, one device, budgets as
tokens) either runs with the cache in 4 bits, every layer's keys grouped along tokens and values
per token (about a third of the fp32 bytes here), the prompt's last logits and the teacher-forced
NLL of 4 decode steps within a stated tolerance of the same run in the model's dtype; or states
an `int4_refusal` and is refused with it, in one line, before anything runs. Every method over a
mesh stores it (here on one device).

Tolerances: a 4-bit group rounds each value by at most half a step, 1/30 of its group's range
(values: a token's 8 channels here, head_dim 8; keys: a channel over 32 tokens, or whole while
their group fills). On this model (random weights, std 0.02, logits of order 1e-1) the measured
largest logit differences are 0.010 (full, quest, topk, resa) and 0.033 (reattention, whose
top-k votes can change with the keys), NLL 0.17%: the bounds are 4x and 3x those.

A padded batch (prompts of 21 and 33 tokens in chunks of 8) gives each row what it gives alone:
the shorter row's padding is never written, so its next real token joins the key group it
belongs to.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.methods import MethodError, get, names
from jax_longctx.ops.cache import KVCache
from pallas_kernels import quant4
from tests.test_kv_quant import _run
from tests.test_methods import _method

LOGIT_ATOL, NLL_RTOL = 0.04, 0.005
LAYER = names("layer")


@pytest.mark.parametrize("name", LAYER)
def test_every_method_stores_a_4_bit_cache_or_refuses_it_in_one_line(tiny, name):
  cfg, params = tiny
  method = _method(name, 24)
  if method.int4_refusal:
    with pytest.raises(MethodError) as e:
      _run(params, cfg, method, "int4")
    line = str(e.value)
    assert "\n" not in line and "cannot store a 4-bit cache" in line
    assert method.int4_refusal in line and line.startswith(name), line
    return
  want_last, want_nll, _ = _run(params, cfg, method, None)
  last, nll, cache = _run(params, cfg, method, "int4")
  np.testing.assert_allclose(last, want_last, atol=LOGIT_ATOL, rtol=0, err_msg=name)
  np.testing.assert_allclose(nll, want_nll, atol=0, rtol=NLL_RTOL, err_msg=name)
  assert not np.array_equal(last, want_last), f"{name}: the 4-bit run read whole keys"
  leaves = jax.tree.leaves(cache.state, is_leaf=quant4.is_int4)
  keys = [x for x in leaves if isinstance(x, quant4.GroupedKeys)]
  values = [x for x in leaves if isinstance(x, quant4.Int4)]
  assert len(keys) == len(values) == cfg.num_layers, (name, len(keys), len(values))
  assert all(k.main.codes.shape[-1] * 2 == cfg.head_dim == k.residual.shape[-1] for k in keys)
  assert all(x.codes.dtype == jnp.uint8 for x in [k.main for k in keys] + values)


@pytest.mark.parametrize("fmt,ratio", [("int4", 0.375), ("int4_fp16", 0.3125),
                                       ("int4_g64_fp16", 0.28125)])
def test_a_4_bit_cache_of_a_real_shape_holds_what_its_format_states(fmt, ratio):
  """Codes are half a byte a value; fp32 scales and zero points a quarter more (one pair per
  32 values), fp16 ones an eighth, fp16 ones per 64 values a sixteenth; the residual group is
  a group of tokens a sequence whole."""
  from tests.conftest import tiny_config
  cfg = tiny_config(num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
  def made(dtype):
    shapes = jax.eval_shape(lambda: KVCache.zeros(cfg, 2, 32768, dtype))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  g = quant4.format_of(fmt).group
  assert made(fmt) / made("bfloat16") == pytest.approx(ratio + g / 32768 / 2, rel=1e-3)


@pytest.mark.parametrize("name", [n for n in names() if n not in LAYER])
def test_every_method_over_a_mesh_stores_a_4_bit_cache(tiny, name):
  """On one device, as the per-layer methods above (on 8 devices: tests/test_reattention_mesh.py
  and tests/test_distributed.py)."""
  from tests.test_kv_quant import _mesh_method
  cfg, params = tiny
  method = _mesh_method(name)
  assert not method.int4_refusal
  want_last, want_nll, _ = _run(params, cfg, method, None)
  last, nll, cache = _run(params, cfg, method, "int4")
  np.testing.assert_allclose(last, want_last, atol=LOGIT_ATOL, rtol=0, err_msg=name)
  np.testing.assert_allclose(nll, want_nll, atol=0, rtol=NLL_RTOL, err_msg=name)
  assert not np.array_equal(last, want_last), f"{name}: the 4-bit run read whole keys"
  assert any(isinstance(x, quant4.GroupedKeys)
             for x in jax.tree.leaves(cache.state, is_leaf=quant4.is_int4)), name


@pytest.mark.parametrize("name", ["full", "reattention"])
def test_a_padded_batch_gives_each_row_what_it_gives_alone(tiny, name):
  from jax_longctx.core.options import RunOptions
  from jax_longctx.run import generation as gen
  from tests.test_methods import CACHE_LEN, _apart, _prompts
  cfg, params = tiny
  method = _method(name, 24)
  docs, ins = _apart(_prompts(cfg, (21, 33), seed=2))
  options = RunOptions(prefill_chunk=8, kv_dtype="int4")

  targets = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 4)), jnp.int32)

  def scores(rows):  # the prompt's last logits and the NLL of 4 decode steps after it
    cache, last = gen.prefill(params, cfg, [docs[r] for r in rows], method, cache_len=CACHE_LEN,
                              decode_room=4, instructions=[ins[r] for r in rows], options=options)
    nll, _ = gen.teacher_forced_nll(params, cache, last, targets[np.asarray(rows)], cfg=cfg,
                                    method=method, options=options)
    return np.asarray(last), np.asarray(nll)

  together = scores([0, 1])
  for row in range(2):
    for got, alone in zip(together, scores([row])):
      np.testing.assert_allclose(got[row], alone[0], atol=1e-5, rtol=1e-5, err_msg=f"{row}")


def test_a_4_bit_write_without_valid_is_refused():
  from tests.conftest import tiny_config
  from pallas_kernels import Route
  cfg = tiny_config()
  kv = KVCache.zeros(cfg, 1, 32, "int4")
  new = jnp.ones((1, 1, cfg.num_kv_heads, cfg.head_dim))
  with pytest.raises(TypeError, match="valid="):
    kv.write(jnp.zeros((1, 1), jnp.int32), new, new, route=Route())


def test_the_decode_benchmark_fills_a_4_bit_cache_and_counts_its_bytes():
  """`jax-longctx bench --fill-cache`'s cache: full groups up to the length, its bytes read
  a step as bytes_per_token says (half a byte a value, a scale and zero point per 32)."""
  from jax_longctx.app.bench_decode import bytes_per_token, filled_cache
  from jax_longctx.core.options import RunOptions
  from tests.conftest import tiny_config
  cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=64)
  cache = filled_cache(cfg, get("full"), 2, 128, 128, RunOptions(kv_dtype="int4"))
  for layer in cache.state:
    assert isinstance(layer.k, quant4.GroupedKeys) and isinstance(layer.v, quant4.Int4)
    np.testing.assert_array_equal(np.asarray(layer.k.residual_group), [4, 4])
    assert len(np.unique(np.asarray(layer.v.codes))) > 200  # random bytes, not zeros
  held = sum(quant4.nbytes(s.k.main) + quant4.nbytes(s.v) for s in cache.state)
  assert bytes_per_token(cfg, 128, 2, "int4")[1] == held
  # every buffer committed to its device, as the decode step's outputs are: an uncommitted one
  # made the first timed loop compile the step again
  assert all(x.committed for x in jax.tree.leaves(cache))


def test_a_4_bit_cache_takes_its_declaration_and_a_row_of_it_is_that_rows():
  """KVCache's (ROWS, HEADS, TOKENS, None) for codes, scales and zero points alike; the keys'
  residual keeps its tokens whole and its group index is per row; take_rows (a batch's one
  sequence) cuts every part of it."""
  from jax_longctx.core.axes import HEADS, ROWS, TOKENS, Axes, logical_axes, take_rows
  from tests.conftest import tiny_config
  cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=64)
  kv = KVCache.zeros(cfg, 3, 64, "int4")
  got = logical_axes(kv)
  declared = Axes((ROWS, HEADS, TOKENS, None))
  for part in (got.k.main, got.v):
    assert part.codes == part.scale == part.zero == declared
  assert got.k.residual == Axes((ROWS, HEADS, None, None))
  assert got.k.residual_group == Axes((ROWS,))
  one = take_rows(kv, 1, 2)
  assert one.k.main.codes.shape[0] == one.k.residual.shape[0] == one.v.scale.shape[0] == 1
  assert one.k.residual_group.shape == (1,)


@pytest.mark.parametrize("name,hparams,reader,fmt", [
    ("full", {}, "four_bit_tiles", "int4"),  # attention/int4_decode.py reads the tiles
    ("reattention", dict(n_global=8, n_local=16, span=8, top_k=2, clip=4, chunk=16),
     "four_bit_scores", "int4"),  # and its top-k scores the codes (topk/int4_scores.py)
    ("full", {}, "four_bit_tiles", "int4_g64_fp16"),  # the compact format
])
def test_decode_through_the_4_bit_kernels_scores_what_the_reference_route_scores(name, hparams,
                                                                                 reader, fmt):
  """Decode steps on the GPU variant (interpreted) read the 4-bit cache through the kernels that
  read its codes (a head dim of 64: value pieces the decode kernel takes; the tiny model's 8 are
  below them): full attention's through attention/int4_decode.py, ReAttention's selection
  through topk/int4_scores.py; two prompts of different lengths, each step's NLL as the
  reference route's over the dequantized cache, within fp32's summation order."""
  from jax_longctx.core.options import RunOptions
  from jax_longctx.model import random_params
  from jax_longctx.run import generation as gen
  from pallas_kernels import Route, read
  from tests.conftest import tiny_config
  from tests.test_methods import _prompts
  cfg = tiny_config(num_layers=2, hidden_size=128, num_heads=4, head_dim=64,
                    max_position_embeddings=128)
  params = random_params(cfg, seed=4)
  g = quant4.format_of(fmt).group
  prompts = _prompts(cfg, (g + 8, 29), seed=5)  # a group and an open residual; one still open
  targets = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
  method = get(name, **hparams)
  calls = []
  predicate = getattr(read, reader)

  def counted(q, *args, **kw):
    answer = predicate(q, *args, **kw)
    if q.shape[1] == 1:  # a decode step's call (a prefill chunk's many rows take the copy)
      calls.append(answer)
    return answer

  def nll(route):
    options = RunOptions(prefill_chunk=16, kv_dtype=fmt, route=route)
    cache, last = gen.prefill(params, cfg, prompts, method, cache_len=128, decode_room=6,
                              options=options)
    return np.asarray(gen.teacher_forced_nll(params, cache, last, targets, cfg=cfg,
                                             method=method, options=options)[0])

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(read, reader, counted)
    got = nll(Route(backend="gpu", prefill_kernel=False, decode_kernel=True,
                    cache_write_backend="gpu"))  # and int4_write's kernel writes each token
  assert calls and all(calls), calls  # every decode step read the codes
  np.testing.assert_allclose(got, nll(Route(backend="reference")), rtol=1e-4, atol=1e-5)


def test_refreshkv_refreshes_over_a_4_bit_cache(tiny):
  """RefreshKV's full steps (every other decode step here) read the whole 4-bit C_f and refill
  C_p, which holds positions into it, not keys: the NLL of its decode steps within the stated
  tolerance of the fp32 cache's, with full steps taken in every layer."""
  cfg, params = tiny
  method = get("refreshkv", budget=24, fixed_stride=2)
  _, want_nll, _ = _run(params, cfg, method, None)
  _, nll, cache = _run(params, cfg, method, "int4")
  np.testing.assert_allclose(nll, want_nll, atol=0, rtol=NLL_RTOL)
  assert all(float(np.sum(np.asarray(layer.n_full))) > 0 for layer in cache.state)
  assert all(isinstance(layer.full.k, quant4.GroupedKeys) for layer in cache.state)
