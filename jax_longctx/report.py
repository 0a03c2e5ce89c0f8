"""Summary table and plots of an evaluation sweep's results (results.jsonl records)."""

from __future__ import annotations

import collections
import math
import os

import numpy as np


def _mean(xs):
  return sum(xs) / len(xs) if xs else float("nan")


def summary_table(records: list[dict]) -> str:
  """Markdown: mean score per method x length (perplexity for ppl, accuracy in % otherwise)."""
  by = collections.defaultdict(list)
  for r in records:
    by[(r["task"], r["method"], r["length"])].append(r["score"])
  out = []
  for task in sorted({k[0] for k in by}):
    methods = sorted({k[1] for k in by if k[0] == task}, key=lambda m: (m != "full", m))
    lengths = sorted({k[2] for k in by if k[0] == task})
    unit = "perplexity" if task == "ppl" else "score %"
    out.append(f"### {task} ({unit}, mean over samples; n = samples per cell)\n")
    out.append("| method | " + " | ".join(f"{n // 1024}K" if n % 1024 == 0 else str(n)
                                          for n in lengths) + " |")
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
  return "\n".join(out + _stride_table(records))


def _stride_table(records: list[dict]) -> list[str]:
  """RefreshKV's effective stride (decode steps per full step), mean over samples, per layer."""
  by = collections.defaultdict(list)
  for r in records:
    if r.get("full_steps"):
      n = np.asarray(r["full_steps"], np.float64)
      stride = np.where(n > 0, r["decode_steps"] / np.maximum(n, 1e-9), np.inf)
      by[(r["task"], r["method"], r["length"])].append(stride)
  if not by:
    return []
  out = ["### effective stride (decode steps per full step; inf: never full)\n",
         "| task | method | length | mean over layers | per layer |", "|---" * 5 + "|"]
  for (task, m, n), rows in sorted(by.items()):
    per_layer = np.mean(np.asarray(rows, np.float64), axis=0)
    finite = per_layer[np.isfinite(per_layer)]
    mean = f"{finite.mean():.1f}" if finite.size else "inf"
    out.append(f"| {task} | {m} | {n} | {mean} | "
               + " ".join(f"{x:.0f}" if math.isfinite(x) else "inf" for x in per_layer) + " |")
  return out + [""]


def _ppl_ratio_curves(records, bins=8):
  """Per method and length: ratio of windowed perplexity to full attention's, same samples."""
  full = {(r["length"], r["seed"]): np.asarray(r["nll"]) for r in records
          if r["task"] == "ppl" and r["method"] == "full"}
  curves = collections.defaultdict(list)
  for r in records:
    if r["task"] != "ppl" or r["method"] == "full" or (r["length"], r["seed"]) not in full:
      continue
    ref, got = full[(r["length"], r["seed"])], np.asarray(r["nll"])
    edges = np.linspace(0, len(got), bins + 1).astype(int)
    curves[(r["method"], r["length"])].append(
        [math.exp(got[a:b].mean() - ref[a:b].mean()) for a, b in zip(edges[:-1], edges[1:])])
  return {k: np.mean(v, axis=0) for k, v in curves.items()}, bins


def write_plots(records: list[dict], out_dir: str) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  written = []
  for task in sorted({r["task"] for r in records}):
    rs = [r for r in records if r["task"] == task]
    methods = sorted({r["method"] for r in rs}, key=lambda m: (m != "full", m))
    lengths = sorted({r["length"] for r in rs})
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
      ys = [_mean([r["score"] for r in rs if r["method"] == m and r["length"] == n])
            for n in lengths]
      ax.plot(lengths, [y if task == "ppl" else 100 * y for y in ys], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity" if task == "ppl" else "score (%)")
    ax.set_title(task)
    ax.legend()
    path = os.path.join(out_dir, f"{task}_by_length.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    depths = sorted({r["depth"] for r in rs if r["depth"] is not None})
    if depths:
      fig, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 3), squeeze=False)
      for ax, m in zip(axes[0], methods):
        grid = np.array([[100 * _mean([r["score"] for r in rs if r["method"] == m and
                                       r["length"] == n and r["depth"] == d]) for n in lengths]
                         for d in depths])
        ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for (i, j), val in np.ndenumerate(grid):
          ax.text(j, i, "-" if np.isnan(val) else f"{val:.0f}", ha="center", va="center")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(m)
        ax.set_xlabel("length")
      axes[0][0].set_ylabel("needle depth")
      path = os.path.join(out_dir, f"{task}_depth_heatmap.png")
      fig.tight_layout()
      fig.savefig(path, dpi=100)
      plt.close(fig)
      written.append(path)
  curves, bins = _ppl_ratio_curves(records)
  if curves:
    fig, ax = plt.subplots(figsize=(6, 4))
    for (m, n), ys in sorted(curves.items()):
      ax.plot(np.arange(1, bins + 1) / bins, ys, marker="o", label=f"{m} @ {n}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("fraction of the scored tokens")
    ax.set_ylabel("perplexity / full attention's")
    ax.legend()
    path = os.path.join(out_dir, "ppl_ratio_by_position.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
  return written


def write_report(records: list[dict], out_dir: str) -> None:
  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write(summary_table(records))
  write_plots(records, out_dir)
