"""RefreshKV's similarity threshold calibrated per model, as the paper does (Appendix A.4).

The paper runs RefreshKV on 50 held-out Book texts for thresholds {0.80, 0.85, 0.90, 0.95} at QC
strides {5, 10} (Table 9) and keeps the lowest threshold whose perplexity matches the best one:
Llama-3.1-8B's 0.85 "achieves similar performance ... compared to 0.90 and 0.95", while Qwen2-7B
"continues to increase going from 0.80 to 0.95", so 0.95. A lower threshold refreshes less
often, so it decodes faster (Table 9's time column). The rule here, with the similarity made
concrete (`Rule`):

  per query reading (before / after RoPE), among the swept thresholds whose effective stride is
  at least `min_stride` (0: the paper sets none), take those whose share of the paper's SnapKV
  gap to full attention closed is within `tolerance` (5 points) of the best at every QC stride,
  and of them the lowest threshold.

With SnapKV placed as in the paper's Table 1, this gives 0.85 for Table 9's Llama numbers and
0.95 for its Qwen numbers (tests/test_calibration.py). The reading shipped is the one that closes
more of the gap at the same effective stride: both readings' gap-vs-stride curves (linear
between swept thresholds, flat past their ends) are read at each reading's chosen stride, and
after RoPE is shipped if it leads on average over the two (a tie keeps queries before RoPE).

Perplexity is pooled over the texts' token NLLs (`gap_stats`); texts are the ppl task's held-out
split (`heldout=True`: the prose's last 30%, which no evaluation text reaches), seeds 0..n-1.
Every threshold and reading of a QC stride runs in one batch, one row each (`SweptRefreshKV`;
each sequence decodes as it would alone), so a stride compiles once for the whole sweep; full
attention and the paper's SnapKV (window 1, kernel 7, fixed size) run beside as anchors.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from jax_longctx.app import calibration_store, gap_stats
from jax_longctx.app.calibration_report import write_calibration_report
from jax_longctx.app import tasks as tasks_lib
from jax_longctx.run.generation import prefill, teacher_forced_nll
from jax_longctx.app.eval import load_results, unpack_results
from jax_longctx.methods import get
from jax_longctx.methods.refreshkv import CALIBRATION_THRESHOLDS, RefreshKV
from jax_longctx.core.progress import progress
from jax_longctx.app.report import effective_stride, stride_counts, write_report
from jax_longctx.core.rope import apply_rope

READINGS = {"before": False, "after": True}  # label -> similarity_after_rope
FULL, SNAPKV = "full", "snapkv_paper"


@dataclasses.dataclass(frozen=True)
class Rule:
  """Appendix A.4's choice made concrete: the lowest threshold within `tolerance` (a share of
  the gap) of the best, among those refreshing at most every `min_stride` steps on average."""

  # In Table 9, SnapKV placed at Table 1's ratio to full attention, the thresholds the paper
  # calls similar to the best are within 3 points of the gap, those it passes over 8.5 or more.
  tolerance: float = 0.05
  min_stride: float = 0.0  # the paper sets no floor on the effective stride

  def __post_init__(self):
    if not 0 <= self.tolerance < 1 or self.min_stride < 0:
      raise ValueError(f"tolerance must lie in [0, 1) and min_stride be >= 0, got {self}")


@dataclasses.dataclass(frozen=True)
class SweptRefreshKV(RefreshKV):
  """RefreshKV whose sequence b compares with its own (threshold, after RoPE) = rows[b]: the
  sweep's settings as the rows of one batch. Not registered: calibration's own."""

  rows: tuple = ()

  def _mean_query(self, q, ctx):
    # ctx.heads.mean, as RefreshKV: on a tensor-parallel mesh q holds one shard's heads, and the
    # layer's mean query is over all of them.
    after = jnp.asarray([a for _, a in self.rows])[:, None, None]
    plain = ctx.heads.mean(q.astype(jnp.float32), axis=2)
    rotated = ctx.heads.mean(apply_rope(q, ctx.q_pos, ctx.freqs).astype(jnp.float32), axis=2)
    return jnp.where(after, rotated, plain)

  def _threshold(self):
    return jnp.asarray([t for t, _ in self.rows], jnp.float32)


def label(qc_stride: int, reading: str, threshold: float) -> str:
  return f"qc{qc_stride}_{reading}_{threshold:g}"


def _anchors(budget) -> dict:
  return {FULL: get("full"),
          SNAPKV: get("snapkv", budget=budget, window=1, pool_kernel=7, keep_size=True)}


def _record(lab: str, hparams: dict, length: int, seed: int, nll, n_tokens: int,
            counts: dict) -> dict:
  return {"task": "ppl", "method": lab, "hparams": hparams, "length": length, "depth": None,
          "seed": seed, "n_tokens": n_tokens, "chat": False, "score": math.exp(nll.mean()),
          "nll": nll.round(5).tolist(), **counts}


def _nll_rows(lm, method, prefix, targets, rows: int, cache_len: int, chunk):
  """(NLL [rows, N] of targets after prefix, the cache): the text in `rows` sequences of one
  batch (as driver.continuation_nll for one; RefreshKV needs no instruction routed)."""
  options = lm.run_options(chunk)
  cache, last = prefill(lm.params, lm.config, [prefix] * rows, method, cache_len=cache_len,
                        options=options)
  nll, cache = teacher_forced_nll(lm.params, cache, last, np.asarray([targets] * rows, np.int32),
                                  cfg=lm.config, method=method, options=options)
  return np.asarray(nll, np.float64), cache


def _run_text(lm, length, seed, sample, task, qc_strides, rows, budget, chunk) -> list[dict]:
  """Records of every setting on one text: the anchors one by one, each QC stride's rows as one
  batch."""
  prefix, targets = task.split(sample)
  cache_len = length + 512  # as experiments/refreshkv_*.sh: K = budget x (L + 512)
  out = []
  for lab, method in _anchors(budget).items():
    nll, cache = _nll_rows(lm, method, prefix, targets, 1, cache_len, chunk)
    out.append(_record(lab, method.hparams(), length, seed, nll[0], sample.n_tokens,
                       method.report(cache)))
  for stride in qc_strides:
    swept = SweptRefreshKV(budget=budget, qc_stride=stride,
                           rows=tuple((t, READINGS[r]) for r, t in rows))
    nll, cache = _nll_rows(lm, swept, prefix, targets, len(rows), cache_len, chunk)
    steps = cache.lengths - cache.state[0].prompt_lengths
    for i, (reading, t) in enumerate(rows):
      plain = RefreshKV(budget=budget, qc_stride=stride, threshold=t,
                        similarity_after_rope=READINGS[reading])
      counts = {"full_steps": [float(layer.n_full[i]) for layer in cache.state],
                "decode_steps": float(steps[i])}
      out.append(_record(label(stride, reading, t), plain.hparams(), length, seed, nll[i],
                         sample.n_tokens, counts))
  return out


def summarize(records: list[dict], qc_strides, readings, thresholds) -> dict:
  """Per setting: pooled ppl, share of the paper's SnapKV gap closed (with its paired-bootstrap
  interval) and effective stride, over every length and text of the records."""
  def nll(lab):  # {(length, seed): NLLs}, every length pooled
    return {(r["length"], r["seed"]): r["nll"] for r in records if r["method"] == lab}
  full, snap = nll(FULL), nll(SNAPKV)
  anchors = {FULL: gap_stats.pooled_ppl(list(full.values())),
             SNAPKV: gap_stats.pooled_ppl(list(snap.values()))}
  counts = stride_counts(records)
  settings = []
  for stride in qc_strides:
    for reading in readings:
      for t in thresholds:
        lab = label(stride, reading, t)
        mine = nll(lab)
        gap = gap_stats.paired_gap(mine, snap, full)
        full_steps = sum(counts[k][0] for k in counts if k[1] == lab)
        decode_steps = sum(counts[k][1] for k in counts if k[1] == lab)
        settings.append({"qc_stride": stride, "reading": reading, "threshold": t,
                         "ppl": gap_stats.pooled_ppl(list(mine.values())),
                         "gap_closed": gap.share, "gap_interval": [gap.low, gap.high],
                         "stride": effective_stride(full_steps, decode_steps),
                         "stride_per_layer": [decode_steps / n if n else None
                                              for n in full_steps.tolist()]})
  return {"anchors": anchors, "n_texts": len(full), "settings": settings}


def choose(settings: list[dict], rule: Rule) -> dict:
  """{reading: its chosen setting (the lowest QC stride's entry)} by `Rule` over every stride."""
  chosen = {}
  for reading in dict.fromkeys(s["reading"] for s in settings):
    mine = [s for s in settings if s["reading"] == reading]
    strides = sorted({s["qc_stride"] for s in mine})
    ok = set(s["threshold"] for s in mine)
    for qc in strides:
      at = [s for s in mine if s["qc_stride"] == qc and s["stride"] >= rule.min_stride]
      if not at:
        ok = set()
        break
      best = max(s["gap_closed"] for s in at)
      ok &= {s["threshold"] for s in at if s["gap_closed"] >= best - rule.tolerance}
    if ok:
      pick = min(ok)
      chosen[reading] = next(s for s in mine if s["threshold"] == pick
                             and s["qc_stride"] == strides[0])
  if not chosen:
    raise calibration_store.CalibrationError(
        f"no threshold is within tolerance={rule.tolerance} of the best at every QC stride with "
        f"an effective stride >= min_stride={rule.min_stride}; raise the one or lower the other")
  return chosen


def gap_at_stride(settings: list[dict], reading: str, qc_stride: int, at: float) -> float:
  """The reading's share of the gap closed at effective stride `at`: linear between its swept
  thresholds, flat past the ends."""
  pts = sorted((s["stride"], s["gap_closed"]) for s in settings
               if s["reading"] == reading and s["qc_stride"] == qc_stride)
  if at <= pts[0][0]:
    return pts[0][1]
  if at >= pts[-1][0]:  # also an infinite stride (a threshold that never refreshes)
    return pts[-1][1]
  for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
    if at <= x1:
      return y0 + (y1 - y0) * (at - x0) / (x1 - x0) if x1 > x0 else max(y0, y1)
  return pts[-1][1]


def pick_reading(settings: list[dict], chosen: dict) -> tuple[str, str]:
  """(reading to ship, why): the one closing more of the gap at the same effective stride, read
  at both chosen strides and averaged (the curves may cross); a tie keeps before RoPE."""
  if len(chosen) == 1:
    (only,) = chosen
    return only, f"only queries {only} RoPE were swept or met the rule"
  qc = min(s["qc_stride"] for s in settings)
  at = sorted({c["stride"] for c in chosen.values()})
  gaps = {r: [gap_at_stride(settings, r, qc, x) for x in at] for r in ("before", "after")}
  lead = sum(a - b for a, b in zip(gaps["after"], gaps["before"])) / len(at)
  where = " and ".join(f"{x:.1f}" for x in at)
  return ("after" if lead > 0 else "before"), (
      f"at effective stride {where} (QC {qc}) queries after RoPE close "
      f"{100 * lead:+.0f} points of the gap on average against before RoPE")


def check_args(readings, thresholds, texts: int, qc_strides) -> None:
  """One-line errors for a sweep that cannot run, before any model loads."""
  if not readings or set(readings) - set(READINGS):
    raise calibration_store.CalibrationError(
        f"readings must be among {', '.join(READINGS)}, got {', '.join(readings) or 'none'}")
  if not thresholds or any(not -1 <= t <= 1 for t in thresholds):
    raise calibration_store.CalibrationError(
        f"thresholds must be cosine similarities in [-1, 1], got {list(thresholds)}")
  if texts < 1 or not qc_strides or any(s < 1 for s in qc_strides):
    raise calibration_store.CalibrationError(
        f"texts ({texts}) and every QC stride ({list(qc_strides)}) must be >= 1")


def calibrate_refreshkv(lm, *, lengths=(16384,), texts: int = 24,
                        thresholds=CALIBRATION_THRESHOLDS,
                        readings=tuple(READINGS), qc_strides=(5,), budget: float = 0.125,
                        n_scored: int = 256, rule: Rule = Rule(), out_dir: str | None = None,
                        chunk: int | None = None, write: bool = True) -> dict:
  """Runs the sweep on `lm` (an api.LM), chooses, and (write) records the calibration beside
  its checkpoint. out_dir: per-text records (results.jsonl; a rerun resumes), summary.md,
  calibration.md/png and a copy of the JSON."""
  check_args(readings, thresholds, texts, qc_strides)
  task = tasks_lib.get("ppl", n_scored=n_scored, heldout=True)
  rows = [(r, float(t)) for r in readings for t in thresholds]
  # A text cut off midway reruns whole: its later records replace the earlier ones.
  records = list({(r["length"], r["seed"], r["method"]): r
                  for r in (load_results(out_dir) if out_dir else [])}.values())
  done = {(r["length"], r["seed"], r["method"]) for r in records}
  labels = [FULL, SNAPKV] + [label(s, r, t) for s in qc_strides for r, t in rows]
  todo = [(n, s) for n in lengths for s in range(texts)
          if any((n, s, lab) not in done for lab in labels)]
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
  sink = open(unpack_results(out_dir), "a") if out_dir else None
  try:
    for length, seed in progress(todo, desc="calibrating refreshkv"):
      sample = task.make(lm.tokenizer, length, None, seed)
      recs = _run_text(lm, length, seed, sample, task, qc_strides, rows, budget, chunk)
      records = [r for r in records if (r["length"], r["seed"]) != (length, seed)] + recs
      if sink:
        sink.write("".join(json.dumps(r) + "\n" for r in recs))
        sink.flush()
  finally:
    if sink:
      sink.close()
  records = [r for r in records if r["length"] in lengths and r["seed"] < texts]
  result = summarize(records, qc_strides, readings, [float(t) for t in thresholds])
  chosen = choose(result["settings"], rule)
  reading, why = pick_reading(result["settings"], chosen)
  calib = {
      "format": calibration_store.FORMAT, "method": "refreshkv", "model": lm.model_id,
      "config_fingerprint": calibration_store.fingerprint(lm.config),
      "threshold": chosen[reading]["threshold"],
      "similarity_after_rope": READINGS[reading], "reading": reading, "why": why,
      "chosen": chosen, "rule": dataclasses.asdict(rule),
      "qc_strides": list(qc_strides), "budget": budget, "lengths": list(lengths),
      "texts": f"ppl task, heldout=True (the prose's last 30%), seeds 0..{texts - 1}",
      "n_scored": n_scored, "dtype": lm.config.dtype, "thresholds": [float(t) for t in thresholds],
      **result,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "library_version": _version(),
  }
  if write:
    calib["written_to"] = calibration_store.write(calib, calibration_store.local_path(lm.path))
  if out_dir:
    calibration_store.write(calib, os.path.join(out_dir, calibration_store.FILE))
    write_report(records, out_dir, baselines=[SNAPKV])
    write_calibration_report(calib, out_dir)
  return calib


def _version() -> str:
  try:
    return importlib.metadata.version("jax-longctx")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"
