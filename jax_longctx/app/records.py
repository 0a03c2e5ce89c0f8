"""An eval sweep's records: results.jsonl, one JSON record a line, appended and synced as each
sample finishes, read back to resume (a last line an interrupted write cut short is dropped and
its sample runs again), and the checks an --out passes before any sample runs."""

from __future__ import annotations

import json
import os
import sys

from jax_longctx.core.errors import LongctxError

RESULTS = "results.jsonl"


class EvalError(LongctxError, ValueError):
  pass


def record_key(rec: dict) -> tuple:
  return (rec["task"], rec["method"], rec["length"], rec["depth"], rec["seed"])


def load_results(out_dir: str, repair: bool = True) -> list[dict]:
  """Finished samples of the sweep in `out_dir` (`read_records`)."""
  return read_records(os.path.join(out_dir, RESULTS), repair, record_key)


def read_records(path: str, repair: bool = True, key=lambda rec: rec) -> list[dict]:
  """The records of a JSONL file that `append_record` writes. A last line without its newline
  is a record whose write was interrupted (a killed run): it is dropped, with one line saying
  so, and its sample runs again; with `repair` the file is cut back to the end of the line
  before, so the next record starts a line of its own. Any other line that is not valid JSON
  (or that `key` cannot read) is an error, never silently dropped."""
  if not os.path.exists(path):
    return []
  with open(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  cut = lines.pop()  # after the last newline: b"" unless a write was cut short
  if cut.strip():
    print(f"{path}: dropped its last line, a record cut short by an interrupted write "
          f"({len(cut)} bytes); its sample runs again", file=sys.stderr)
    if repair:
      with open(path, "r+b") as f:
        f.truncate(len(data) - len(cut))
  out = []
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      key(rec)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
      raise EvalError(f"{path} line {i} is corrupt ({e}); fix or move the file, then rerun") from e
    out.append(rec)
  return out


def append_record(path: str, rec: dict) -> None:
  """One record as one line, in one write, on disk before the next sample starts: a kill leaves
  at most the last line cut short, which read_records recognises."""
  line = (json.dumps(rec) + "\n").encode()
  with open(path, "ab", buffering=0) as f:
    while line:  # a regular file takes it in one write; a short write only if interrupted
      line = line[f.write(line):]
    os.fsync(f.fileno())


# The answers kept in a record: chain-of-key's are the haystack's whole key list (~60 KB a
# sample); the sample is regenerated from (task, length, depth, seed) when more is needed.
STORED_ANSWERS = 32


def stored_expected(expected) -> dict:
  expected = list(expected)
  if len(expected) <= STORED_ANSWERS:
    return {"expected": expected}
  return {"expected": expected[:STORED_ANSWERS], "n_expected": len(expected)}


def writable_results(out_dir: str) -> str:
  """The results file of `out_dir`, the directory made and the file opened for appending here,
  so an --out that cannot take the records fails before any sample runs."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise EvalError(f"--out {out_dir} is a file; it names a directory (for results.jsonl, "
                    f"summary.md and the plots)")
  path = os.path.join(out_dir, RESULTS)
  try:
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "ab"):
      pass
  except OSError as e:
    raise EvalError(f"--out {out_dir} cannot be written: {e.strerror or e}") from None
  return path
