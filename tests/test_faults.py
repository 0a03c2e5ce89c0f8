"""Faults survived (issue 43): a conversion or an eval sweep killed (SIGKILL) at moments spread
over its run leaves no destination and no scratch that the next run does not remove, and the next
run finishes the work. The moments are the steps of tests/helpers/fault_child.py, reached
deterministically (the child stops there and the kill lands while it waits)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from checkpoints_convert import convert, export_hf, restore
from jax_longctx.model import random_params
from tests.helpers import fault_child
from tests.conftest import TINY_LLAMA3, tiny_config, write_tiny_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Without the suite's compilation cache: a child killed while writing an entry would leave it
# cut short (JAX writes entries in place) for the processes after it.
ENV = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
ENV.update(PYTHONPATH=ROOT, JAX_LONGCTX_QUIET="1", JAX_PLATFORMS="cpu")


def _kill_at(moment: str, *args: str, env=ENV) -> str:
  """Runs the fault child until it reports `moment`, kills it there; returns its stderr."""
  proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.fault_child", args[0], moment,
                           *args[1:]], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  line = proc.stdout.readline()  # blocks until the moment (or the child's end)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=60)
  err = proc.stderr.read()
  assert line.strip() == f"at {moment}", f"never reached {moment!r}: {line!r}\n{err[-3000:]}"
  return err


def test_conversion_killed_at_ten_moments_leaves_nothing_and_the_next_one_cleans_up(
    tmp_path, capfd):
  cfg = tiny_config(**TINY_LLAMA3)
  export_hf(jax.tree.map(np.asarray, random_params(cfg, seed=2)), cfg, str(tmp_path / "src"))
  out = tmp_path / "out"
  out.mkdir()
  dst = out / "ckpt"
  assert len(fault_child.CONVERT_MOMENTS) == 10
  for moment in fault_child.CONVERT_MOMENTS:
    _kill_at(moment, "convert", str(tmp_path / "src"), str(dst))
    assert not dst.exists(), moment
    left = sorted(os.listdir(out))
    capfd.readouterr()
    convert(str(tmp_path / "src"), str(dst))
    err = capfd.readouterr().err
    scratch = [n for n in left if ".tmp-" in n]
    assert len(scratch) == (0 if moment == "locked" else 1), (moment, left)
    for name in scratch:  # what the kill left, removed and said so in one line
      assert f"removed stale scratch of {dst} from an interrupted run: {name} (" in err, (moment, err)
    assert os.listdir(out) == ["ckpt"], (moment, os.listdir(out))  # no scratch, no lock file
    restore(str(dst))
    for d, _, names in os.walk(dst):  # nothing of the dead writer inside the result either
      assert ".scratch" not in d
    shutil.rmtree(dst)


# ---- an eval sweep ------------------------------------------------------------------------------
RECORDS = 6  # 2 methods x 1 length x 3 samples


def _eval_args(model, out):
  return ["--model", str(model), "--task", "ppl", "--task-arg", "n_scored=16",
          "--methods", "full,streaming_llm", "--method-arg", "streaming_llm.budget=64",
          "--lengths", "160", "--samples", "3", "--out", str(out)]


# In the order a sweep reaches them, each run resuming where the kill before left it.
EVAL_MOMENTS = [fault_child.eval_moment(p, k) for p, k in (
    ("compute", 0), ("write", 0), ("compute", 1), ("write", 1), ("write", 2), ("compute", 3),
    ("write", 3), ("write", 4), ("write", 5), ("report", 0))]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
  """A converted tiny Llama whose tokenizer has every byte (prose tokenizes one byte a token)."""
  return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_eval"))


@pytest.fixture(scope="module")
def eval_env(tmp_path_factory):
  """The runs share compiled programs through JAX's persistent cache: half of each run's CPU time
  on this tiny model is compiling, and twelve runs of it are most of this file's time."""
  return dict(ENV, JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _keys(out):
  with open(out / "results.jsonl") as f:
    return [(r["method"], r["length"], r["seed"]) for r in map(json.loads, f)]


def _eval(model, out, env) -> str:
  """An eval run to the end; its stderr."""
  done = subprocess.run([sys.executable, "-m", "jax_longctx", "eval", *_eval_args(model, out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stderr


def test_eval_sweep_killed_at_ten_moments_resumes_to_the_uninterrupted_result(
    tiny_checkpoint, eval_env, tmp_path):
  ref, out = tmp_path / "ref", tmp_path / "killed"
  _eval(tiny_checkpoint, ref, eval_env)
  before = None
  for moment in EVAL_MOMENTS + [None]:  # None: the last run, to the end
    err = (_kill_at(moment, "eval", *_eval_args(tiny_checkpoint, out), env=eval_env) if moment
           else _eval(tiny_checkpoint, out, eval_env))
    # A run after a kill halfway through writing a record drops that line (and only then).
    dropped = "dropped its last line, a record cut short by an interrupted write" in err
    assert dropped == bool(before and before.startswith("write")), (before, moment, err)
    before = moment
  keys = _keys(out)
  assert len(keys) == len(set(keys)) == RECORDS and sorted(keys) == sorted(_keys(ref))
  assert (out / "summary.md").read_text() == (ref / "summary.md").read_text()
  with open(ref / "results.jsonl") as a, open(out / "results.jsonl") as b:
    want = {(r["method"], r["seed"]): r["nll"] for r in map(json.loads, a)}
    got = {(r["method"], r["seed"]): r["nll"] for r in map(json.loads, b)}
  assert got == want
