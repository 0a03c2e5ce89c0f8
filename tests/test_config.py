"""LlamaConfig from HF config.json (both transformers spellings), GGUF metadata and presets."""

import pytest

from jax_longctx.core.config import ConfigError, LlamaConfig, preset

HF_V4 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
         "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
         "tie_word_embeddings": False, "bos_token_id": 128000,
         "eos_token_id": [128001, 128008, 128009],
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def test_hf_v4_and_v5_spellings_agree():
  v5 = {k: v for k, v in HF_V4.items() if k not in ("rope_theta", "rope_scaling")}
  v5["rope_parameters"] = dict(HF_V4["rope_scaling"], rope_theta=500000.0)
  a, b = LlamaConfig.from_hf(HF_V4), LlamaConfig.from_hf(v5)
  assert a == b == preset("llama-3.1-8b")


def test_round_trip_through_hf_dict():
  cfg = preset("llama-3.2-3b")
  assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
  assert LlamaConfig.from_dict(cfg.to_dict()) == cfg


def test_presets_param_counts():
  assert abs(preset("llama-3.1-8b").num_params() / 8.03e9 - 1) < 0.01
  assert abs(preset("smollm2-135m").num_params() / 134.5e6 - 1) < 0.01
  with pytest.raises(ConfigError, match="unknown model shape"):
    preset("gpt-5")


def test_gguf_metadata(default_lm):
  from jax_longctx.checkpoints.sources import _gguf_reader, gguf_metadata
  from jax_longctx.app.default_model import gguf_path
  _, reader = _gguf_reader(gguf_path())
  meta = gguf_metadata(reader)
  cfg = LlamaConfig.from_gguf_fields(meta)
  assert cfg.vocab_size == 49152 and cfg.intermediate_size == 1536
  assert cfg.max_position_embeddings == 8192 and cfg.eos_token_ids == (2,)


def test_unknown_rope_type():
  with pytest.raises(ConfigError, match="rope scaling type 'longrope'"):
    LlamaConfig.from_hf(dict(HF_V4, rope_scaling={"rope_type": "longrope", "factor": 2.0}))
