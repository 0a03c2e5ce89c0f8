"""The paper's Table 9 trade-off for a RefreshKV sweep as one markdown table: per method, the
effective stride, pooled perplexity and share of the paper's SnapKV gap closed (90% paired
bootstrap) at each length, and decode ms/token from benchmarks/decode.py records (the 8B shape
at 128K) with the speed-up over full attention measured in the same file.

    python experiments/refreshkv_tradeoff.py --sweep docs/results/refreshkv/MODEL/ppl \
        --lengths 16k,32k --decode benchmarks/results/decode_refreshkv_calibrated_128k.jsonl \
        --out docs/results/refreshkv/MODEL/tradeoff.md
"""

from __future__ import annotations

import argparse
import json
import os

from jax_longctx.app.records import read_records, results_file
from jax_longctx.app.gap_stats import nll_by_seed, paired_gap, pooled_ppl
from jax_longctx.app.report import effective_stride, stride_counts

BASELINE = "snapkv_paper"


def _lines(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def _decode_ms(path: str) -> dict[str, float]:
  """{label: ms/token}, the latest record of each label without an error."""
  return {r["label"]: r["decode_ms"] for r in _lines(path) if "decode_ms" in r}


def table(sweep: str, lengths: list[str], decode: str) -> str:
  ms = _decode_ms(decode)
  cells, labels, thresholds = {}, [], {}
  for length in lengths:
    recs = read_records(results_file(os.path.join(sweep, length)), repair=False)
    strides = stride_counts(recs)
    for n in sorted({r["length"] for r in recs}):
      full, base = nll_by_seed(recs, "full", n), nll_by_seed(recs, BASELINE, n)
      for m in dict.fromkeys(r["method"] for r in recs if r["length"] == n):
        labels += [m] if m not in labels else []
        thresholds.setdefault(m, next((r["hparams"].get("threshold") for r in recs
                                       if r["method"] == m), None))
        mine = nll_by_seed(recs, m, n)
        gap = None if m in ("full", BASELINE) else paired_gap(mine, base, full)
        counts = strides.get(("ppl", m, n))
        cells[(m, length)] = (
            f"{effective_stride(*counts):.1f}" if counts else "-",
            f"{pooled_ppl(list(mine.values())):.3f}",
            "-" if gap is None else f"{100 * gap.share:.0f}% [{100 * gap.low:.0f}, "
                                    f"{100 * gap.high:.0f}] (n={gap.n_texts})")
  first = ["full", BASELINE, "snapkv"]
  labels = [m for m in first if m in labels] + [m for m in labels if m not in first]
  head = ["method", "threshold"] + [f"{x} {length}" for length in lengths
                                    for x in ("stride", "ppl", f"gap closed vs {BASELINE}")]
  head += ["ms/token 128K (8B)", "vs full"]
  out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for m in labels:
    row = [m, "-" if thresholds.get(m) is None else f"{thresholds[m]:g}"]
    for length in lengths:
      row += list(cells.get((m, length), ("-", "-", "-")))
    t = ms.get(m)
    row += ["-" if t is None else f"{t:.2f}",
            "-" if t is None or "full" not in ms else f"{ms['full'] / t:.2f}x"]
    out.append("| " + " | ".join(row) + " |")
  fixed = [f"{k}: {v:.2f}" for k, v in ms.items() if k not in labels]
  if fixed:  # fixed-stride stand-ins for the measured strides, and any other timed label
    out.append("\nAlso timed (ms/token at 128K): " + ", ".join(fixed))
  return "\n".join(out) + "\n"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--sweep", required=True, help="directory holding LENGTH/results.jsonl")
  p.add_argument("--lengths", default="16k,32k")
  p.add_argument("--decode", default="", help="benchmarks/decode.py records (JSON lines)")
  p.add_argument("--out", required=True)
  args = p.parse_args()
  text = ("# RefreshKV trade-off (the paper's Table 9): effective stride (decode steps per full "
          "step, all layers), pooled perplexity, share of the paper's SnapKV gap closed, decode "
          "speed\n\n" + table(args.sweep, args.lengths.split(","), args.decode))
  with open(args.out, "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
