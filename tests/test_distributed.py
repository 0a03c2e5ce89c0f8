"""Cross-device attention on 8 fake CPU devices (the checks in one process of their own, since the
device count is fixed when JAX starts)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import run_on_eight_devices, xla_flags


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", ["ring_causal", "ring_full", "star_phase2", "star_one_block",
                                  "star_two_blocks", "ring_end_to_end", "star_blocks",
                                  "star_vs_transformers", "star_two_blocks_in_rows",
                                  "four_bit"])
def test_on_eight_devices(name, request):
  run_on_eight_devices("tests.helpers.distributed_checks", name, request)


def _free_port() -> str:
  import socket
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return str(s.getsockname()[1])


TWO_PROCESS_METHODS = ["star", "reattention_mesh", "tensor_parallel"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
  """Each of TWO_PROCESS_METHODS run by 2 processes x 4 CPU devices (jax.distributed on
  localhost) and by 1 process x 8, every method of a side in the same processes (one start-up
  and one jax.distributed set-up for the three): the directory of their outputs."""
  out = tmp_path_factory.mktemp("two_processes")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=4"))
  cmd = [sys.executable, "-m", "tests.helpers.two_process_check"]
  port = _free_port()
  procs = [subprocess.Popen(cmd + [port, str(i), str(out), *TWO_PROCESS_METHODS], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=600 * len(TWO_PROCESS_METHODS)) for p in procs]
  for p, (stdout, err) in zip(procs, outs):
    assert p.returncode == 0 and "OK" in stdout, err[-3000:]
  single = subprocess.run(cmd + ["single", str(out), *TWO_PROCESS_METHODS], cwd=ROOT,
                          timeout=600 * len(TWO_PROCESS_METHODS),
                          env=dict(env, XLA_FLAGS=xla_flags(
                              "--xla_force_host_platform_device_count=8")),
                          capture_output=True, text=True)
  assert single.returncode == 0, single.stderr[-3000:]
  return out


@pytest.mark.parametrize("method", TWO_PROCESS_METHODS)
def test_mesh_method_across_two_processes_matches_one(two_process_runs, method):
  """2 processes x 4 CPU devices (jax.distributed on localhost) give what 1 process x 8 does:
  Star, mesh ReAttention (its cache split over both processes' devices), and SnapKV with rows
  over data (each process two groups) and heads over model."""
  import numpy as np
  want = np.load(two_process_runs / f"{method}.single.npz")
  for i in range(2):
    got = np.load(two_process_runs / f"{method}.p{i}.npz")
    assert (got["tokens"] == want["tokens"]).all()
    np.testing.assert_allclose(got["logits"], want["logits"], atol=1e-5)


def test_eval_as_two_processes(tmp_path):
  """`jax-longctx eval --coordinator ...` as 2 processes x 2 CPU devices, as one process per GPU
  would run it: Star's and mesh ReAttention's meshes span both processes' 4 devices, and only
  process 0 writes. The cache is empty, so the processes first convert the model (it once
  deadlocked there). The int8 cache: the load calibrates key smoothing on the first context
  shard's devices, all of them process 0's (it once refused a mesh with a ctx axis)."""
  import json
  port, out = _free_port(), tmp_path / "eval"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_LONGCTX_CACHE=str(tmp_path),
             XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=2"))
  cmd = [sys.executable, "-m", "jax_longctx", "eval", "--model", "default", "--task",
         "passkey", "--chat", "--methods", "star,reattention_mesh", "--kv-dtype", "int8",
         "--method-arg", "reattention_mesh.n_local=512", "--method-arg", "reattention_mesh.clip=63",
         "--lengths", "1k", "--samples", "1", "--out", str(out), "--coordinator",
         f"localhost:{port}", "--num-processes", "2"]
  procs = [subprocess.Popen(cmd + ["--process-id", str(i)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  assert len(records) == 2 and all(r["devices"] == 4 for r in records)
  assert {r["method"] for r in records} == {"star", "reattention_mesh"}
  assert (out / "summary.md").exists()


@pytest.mark.parametrize("shared_anchor", [True, False])
def test_star_on_one_device_matches_transformers(tmp_path, shared_anchor):
  """Every block on one device (5 rows: several per device, in this process): Star equals Star
  written over transformers' Llama (tests/helpers/hf_reference.hf_star)."""
  import numpy as np
  import torch
  from transformers import LlamaForCausalLM

  from checkpoints_convert import export_hf
  from jax_longctx.model import random_params
  from tests.conftest import TINY_LLAMA3, tiny_config
  from tests.helpers.distributed_checks import star_run
  from tests.helpers.hf_reference import hf_star
  cfg = tiny_config(**TINY_LLAMA3)
  params = random_params(cfg, seed=4)
  export_hf(params, cfg, str(tmp_path / "hf"))
  model = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                           attn_implementation="eager").eval()
  rng = np.random.default_rng(3)
  context = rng.integers(0, cfg.vocab_size, 33).tolist()
  query = rng.integers(0, cfg.vocab_size, 4).tolist()
  rows, logits = star_run(params, cfg, [context], [query], 1, new=3, block_size=7,
                          anchor_size=7, shared_anchor=shared_anchor)
  want_logits, want_rows = hf_star(model, context, query, 7, 7, 3)
  np.testing.assert_allclose(np.asarray(logits)[0], want_logits, atol=1e-4, rtol=0)
  assert rows[0] == want_rows


def test_star_layout_and_errors(tiny):
  """The default block is a quarter of the context, rounded to 128 tokens from 4K on (so
  nearby lengths share one compile); bad settings are refused with the setting named."""
  from jax_longctx.methods import MethodError, get
  from jax_longctx.run.driver import generate
  from jax_longctx.run.generation import GenerationError
  star = get("star")
  assert star.context_layout(8177, 4) == star.context_layout(8100, 4)
  assert star.context_layout(8177, 4).block == 2048
  assert star.context_layout(8177, 4).n_blocks == 4
  assert star.context_layout(50, 8).block == 13  # short contexts: exactly a quarter
  assert get("star", block_size=64).context_layout(50, 8).anchor == 0  # one block: full
  assert get("star", block_size=4).context_layout(50, 8).n_blocks == 16  # 13 padded to 16
  with pytest.raises(MethodError, match="anchor_size=9"):
    get("star", block_size=8, anchor_size=9).context_layout(40, 1)
  cfg, params = tiny
  with pytest.raises(GenerationError, match="empty prompt"):
    generate(params, cfg, [[]], star, max_new_tokens=2, instructions=[[1]])
  with pytest.raises(GenerationError, match="empty instruction"):
    generate(params, cfg, [[1, 2]], star, max_new_tokens=2, instructions=[[]])
  with pytest.raises(GenerationError, match="needs the instruction apart"):
    generate(params, cfg, [[1, 2]], star, max_new_tokens=2)
