"""Conversion: HF <-> orbax round trips, sharded checkpoints, GGUF, atomic writes."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from checkpoints_convert import CheckpointError, convert, export_hf, load_source, restore
from jax_longctx.checkpoints import pipeline as convert_mod
from jax_longctx.checkpoints import safetensors_io
from jax_longctx.model import random_params
from tests.conftest import TINY_LLAMA3, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_tensors(directory):
  out = {}
  for f in sorted(os.listdir(directory)):
    if f.endswith(".safetensors"):
      for name, arr in safetensors_io.iter_tensors(os.path.join(directory, f)):
        out[name] = np.array(arr)
  return out


def _make_hf_dir(path, dtype, shard_bytes=None, monkeypatch=None):
  cfg = tiny_config(**TINY_LLAMA3)
  params = random_params(cfg, seed=5)
  params = {k: v for k, v in params.items()}
  import jax
  params = jax.tree.map(lambda a: np.asarray(a).astype(dtype), params)
  cfg = cfg.replace(dtype=np.dtype(dtype).name if dtype != ml_dtypes.bfloat16 else "bfloat16")
  if shard_bytes:
    monkeypatch.setattr(convert_mod, "_SHARD_BYTES", shard_bytes)
  export_hf(params, cfg, str(path))
  return cfg


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_hf_orbax_hf_round_trip_is_bit_exact(tmp_path, dtype, monkeypatch):
  _make_hf_dir(tmp_path / "src", dtype, shard_bytes=20_000, monkeypatch=monkeypatch)
  assert os.path.exists(tmp_path / "src" / "model.safetensors.index.json")  # sharded
  convert(str(tmp_path / "src"), str(tmp_path / "ckpt"))
  cfg, params = restore(str(tmp_path / "ckpt"))
  export_hf(params, cfg, str(tmp_path / "back"))
  a, b = _hf_tensors(tmp_path / "src"), _hf_tensors(tmp_path / "back")
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
  with open(tmp_path / "back" / "config.json") as f:
    assert json.load(f)["num_key_value_heads"] == cfg.num_kv_heads


def test_hf_directory_loads_directly(tmp_path):
  cfg = _make_hf_dir(tmp_path / "src", np.float32)
  cfg2, params, _ = load_source(str(tmp_path / "src"))
  assert cfg2.num_layers == cfg.num_layers and len(params["layers"]) == cfg.num_layers


def test_default_gguf_converted(default_lm):
  cfg = default_lm.config
  assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
  assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
  assert os.path.exists(os.path.join(default_lm.path, "tokenizer.json"))
  assert default_lm.tokenizer.chat_template and "<|im_start|>" in default_lm.tokenizer.chat_template


def test_existing_destination_is_not_overwritten(tmp_path):
  _make_hf_dir(tmp_path / "src", np.float32)
  os.makedirs(tmp_path / "dst")
  with pytest.raises(FileExistsError):
    convert(str(tmp_path / "src"), str(tmp_path / "dst"))
  convert(str(tmp_path / "src"), str(tmp_path / "dst"), overwrite=True)
  assert os.path.isdir(tmp_path / "dst" / "params")


def test_failed_conversion_leaves_nothing(tmp_path):
  _make_hf_dir(tmp_path / "src", np.float32)
  victim = next(f for f in os.listdir(tmp_path / "src") if f.endswith(".safetensors"))
  with open(tmp_path / "src" / victim, "r+b") as f:  # truncate the data section
    f.truncate(os.path.getsize(tmp_path / "src" / victim) // 2)
  with pytest.raises(CheckpointError):
    convert(str(tmp_path / "src"), str(tmp_path / "dst"))
  assert os.listdir(tmp_path) == ["src"]


def test_gguf_file_loads_directly_with_the_same_weights(default_lm):
  import jax
  import jax_longctx
  from jax_longctx.app.default_model import gguf_path
  direct = jax_longctx.load(gguf_path())
  assert direct.config == default_lm.config
  same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                      direct.params, default_lm.params)
  assert all(jax.tree.leaves(same))
  assert direct.tokenizer.encode("pass key 12345") == default_lm.tokenizer.encode("pass key 12345")


_CONVERT_ONCE = """
import os, sys, time
from jax_longctx.checkpoints import pipeline, safetensors_io
src, dst, log, go = sys.argv[1:5]
real = pipeline.convert
def logged(src, dst, overwrite=False):
  with open(log, "a") as f:
    f.write(f"{os.getpid()}\\n")
  return real(src, dst, overwrite)
pipeline.convert = logged
if go != "-":  # stop mid-way until the test says go
  real_iter = safetensors_io.iter_tensors
  def paused(path):
    for i, item in enumerate(real_iter(path)):
      if i == 3 and not os.path.exists(go):
        open(go + ".midway", "w").close()
        while not os.path.exists(go):
          time.sleep(0.05)
      yield item
  safetensors_io.iter_tensors = paused
pipeline.convert_once(src, dst)
pipeline.restore(dst)
"""


def _waiting_line(proc):
  """Reads proc's stderr up to its line saying that it waits; that line."""
  for line in proc.stderr:
    if "waiting for another process" in line:
      return line.strip()
  return None


def test_concurrent_conversions_one_converts_the_other_waits_and_uses_it(tmp_path):
  """Two jobs converting one model into one cache (issue 43): the second waits for the first and
  loads its result; both exit 0. A plain `convert` into the same place also waits, then refuses
  to replace it, as for any existing destination."""
  _make_hf_dir(tmp_path / "src", np.float32)
  src, dst, log, go = (str(tmp_path / "src"), str(tmp_path / "out" / "ckpt"),
                       str(tmp_path / "conversions.txt"), str(tmp_path / "go"))
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "JAX_LONGCTX_QUIET": "1"}

  def start(*args):
    return subprocess.Popen([sys.executable, *args], env=env, stderr=subprocess.PIPE, text=True)
  first = start("-c", _CONVERT_ONCE, src, dst, log, go)
  rescue = threading.Timer(120, lambda: open(go, "w").close())  # no hang if nobody waits
  rescue.start()
  try:
    deadline = time.time() + 120
    while not os.path.exists(go + ".midway") and time.time() < deadline and first.poll() is None:
      time.sleep(0.1)
    assert os.path.exists(go + ".midway"), first.stderr.read()[-2000:]
    second = start("-c", _CONVERT_ONCE, src, dst, log, "-")
    plain = start("-m", "jax_longctx", "convert", src, dst)
    waiting = f"waiting for another process writing {dst} (pid {first.pid} on {socket.gethostname()})"
    assert _waiting_line(second) == waiting
    assert _waiting_line(plain) == waiting
    open(go, "w").close()
    for job in (first, second):
      assert job.wait(timeout=300) == 0, job.stderr.read()[-2000:]
    assert plain.wait(timeout=300) == 2
    assert "exists (written by the process this one waited for)" in plain.stderr.read()
  finally:
    rescue.cancel()
  assert open(log).read().split() == [str(first.pid)]  # one conversion
  assert os.listdir(tmp_path / "out") == ["ckpt"]  # no lock file, no scratch
  restore(dst)
