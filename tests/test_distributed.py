"""Cross-device attention on 8 fake CPU devices (each check in its own process, since the device
count is fixed when JAX starts)."""

import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["ring_causal", "ring_full", "star_phase2", "star_one_block",
                                  "ring_end_to_end", "star_blocks"])
def test_on_eight_devices(name):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "tests.distributed_checks", name], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
