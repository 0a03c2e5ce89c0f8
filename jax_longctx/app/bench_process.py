"""Benchmarks run each setting in a child process of its own: its peak memory is that setting's
alone, XLA_FLAGS (read once per process) can differ, and a setting that runs out of memory or
crashes is a result, not the end of the sweep. The child hands its record to the parent as one
line of its stdout. Cases run in one process (`run_cases`) are kept apart the same way: one that
raises is a record with its error."""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable

# A child process's record: this, then the record's JSON, one line of its stdout.
RESULT = "RESULT "
STDERR_KEPT = 8000  # characters of a child's stderr kept for its parent's error record


def child_result(rec: dict) -> None:
  """In a child process (`run_child`): hands `rec` to the parent."""
  print(RESULT + json.dumps(rec), flush=True)


@dataclasses.dataclass(frozen=True)
class ChildRun:
  records: list  # what the child handed over (`child_result`), in order
  returncode: int
  stderr: str  # the last STDERR_KEPT characters of its stderr
  timed_out: bool = False


def run_child(argv: list[str], *, env: dict | None = None, cwd: str | None = None,
              timeout: float | None = None, echo_stderr: bool = False,
              on_record: Callable[[dict], None] | None = None) -> ChildRun:
  """Runs `python ARGV...` (a script and its arguments, or -m MODULE ...) and collects its
  records. on_record(rec) is called as each record arrives, so a parent cut off keeps what
  finished; echo_stderr passes the child's stderr (its progress lines) through as it comes;
  past `timeout` seconds the child is killed (timed_out)."""
  proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
  kept = [""]

  def read_stderr():  # in a thread: a child filling the stderr pipe would block otherwise
    for line in proc.stderr:
      if echo_stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
      kept[0] = (kept[0] + line)[-STDERR_KEPT:]

  reader = threading.Thread(target=read_stderr, daemon=True)
  reader.start()
  killed = threading.Event()
  timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill())) if timeout else None
  if timer:
    timer.start()
  records = []
  try:
    for line in proc.stdout:
      if line.startswith(RESULT):
        records.append(json.loads(line[len(RESULT):]))
        if on_record:
          on_record(records[-1])
    proc.wait()
    reader.join()
  finally:
    if timer:
      timer.cancel()
    if proc.poll() is None:  # the parent was interrupted: the child goes with it
      proc.kill()
  return ChildRun(records, proc.returncode, kept[0], killed.is_set())


def run_cases(cases: dict[str, Callable], only: str, record: Callable[[dict], None]) -> list[str]:
  """Runs each case (name -> a function returning a record or a list of them) unless `only`
  (comma list) leaves it out; hands every record, stamped with the case name and seconds, to
  `record`. A case that raises is recorded with its error and the rest still run (one broken
  case must not waste a device's time). Returns the names of the failed cases."""
  wanted = set(filter(None, only.split(",")))
  failed = []
  for name, run in cases.items():
    if wanted and name not in wanted:
      continue
    t0 = time.time()
    try:
      recs = run()
    except Exception as e:  # noqa: BLE001 - reported in the record
      traceback.print_exc()
      recs = {"case": name, **getattr(e, "record", {}),
              "error": f"{type(e).__name__}: {str(e)[:3000]}"}
      failed.append(name)
    for rec in recs if isinstance(recs, list) else [recs]:
      rec.update(name=rec.get("name", name), seconds=round(time.time() - t0, 1))
      record(rec)
    gc.collect()
  return failed
