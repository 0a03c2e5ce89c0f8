"""Cross-device attention on 8 fake CPU devices (each check in its own process, since the device
count is fixed when JAX starts)."""

import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["ring_causal", "ring_full", "star_phase2", "star_one_block",
                                  "star_two_blocks", "ring_end_to_end", "star_blocks",
                                  "star_vs_transformers", "star_two_blocks_in_rows"])
def test_on_eight_devices(name):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "tests.distributed_checks", name], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_star_across_two_processes_matches_one(tmp_path):
  """2 processes x 4 CPU devices (jax.distributed on localhost) give what 1 process x 8 does."""
  import socket

  import numpy as np
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  cmd = [sys.executable, "-m", "tests.two_process_check"]
  procs = [subprocess.Popen(cmd + [port, str(i), str(tmp_path / f"p{i}.npz")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0 and "OK" in out, err[-3000:]
  single = subprocess.run(cmd + ["single", str(tmp_path / "s.npz")], cwd=ROOT, timeout=600,
                          env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"),
                          capture_output=True, text=True)
  assert single.returncode == 0, single.stderr[-3000:]
  want = np.load(tmp_path / "s.npz")
  for i in range(2):
    got = np.load(tmp_path / f"p{i}.npz")
    assert (got["tokens"] == want["tokens"]).all()
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)
