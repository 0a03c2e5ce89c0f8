"""The sweep report's statistics on synthetic records with known values: RefreshKV's effective
stride (counts summed over texts, then divided) and the share of the gap closed (pooled NLL,
paired bootstrap)."""

import math

import numpy as np
import pytest

from jax_longctx.app.gap_stats import (gap_closed, paired_contrast, paired_gap, paired_relative,
                                       pooled_ppl)
from jax_longctx.app.report import effective_stride, stride_counts, summary_table


def _rkv(seed, full_steps, decode_steps=10.0, method="rkv5"):
  return {"task": "ppl", "method": method, "length": 1024, "seed": seed,
          "full_steps": full_steps, "decode_steps": decode_steps}


def test_stride_sums_counts_over_texts_before_dividing():
  # Layer 0: full steps 0 and 2 over two texts of 10 steps: 20 / 2 = 10 (a mean of per-text
  # strides would be inf). Layer 1: never full in any text: inf.
  recs = [_rkv(0, [0.0, 0.0]), _rkv(1, [2.0, 0.0])]
  full, steps = stride_counts(recs)[("ppl", "rkv5", 1024)]
  assert full.tolist() == [2.0, 0.0] and steps == 20.0
  assert effective_stride(full, steps) == 20.0  # 2 layers x 20 steps / 2 full steps
  assert effective_stride([0.0, 0.0], 20.0) == math.inf
  table = summary_table([dict(r, score=1.0) for r in recs])
  assert "| ppl | rkv5 | 1024 | 20.0 | 10 inf |" in table


def _ppl_rec(method, seed, nll):
  return {"task": "ppl", "method": method, "length": 64, "seed": seed, "depth": None,
          "score": math.exp(np.mean(nll)), "nll": list(nll)}


def test_pooled_ppl_and_gap_share():
  assert pooled_ppl([[0.0, 2.0], [1.0]]) == pytest.approx(math.exp(1.0))
  # Not the mean of per-text perplexities ((1 + e^2) / 2 = 4.19).
  assert pooled_ppl([[0.0], [2.0]]) == pytest.approx(math.e)
  assert gap_closed(11.0, 12.0, 10.0) == pytest.approx(0.5)
  assert gap_closed(13.0, 12.0, 10.0) == pytest.approx(-0.5)


def test_paired_bootstrap_interval_on_known_records():
  rng = np.random.default_rng(1)
  base = {s: rng.uniform(2, 4, 8) for s in range(30)}
  full = {s: x - 0.2 for s, x in base.items()}
  # Closes exactly half the gap on every text: the share and its whole interval are ~0.5.
  half = {s: x - 0.1 for s, x in base.items()}
  gap = paired_gap(half, base, full)
  assert gap.n_texts == 30
  # Pooled: ppl_B = P, ppl_F = P e^-0.2, ppl_M = P e^-0.1, in every resample too.
  assert gap.share == pytest.approx(math.expm1(-0.1) / math.expm1(-0.2), rel=1e-9)
  assert gap.low == pytest.approx(gap.share, rel=1e-9) == gap.high
  # Noisy per text (half the texts closed fully, half not at all): a wide interval around ~0.5.
  noisy = {s: (full if s % 2 else base)[s] for s in base}
  g2 = paired_gap(noisy, base, full)
  assert g2.low < 0.4 < 0.6 < g2.high and g2.low < g2.share < g2.high
  # Texts are paired: only those all three ran count.
  del half[0]
  assert paired_gap(half, base, full).n_texts == 29
  assert paired_gap({}, base, full) is None
  # Fixed seed: the same interval twice.
  assert paired_gap(noisy, base, full) == g2


def test_paired_contrast_of_before_and_after_and_of_two_gains():
  rng = np.random.default_rng(2)
  before = {s: rng.uniform(2, 4, 5) for s in range(40)}
  after = {s: x - 0.05 for s, x in before.items()}  # 0.05 nats/token better on every text
  change = paired_contrast([before, after], [-1, 1])
  assert change.value == pytest.approx(-0.05) and change.n_texts == 40
  assert change.low == pytest.approx(-0.05) == pytest.approx(change.high)
  # Gains 0.05 and 0.02 on noisy texts: the difference of gains is 0.03 in every resample.
  other = {s: x + rng.normal(0, 0.5, 5) for s, x in before.items()}
  other_after = {s: x - 0.02 for s, x in other.items()}
  more = paired_contrast([before, after, other, other_after], [1, -1, -1, 1])
  assert more.value == pytest.approx(0.03) and more.low == pytest.approx(0.03)
  # A gain on half the texts only: a wide interval; pairing over the texts all of them ran.
  half = {s: x - (0.1 if s % 2 else 0.0) for s, x in before.items()}
  wide = paired_contrast([before, half], [-1, 1])
  assert wide.low < -0.06 < -0.04 < wide.high <= 0 and wide.value == pytest.approx(-0.05)
  del half[3]
  assert paired_contrast([before, half], [-1, 1]).n_texts == 39
  assert paired_contrast([{}, after], [-1, 1]) is None
  with pytest.raises(ValueError, match="different numbers of tokens"):
    paired_contrast([before, {s: x[:4] for s, x in after.items()}], [-1, 1])


def test_gap_table_in_the_summary():
  recs = []
  for s in range(4):
    recs += [_ppl_rec("full", s, [1.0, 1.0]), _ppl_rec("snapkv_paper", s, [1.2, 1.2]),
             dict(_ppl_rec("rkv5", s, [1.1, 1.1]), full_steps=[1.0, 1.0], decode_steps=2.0)]
  table = summary_table(recs)
  share = (math.exp(1.2) - math.exp(1.1)) / (math.exp(1.2) - math.exp(1.0))
  row = next(line for line in table.splitlines() if line.startswith("| rkv5 | ") and "%" in line)
  assert row.startswith(f"| rkv5 | {math.exp(1.1):.3f} | 4 | 2.0 | {100 * share:.0f}% ")
  assert "vs snapkv_paper" in table
  # A named baseline replaces the detected one; without full attention there is no gap table.
  assert "vs rkv5" in summary_table(recs, baselines=["rkv5"])
  assert "vs" not in summary_table([r for r in recs if r["method"] != "full"])


def test_kv_dtype_table_pairs_each_8bit_cache_with_the_model_dtype():
  """Labels "METHOD DTYPE" (eval --kv-dtype a,b): each 8- or 4-bit cache's pooled NLL against the
  same method's bf16 cache over the texts both ran (here int8 ran 3 of 4), +1% where every int8
  token is 1% worse (int4: 2%); a method with only 8-bit cells gets no row."""
  recs = []
  for s in range(4):
    base = [1.0 + 0.1 * s, 2.0]
    recs.append(dict(_ppl_rec("re bfloat16", s, base), kv_dtype="bfloat16"))
    if s < 3:
      recs.append(dict(_ppl_rec("re int8", s, [1.01 * x for x in base]), kv_dtype="int8"))
    recs.append(dict(_ppl_rec("solo int8", s, base), kv_dtype="int8"))
    recs.append(dict(_ppl_rec("re int4", s, [1.02 * x for x in base]), kv_dtype="int4"))
  # a needle task: 3 samples both ran, one answered differently (and wrongly) in int8
  for s in range(3):
    for kv, pred in (("bfloat16", "42"), ("int8", "41" if s == 2 else "42")):
      recs.append({"task": "passkey", "method": f"re {kv}", "length": 64, "seed": s, "depth": 0.5,
                   "kv_dtype": kv, "prediction": pred, "score": float(pred == "42")})
  recs.append({"task": "passkey", "method": "re bfloat16", "length": 64, "seed": 3, "depth": 0.5,
               "kv_dtype": "bfloat16", "prediction": "42", "score": 1.0})  # bf16 only: left out
  table = summary_table(recs)
  assert "| 64 | re | int8 vs bfloat16 | +1.000% | [+1.000, +1.000] | 3 |" in table, table
  assert "| 64 | re | int4 vs bfloat16 | +2.000% | [+2.000, +2.000] | 4 |" in table, table
  assert "| solo |" not in table
  assert "| passkey | 64 | re | int8 | 3 | 100 | 67 | 2 |" in table, table
  gap = paired_relative({0: np.array([2.0])}, {0: np.array([1.0]), 1: np.array([1.0])})
  assert gap.value == pytest.approx(1.0) and gap.n_texts == 1
  assert paired_relative({0: np.array([1.0])}, {1: np.array([1.0])}) is None


def _drawn(fig):
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  canvas = FigureCanvasAgg(fig)  # a saved figure is closed: draw it again on a canvas of its own
  canvas.draw()  # legends and axes get their final places only once drawn
  return canvas.get_renderer()


def _outside(fig):
  """Every legend of the figure lies clear of its axes (beside or below the data)."""
  renderer = _drawn(fig)
  for ax in fig.axes:
    leg = ax.get_legend()
    if leg is not None:
      box, frame = leg.get_window_extent(renderer), ax.get_window_extent(renderer)
      assert box.x0 >= frame.x1 or box.y1 <= frame.y0, (box, frame)


def test_score_plot_is_clamped_to_percent_with_legends_outside(tmp_path):
  from jax_longctx.app.plots import PERCENT_YLIM, line_plot
  path = tmp_path / "passkey_by_length.png"
  fig = line_plot({"full": ([4096, 8192], [100.0, 90.0]), "snap": ([4096, 8192], [40.0, 0.0])},
                  title="passkey", by="context length", xlabel="tokens", ylabel="score (%)",
                  percent=True, lengths=True, path=str(path))
  assert path.exists()
  (ax,) = fig.axes
  low, high = ax.get_ylim()
  assert 0 <= low and 100 < high <= PERCENT_YLIM[1] <= 105
  _outside(fig)


def test_many_series_go_to_panels_of_at_most_eight_lines():
  from jax_longctx.app.plots import MAX_SERIES, line_plot, series_style
  labels = ["full"] + [f"m{i}@cr{r}" for i in range(7) for r in (0.25, 0.5, 0.75)]
  assert len(labels) == 22
  series = {m: ([4096, 8192], [50.0 + i, 40.0 + i]) for i, m in enumerate(labels)}
  fig = line_plot(series, title="RULER", by="context length", xlabel="tokens", ylabel="%",
                  percent=True, lengths=True)
  assert len(fig.axes) >= 3
  drawn = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
  assert set(drawn) == set(labels)  # every series somewhere; full attention on every panel
  for ax in fig.axes:
    lines = ax.get_lines()
    assert 0 < len(lines) <= MAX_SERIES and "full" in [ln.get_label() for ln in lines]
    looks = [(ln.get_color(), ln.get_marker()) for ln in lines]
    assert len(set(looks)) == len(looks)  # no two series on one axes alike
    assert ax.get_ylim()[0] >= 0 and ax.get_ylim()[1] <= 105
  # a method's settings stay together on one panel
  for i in range(7):
    assert len({j for j, ax in enumerate(fig.axes) for ln in ax.get_lines()
                if ln.get_label().startswith(f"m{i}@")}) == 1
  assert len({(series_style(i, "x")["color"], series_style(i, "x")["marker"])
              for i in range(40)}) == 40
  _outside(fig)


def test_one_length_is_drawn_as_labelled_bars(tmp_path):
  from jax_longctx.app.plots import line_plot
  labels = ["full"] + [f"m{i}@cr0.5" for i in range(21)]
  fig = line_plot({m: ([4096], [float(i)]) for i, m in enumerate(labels)}, title="RULER",
                  by="context length", xlabel="tokens", ylabel="RULER average (%)",
                  percent=True, lengths=True, path=str(tmp_path / "r.png"))
  (ax,) = fig.axes
  assert len(ax.patches) == 22 and ax.get_lines() == []
  where = {t.get_text(): y for t, y in zip(ax.get_yticklabels(), ax.get_yticks())}
  assert set(where) == set(labels) and where["full"] == max(where.values())  # first on top
  assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] <= 105
  assert "4K" in ax.get_title()


def test_write_report_keeps_file_names(tmp_path):
  from jax_longctx.app.report import write_report
  recs = [{"task": "passkey", "method": m, "length": n, "seed": s, "depth": d, "score": sc}
          for m, sc in (("full", 1.0), ("snap", 0.0)) for n in (4096, 8192) for s in range(2)
          for d in (0.1, 0.9)]
  recs += [dict(_ppl_rec(m, s, [x] * 16), length=n) for m, x in (("full", 1.0), ("snap", 1.1))
           for n in (64, 128) for s in range(2)]
  write_report(recs, str(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "passkey_by_length.png", "passkey_depth_heatmap.png", "ppl_by_length.png",
      "ppl_ratio_by_position.png", "summary.md"]
