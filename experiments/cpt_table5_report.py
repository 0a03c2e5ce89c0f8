"""Table 5 from the records of experiments/refreshkv_cpt_table5.py: DIR/before.jsonl and
DIR/after.jsonl -> DIR/table5.md, DIR/table5.json and DIR/table5.png (`python
experiments/cpt_table5_report.py DIR` redraws only the figure, from DIR/table5.json).

Perplexity is pooled over the windows both runs scored (exp of the mean token NLL: gap_stats),
as the paper's "Test PPL". The change CPT made is the pooled NLL after minus before in
nats/token, with a 90% paired bootstrap over windows (the same windows before and after). The
paper's claim, that RefreshKV gains more from CPT than the eviction methods do, is read off the
difference of gains (before - after) of each RefreshKV stride and each eviction method, paired
the same way.
"""

from __future__ import annotations

import json
import os
import sys

from jax_longctx.app import plots
from jax_longctx.app.eval import read_records
from jax_longctx.app.gap_stats import LEVEL, nll_by_seed, paired_contrast, pooled_ppl
from jax_longctx.core.errors import LongctxError

TASK = "cpt_table5"
NAMES = {"full": "Vanilla", "streaming_llm": "Streaming", "h2o": "H2O", "snapkv": "SnapKV",
         "refreshkv": "RefreshKV"}
EVICTION = ("streaming_llm", "h2o", "snapkv")


class Table5Error(LongctxError, ValueError):
  """Bad settings for the Table 5 run, or records it cannot use."""


def _read(path: str) -> list[dict]:
  records = [r for r in read_records(path, repair=False) if r.get("task") == TASK]
  if not records:
    raise Table5Error(f"{path}: no Table 5 records (run the eval subcommand first)")
  return records


def _check_same_windows(before: list[dict], after: list[dict]) -> None:
  sha = {(r["length"], r["seed"]): r["tokens_sha1"] for r in before}
  for r in after:
    key = (r["length"], r["seed"])
    if sha.get(key, r["tokens_sha1"]) != r["tokens_sha1"]:
      raise Table5Error(f"before and after scored different text at L={key[0]}, window start "
                        f"{key[1]}: evaluate both with the same config and tokenizer")


def _stride(rec: dict):
  return rec["hparams"].get("fixed_stride") if rec["name"] == "refreshkv" else None


def tabulate(before: list[dict], after: list[dict]) -> dict:
  """Every number of the report (what table5.json holds)."""
  _check_same_windows(before, after)
  lengths = sorted({r["length"] for r in before} & {r["length"] for r in after})
  first = {}  # label -> its first record, in the order the eval ran them
  for r in before:
    first.setdefault(r["method"], r)
  nll = {(w, m, n): nll_by_seed(recs, m, n, TASK) for w, recs in (("b", before), ("a", after))
         for m in first for n in lengths}
  rows = []
  for label, rec in first.items():
    cells = {}
    for n in lengths:
      b, a = nll[("b", label, n)], nll[("a", label, n)]
      change = paired_contrast([b, a], [-1, 1])
      if change is not None:
        both = sorted(set(b) & set(a))
        cells[n] = {"ppl_before": pooled_ppl([b[s] for s in both]),
                    "ppl_after": pooled_ppl([a[s] for s in both]), "change": change.value,
                    "low": change.low, "high": change.high, "windows": change.n_texts}
    rows.append({"method": label, "name": rec["name"], "stride": _stride(rec), "cells": cells,
                 "hparams": rec["hparams"], "scored": len(rec["nll"])})
  versus = []
  for r in (r for r in rows if r["name"] == "refreshkv"):
    for e in (e for e in rows if e["name"] in EVICTION):
      for n in lengths:
        four = [nll[(w, m, n)] for m in (r["method"], e["method"]) for w in "ba"]
        d = paired_contrast(four, [1, -1, -1, 1])
        if d is not None:
          versus.append({"refreshkv": r["method"], "eviction": e["method"], "length": n,
                         "gain_difference": d.value, "low": d.low, "high": d.high,
                         "windows": d.n_texts, "same_method": _snapkv_alike(r, e)})
  return {"model_before": before[0]["model"], "model_after": after[0]["model"],
          "lengths": lengths, "level": LEVEL, "rows": rows, "refreshkv_vs_eviction": versus,
          "verdict": verdict(versus, lengths)}


def _snapkv_alike(rkv: dict, other: dict) -> bool:
  """Whether RefreshKV row `rkv` is SnapKV row `other` by construction: no full step falls
  within the scored tokens (the first is predicted by the prefill, the rest by decode steps
  1..scored-1; a full step every `fixed_stride`) and its partial cache, never refreshed, is that
  SnapKV's (window 1, fixed size, the same budget and pooling). Their NLLs then differ only by
  rounding."""
  r, s = rkv["hparams"], other["hparams"]
  return (other["name"] == "snapkv" and r.get("fixed_stride", 0) >= rkv["scored"]
          and s.get("window") == 1 and bool(s.get("keep_size"))
          and (s.get("budget"), s.get("pool_kernel")) == (r.get("budget"), r.get("pool_kernel")))


def verdict(versus: list[dict], lengths: list[int]) -> list[str]:
  """Sentences on the paper's claim, one per length and one overall. RefreshKV at a stride with
  no full step among the scored tokens is the paper's SnapKV (`_snapkv_alike`): that pair gains
  alike by construction and is left out of the count."""
  out, total, clear, count = [], 0, 0, 0
  same = [f"{v['refreshkv']} and {v['eviction']} at L = {v['length']}" for v in versus
          if v["same_method"]]
  if same:
    out.append("The same method by construction (no full step among the scored tokens), so left "
               f"out of the comparison: {', '.join(same)}.")
  for n in lengths:
    vs = [v for v in versus if v["length"] == n and not v["same_method"]]
    more, sure = sum(v["gain_difference"] > 0 for v in vs), sum(v["low"] > 0 for v in vs)
    total, clear, count = total + more, clear + sure, count + len(vs)
    out.append(f"At L = {n}, RefreshKV gained more from CPT than the eviction method in {more} "
               f"of {len(vs)} (stride, eviction method) pairs; in {sure} of them the "
               f"{LEVEL:.0%} interval of the difference lies above 0.")
  if count == 0:
    return out + ["No RefreshKV and eviction rows to compare."]
  if total < count:
    claim = (f"does not hold in full: in {count - total} of {count} pairs RefreshKV did not "
             "gain more")
  elif clear < count:
    claim = ("holds in the point estimates, but not every interval excludes 0 "
             f"({clear} of {count} do)")
  else:
    claim = "holds in these numbers, every interval above 0"
  return out + [f"The paper's claim (larger gains for RefreshKV than for the eviction methods) "
                f"{claim}."]


def _label(row: dict) -> str:
  return NAMES.get(row["name"], row["name"]) + (f" {row['stride']}" if row["stride"] else "")


def markdown(t: dict) -> str:
  lengths = t["lengths"]
  lines = [
      "# RefreshKV Table 5: last-50-token perplexity of held-out text, before -> after CPT", "",
      f"Before: `{t['model_before']}`; after: `{t['model_after']}`. K = L/8. Perplexity pooled "
      "over the windows both runs scored; change: pooled NLL after - before in nats/token "
      f"(negative: CPT helped) with its {t['level']:.0%} paired-bootstrap interval over "
      "windows.", "",
      "| Method | Stride | " + " | ".join(f"PPL ({n})" for n in lengths) + " | "
      + " | ".join(f"change ({n}) | windows" for n in lengths) + " |",
      "|---|---|" + "---|" * (3 * len(lengths))]
  for row in t["rows"]:
    ppl, change = [], []
    for n in lengths:
      c = row["cells"].get(n)
      ppl.append(f"{c['ppl_before']:.3f} -> {c['ppl_after']:.3f}" if c else "-")
      change.append(f"{c['change']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] | {c['windows']}"
                    if c else "- | 0")
    lines.append(f"| {NAMES.get(row['name'], row['name'])} | {row['stride'] or '-'} | "
                 + " | ".join(ppl) + " | " + " | ".join(change) + " |")
  evict = [r for r in t["rows"] if r["name"] in EVICTION]
  lines += ["", "RefreshKV's gain (before - after, nats/token) minus each eviction method's, "
            f"{t['level']:.0%} paired interval (> 0: RefreshKV gained more):", "",
            "| RefreshKV stride | " + " | ".join(f"vs {_label(e)} ({n})" for n in lengths
                                               for e in evict) + " |",
            "|---|" + "---|" * (len(lengths) * len(evict))]
  cell = {(v["refreshkv"], v["eviction"], v["length"]): v for v in t["refreshkv_vs_eviction"]}
  for row in (r for r in t["rows"] if r["name"] == "refreshkv"):
    vs = [cell.get((row["method"], e["method"], n)) for n in lengths for e in evict]
    lines.append(f"| {row['stride']} | " + " | ".join(
        f"{v['gain_difference']:+.4f} [{v['low']:+.4f}, {v['high']:+.4f}]" if v else "-"
        for v in vs) + " |")
  return "\n".join(lines + [""] + t["verdict"]) + "\n"


def plot(t: dict, path: str) -> str:
  """table5.png: a panel per length, each method's perplexity before and after CPT joined by a
  grey line. `t` as `tabulate` returns it or as table5.json holds it (lengths as strings)."""
  plt = plots.pyplot()
  lengths = t["lengths"]
  fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), sharey=True,
                           squeeze=False)
  for ax, n in zip(axes[0], lengths):
    rows = [(r, {int(k): c for k, c in r["cells"].items()}) for r in t["rows"]]
    rows = [(r, cells[n]) for r, cells in rows if n in cells]
    xs = list(range(len(rows)))
    before, after = [c["ppl_before"] for _, c in rows], [c["ppl_after"] for _, c in rows]
    ax.vlines(xs, after, before, color="0.75", linewidth=2, zorder=1)
    plots.draw_lines(ax, {"before CPT": (xs, before), "after CPT": (xs, after)},
                     linestyle="none", zorder=2)
    ax.set_xticks(xs, [NAMES.get(r["name"], r["name"]) + (f", stride {r['stride']}" if
                                                          r["stride"] else "") for r, _ in rows],
                  rotation=30, ha="right")
    ax.set_title(f"L = {n} tokens, budget K = {n // 8} tokens", fontsize="medium")
  axes[0, 0].set_ylabel("perplexity of the last 50 tokens\n(lower is better)")
  plots.legend_outside(axes[0, -1])
  fig.suptitle("RefreshKV Table 5: perplexity before and after continued pretraining (CPT)")
  fig.tight_layout()
  return plots.save(fig, path)


def replot(out_dir: str) -> str:
  """table5.png again from OUT/table5.json alone (the report itself: refreshkv_cpt_table5.py
  report OUT)."""
  with open(os.path.join(out_dir, "table5.json")) as f:
    return plot(json.load(f), os.path.join(out_dir, "table5.png"))


def write_report(out_dir: str) -> str:
  """Writes table5.md, table5.json and table5.png into `out_dir`; returns the markdown."""
  t = tabulate(_read(os.path.join(out_dir, "before.jsonl")),
               _read(os.path.join(out_dir, "after.jsonl")))
  md = markdown(t)
  with open(os.path.join(out_dir, "table5.md"), "w") as f:
    f.write(md)
  with open(os.path.join(out_dir, "table5.json"), "w") as f:
    json.dump(t, f, indent=1)
  plot(t, os.path.join(out_dir, "table5.png"))
  return md


if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit("usage: python experiments/cpt_table5_report.py DIR... (redraws DIR/table5.png "
             "from DIR/table5.json)")
  for out_dir in sys.argv[1:]:
    print(replot(out_dir))
