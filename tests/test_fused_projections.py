"""The serving layout of `model.fuse_projections` (one q/k/v and one gate/up weight per layer)
computes what the unfused params compute: prefill chunks, decode steps and the decode loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.generation import Sampling, decode_loop
from jax_longctx.methods import get
from jax_longctx.model import abstract_model, fold_norm_scales, forward, fuse_projections, \
    is_folded, is_fused, new_cache, random_params
from tests.conftest import TINY_LLAMA3, chunked_then_decoded_logits, tiny_config

FULL = get("full")
FAMILIES = {"llama": TINY_LLAMA3, "qwen2": dict(architecture="qwen2", attention_bias=True),
            "qwen3": dict(architecture="qwen3", qk_norm=True)}


def _prefill_then_decode(cfg, params, ids, n_prompt):
  """fp32 logits of a 2-chunk prefill of ids[:, :n_prompt] and one decode step per later token."""
  return chunked_then_decoded_logits(cfg, params, ids, n_prompt, -(-n_prompt // 2), 32)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_logits_equal_unfused(family):
  cfg = tiny_config(**FAMILIES[family])  # fp32
  params = random_params(cfg, seed=3)
  fused = fuse_projections(params)
  assert is_fused(fused) and not is_fused(params)
  layer = fused["layers"][0]
  h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  assert layer["attn"]["qkv_proj"].shape == (cfg.hidden_size, h + 2 * kv, d)
  assert layer["mlp"]["gate_up_proj"].shape == (cfg.hidden_size, 2 * cfg.intermediate_size)
  assert "q_proj" not in layer["attn"] and "gate_proj" not in layer["mlp"]
  assert "q_proj" in params["layers"][0]["attn"]  # the input tree is left as it was
  # the fused tree has exactly the shapes of the fused model (nnx.merge would refuse otherwise)
  _, shapes = abstract_model(cfg, fused=True)
  assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(lambda a: a.shape, fused)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 14))
  ref = _prefill_then_decode(cfg, params, ids, 10)
  got = _prefill_then_decode(cfg, fused, ids, 10)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
  assert fuse_projections(fused) is fused


def _greedy_tokens(cfg, p, ids):
  """(tokens, steps) of a 6-token greedy decode loop after a prefill of ids."""
  b, n = ids.shape
  cache = new_cache(cfg, FULL, b, 32)
  pos = jnp.broadcast_to(jnp.arange(n), (b, n))
  logits, cache = forward(p, jnp.asarray(ids), pos, cache, FULL, cfg,
                          logits_index=jnp.full((b,), n - 1, jnp.int32))
  out, steps, _ = decode_loop(p, cache, logits, jnp.asarray([-1], jnp.int32), jax.random.key(0),
                              cfg=cfg, method=FULL, max_new_tokens=6, sampling=Sampling())
  return np.asarray(out).tolist(), int(steps)


def test_fused_decode_loop_generates_the_same_tokens():
  cfg = tiny_config(**TINY_LLAMA3)
  params = random_params(cfg, seed=4)
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
  a, b = _greedy_tokens(cfg, params, ids), _greedy_tokens(cfg, fuse_projections(params), ids)
  assert a == b and a[1] == 6

def _random_norm_scales(params, seed):
  """Norm scales drawn around 1 (random_params leaves them at exactly 1, which folding keeps)."""
  rng = np.random.default_rng(seed)

  def draw(path, x):
    if str(path[-1]).endswith("'scale']"):
      return jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype)
    return x
  return jax.tree_util.tree_map_with_path(draw, params)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_folded_norm_scales_equal_unfolded(family):
  """fold_norm_scales (norm scales inside qkv / gate_up, 1 / rms on the products): fp32 logits of
  prefill chunks and decode steps as the plain params' up to fp32 rounding (1e-5 of the largest
  logit)."""
  cfg = tiny_config(**FAMILIES[family])  # fp32
  params = _random_norm_scales(random_params(cfg, seed=5), seed=6)
  folded = fold_norm_scales(params)
  assert is_folded(folded) and is_fused(folded) and not is_folded(params)
  assert not is_folded(fuse_projections(params))
  assert "attn_norm" not in folded["layers"][0] and "final_norm" in folded
  _, shapes = abstract_model(cfg, fused=True, folded=True)
  assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(lambda a: a.shape, folded)
  ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 14))
  ref = _prefill_then_decode(cfg, params, ids, 10)
  got = _prefill_then_decode(cfg, folded, ids, 10)
  np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
  assert fold_norm_scales(folded) is folded


def test_folded_norm_scales_bf16_within_rounding():
  """In bf16 the folded weights are rounded once more and x enters the product unnormalized: the
  logits stay within a few bf16 ulps of the plain params' (2% of the largest logit; a wrong
  fold, e.g. the scales of other params folded in, moves them by ~50%)."""
  cfg = tiny_config(**TINY_LLAMA3, dtype="bfloat16")
  params = _random_norm_scales(random_params(cfg, seed=7), seed=8)
  ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 12))
  ref = _prefill_then_decode(cfg, params, ids, 8)
  got = _prefill_then_decode(cfg, fold_norm_scales(params), ids, 8)
  np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(ref).max(), rtol=0)


def test_folded_decode_loop_generates_the_same_tokens():
  cfg = tiny_config(**TINY_LLAMA3)
  params = _random_norm_scales(random_params(cfg, seed=4), seed=9)
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
  assert _greedy_tokens(cfg, params, ids) == _greedy_tokens(cfg, fold_norm_scales(params), ids)
