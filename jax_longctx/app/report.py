"""Summary tables of an evaluation sweep's results (results.jsonl records); jax_longctx.app.plots
draws its figures."""

from __future__ import annotations

import collections
import math
import os

import numpy as np

from jax_longctx.app.gap_stats import (LEVEL, RESAMPLES, nll_by_seed, paired_gap, paired_relative,
                                       pooled_ppl)
from jax_longctx.app.tasks.ruler import LEFT_OUT_NOTE, PREFIX as RULER
from jax_longctx.app.tasks.ruler_suite import NAMES as RULER_TASKS
from pallas_kernels.quant import EIGHT_BIT
from pallas_kernels.quant4 import FORMATS

QUANTIZED = (*EIGHT_BIT, *FORMATS)  # the cache dtypes a sweep compares with the model's


def _mean(xs):
  return sum(xs) / len(xs) if xs else float("nan")


def _len(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _methods(labels) -> list[str]:
  return sorted(labels, key=lambda m: (m != "full", m))


def summary_table(records: list[dict], baselines: list[str] | None = None) -> str:
  """Markdown: mean score per method x length (perplexity for ppl, accuracy in % otherwise);
  RULER's tables (tasks x lengths per method, and their average); score by compression ratio."""
  by = collections.defaultdict(list)
  for r in records:
    if not r["task"].startswith(RULER):
      by[(r["task"], r["method"], r["length"])].append(r["score"])
  out = ruler_tables(records) + compression_tables(records)
  for task in sorted({k[0] for k in by}):
    methods = _methods({k[1] for k in by if k[0] == task})
    lengths = sorted({k[2] for k in by if k[0] == task})
    unit = "perplexity" if task == "ppl" else "score %"
    out.append(f"### {task} ({unit}, mean over samples; n = samples per cell)\n")
    out.append("| method | " + " | ".join(_len(n) for n in lengths) + " |")
    out.append("|---" * (len(lengths) + 1) + "|")
    for m in methods:
      cells = []
      for n in lengths:
        xs = by.get((task, m, n), [])
        if not xs:
          cells.append("-")
        elif task == "ppl":
          cells.append(f"{_mean(xs):.2f} (n={len(xs)})")
        else:
          cells.append(f"{100 * _mean(xs):.0f} (n={len(xs)})")
      out.append(f"| {m} | " + " | ".join(cells) + " |")
    out.append("")
  return "\n".join(out + _gap_table(records, baselines) + _kv_dtype_table(records)
                   + _stride_table(records))


def suite_scores(records: list[dict]) -> dict[tuple, tuple[float, int, int]]:
  """(suite, method, length) -> (score, samples, tasks). RULER's suite scores the average of its
  tasks' mean scores (RULER's average), every other task alone; in % (perplexity for ppl)."""
  by = collections.defaultdict(list)
  for r in records:
    by[(r["task"], r["method"], r["length"])].append(r["score"])
  groups = collections.defaultdict(list)
  for (task, m, n), xs in by.items():
    scale = 1 if task == "ppl" else 100
    groups[("ruler" if task.startswith(RULER) else task, m, n)].append((scale * _mean(xs), len(xs)))
  return {k: (_mean([s for s, _ in v]), sum(c for _, c in v), len(v)) for k, v in groups.items()}


def ruler_tables(records: list[dict]) -> list[str]:
  """RULER's table per method: its tasks as rows, lengths as columns, the average row (RULER's:
  the mean of the tasks' scores); each cell's samples, and the note on what differs from RULER."""
  by = collections.defaultdict(list)
  for r in records:
    if r["task"].startswith(RULER):
      by[(r["task"][len(RULER):], r["method"], r["length"])].append(r["score"])
  if not by:
    return []
  out = [f"{LEFT_OUT_NOTE}\n"]
  scores = suite_scores(records)
  for m in _methods({k[1] for k in by}):
    lengths = sorted({k[2] for k in by if k[1] == m})
    out.append(f"### RULER: {m} (score %, string_match_all; n = samples per cell)\n")
    out.append("| task | " + " | ".join(_len(n) for n in lengths) + " |")
    out.append("|---" * (len(lengths) + 1) + "|")
    for t in [t for t in RULER_TASKS if any(k[0] == t and k[1] == m for k in by)]:
      cells = [f"{100 * _mean(xs):.1f} (n={len(xs)})" if (xs := by.get((t, m, n))) else "-"
               for n in lengths]
      out.append(f"| {t} | " + " | ".join(cells) + " |")
    avg = [scores[("ruler", m, n)] for n in lengths]
    out.append("| **average** | " + " | ".join(f"**{s:.1f}** ({k} tasks, n={c})"
                                                for s, c, k in avg) + " |")
    out.append("")
  return out


def _compression_points(records: list[dict]) -> dict[tuple, dict]:
  """(suite, length) -> {base method: {compression ratio: label}} of a compression sweep."""
  points: dict[tuple, dict] = collections.defaultdict(lambda: collections.defaultdict(dict))
  for r in records:
    if r.get("compression_ratio") is not None:
      suite = "ruler" if r["task"].startswith(RULER) else r["task"]
      points[(suite, r["length"])][r["base_method"]][round(r["compression_ratio"], 4)] = r["method"]
  return points


def compression_tables(records: list[dict]) -> list[str]:
  """Per suite and length: each method's score at each compression ratio, full attention's
  beside them (the numbers of kvpress's plot)."""
  scores = suite_scores(records)
  out = []
  for (suite, n), bases in sorted(_compression_points(records).items()):
    ratios = sorted({cr for by_cr in bases.values() for cr in by_cr})
    full = scores.get((suite, "full", n))
    what = "the average of RULER's tasks" if suite == "ruler" else "mean over samples"
    out.append(f"### {suite} at {_len(n)} by compression ratio (score %, {what}; ratio = 1 - "
               f"kept tokens / {n}, kvpress's compression_ratio; n = samples)\n")
    out.append("full attention: " + (f"{full[0]:.1f} (n={full[1]})" if full else "not run") + "\n")
    out.append("| method | " + " | ".join(f"{cr:g}" for cr in ratios) + " |")
    out.append("|---" * (len(ratios) + 1) + "|")
    for b in sorted(bases):
      cells = [f"{sc[0]:.1f} (n={sc[1]})" if (sc := scores.get((suite, bases[b].get(cr), n)))
               else "-" for cr in ratios]
      out.append(f"| {b} | " + " | ".join(cells) + " |")
    # The prompts are shorter than the length (RULER leaves room for the answer): what they lost.
    dropped = collections.defaultdict(list)
    for r in records:
      if r.get("compression_ratio") is not None and r["length"] == n and (
          suite == ("ruler" if r["task"].startswith(RULER) else r["task"])):
        dropped[round(r["compression_ratio"], 4)].append(r["prompt_compression"])
    out.append("| share of the prompt dropped (mean) | " + " | ".join(
        f"{_mean(dropped[cr]):.3f}" for cr in ratios) + " |")
    out.append("")
  return out


def stride_counts(records: list[dict]) -> dict[tuple, tuple[np.ndarray, float]]:
  """RefreshKV's counts per (task, method, length): (full steps per layer, decode steps), each
  summed over the samples. A rate is averaged by summing its counts first: one sample with no
  full step in a layer must not make that layer's stride infinite."""
  sums: dict[tuple, tuple[np.ndarray, float]] = {}
  for r in records:
    if r.get("full_steps"):
      key = (r["task"], r["method"], r["length"])
      full, steps = sums.get(key, (0.0, 0.0))
      sums[key] = (full + np.asarray(r["full_steps"], np.float64), steps + r["decode_steps"])
  return sums


def effective_stride(full_steps, decode_steps: float) -> float:
  """Decode steps per full step of an average layer: every layer's full steps pooled (inf: no
  layer ever took one)."""
  full = np.asarray(full_steps, np.float64)
  total = float(full.sum())
  return decode_steps * full.size / total if total > 0 else math.inf


def _stride_table(records: list[dict]) -> list[str]:
  """RefreshKV's effective stride (decode steps per full step) per layer and over all layers,
  from full and decode steps summed over the samples."""
  sums = stride_counts(records)
  if not sums:
    return []
  out = ["### effective stride (decode steps per full step, summed over samples; inf: no sample "
         "had a full step)\n",
         "| task | method | length | all layers | per layer |", "|---" * 5 + "|"]
  for (task, m, n), (full, steps) in sorted(sums.items()):
    per_layer = np.where(full > 0, steps / np.maximum(full, 1e-30), np.inf)
    out.append(f"| {task} | {m} | {n} | {effective_stride(full, steps):.1f} | "
               + " ".join(f"{x:.0f}" if math.isfinite(x) else "inf" for x in per_layer) + " |")
  return out + [""]


def _gap_table(records: list[dict], baselines: list[str] | None = None) -> list[str]:
  """Per ppl length with full attention and a baseline (labels in `baselines`, else every label
  containing "snap"): each method's pooled perplexity and the share of each baseline's gap to
  full attention it closes, with the paired-bootstrap interval over the texts all three ran."""
  ppl = [r for r in records if r["task"] == "ppl" and r.get("nll") is not None]
  strides = stride_counts(records)
  out = []
  for n in sorted({r["length"] for r in ppl}):
    labels = {r["method"] for r in ppl if r["length"] == n}
    bases = sorted(m for m in labels if (m in baselines if baselines is not None else "snap" in m))
    if "full" not in labels or not bases:
      continue
    order = ["full"] + bases + sorted(labels - {"full", *bases})
    nll = {m: nll_by_seed(ppl, m, n) for m in order}
    if not out:
      out.append(f"### ppl: share of a baseline's gap to full attention closed (pooled token NLL; "
                 f"(ppl_B - ppl_M) / (ppl_B - ppl_F); {LEVEL:.0%} paired bootstrap over texts, "
                 f"{RESAMPLES} resamples)\n")
    out.append(f"{n} tokens:\n")
    out.append("| method | ppl (pooled) | texts | stride | " + " | ".join(
        f"vs {b}" for b in bases) + " |")
    out.append("|---" * (4 + len(bases)) + "|")
    for m in order:
      counts = strides.get(("ppl", m, n))
      stride = f"{effective_stride(*counts):.1f}" if counts else "-"
      cells = [f"{pooled_ppl(list(nll[m].values())):.3f}", str(len(nll[m])), stride]
      for b in bases:
        gap = None if m in ("full", b) else paired_gap(nll[m], nll[b], nll["full"])
        cells.append("-" if gap is None else f"{100 * gap.share:.0f}% [{100 * gap.low:.0f}, "
                     f"{100 * gap.high:.0f}] (n={gap.n_texts})")
      out.append(f"| {m} | " + " | ".join(cells) + " |")
    out.append("")
  return out


def _cache_pairs(records: list[dict]):
  """(task, length, method, model-dtype label, quantized dtype, its label) for each method a
  sweep ran with a cache in the model's dtype and in 8 or 4 bits (eval --kv-dtype labels them
  "METHOD bfloat16", "METHOD int8")."""
  labels = collections.defaultdict(dict)  # (task, length, method without its dtype) -> {dtype: label}
  for r in records:
    if r.get("kv_dtype"):
      key = (r["task"], r["length"], r["method"].removesuffix(" " + r["kv_dtype"]))
      labels[key][r["kv_dtype"]] = r["method"]
  for (task, n, method), by_dtype in sorted(labels.items()):
    plain = [kv for kv in by_dtype if kv not in QUANTIZED]
    if len(plain) == 1:
      for kv in sorted(set(by_dtype) & set(QUANTIZED)):
        yield task, n, method, by_dtype[plain[0]], kv, by_dtype[kv]


def answers_compared(a: dict, b: dict) -> str:
  """'samples | score a | score b | same answers' (scores in %) of two runs of one cell on the
  samples both ran ({sample key: record} each); '' when they share none."""
  both = sorted(set(a) & set(b), key=str)
  if not both:
    return ""
  score = [100 * _mean([run[k]["score"] for k in both]) for run in (a, b)]
  same = sum(a[k]["prediction"] == b[k]["prediction"] for k in both)
  return f"{len(both)} | {score[0]:.0f} | {score[1]:.0f} | {same}"


def _kv_dtype_table(records: list[dict]) -> list[str]:
  """Each 8- or 4-bit cache against the same method's cache in the model's dtype, on the samples both
  ran (cells with different sample counts are compared on their common samples only), issue
  54's quality measures: for ppl the pooled token NLL with its paired-bootstrap interval; for
  the other tasks both scores and how many answers are the same string."""
  ppl_rows, task_rows = [], []
  for task, n, method, plain, kv, label in _cache_pairs(records):
    if task == "ppl":
      base, gap = nll_by_seed(records, plain, n), None
      if base:
        gap = paired_relative(nll_by_seed(records, label, n), base)
      if gap is not None:
        ppl_rows.append(f"| {_len(n)} | {method} | {kv} vs {plain.removeprefix(method + ' ')} | "
                        f"{100 * gap.value:+.3f}% | [{100 * gap.low:+.3f}, {100 * gap.high:+.3f}]"
                        f" | {gap.n_texts} |")
      continue
    runs = [{(r["depth"], r["seed"]): r for r in records
             if r["task"] == task and r["method"] == m and r["length"] == n} for m in (plain, label)]
    compared = answers_compared(*runs)
    if compared:
      task_rows.append(f"| {task} | {_len(n)} | {method} | {kv} | {compared} |")
  out = []
  if ppl_rows:
    out += [f"### ppl: the quantized cache's pooled token NLL against the model dtype's ({LEVEL:.0%} "
            f"paired bootstrap over the texts both ran, {RESAMPLES} resamples)\n",
            "| length | method | cache | NLL vs | interval | texts |", "|---" * 6 + "|",
            *ppl_rows, ""]
  if task_rows:
    out += ["### The quantized cache against the model dtype's, on the samples both ran (score %)\n",
            "| task | length | method | cache | samples | score, model dtype | score, quantized | "
            "same answer |", "|---" * 8 + "|", *task_rows, ""]
  return out


def write_report(records: list[dict], out_dir: str, baselines: list[str] | None = None) -> None:
  from jax_longctx.app.plots import write_plots  # plots reads this module's tables

  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write(summary_table(records, baselines))
  write_plots(records, out_dir)


def main(argv=None) -> int:
  """Rewrites summary.md and the plots of finished sweeps from their records (results.jsonl,
  or results.jsonl.gz packed), then with --pack keeps the records packed:
      python -m jax_longctx.app.report DIR [DIR ...] [--baseline LABEL ...] [--pack]"""
  import argparse

  from jax_longctx.app.records import PACKED, pack_results, read_records, results_file

  p = argparse.ArgumentParser(prog="python -m jax_longctx.app.report", description=main.__doc__)
  p.add_argument("dirs", nargs="+", help="sweep directories holding results.jsonl")
  p.add_argument("--baseline", action="append", default=None,
                 help="a label to measure gaps against (default: every label containing 'snap')")
  p.add_argument("--pack", action="store_true",
                 help="then compress each sweep's results.jsonl to results.jsonl.gz (a finished "
                      "sweep kept small; every reader takes it, a rerun unpacks it)")
  args = p.parse_args(argv)
  for d in args.dirs:
    path = results_file(d)
    open(path, "rb").close()  # none there: the OSError the command line reports in one line
    records = read_records(path, repair=False)
    write_report(records, d, args.baseline)
    print(f"wrote {d}/summary.md ({len(records)} records)")
    if args.pack and not os.path.exists(os.path.join(d, PACKED)):
      print(f"packed {pack_results(d)}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
