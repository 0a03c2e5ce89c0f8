"""The figures of an evaluation sweep (results.jsonl records), drawn to be read by a person:
scores in % on a 0-100 axis, at most MAX_SERIES series on one axes (more go to further panels),
each series its own colour and marker, legends beside the data rather than over it, and a sweep
of one length drawn as labelled bars instead of points stacked on one x value."""

from __future__ import annotations

import collections
import math
import os
import re

import numpy as np

from jax_longctx.app.report import _compression_points, _len, _mean, _methods, suite_scores
from jax_longctx.app.tasks.ruler import PREFIX as RULER

MAX_SERIES = 8
# tab10's colours and 8 markers: series i and j look alike only when i = j mod 40.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
REFERENCE = "full"  # full attention: the line every other method is read against
PERCENT_YLIM = (0.0, 103.0)  # the margin keeps a series at 100% off the frame
TASK_NAMES = {"ppl": "perplexity", "ruler": "RULER average", "passkey": "passkey retrieval",
              "niah_single": "needle in a haystack (single)",
              "niah_multikey": "needle in a haystack (multi-key)",
              "niah_multivalue": "needle in a haystack (multi-value)",
              "chain_of_key": "chain of keys"}


def pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def series_style(i: int, label: str) -> dict:
  if label == REFERENCE:
    return {"color": "black", "marker": "o", "linestyle": "--"}
  return {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)]}


def legend_outside(ax, **kw):
  """The legend to the right of the axes, so it never hides a point or an axis label."""
  return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                   fontsize="small", frameon=False, **kw)


def base_method(label: str) -> str:
  """A label's method without its setting ("snapkv@cr0.5", "re int8", "qc5_after_0.85" ->
  "snapkv", "re", "qc5_after")."""
  return re.sub(r"_[0-9.]+$", "", re.split(r"[@ ]", label, maxsplit=1)[0])


def panels(labels: list[str], limit: int = MAX_SERIES) -> list[list[str]]:
  """Labels dealt onto panels of at most `limit` series: full attention on every panel as the
  reference, a method's settings kept on one panel where they fit."""
  ref = [REFERENCE] if REFERENCE in labels else []
  room = limit - len(ref)
  groups = collections.defaultdict(list)
  for label in labels:
    if label != REFERENCE:
      groups[base_method(label)].append(label)
  out: list[list[str]] = []
  for group in groups.values():
    for i in range(0, len(group), room):
      chunk = group[i:i + room]
      if out and len(out[-1]) + len(chunk) <= room:
        out[-1] += chunk
      else:
        out.append(chunk)
  return [ref + p for p in out] or [ref]


def _length_axis(ax, lengths):
  ax.set_xscale("log", base=2)
  ax.set_xticks(lengths, [_len(n) for n in lengths])
  ax.minorticks_off()


def save(fig, path: str) -> str:
  # "tight" grows the canvas to hold the legends drawn outside the axes.
  fig.savefig(path, dpi=100, bbox_inches="tight")
  pyplot().close(fig)
  return path


def draw_lines(ax, series: dict[str, tuple[list, list]], *, order: dict[str, int] | None = None,
               percent: bool = False, ylabel: str | None = None, **kw) -> None:
  """A line per label (x values, y values) on one axes of a figure laid out by the caller, in
  this module's styles; `order` (label -> style index) keeps a label's look across the panels of
  a figure (default: the labels' order here). `percent`: a 0-100 axis. The caller adds the legend
  (`legend_outside`); `kw` goes to every `ax.plot` (e.g. markersize)."""
  for i, (m, (xs, ys)) in enumerate(series.items()):
    style = series_style(i if order is None else order[m], m)
    # clip_on off: a marker at 0% or 100% shows whole instead of cut by the frame
    ax.plot(xs, ys, label=m, clip_on=False, **{**style, **kw})
  if percent:
    ax.set_ylim(*PERCENT_YLIM)
  if ylabel is not None:
    ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)


def line_plot(series: dict[str, tuple[list, list]], *, title: str, by: str, xlabel: str,
              ylabel: str, percent: bool, lengths: bool = False,
              hline: tuple[str, float] | None = None, path: str | None = None):
  """A line per label (x values, y values); the title reads "TITLE by BY". More than MAX_SERIES
  lines: a column of panels sharing both axes. Every label at the same single x: bars
  (`bar_plot`), titled "TITLE at X". Returns the figure, saved to `path` when given."""
  xs_all = {x for xs, _ in series.values() for x in xs}
  if len(xs_all) == 1 and hline is None:
    x = next(iter(xs_all))
    where = f"{_len(x)} tokens" if lengths else f"{by} {x:g}"
    return bar_plot({m: ys[0] for m, (_, ys) in series.items()}, title=f"{title} at {where}",
                    xlabel=ylabel, percent=percent, path=path)
  plt = pyplot()
  labels = list(series)
  order = {m: i for i, m in enumerate(labels)}  # one style per label on every panel
  groups = panels(labels, MAX_SERIES - (hline is not None))
  fig, axes = plt.subplots(len(groups), 1, figsize=(7, 3.6 * len(groups)), sharex=True,
                           sharey=True, squeeze=False)
  for ax, group in zip(axes[:, 0], groups):
    draw_lines(ax, {m: series[m] for m in group}, order=order, percent=percent, ylabel=ylabel)
    if hline is not None:
      ax.axhline(hline[1], color="black", linestyle=":", linewidth=1, label=hline[0])
    if lengths:
      _length_axis(ax, sorted(xs_all))
    legend_outside(ax)
  axes[-1, 0].set_xlabel(xlabel)
  axes[0, 0].set_title(f"{title} by {by}" + (
      f"\n{len(labels)} methods in {len(groups)} panels" if len(groups) > 1 else ""))
  if path:
    save(fig, path)
  return fig


def bar_plot(values: dict[str, float], *, title: str, xlabel: str, percent: bool,
             path: str | None = None):
  """A horizontal bar per label with its value written at the bar's end; the settings of one
  method share its colour."""
  plt = pyplot()
  labels = list(values)
  bases = list(dict.fromkeys(base_method(m) for m in labels if m != REFERENCE))
  fig, ax = plt.subplots(figsize=(7, 1.2 + 0.32 * len(labels)))
  ys = np.arange(len(labels))[::-1]  # the first label on top
  vals = [values[m] for m in labels]
  colors = ["black" if m == REFERENCE else COLORS[bases.index(base_method(m)) % len(COLORS)]
            for m in labels]
  ax.barh(ys, vals, color=colors, height=0.7)
  ax.set_yticks(ys, labels)
  for y, v in zip(ys, vals):
    if not math.isnan(v):
      ax.text(v, y, f" {v:.1f}" if percent else f" {v:.2f}", va="center", fontsize="small")
  if percent:
    ax.set_xlim(*PERCENT_YLIM)
  else:
    ax.set_xlim(0, 1.12 * max([v for v in vals if not math.isnan(v)], default=1.0))
  ax.set_xlabel(xlabel)
  ax.set_title(title)
  ax.grid(axis="x", alpha=0.3)
  if path:
    save(fig, path)
  return fig


def heatmaps(grids: dict[str, np.ndarray], *, xticks: list[str], yticks: list[str], title: str,
             xlabel: str, ylabel: str, path: str | None = None):
  """A 0-100 heatmap per label (rows yticks, columns xticks), the value in each cell, at most
  four panels to a row."""
  plt = pyplot()
  cols = min(4, len(grids))
  rows = -(-len(grids) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(1.2 + 2.6 * cols, 0.8 + 2.6 * rows),
                           sharex=True, sharey=True, squeeze=False, layout="constrained")
  for ax in axes.flat[len(grids):]:
    ax.set_visible(False)
  for ax, (m, grid) in zip(axes.flat, grids.items()):
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    for (i, j), val in np.ndenumerate(grid):
      ax.text(j, i, "-" if np.isnan(val) else f"{val:.0f}", ha="center", va="center")
    ax.set_xticks(range(len(xticks)), xticks)
    ax.set_yticks(range(len(yticks)), yticks)
    ax.tick_params(labelbottom=True)  # a panel over an empty slot needs its own length labels
    ax.set_title(m, fontsize="medium")
  for ax in axes[:, 0]:
    ax.set_ylabel(ylabel)
  for ax in axes.flat[max(0, len(grids) - cols):len(grids)]:
    ax.set_xlabel(xlabel)
  fig.colorbar(im, ax=axes.ravel().tolist(), label="score (%)", shrink=0.8)
  fig.suptitle(title)
  if path:
    save(fig, path)
  return fig


def _task_name(task: str) -> str:
  return TASK_NAMES.get(task, task)


def ppl_ratio_curves(records, bins=8):
  """Per method and length: ratio of windowed perplexity to full attention's over the same
  samples (the paper's Figure 3), token NLLs pooled over the samples in each window."""
  full = {(r["length"], r["seed"]): np.asarray(r["nll"]) for r in records
          if r["task"] == "ppl" and r["method"] == "full"}
  curves = collections.defaultdict(list)
  for r in records:
    if r["task"] != "ppl" or r["method"] == "full" or (r["length"], r["seed"]) not in full:
      continue
    ref, got = full[(r["length"], r["seed"])], np.asarray(r["nll"])
    edges = np.linspace(0, len(got), bins + 1).astype(int)
    curves[(r["method"], r["length"])].append(
        [got[a:b].mean() - ref[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
  # Pooled over the texts (a mean of NLL differences, then exp), as the gap table pools them.
  return {k: np.exp(np.mean(v, axis=0)) for k, v in curves.items()}, bins


def write_plots(records: list[dict], out_dir: str) -> list[str]:
  """Every figure of a sweep into out_dir: TASK_by_length.png, TASK_depth_heatmap.png,
  ppl_ratio_by_position.png, ruler_by_length.png and compression_SUITE_LENGTH.png."""
  written = _suite_plots(records, out_dir)
  for task in sorted({r["task"] for r in records if not r["task"].startswith(RULER)}):
    rs = [r for r in records if r["task"] == task]
    methods = _methods({r["method"] for r in rs})
    lengths = sorted({r["length"] for r in rs})
    ppl = task == "ppl"
    series = {}
    for m in methods:
      ns = [n for n in lengths if any(r["method"] == m and r["length"] == n for r in rs)]
      ys = [_mean([r["score"] for r in rs if r["method"] == m and r["length"] == n]) for n in ns]
      series[m] = (ns, ys if ppl else [100 * y for y in ys])
    path = os.path.join(out_dir, f"{task}_by_length.png")
    line_plot(series, title=f"{_task_name(task)}: mean over samples", by="context length",
              xlabel="context length (tokens)", ylabel="perplexity" if ppl else "score (%)",
              percent=not ppl, lengths=True, path=path)
    written.append(path)
    depths = sorted({r["depth"] for r in rs if r["depth"] is not None})
    if depths:
      grids = {m: np.array([[100 * _mean([r["score"] for r in rs if r["method"] == m and
                                          r["length"] == n and r["depth"] == d])
                             for n in lengths] for d in depths]) for m in methods}
      path = os.path.join(out_dir, f"{task}_depth_heatmap.png")
      heatmaps(grids, xticks=[_len(n) for n in lengths], yticks=[f"{d:.0%}" for d in depths],
               title=f"{_task_name(task)}: score (%) by needle depth and context length",
               xlabel="context length", ylabel="needle depth", path=path)
      written.append(path)
  curves, bins = ppl_ratio_curves(records)
  if curves:
    x = list(np.arange(1, bins + 1) / bins)
    one_length = len({n for _, n in curves}) == 1
    series = {(m if one_length else f"{m} @ {_len(n)}"): (x, list(ys))
              for (m, n), ys in sorted(curves.items())}
    path = os.path.join(out_dir, "ppl_ratio_by_position.png")
    line_plot(series, title="perplexity relative to full attention"
              + (f" at {_len(next(iter(curves))[1])} tokens" if one_length else ""),
              by="position in the text",
              xlabel="fraction of the scored tokens (window end)",
              ylabel="perplexity / full attention's", percent=False,
              hline=("full attention", 1.0), path=path)
    written.append(path)
  return written


def _suite_plots(records: list[dict], out_dir: str) -> list[str]:
  """ruler_by_length.png (RULER's average per method by length) and, for a compression sweep,
  compression_<suite>_<length>.png: the score against the compression ratio, a line per method,
  full attention a horizontal line (kvpress's plot)."""
  scores = suite_scores(records)
  written = []
  labels = _methods({m for (suite, m, _) in scores if suite == "ruler"})
  if labels:
    series = {}
    for m in labels:
      ns = sorted(n for (suite, mm, n) in scores if suite == "ruler" and mm == m)
      series[m] = (ns, [scores[("ruler", m, n)][0] for n in ns])
    path = os.path.join(out_dir, "ruler_by_length.png")
    line_plot(series, title="RULER: average of the tasks' scores", by="context length",
              xlabel="context length (tokens)", ylabel="RULER average (%)", percent=True,
              lengths=True, path=path)
    written.append(path)
  for (suite, n), bases in sorted(_compression_points(records).items()):
    series = {}
    for b in sorted(bases):
      crs = sorted(cr for cr in bases[b] if (suite, bases[b][cr], n) in scores)
      series[b] = (crs, [scores[(suite, bases[b][cr], n)][0] for cr in crs])
    full = scores.get((suite, REFERENCE, n))
    path = os.path.join(out_dir, f"compression_{suite}_{_len(n)}.png")
    line_plot(series, title=f"{_task_name(suite)} at {_len(n)} tokens", by="compression ratio",
              xlabel="compression ratio (1 - kept tokens / length)",
              ylabel={"ruler": "RULER average (%)", "ppl": "perplexity"}.get(suite, "score (%)"),
              percent=suite != "ppl", hline=(f"full attention ({full[0]:.1f})", full[0])
              if full else None, path=path)
    written.append(path)
  return written
