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
  nll, boot = _pooled_resampled([method, base, full], seeds, resamples, seed)
  ppl, boot = np.exp(nll), np.exp(boot)
  with np.errstate(divide="ignore", invalid="ignore"):
    shares = (boot[1] - boot[0]) / (boot[1] - boot[2])
  return Gap(float(gap_closed(*ppl)), *_interval(shares, level), len(seeds))


@dataclasses.dataclass(frozen=True)
class Contrast:
  value: float  # nats/token (paired_contrast) or a ratio less one (paired_relative), paired texts
  low: float  # the paired bootstrap's interval at LEVEL
  high: float
  n_texts: int


def paired_contrast(nlls: list[dict], weights: list[float], *, resamples: int = RESAMPLES,
                    seed: int = SEED, level: float = LEVEL) -> Contrast | None:
  """sum_i weights[i] x pooled NLL of nlls[i] ({seed: NLLs} each, scored on the same texts),
  over the texts all ran, with its paired-bootstrap interval; None when they share no text.

  [before, after] with weights [-1, 1]: the change a model update made (negative: better);
  [a_before, a_after, b_before, b_after] with [1, -1, -1, 1]: how much more a gained than b."""
  seeds = sorted(set.intersection(*(set(d) for d in nlls)))
  if not seeds:
    return None
  if any(len(d[s]) != len(nlls[0][s]) for d in nlls for s in seeds):
    raise ValueError("paired_contrast: the methods scored different numbers of tokens on a text")
  w = np.asarray(weights, np.float64)[:, None]
  nll, boot = _pooled_resampled(nlls, seeds, resamples, seed)
  return Contrast(float(np.sum(w[:, 0] * nll)), *_interval(np.sum(w * boot, 0), level), len(seeds))


def paired_relative(method: dict, base: dict, *, resamples: int = RESAMPLES, seed: int = SEED,
                    level: float = LEVEL) -> Contrast | None:
  """method's pooled NLL over base's, less one (0.001: 0.1% higher), over the texts both ran
  ({seed: NLLs} each), with its paired-bootstrap interval; None when they share no text. The
  quantized (8- or 4-bit) cache's quality measure against the cache in the model's dtype (issue 54)."""
  seeds = sorted(set(method) & set(base))
  if not seeds:
    return None
  nll, boot = _pooled_resampled([base, method], seeds, resamples, seed)
  return Contrast(float(nll[1] / nll[0] - 1), *_interval(boot[1] / boot[0] - 1, level), len(seeds))


def _pooled_resampled(nlls: list[dict], seeds: list, resamples: int, seed: int):
  """(pooled NLL per method [M], the same over `resamples` draws of the texts [M, R]): each draw
  takes len(seeds) texts with replacement, the same texts for every method. Token counts are the
  last method's (the same text gives the same count)."""
  counts = np.array([len(nlls[-1][s]) for s in seeds], np.float64)  # [T]
  sums = np.array([[np.sum(d[s]) for s in seeds] for d in nlls])  # [M, T]
  idx = np.random.default_rng(seed).integers(0, len(seeds), (resamples, len(seeds)))
  return sums.sum(-1) / counts.sum(), sums[:, idx].sum(-1) / counts[idx].sum(-1)


def _interval(draws: np.ndarray, level: float) -> tuple[float, float]:
  tail = 100 * (1 - level) / 2
  low, high = np.nanpercentile(draws, [tail, 100 - tail])
  return float(low), float(high)
