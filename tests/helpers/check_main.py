"""The command line of the multi-device check modules (`python -m tests.helpers.MODULE NAME...`):
each named check in turn in this one process (its device count fixed when JAX started), so that
the checks of a test file share its start-up and its compiled programs. Each check's output lies
between a start line and an end line that says OK or FAILED (after its traceback), which
tests/conftest.py `run_on_eight_devices` reads; a check that fails leaves the next ones to run.
"OK" alone ends the output when every check passed."""

import os
import sys
import traceback

import jax

START, END = "@@check start", "@@check end"
# XLA's CPU executables stay mapped while JAX caches them (~6 memory maps each): a process of all
# of test_tensor_parallel's checks passed 43,000 maps halfway, near the kernel's 65,530 where
# XLA's compiler crashed (tests/conftest.py `_drop_compiled_programs`). Past this many, the
# cached programs are dropped between two checks (the next reads the suite's on-disk cache).
MAX_MAPS = 10_000


def _maps() -> int:
  try:
    with open(f"/proc/{os.getpid()}/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


def main(checks: dict, names: list[str]) -> None:
  failed = False
  for name in names:
    print(f"{START} {name}", flush=True)
    try:
      checks[name]()
    except Exception:  # reported; the next check still runs
      traceback.print_exc(file=sys.stdout)
      print(f"{END} {name} FAILED", flush=True)
      failed = True
    else:
      print(f"{END} {name} OK", flush=True)
    if _maps() > MAX_MAPS:
      jax.clear_caches()
  if failed:
    sys.exit(1)
  print("OK")


def results(stdout: str) -> dict[str, tuple[bool, str]]:
  """name -> (passed, its output) for each check whose end line `stdout` holds."""
  out, name, lines = {}, None, []
  for line in stdout.splitlines():
    if line.startswith(START + " "):
      name, lines = line[len(START) + 1:], []
    elif line.startswith(END + " ") and name is not None:
      out[name] = (line.endswith(" OK"), "\n".join(lines))
      name = None
    else:
      lines.append(line)
  return out
