"""An eval sweep's records: results.jsonl, one JSON record a line, appended and synced as each
sample finishes, read back to resume (a last line an interrupted write cut short is dropped and
its sample runs again), and the checks an --out passes before any sample runs.

A finished sweep's records may be kept packed (`pack_results`: results.jsonl.gz, gzip, as the
sweeps under docs/results are, a quarter of the bytes): every reader takes either, and a
rerun into a packed sweep unpacks it first (`unpack_results`), so new records append to the
plain file."""

from __future__ import annotations

import gzip
import json
import os
import sys

from jax_longctx.core.errors import LongctxError

RESULTS = "results.jsonl"
PACKED = RESULTS + ".gz"


class EvalError(LongctxError, ValueError):
  pass


def record_key(rec: dict) -> tuple:
  return (rec["task"], rec["method"], rec["length"], rec["depth"], rec["seed"])


def results_file(out_dir: str) -> str:
  """The records file of `out_dir`: results.jsonl, or results.jsonl.gz where only that one is
  there (a packed sweep)."""
  plain, packed = (os.path.join(out_dir, name) for name in (RESULTS, PACKED))
  return packed if os.path.exists(packed) and not os.path.exists(plain) else plain


def load_results(out_dir: str, repair: bool = True) -> list[dict]:
  """Finished samples of the sweep in `out_dir` (`read_records`; packed or not)."""
  return read_records(results_file(out_dir), repair, record_key)


def pack_results(out_dir: str) -> str:
  """Compresses a finished sweep's results.jsonl into results.jsonl.gz (through a temporary
  file renamed into place; the header's time zeroed, so the same records give the same bytes)
  and removes the plain file. Returns the packed file's path."""
  plain, packed = (os.path.join(out_dir, name) for name in (RESULTS, PACKED))
  with open(plain, "rb") as f:
    data = f.read()
  if data and not data.endswith(b"\n"):
    raise EvalError(f"{plain} ends in a record cut short: rerun its sweep (it resumes) first")
  read_records(plain, repair=False, key=record_key)  # every line a record
  _replace(packed, gzip.compress(data, compresslevel=9, mtime=0))
  os.remove(plain)
  return packed


def unpack_results(out_dir: str) -> str:
  """Makes `out_dir`'s records appendable: a packed sweep's results.jsonl.gz back to
  results.jsonl (through a temporary file), the packed file removed. Returns the plain file's
  path (which may not exist: a sweep with no records yet)."""
  plain, packed = (os.path.join(out_dir, name) for name in (RESULTS, PACKED))
  if os.path.exists(packed) and not os.path.exists(plain):
    with gzip.open(packed, "rb") as f:
      _replace(plain, f.read())
    os.remove(packed)
  return plain


def _replace(path: str, data: bytes) -> None:
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_records(path: str, repair: bool = True, key=lambda rec: rec) -> list[dict]:
  """The records of a JSONL file that `append_record` writes. A last line without its newline
  is a record whose write was interrupted (a killed run): it is dropped, with one line saying
  so, and its sample runs again; with `repair` the file is cut back to the end of the line
  before, so the next record starts a line of its own. Any other line that is not valid JSON
  (or that `key` cannot read) is an error, never silently dropped."""
  if not os.path.exists(path):
    return []
  packed = path.endswith(".gz")
  with (gzip.open if packed else open)(path, "rb") as f:
    data = f.read()
  lines = data.split(b"\n")
  cut = lines.pop()  # after the last newline: b"" unless a write was cut short
  if cut.strip() and packed:
    raise EvalError(f"{path} ends in a line cut short; a packed file holds whole records")
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
  try:
    os.makedirs(out_dir, exist_ok=True)
    path = unpack_results(out_dir)
    with open(path, "ab"):
      pass
  except OSError as e:
    raise EvalError(f"--out {out_dir} cannot be written: {e.strerror or e}") from None
  return path
