"""A RefreshKV calibration as a markdown table and a plot: per query reading and QC stride, each
threshold's pooled perplexity, share of the paper's SnapKV gap closed and effective stride (the
paper's Table 9 measures)."""

from __future__ import annotations

import math
import os


def _fmt_stride(x) -> str:
  return "inf" if x is None or not math.isfinite(x) else f"{x:.1f}"


def calibration_table(calib: dict) -> str:
  a = calib["anchors"]
  chosen = {r: c["threshold"] for r, c in calib["chosen"].items()}
  out = [f"## RefreshKV threshold calibration: {calib['model']}\n",
         f"{calib['texts']}; {calib['n_texts']} texts at {calib['lengths']} tokens, last "
         f"{calib['n_scored']} scored; K = {calib['budget']} of the cache; {calib['dtype']}.",
         f"Anchors (pooled token NLL): full attention {a['full']:.3f}, the paper's SnapKV "
         f"(window 1, kernel 7, fixed size) {a['snapkv_paper']:.3f}.",
         f"Rule (Appendix A.4): per reading, the lowest threshold whose share of the gap closed "
         f"is within {calib['rule']['tolerance']:.0%} of the best at every QC stride (effective "
         f"stride >= {calib['rule']['min_stride']}).",
         f"**Shipped: threshold {calib['threshold']} with queries {calib['reading']} RoPE** "
         f"({calib['why']}).\n",
         "| QC stride | reading | threshold | ppl | gap closed [90%] | effective stride |",
         "|---|---|---|---|---|---|"]
  for s in calib["settings"]:
    mark = " (chosen)" if chosen.get(s["reading"]) == s["threshold"] else ""
    lo, hi = s["gap_interval"]
    out.append(f"| {s['qc_stride']} | {s['reading']} | {s['threshold']:g}{mark} | "
               f"{s['ppl']:.3f} | {100 * s['gap_closed']:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}] "
               f"| {_fmt_stride(s['stride'])} |")
  return "\n".join(out) + "\n"


def write_calibration_report(calib: dict, out_dir: str) -> list[str]:
  """calibration.md and calibration.png in out_dir."""
  from jax_longctx.app.plots import legend_outside, pyplot, save, series_style

  md = os.path.join(out_dir, "calibration.md")
  with open(md, "w") as f:
    f.write(calibration_table(calib))
  fig, axes = pyplot().subplots(1, 3, figsize=(14, 4), layout="constrained")
  curves = sorted({(s["reading"], s["qc_stride"]) for s in calib["settings"]})
  for i, (reading, qc) in enumerate(curves):
    pts = [s for s in calib["settings"] if (s["reading"], s["qc_stride"]) == (reading, qc)]
    name = f"{reading} RoPE, QC stride {qc}"
    ts = [s["threshold"] for s in pts]
    # The share of the gap closed is not a score: it can leave 0-100%, so its axis is free.
    gaps = [100 * s["gap_closed"] for s in pts]
    strides = [s["stride"] if math.isfinite(s["stride"]) else float("nan") for s in pts]
    style = series_style(i, name)
    axes[0].plot(ts, gaps, label=name, **style)
    axes[1].plot(ts, strides, label=name, **style)
    axes[2].plot(strides, gaps, label=name, **style)
  axes[0].set(xlabel="similarity threshold", ylabel="SnapKV's perplexity gap closed (%)",
              title="quality by threshold")
  axes[1].set(xlabel="similarity threshold", ylabel="decode steps per full step (log)",
              title="effective stride by threshold", yscale="log")
  axes[2].set(xlabel="decode steps per full step (log)",
              ylabel="SnapKV's perplexity gap closed (%)", title="quality against stride",
              xscale="log")
  for ax in axes:
    ax.grid(alpha=0.3)
  legend_outside(axes[2])  # one legend: the three panels draw the same curves
  lengths = calib["lengths"] if isinstance(calib["lengths"], list) else [calib["lengths"]]
  fig.suptitle(f"RefreshKV threshold calibration: {calib['model']}, "
               f"{', '.join(map(str, lengths))} tokens")
  png = save(fig, os.path.join(out_dir, "calibration.png"))
  return [md, png]
