"""The command line, as a user runs it."""

import argparse
import errno
import io
import json
import os
import shlex
import subprocess
import sys

import pytest

from jax_longctx.app import cli, cli_commands
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
  from tests.helpers.gguf_fixtures import write_gguf
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
  assert "KernelOptions has no field 'topk'" in _one_line_error(
      ["eval", "--task", "passkey", "--kernel-option", "topk=1", "--out", str(tmp_path / "o")],
      capsys)
  assert "topk_eight_bit='maybe' must be one of" in _one_line_error(
      ["eval", "--task", "passkey", "--kernel-option", "topk_eight_bit=maybe",
       "--out", str(tmp_path / "o")], capsys)
  with pytest.raises(SystemExit) as exit_:
    cli.main(["generate", "--prompt", "hi", "--dtype", "float8"])
  assert exit_.value.code == 2 and "invalid choice: 'float8'" in capsys.readouterr().err


def test_an_empty_prompt_is_a_one_line_error(default_lm, capsys):
  assert "empty prompt" in _one_line_error(["generate", "--prompt", ""], capsys)


# Fast tests below: the command line in this process, no model loaded.

def _only_line(capsys) -> str:
  err = capsys.readouterr().err
  assert "Traceback" not in err and err.count("\n") == 1, err
  return err.strip()


def test_out_naming_a_file_is_one_line(capsys, tmp_path):
  out = tmp_path / "results"
  out.write_text("not a directory")
  assert cli.main(["eval", "--task", "passkey", "--lengths", "256", "--samples", "1",
                   "--out", str(out)]) != 0
  err = _only_line(capsys)
  assert err.startswith(f"jax-longctx: error: --out {out}"), err


@pytest.mark.parametrize("error, line", [
    (OSError(errno.EROFS, "Read-only file system", "{out}/results.jsonl"),
     "--out {out}: {out}/results.jsonl: Read-only file system"),
    (FileExistsError(errno.EEXIST, "File exists", "{out}"), "--out {out}: File exists"),
    (OSError(errno.ENOSPC, "No space left on device"), "eval: No space left on device"),
    (PermissionError(errno.EACCES, "Permission denied", "/elsewhere"),
     "eval: /elsewhere: Permission denied"),
])
def test_an_os_error_anywhere_is_one_line(error, line, capsys, monkeypatch, tmp_path):
  """Whatever fails to read or write once the sweep runs (a read-only --out after a sample, a
  full disk) ends in one line naming the path and the reason."""
  out = str(tmp_path / "r")
  if error.filename:
    error.filename = error.filename.format(out=out)

  def fails(args):
    raise error
  monkeypatch.setattr(cli_commands, "cmd_eval", fails)
  assert cli.main(["eval", "--task", "passkey", "--out", out]) == 2
  assert _only_line(capsys) == "jax-longctx: error: " + line.format(out=out)


def test_ctrl_c_is_one_line_with_the_command_that_resumes(capsys, monkeypatch, tmp_path):
  def interrupted(args):
    raise KeyboardInterrupt
  monkeypatch.setattr(cli_commands, "cmd_eval", interrupted)
  monkeypatch.setattr(cli_commands, "cmd_generate", interrupted)
  out = str(tmp_path / "my results")
  argv = ["eval", "--task", "passkey", "--methods", "full,snapkv", "--out", out]
  assert cli.main(argv) == 130
  again = "jax-longctx eval --task passkey --methods full,snapkv --out " + shlex.quote(out)
  assert _only_line(capsys) == (
      f"jax-longctx: interrupted; finished samples are kept in {out}/results.jsonl; run the same "
      f"command to resume: {again}")
  assert cli.main(["generate", "--prompt", "hi"]) == 130
  assert _only_line(capsys) == "jax-longctx: interrupted"


def test_a_closed_stdout_ends_quietly(capsys, monkeypatch):
  def closed(args):
    raise BrokenPipeError(errno.EPIPE, "Broken pipe")
  monkeypatch.setattr(cli_commands, "cmd_methods", closed)
  assert cli.main(["methods"]) == 1
  assert capsys.readouterr().err == ""


class _EchoLM:
  """Stands in for the model: `generate` answers with the prompt it was given."""

  def generate(self, prompts, method, **kw):
    return [f"prompt: {prompts[0]}"]


@pytest.fixture
def echo_lm(monkeypatch):
  from jax_longctx.app import api
  monkeypatch.setattr(api, "load", lambda *a, **kw: _EchoLM())


@pytest.mark.parametrize("stdin", [
    lambda text: io.TextIOWrapper(io.BytesIO(text.encode()), encoding="latin-1"),
    io.StringIO,  # a stream of text only (no bytes beneath)
])
def test_prompt_file_dash_reads_stdin(stdin, echo_lm, capsys, monkeypatch):
  monkeypatch.setattr(sys, "stdin", stdin("Où est Paris ?\n"))
  assert cli.main(["generate", "--prompt-file", "-"]) == 0
  assert capsys.readouterr().out == "prompt: Où est Paris ?\n\n"


def test_a_binary_prompt_is_a_one_line_error(echo_lm, capsys, monkeypatch, tmp_path):
  f = tmp_path / "weights.bin"
  f.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
  assert cli.main(["generate", "--prompt-file", str(f)]) == 2
  assert _only_line(capsys) == f"jax-longctx: error: --prompt-file {f} is not UTF-8 text"
  monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(f.read_bytes())))
  assert cli.main(["generate", "--prompt-file", "-"]) == 2
  assert _only_line(capsys) == ("jax-longctx: error: --prompt-file - (standard input) is not "
                                "UTF-8 text")


def test_version(capsys):
  from importlib.metadata import version
  with pytest.raises(SystemExit) as exit_:
    cli.main(["--version"])
  assert exit_.value.code == 0
  assert capsys.readouterr().out == f"jax-longctx {version('jax-longctx')}\n"


def test_methods_lists_every_method_with_its_defaults_and_paper(capsys):
  from jax_longctx import methods
  from jax_longctx.methods.hparams import field_types
  assert cli.main(["methods"]) == 0
  out = capsys.readouterr().out
  lines = out.splitlines()
  for name in names():
    block = lines[lines.index(next(x for x in lines if x.startswith(f"{name}: "))):]
    block = block[:block.index("")] if "" in block else block
    entry = methods.get(name)
    for field in field_types(type(entry)):
      assert any(x.strip().startswith(f"{field}={getattr(entry, field)!r} ") for x in block), (
          name, field, block)
    assert any(x.startswith("  paper: ") for x in block), block
  assert 'paper: "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469' in out
  assert "share of the cache KEPT" in out
  assert cli.main(["methods", "tova"]) == 0
  assert capsys.readouterr().out.count("\ntova: ") == 1


def test_tasks_lists_every_task_with_its_options(capsys):
  from jax_longctx.app import tasks
  assert cli.main(["tasks"]) == 0
  out = capsys.readouterr().out
  for name in tasks.names():
    assert f"\n{name}: " in out
  for name in tasks.expand("ruler"):
    assert f"\n  {name}: options: max_new_tokens=" in out
  assert "options: max_new_tokens=12" in out  # passkey's
  assert "options: n_scored=256, heldout=False" in out  # ppl's


def test_report_rebuilds_the_summary(capsys, tmp_path):
  records = [{"task": "passkey", "method": m, "length": 256, "depth": 0.5, "seed": s,
              "score": float(m == "full" or s)} for m in ("full", "snapkv") for s in (0, 1)]
  (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  assert cli.main(["report", str(tmp_path)]) == 0
  assert f"wrote {tmp_path}/summary.md (4 records)" in capsys.readouterr().out
  summary = (tmp_path / "summary.md").read_text()
  assert "| full | 100 (n=2) |" in summary and "| snapkv | 50 (n=2) |" in summary
  assert cli.main(["report", str(tmp_path / "none")]) == 2
  assert _only_line(capsys) == (f"jax-longctx: error: report: {tmp_path}/none/results.jsonl: No "
                                "such file or directory")
  # --pack keeps the records compressed; a report reads them packed as they were
  assert cli.main(["report", str(tmp_path), "--pack"]) == 0
  assert not (tmp_path / "results.jsonl").exists() and (tmp_path / "results.jsonl.gz").exists()
  (tmp_path / "summary.md").unlink()
  assert cli.main(["report", str(tmp_path)]) == 0
  assert f"wrote {tmp_path}/summary.md (4 records)" in capsys.readouterr().out
  assert (tmp_path / "summary.md").read_text() == summary


def test_help_is_for_users_and_shows_every_default(capsys):
  parser = cli.build_parser()
  with pytest.raises(SystemExit):
    parser.parse_args(["--help"])
  top = capsys.readouterr().out
  assert "entry point" not in top and "jax-longctx methods" in top
  sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  for command, p in sub.choices.items():
    if command == "train-cpt":  # another package's command
      continue
    for action in p._actions:
      if action.option_strings and action.nargs != 0 and not action.required:
        text = p._get_formatter()._get_help_string(action)
        assert "default" in text, (command, action.option_strings, text)
  helps = {c: p.format_help() for c, p in sub.choices.items()}
  assert "(default: 64)" in helps["generate"] and "(default: 20)" in helps["eval"]
  assert "jax-longctx tasks" in helps["eval"] and "snapkv" in helps["generate"]
  assert "share of the cache KEPT" in helps["eval"] and "compression_ratio" in helps["eval"]
