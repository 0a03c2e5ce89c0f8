"""One sweep against another run the same way but for one choice (a kernel route, say): two
trees of `jax-longctx eval` outputs, A the reference and B the variant, matched by the path of
each results.jsonl below the tree and by each record's task, method label, length and sample.

    python -m experiments.route_compare OUT/dequantize OUT/products [--out FILE.md]

Prints (and writes with --out) a markdown table: for ppl, B's pooled token NLL against A's with
the paired-bootstrap interval over the texts both ran (jax_longctx.app.gap_stats, as the 8-bit
cache's table in summary.md); for the other tasks both scores and how many answers are the same
string, on the samples both ran; and for ppl how many scored tokens' NLL differ at all (0 would
say the choice never acted).
"""

from __future__ import annotations

import argparse
import collections
import os

import numpy as np

from jax_longctx.app.gap_stats import LEVEL, RESAMPLES, nll_by_seed, paired_relative
from jax_longctx.app.records import PACKED, RESULTS, load_results
from jax_longctx.app.report import answers_compared


def _sweeps(root: str) -> dict[str, list[dict]]:
  """{path of a sweep's folder below root: its records}."""
  out = {}
  for folder, _, files in os.walk(root):
    if RESULTS in files or PACKED in files:
      out[os.path.relpath(folder, root)] = load_results(folder, repair=False)
  return out


def _cells(records: list[dict]) -> dict[tuple, dict]:
  """{(task, method label, length): {(depth, seed): record}}."""
  cells = collections.defaultdict(dict)
  for r in records:
    cells[(r["task"], r["method"], r["length"])][(r["depth"], r["seed"])] = r
  return cells


def compare(a_root: str, b_root: str) -> list[str]:
  a_sweeps, b_sweeps = _sweeps(a_root), _sweeps(b_root)
  ppl, tasks = [], []
  for path in sorted(set(a_sweeps) & set(b_sweeps)):
    a, b = a_sweeps[path], b_sweeps[path]
    b_cells = _cells(b)
    for (task, method, n), a_runs in sorted(_cells(a).items(), key=str):
      b_runs = b_cells.get((task, method, n), {})
      if task == "ppl":
        base, var = nll_by_seed(a, method, n), nll_by_seed(b, method, n)
        gap = paired_relative(var, base)
        if gap is None:
          continue
        seeds = sorted(set(base) & set(var))
        moved = sum(int(np.sum(base[s] != var[s])) for s in seeds)
        tokens = sum(len(base[s]) for s in seeds)
        ppl.append(f"| {path} | {method} | {n} | {100 * gap.value:+.3f}% | "
                   f"[{100 * gap.low:+.3f}, {100 * gap.high:+.3f}] | {gap.n_texts} | "
                   f"{moved} of {tokens} |")
        continue
      compared = answers_compared(a_runs, b_runs)
      if compared:
        tasks.append(f"| {path} | {task} | {method} | {n} | {compared} |")
  out = []
  if ppl:
    out += [f"B's pooled token NLL against A's ({LEVEL:.0%} paired bootstrap over the texts both "
            f"ran, {RESAMPLES} resamples)\n",
            "| sweep | method | length | NLL vs A | interval | texts | tokens whose NLL moved |",
            "|---" * 7 + "|", *ppl, ""]
  if tasks:
    out += ["Scores on the samples both ran (%)\n",
            "| sweep | task | method | length | samples | A | B | same answer |",
            "|---" * 8 + "|", *tasks, ""]
  return out or [f"no sweep of {a_root} has a counterpart with common samples in {b_root}"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("a", help="the reference tree of eval outputs")
  p.add_argument("b", help="the variant's tree, laid out as the reference's")
  p.add_argument("--out", default=None, help="also write the table to this markdown file")
  args = p.parse_args(argv)
  text = "\n".join(compare(args.a, args.b))
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
