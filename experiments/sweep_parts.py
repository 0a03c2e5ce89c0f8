"""One sweep run as several eval processes on one GPU, each into DIR/parts/LABEL, then merged.

    python experiments/sweep_parts.py seed DIR LABEL   # before a worker: its finished records
    python experiments/sweep_parts.py merge DIR N [--baseline L ...]

`seed` gives a worker whose part is gone (merged away) its label's records from DIR/results.jsonl,
so the eval resumes instead of rerunning them. `merge` unites DIR/results.jsonl and every part
(one record per task, method, length, depth and seed; the merged file's first), writes
DIR/results.jsonl through a temporary file, rewrites summary.md and the plots, and removes the
parts once every label has N records per length (experiments/refreshkv_calibrated.sh).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil

from jax_longctx.app.eval import RESULTS, load_results, unpack_results
from jax_longctx.app.report import write_report


def _key(rec: dict) -> tuple:  # what identifies a sample in a sweep (as eval's resume)
  return (rec["task"], rec["method"], rec["length"], rec["depth"], rec["seed"])


def _write(records: list[dict], path: str) -> None:
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))
  os.replace(tmp, path)


def seed(out_dir: str, label: str) -> int:
  part = os.path.join(out_dir, "parts", label)
  if os.path.exists(os.path.join(part, RESULTS)):
    return 0
  mine = [r for r in load_results(out_dir) if r["method"] == label]
  os.makedirs(part, exist_ok=True)
  _write(mine, os.path.join(part, RESULTS))
  return len(mine)


def merge(out_dir: str, n: int, baselines: list[str] | None) -> tuple[int, bool]:
  """(records merged, whether every label is complete and the parts were removed)."""
  parts = os.path.join(out_dir, "parts")
  labels = sorted(d for d in (os.listdir(parts) if os.path.isdir(parts) else [])
                  if os.path.isdir(os.path.join(parts, d)))  # beside them: the workers' logs
  merged = {}
  for rec in load_results(out_dir) + [r for lab in labels
                                      for r in load_results(os.path.join(parts, lab))]:
    merged.setdefault(_key(rec), rec)
  records = list(merged.values())
  _write(records, unpack_results(out_dir))
  write_report(records, out_dir, baselines)
  count = collections.Counter((r["method"], r["length"]) for r in records)
  complete = bool(labels) and all(
      count[(lab, length)] >= n for lab in labels for length in {r["length"] for r in records})
  if complete:
    shutil.rmtree(parts)
  return len(records), complete


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  s = sub.add_parser("seed")
  s.add_argument("dir")
  s.add_argument("label")
  m = sub.add_parser("merge")
  m.add_argument("dir")
  m.add_argument("n", type=int, help="samples per label and length when complete")
  m.add_argument("--baseline", action="append", default=None)
  args = p.parse_args()
  if args.cmd == "seed":
    print(f"{args.label}: {seed(args.dir, args.label)} finished records seeded")
  else:
    total, complete = merge(args.dir, args.n, args.baseline)
    print(f"{args.dir}: {total} records" + (", complete (parts removed)" if complete else
                                             ", not complete yet: run the sweep again"))


if __name__ == "__main__":
  main()
