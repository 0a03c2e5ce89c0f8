"""One writer per destination, and nothing left behind by a writer that died.

Every writer of a destination DST (a converted checkpoint, an export, a bundled model's joined
GGUF) holds an flock on `.DST.lock` beside it while it works, and builds its result in scratch
beside it, named for DST and the host: `.DST.tmp-XXXXXXXX@HOST` (the result before its rename)
and `.DST.old-XXXXXXXX@HOST` (a replaced result on its way out).

The stale-scratch rule: the kernel releases an flock when its holder dies (SIGKILL included), so
whoever gets the lock knows that every earlier writer of DST on this host is gone, and their
scratch is removed at once (one line on stderr). flock is per host: on a filesystem shared by
several hosts it may not exclude a writer elsewhere, so scratch made on another host is left alone
(one line naming it) -- its writer may still be running there. Scratch named without a host
(written before this rule) counts as this host's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
from typing import Callable, Iterator

from jax_longctx.checkpoints.errors import CheckpointError

_HOST = socket.gethostname()
_held = threading.local()  # paths of the locks this thread holds -> nesting depth
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _say(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _split(dst: str) -> tuple[str, str]:
  dst = os.path.abspath(dst)
  return os.path.dirname(dst), os.path.basename(dst)


def lock_path(dst: str) -> str:
  parent, base = _split(dst)
  return os.path.join(parent, f".{base}.lock")


# ---- the lock -----------------------------------------------------------------------------------
def _acquire(path: str, dst: str):
  """The open, flocked lock file and whether another process had to be waited for."""
  waited = False
  while True:
    f = open(path, "a+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if not waited:
        f.seek(0)
        pid, _, host = f.read().strip().partition(" ")
        _say(f"waiting for another process writing {dst} (pid {pid or '?'} on {host or '?'})")
      waited = True
      fcntl.flock(f, fcntl.LOCK_EX)
    # The holder before us removes the file on its way out; a newcomer may then have created and
    # locked a new one, and the old file's lock would exclude nobody. Retry on the current file.
    try:
      current = os.stat(path)
    except FileNotFoundError:
      current = None
    mine = os.fstat(f.fileno())
    if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
      f.seek(0)
      f.truncate()
      f.write(f"{os.getpid()} {_HOST}\n")  # for a waiter's message
      f.flush()
      return f, waited
    f.close()


@contextlib.contextmanager
def writer_lock(dst: str) -> Iterator[bool]:
  """Holds DST's lock (waiting, with one line, for another process that holds it) and removes
  stale scratch of DST first. Yields whether it waited. Nested holds in one thread are free."""
  dst = os.path.abspath(dst)
  path = lock_path(dst)
  if not hasattr(_held, "depth"):
    _held.depth = {}
  held = _held.depth
  if held.get(path):
    held[path] += 1
    try:
      yield False
    finally:
      held[path] -= 1
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  f, waited = _acquire(path, dst)
  held[path] = 1
  try:
    remove_stale_scratch(dst)
    yield waited
  finally:
    held[path] = 0
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)  # before the release (see _acquire): no lock file outlives its writer
    f.close()


def once(dst: str, done: Callable[[], bool], make: Callable[[], object]) -> str:
  """`dst`, made by `make()` unless `done()` says it is there; a process that finds another one
  making it waits for it and then uses its result."""
  if not done():
    with writer_lock(dst):
      if not done():
        make()
  return dst


# ---- scratch ------------------------------------------------------------------------------------
def _scratch_re(base: str) -> re.Pattern:
  # tempfile's 8 random characters, then "@host" (absent in scratch named before the host was).
  return re.compile(rf"\.{re.escape(base)}\.(tmp|old)-[a-z0-9_]{{8}}(@(?P<host>.+))?")


def _size(path: str) -> int:
  if not os.path.isdir(path) or os.path.islink(path):
    return os.lstat(path).st_size
  return sum(os.lstat(os.path.join(d, n)).st_size
             for d, _, names in os.walk(path) for n in names)


def _readable(n: int) -> str:
  return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


def remove_stale_scratch(dst: str) -> None:
  """Removes this host's scratch of DST. Only call it holding DST's lock (see the module doc)."""
  parent, base = _split(dst)
  pattern = _scratch_re(base)
  stale, foreign = [], []
  for name in sorted(os.listdir(parent)):
    m = pattern.fullmatch(name)
    if m:
      (stale if m.group("host") in (None, _HOST) else foreign).append(name)
  if stale:
    sizes = [_size(os.path.join(parent, n)) for n in stale]
    for name in stale:
      _remove(os.path.join(parent, name))
    _say(f"removed stale scratch of {dst} from an interrupted run: "
         + ", ".join(f"{n} ({_readable(s)})" for n, s in zip(stale, sizes)))
  if foreign:
    _say(f"left scratch of {dst} from other hosts alone (their writers may still run; remove "
         f"it if not): {', '.join(foreign)}")


def new_scratch(dst: str, directory: bool = True, kind: str = "tmp") -> str:
  """A new scratch directory (or empty file) beside DST, named by the module doc's rule."""
  parent, base = _split(dst)
  names = dict(prefix=f".{base}.{kind}-", suffix=f"@{_HOST}", dir=parent)
  if directory:
    return tempfile.mkdtemp(**names)
  fd, path = tempfile.mkstemp(**names)
  os.close(fd)
  return path


# ---- disk space ---------------------------------------------------------------------------------
def disk_full(e: BaseException) -> bool:
  """Whether `e` (or what caused it) is a full disk or quota. Libraries that write through their
  own I/O (orbax's tensorstore) report the OS error only in their message."""
  texts = [os.strerror(n) for n in _DISK_FULL]
  seen = set()
  while e is not None and id(e) not in seen:
    if (isinstance(e, OSError) and e.errno in _DISK_FULL) or any(t in str(e) for t in texts):
      return True
    seen.add(id(e))
    e = e.__cause__ or e.__context__
  return False


def space_error(dst: str, need: int | None, free: int) -> CheckpointError:
  needs = f"needs about {_readable(need)}, " if need else ""
  return CheckpointError(f"no space left on device writing {dst}: {needs}{_readable(free)} free")


@contextlib.contextmanager
def writing(dst: str, need: int | None = None, directory: bool = True,
            at_least: int | None = None) -> Iterator[str]:
  """Scratch for a new DST under DST's lock, removed when the block ends however it ends (the
  block moves it into place itself). need: about the peak bytes the block writes; at_least (need
  if not given): what it writes for sure, so that less free space refuses at once. A disk that
  fills anyway is one CheckpointError line naming DST.

  The free space named is the one at the start: a memory map of deleted scratch that the error's
  traceback still holds keeps its blocks until the error is dropped."""
  dst = os.path.abspath(dst)
  with writer_lock(dst):
    free = shutil.disk_usage(_split(dst)[0]).free
    if (at_least or need or 0) > free:
      raise space_error(dst, need, free)
    tmp = new_scratch(dst, directory)
    try:
      yield tmp
    except Exception as e:
      if disk_full(e):
        raise space_error(dst, need, free) from e
      raise
    finally:
      _remove(tmp)
