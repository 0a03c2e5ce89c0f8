"""Qwen2, Qwen3, Mistral and Llama 3.2 (tied): config.json parsing, refused features, and logits
of tiny random models against transformers' own classes in fp32."""

import json

import jax
import numpy as np
import pytest

from checkpoints_convert import CheckpointError, convert, export_hf, load_source
from jax_longctx.app.api import LM
from jax_longctx.core.config import ConfigError, LlamaConfig, RopeScaling
from jax_longctx.model import random_params
from tests.conftest import tiny_config
from tests.helpers.hf_reference import hf_logits

QWEN25_05B = {  # Qwen2.5-Coder-0.5B-Instruct's config.json
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
    "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "vocab_size": 32000}


def test_real_family_configs():
  q2 = LlamaConfig.from_hf(QWEN25_05B)
  assert (q2.architecture, q2.attention_bias, q2.qk_norm, q2.head_dim) == ("qwen2", True, False, 64)
  assert q2.tie_word_embeddings and q2.max_position_embeddings == 32768
  assert abs(q2.num_params() / 494.0e6 - 1) < 0.01  # Qwen2.5-0.5B: 0.49B parameters
  q3 = LlamaConfig.from_hf(QWEN3_06B)
  assert (q3.architecture, q3.attention_bias, q3.qk_norm, q3.head_dim) == ("qwen3", False, True, 128)
  assert abs(q3.num_params() / 596.0e6 - 1) < 0.01  # Qwen3-0.6B: 0.6B parameters
  for cfg in (q2, q3):
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg and LlamaConfig.from_dict(cfg.to_dict()) == cfg


def test_refused_features_are_named():
  with pytest.raises(ConfigError, match="sliding_window=4096"):
    LlamaConfig.from_hf(MISTRAL_7B_V01)
  v03 = LlamaConfig.from_hf(dict(MISTRAL_7B_V01, sliding_window=None))  # Mistral 7B v0.2/0.3
  assert v03.architecture == "mistral" and not v03.attention_bias
  with pytest.raises(ConfigError, match="sliding_window"):
    LlamaConfig.from_hf(dict(QWEN25_05B, use_sliding_window=True, sliding_window=4096))
  with pytest.raises(ConfigError, match="attention_bias"):
    LlamaConfig.from_hf(dict(QWEN3_06B, attention_bias=True))
  with pytest.raises(ConfigError, match="hidden_act"):
    LlamaConfig.from_hf(dict(QWEN25_05B, hidden_act="gelu"))
  with pytest.raises(ConfigError, match="Gemma2ForCausalLM"):
    LlamaConfig.from_hf(dict(QWEN25_05B, architectures=["Gemma2ForCausalLM"], model_type="gemma2"))
  with pytest.raises(ConfigError, match="rope scaling type 'longrope'"):
    LlamaConfig.from_hf(dict(QWEN25_05B, rope_scaling={"rope_type": "longrope", "factor": 2.0}))


def test_yarn_config_spellings():
  yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
  cfg = LlamaConfig.from_hf(dict(QWEN25_05B, rope_scaling=yarn, max_position_embeddings=131072))
  s = cfg.rope_scaling
  assert (s.type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 32768)
  assert abs(s.attention_factor - (0.1 * np.log(4.0) + 1)) < 1e-9
  assert LlamaConfig.from_hf(cfg.to_hf()) == cfg


def _randomize(params, seed=0):
  """Biases and norm scales far from their init, so a dropped or misplaced one shows."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  rng = np.random.default_rng(seed)
  out = []
  for path, leaf in leaves:
    key = jax.tree_util.keystr(path)
    if "bias" in key or "scale" in key:
      leaf = np.asarray(leaf) + rng.normal(0, 0.3, leaf.shape).astype(np.float32)
    out.append(np.asarray(leaf))
  return jax.tree_util.tree_unflatten(treedef, out)


FAMILY_CASES = {
    "qwen2": dict(architecture="qwen2", attention_bias=True, tie_word_embeddings=True,
                  rope_theta=1e6),
    "qwen3": dict(architecture="qwen3", qk_norm=True, head_dim=16),  # head_dim != hidden / heads
    "mistral": dict(architecture="mistral"),
    "llama3.2-tied": dict(tie_word_embeddings=True,
                          rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 16)),
    "qwen2-yarn": dict(architecture="qwen2", attention_bias=True,
                       rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16,
                                                attention_factor=1 + 0.1 * np.log(4.0))),
}


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_tiny_family_matches_transformers(tmp_path, case):
  cfg = tiny_config(**FAMILY_CASES[case])
  params = _randomize(random_params(cfg, seed=3))
  export_hf(params, cfg, str(tmp_path / "hf"))
  with open(tmp_path / "hf" / "config.json") as f:
    parsed = LlamaConfig.from_hf(json.load(f))
  if cfg.rope_scaling.type == "default":  # its unused original window is read as max positions
    parsed = parsed.replace(rope_scaling=cfg.rope_scaling)
  assert parsed == cfg
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40))  # past yarn's window (16)
  ours = np.asarray(LM(cfg, params, None).logits(ids))
  ref = hf_logits(str(tmp_path / "hf"), ids)
  assert np.max(np.abs(ours - ref)) <= 1e-4 * max(1.0, np.max(np.abs(ref)))
  back, loaded, _ = load_source(str(tmp_path / "hf"))  # and the HF directory loads back the same
  assert back.replace(rope_scaling=cfg.rope_scaling) == cfg
  same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), loaded, params)
  assert all(jax.tree.leaves(same))


def test_unknown_tensor_is_an_error(tmp_path):
  """A Qwen2 checkpoint whose config says llama would load without its biases: refused."""
  cfg = tiny_config(architecture="qwen2", attention_bias=True)
  export_hf(random_params(cfg, seed=1), cfg, str(tmp_path / "hf"))
  with open(tmp_path / "hf" / "config.json") as f:
    hf = json.load(f)
  hf.update(architectures=["LlamaForCausalLM"], model_type="llama")
  with open(tmp_path / "hf" / "config.json", "w") as f:
    json.dump(hf, f)
  with pytest.raises(CheckpointError, match=r"does not use: model\.layers\.0\.self_attn\.q_proj\.bias"):
    convert(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()
