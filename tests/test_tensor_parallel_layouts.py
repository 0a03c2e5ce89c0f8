"""Tensor- and data-parallel inference on 8 fake CPU devices for head layouts other than the
16-head / 2-KV-head model of tests/test_tensor_parallel.py (whose doc says why two files):
an 8-head MHA model one head a device, a Qwen2-style model and a 9-head / 3-KV model (the
default model's layout) from tests/helpers/tensor_parallel_checks.py in one process, and the
command line (`--mesh`) on the default model with its 9 heads and 3 KV heads over model=3."""

import os
import subprocess
import sys

import pytest

from tests.conftest import run_on_eight_devices, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["meshes_mha", "qwen", "nine"])
def test_on_eight_devices(name, request):
  run_on_eight_devices("tests.helpers.tensor_parallel_checks", name, request)


def _cli(*args):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_LONGCTX_QUIET="1", JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"))
  return subprocess.run([sys.executable, "-m", "jax_longctx", *args], capture_output=True,
                        text=True, env=env, timeout=600)


def test_cli_generate_on_a_mesh_prints_what_one_device_does(default_lm):
  """SmolLM2's 9 query / 3 KV heads over model=3, two copies over data; SnapKV evicting."""
  args = ("generate", "--model", "default", "--prompt", "Name three colours of the rainbow.",
          "--chat", "--max-new-tokens", "16", "--method", "snapkv", "--method-arg", "budget=16",
          "--method-arg", "window=4")
  one = _cli(*args)
  many = _cli(*args, "--mesh", "data=2,model=3")
  assert one.returncode == 0 and many.returncode == 0, (one.stderr, many.stderr)
  assert many.stdout == one.stdout and one.stdout.strip()


@pytest.mark.parametrize("mesh,words", [
    ("data=4,model=4", "mesh data=4 x model=4 x ctx=1 needs 16 devices, but 8 are visible"),
    ("data=2,pipeline=2", "unknown mesh axis 'pipeline': the axes are data, model, ctx"),
    ("model=2", "num_heads=9 does not divide over model=2")])
def test_cli_bad_mesh_is_one_line(default_lm, mesh, words):
  out = _cli("generate", "--model", "default", "--prompt", "hi", "--mesh", mesh)
  assert out.returncode == 2 and words in out.stderr, out.stderr
  assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
