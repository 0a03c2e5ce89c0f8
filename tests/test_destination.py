"""One writer per destination (jax_longctx/checkpoints/destination.py): the lock, the stale-scratch
rule, and a full disk as one line with nothing left behind."""

import errno
import fcntl
import os
import socket
import threading
import time

import jax
import numpy as np
import pytest

from checkpoints_convert import CheckpointError, convert, export_hf

from jax_longctx.checkpoints import destination, pipeline
from jax_longctx.model import random_params
from tests.conftest import tiny_config

HOST = socket.gethostname()


def _mkdir_with(path, nbytes):
  os.makedirs(path)
  with open(os.path.join(path, "w.npy"), "wb") as f:
    f.write(b"\0" * nbytes)


def test_stale_scratch_of_this_host_is_removed_and_named_in_one_line(tmp_path, capsys):
  dst = tmp_path / "ckpt"
  _mkdir_with(tmp_path / f".ckpt.tmp-abcdefgh@{HOST}", 2_000_000)
  _mkdir_with(tmp_path / ".ckpt.tmp-zyxwv_09", 1000)  # named before the host was in the name
  _mkdir_with(tmp_path / f".ckpt.old-aaaaaaaa@{HOST}", 10)
  (tmp_path / f".ckpt.tmp-fileabcd@{HOST}").write_bytes(b"x" * 3)  # a file's scratch
  keep = [f".ckpt.tmp-bbbbbbbb@elsewhere", f".ckpt2.tmp-cccccccc@{HOST}",  # another host's;
          f".ckpt.gguf.tmp-dddddddd@{HOST}", ".ckpt.tmp-short", "ckpt.tmp-eeeeeeee"]  # not ckpt's
  for name in keep:
    _mkdir_with(tmp_path / name, 10)
  with destination.writer_lock(str(dst)) as waited:
    assert not waited
  assert sorted(os.listdir(tmp_path)) == sorted(keep)  # the lock file is gone too
  err = capsys.readouterr().err.splitlines()
  assert err == [
      f"removed stale scratch of {dst} from an interrupted run: .ckpt.old-aaaaaaaa@{HOST} "
      f"(0.0 MB), .ckpt.tmp-abcdefgh@{HOST} (2.0 MB), .ckpt.tmp-fileabcd@{HOST} (0.0 MB), "
      f".ckpt.tmp-zyxwv_09 (0.0 MB)",
      f"left scratch of {dst} from other hosts alone (their writers may still run; remove it if "
      f"not): .ckpt.tmp-bbbbbbbb@elsewhere"]


def test_a_second_writer_waits_and_then_holds_the_one_current_lock(tmp_path, capsys):
  """The first holder removes the lock file on its way out; the waiter, which locked the removed
  file, must lock the current one, or a third writer could hold a lock at the same time."""
  dst = str(tmp_path / "ckpt")
  held, release, got = threading.Event(), threading.Event(), {}

  def first():
    with destination.writer_lock(dst):
      held.set()
      release.wait(30)

  def second():
    with destination.writer_lock(dst) as waited:
      got["waited"] = waited
      with open(destination.lock_path(dst), "a") as f:  # a third writer, arriving now
        try:
          fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
          got["third locked"] = True
        except BlockingIOError:
          got["third locked"] = False

  a = threading.Thread(target=first)
  a.start()
  assert held.wait(30)
  b = threading.Thread(target=second)
  b.start()
  deadline = time.time() + 30
  out = ""
  while "waiting" not in out and time.time() < deadline:
    time.sleep(0.05)
    out += capsys.readouterr().err
  release.set()
  a.join(30)
  b.join(30)
  assert out.strip() == (f"waiting for another process writing {dst} "
                         f"(pid {os.getpid()} on {HOST})")
  assert got == {"waited": True, "third locked": False}
  assert os.listdir(tmp_path) == []


def test_nested_holds_in_one_thread_do_not_wait(tmp_path):
  with destination.writer_lock(str(tmp_path / "x")):
    with destination.writer_lock(str(tmp_path / "x")) as waited:
      assert not waited
    assert os.path.exists(destination.lock_path(str(tmp_path / "x")))
  assert os.listdir(tmp_path) == []


# ---- a full disk --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
  cfg = tiny_config()
  src = tmp_path_factory.mktemp("hf") / "src"
  export_hf(jax.tree.map(np.asarray, random_params(cfg, seed=4)), cfg, str(src))
  return str(src)


def _no_space(*a, **kw):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _tensorstore_no_space(*a, **kw):  # how orbax's writer reports it: the OS error in a message
  raise ValueError("Error writing local file \"/x/params/d/0\": [OS error 28: No space left on "
                   "device]")


@pytest.mark.parametrize("where", ["memmap", "orbax", "config"])
def test_disk_full_during_conversion_is_one_line_and_leaves_nothing(hf_src, tmp_path, monkeypatch,
                                                                    where):
  if where == "memmap":  # reserving the scratch's blocks (else a full disk is SIGBUS)
    monkeypatch.setattr(pipeline.os, "posix_fallocate", _no_space)
  elif where == "orbax":
    monkeypatch.setattr(pipeline, "save_orbax", _tensorstore_no_space)
  else:
    monkeypatch.setattr(pipeline, "save_config_file", _no_space)
  out = tmp_path / "out"
  with pytest.raises(CheckpointError,
                     match=rf"^no space left on device writing {out / 'ckpt'}: needs about "
                           rf"[0-9.]+ MB, [0-9.]+ [MG]B free$"):
    convert(hf_src, str(out / "ckpt"))
  assert os.listdir(out) == []


@pytest.mark.parametrize("spare", [-1, 1])
def test_conversion_starts_only_if_its_scratch_fits(hf_src, tmp_path, monkeypatch, spare):
  """The memory-mapped scratch (every weight) is sure to be written; orbax's compressed copy
  after it is not known ahead, so less space than twice the weights still starts."""
  weights = tiny_config().num_params() * 4  # fp32

  class Usage:
    free = weights + spare
  monkeypatch.setattr(destination.shutil, "disk_usage", lambda path: Usage)
  out = tmp_path / "out"
  if spare < 0:
    with pytest.raises(CheckpointError, match=rf"needs about {2 * weights / 1e6:.1f} MB, "
                                              rf"{(weights - 1) / 1e6:.1f} MB free$"):
      convert(hf_src, str(out / "ckpt"))
    assert os.listdir(out) == []
  else:
    convert(hf_src, str(out / "ckpt"))
    assert os.listdir(out) == ["ckpt"]


def test_plain_conversion_keeps_what_another_writer_wrote(hf_src, tmp_path, monkeypatch):
  """The check that dst is absent and the rename are both under the lock; a writer that bypasses
  it (another host) and finishes first keeps its result."""
  dst = tmp_path / "ckpt"
  real = pipeline.save_config_file

  def other_writer_finishes(cfg, tmp):
    real(cfg, tmp)
    os.makedirs(dst / "params")
  monkeypatch.setattr(pipeline, "save_config_file", other_writer_finishes)
  with pytest.raises(FileExistsError, match="written by another writer meanwhile"):
    convert(hf_src, str(dst))
  assert os.listdir(dst) == ["params"] and os.listdir(tmp_path) == ["ckpt"]
