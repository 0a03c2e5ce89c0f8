"""Perplexity from pooled token NLLs, the share of a baseline's gap to full attention a method
closes, and its paired-bootstrap interval over texts (RefreshKV's claim, issue 39).

Pooled: ppl = exp(sum of every token's NLL over all texts / number of tokens), not the mean of
per-text perplexities (one hard text moves a mean of exponentials far more than a pooled mean;
it moved RefreshKV's 32K figure on Qwen from 11% to 28%). The share of the gap is taken in
perplexity, as docs/CLAIMS.md and issue 39 state it: (ppl_B - ppl_M) / (ppl_B - ppl_F).

The interval resamples texts with replacement, the same texts for every method (the methods
ran on the same texts, so their errors are paired), and reads the 5th and 95th percentiles.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.9


def pooled_ppl(nlls) -> float:
  """exp(mean NLL) over the tokens of every text (nlls: one sequence of token NLLs per text)."""
  flat = np.concatenate([np.asarray(x, np.float64) for x in nlls]) if len(nlls) else np.zeros(0)
  return math.exp(flat.mean()) if flat.size else float("nan")


def gap_closed(ppl_method: float, ppl_base: float, ppl_full: float) -> float:
  """Share of the baseline's perplexity gap to full attention the method closes (1: all of it,
  0: none, < 0: worse than the baseline)."""
  gap = ppl_base - ppl_full
  return (ppl_base - ppl_method) / gap if gap != 0 else float("nan")


def nll_by_seed(records: list[dict], method: str, length: int, task: str = "ppl") -> dict:
  """{seed: token NLLs [N]} of one method's records at one length."""
  return {r["seed"]: np.asarray(r["nll"], np.float64) for r in records
          if r["task"] == task and r["method"] == method and r["length"] == length
          and r.get("nll") is not None}


@dataclasses.dataclass(frozen=True)
class Gap:
  share: float  # of the pooled perplexities over the paired texts
  low: float  # the paired bootstrap's interval at LEVEL
  high: float
  n_texts: int


def paired_gap(method: dict, base: dict, full: dict, *, resamples: int = RESAMPLES,
               seed: int = SEED, level: float = LEVEL) -> Gap | None:
  """The share of base's gap closed by method, over the texts all three ran ({seed: NLLs}
  each), with its paired-bootstrap interval; None when they share no text."""
  seeds = sorted(set(method) & set(base) & set(full))
  if not seeds:
    return None
  # Per text: NLL sums per method and the token count (the same text gives the same count).
  sums = np.array([[np.sum(d[s]) for s in seeds] for d in (method, base, full)])  # [3, T]
  counts = np.array([len(full[s]) for s in seeds], np.float64)  # [T]
  ppl = np.exp(sums.sum(-1) / counts.sum())
  share = gap_closed(*ppl)
  idx = np.random.default_rng(seed).integers(0, len(seeds), (resamples, len(seeds)))
  boot = np.exp(sums[:, idx].sum(-1) / counts[idx].sum(-1))  # [3, resamples]
  with np.errstate(divide="ignore", invalid="ignore"):
    shares = (boot[1] - boot[0]) / (boot[1] - boot[2])
  tail = 100 * (1 - level) / 2
  low, high = np.nanpercentile(shares, [tail, 100 - tail])
  return Gap(float(share), float(low), float(high), len(seeds))
