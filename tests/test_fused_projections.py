"""The serving layout of `model.fuse_projections` (one q/k/v and one gate/up weight per layer)
computes what the unfused params compute: prefill chunks, decode steps and the decode loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.run.generation import Sampling, decode_loop, row_keys
from jax_longctx.methods import get
from jax_longctx.model import abstract_model, forward, fuse_projections, is_fused, new_cache, \
    random_params
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
  # the output projection transposed [D, H, hd]: the same numbers, its reduction along rows
  np.testing.assert_array_equal(layer["attn"]["o_proj_t"],
                                np.transpose(params["layers"][0]["attn"]["o_proj"], (2, 0, 1)))
  assert "q_proj" not in layer["attn"] and "gate_proj" not in layer["mlp"]
  assert "o_proj" not in layer["attn"]
  assert "q_proj" in params["layers"][0]["attn"]  # the input tree is left as it was
  # the fused tree has exactly the shapes of the fused model (nnx.merge would refuse otherwise)
  _, shapes = abstract_model(cfg, fused=True)
  assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(lambda a: a.shape, fused)
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 14))
  ref = _prefill_then_decode(cfg, params, ids, 10)
  got = _prefill_then_decode(cfg, fused, ids, 10)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
  assert fuse_projections(fused) is fused


def test_fused_decode_loop_generates_the_same_tokens():
  cfg = tiny_config(**TINY_LLAMA3)
  params = random_params(cfg, seed=4)
  ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))

  def run(p):
    cache = new_cache(cfg, FULL, 2, 32)
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    logits, cache = forward(p, jnp.asarray(ids), pos, cache, FULL, cfg,
                            logits_index=jnp.full((2,), 8, jnp.int32))
    out, steps, _ = decode_loop(p, cache, logits, jnp.asarray([-1], jnp.int32), row_keys(0, 2),
                                cfg=cfg, method=FULL, max_new_tokens=6, sampling=Sampling())
    return np.asarray(out), int(np.max(steps))

  (a, sa), (b, sb) = run(params), run(fuse_projections(params))
  np.testing.assert_array_equal(a, b)
  assert sa == sb == 6
