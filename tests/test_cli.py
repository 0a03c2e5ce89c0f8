"""The command line, as a user runs it."""

import os
import subprocess
import sys

import pytest

from jax_longctx.app import cli
from jax_longctx.methods import names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_LONGCTX_QUIET="1")
  return subprocess.run([sys.executable, "-m", "jax_longctx", *args], capture_output=True,
                        text=True, env=env, timeout=600)


def test_generate_continues_with_paris(default_lm):
  # default_lm set JAX_LONGCTX_CACHE, so the CLI finds the converted checkpoint there.
  out = _cli("generate", "--model", "default", "--prompt", "The capital of France is",
             "--max-new-tokens", "8")
  assert out.returncode == 0, out.stderr
  assert "Paris" in out.stdout


def test_prompt_file_and_chat(default_lm, tmp_path):
  f = tmp_path / "prompt.txt"
  f.write_text("What is the capital of France?")
  out = _cli("generate", "--prompt-file", str(f), "--chat", "--max-new-tokens", "12")
  assert out.returncode == 0, out.stderr
  assert "Paris" in out.stdout


def test_unknown_method_is_a_clean_error():
  out = _cli("generate", "--prompt", "hi", "--method", "magic")
  assert out.returncode == 2
  assert f"unknown method 'magic'; known methods: {', '.join(names())}" in out.stderr
  assert "Traceback" not in out.stderr


def test_bad_method_arg():
  out = _cli("generate", "--prompt", "hi", "--method-arg", "budget")
  assert out.returncode == 2 and "key=value" in out.stderr


def test_convert_and_export(tmp_path):
  from checkpoints_convert import export_hf
  from jax_longctx.model import random_params
  from tests.conftest import tiny_config
  cfg = tiny_config()
  export_hf(random_params(cfg), cfg, str(tmp_path / "hf"))
  out = _cli("convert", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
  assert out.returncode == 0, out.stderr
  out = _cli("export", str(tmp_path / "ckpt"), str(tmp_path / "back"))
  assert out.returncode == 0 and (tmp_path / "back" / "model.safetensors").exists()
  out = _cli("convert", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
  assert out.returncode == 2 and "exists" in out.stderr


def test_snapkv_on_a_prompt_file_past_its_budget(default_lm, tmp_path):
  """A prompt file of over 1K tokens, SnapKV keeping 256 (the main job runs it at 3K)."""
  filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
  parts = [filler] * 50
  parts.insert(30, "The pass key is 68213. Remember it. 68213 is the pass key. ")
  f = tmp_path / "long.txt"
  f.write_text("There is important info hidden inside a lot of irrelevant text. " + "".join(parts) +
               "What is the pass key? The pass key is")
  assert len(default_lm.encode(f.read_text())) > 1000
  out = _cli("generate", "--model", "default", "--method", "snapkv", "--method-arg", "budget=256",
             "--prompt-file", str(f), "--max-new-tokens", "8")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip()


def test_citrus_takes_the_instruction_apart(default_lm, tmp_path):
  f = tmp_path / "doc.txt"
  f.write_text("Anna lives in Paris. " + "The grass is green. The sky is blue. " * 30)
  args = ("generate", "--chat", "--max-new-tokens", "12", "--method", "citrus_shared",
          "--method-arg", "budget=64", "--method-arg", "chunk=64")
  out = _cli(*args, "--prompt-file", str(f), "--instruction", "Where does Anna live?")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip()
  one_line = _cli(*args, "--prompt", "a one-line prompt")
  assert one_line.returncode != 0
  assert "cannot split a one-line prompt" in one_line.stderr


def test_wrong_typed_method_arg_is_one_line():
  out = _cli("generate", "--model", "default", "--prompt", "hi", "--method", "snapkv",
             "--method-arg", "budget=abc")
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip() == (
      "jax-longctx: error: method 'snapkv': budget='abc' is not valid; budget takes a number of "
      "tokens (int >= 1) or a fraction of the cache (float in (0, 1])")


def _one_line_error(argv, capsys) -> str:
  """Runs the command in this process; it must fail with one line on stderr (no traceback)."""
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and err.startswith("jax-longctx: error: "), err
  return err


@pytest.mark.parametrize("length", ["0", "-5", "0.0001k"])
def test_a_length_below_one_token_is_a_one_line_error(length, capsys, tmp_path):
  """--lengths 0 ran the task's shortest prompt (68 tokens) and reported it as "0K"; -5 said
  "results in DIR" and wrote nothing. Both fail before the model loads, naming the length."""
  err = _one_line_error(["eval", "--task", "passkey", "--lengths", f"4k,{length}",
                         "--out", str(tmp_path / "out")], capsys)
  assert f"bad length {length!r}" in err
  assert not (tmp_path / "out").exists()


def test_a_prompt_file_that_is_a_directory_is_a_one_line_error(capsys, tmp_path):
  err = _one_line_error(["generate", "--prompt-file", str(tmp_path)], capsys)
  assert err == f"jax-longctx: error: --prompt-file {tmp_path}: Is a directory"


def test_bad_models_and_settings_stay_one_line_errors(capsys, tmp_path):
  """What was already clear stays so: a truncated GGUF, a directory that is no model, a depth
  outside [0, 1], an unknown dtype (argparse's own error)."""
  import jax
  import numpy as np

  from jax_longctx.model import random_params
  from tests.conftest import tiny_config
  from tests.gguf_fixtures import write_gguf
  cfg = tiny_config(vocab_size=97, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=96, architecture="qwen2", attention_bias=True)
  gguf = tmp_path / "m.gguf"
  write_gguf(gguf, cfg, jax.tree.map(np.asarray, random_params(cfg, seed=2)), "qwen2")
  with open(gguf, "r+b") as f:
    f.truncate(os.path.getsize(gguf) // 2)
  assert "not a readable GGUF file" in _one_line_error(
      ["generate", "--model", str(gguf), "--prompt", "hi"], capsys)
  (tmp_path / "empty").mkdir()
  assert "no config.json" in _one_line_error(
      ["generate", "--model", str(tmp_path / "empty"), "--prompt", "hi"], capsys)
  assert "--depths must lie in [0, 1], got [1.5]" in _one_line_error(
      ["eval", "--task", "passkey", "--depths", "1.5", "--out", str(tmp_path / "o")], capsys)
  with pytest.raises(SystemExit) as exit_:
    cli.main(["generate", "--prompt", "hi", "--dtype", "float8"])
  assert exit_.value.code == 2 and "invalid choice: 'float8'" in capsys.readouterr().err


def test_an_empty_prompt_is_a_one_line_error(default_lm, capsys):
  assert "empty prompt" in _one_line_error(["generate", "--prompt", ""], capsys)
