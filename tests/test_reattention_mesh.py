"""Mesh ReAttention (jax_longctx/distributed/reattention_mesh.py) equals one-device ReAttention
on 8 fake CPU devices; each check runs in its own process (the device count is fixed when JAX
starts): tests/reattention_mesh_checks.py says what each one checks."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["layer", "layer_tied", "layer_gpu_kernels", "model",
                                  "resa_model", "errors"])
def test_on_eight_devices(name):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "tests.reattention_mesh_checks", name], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
