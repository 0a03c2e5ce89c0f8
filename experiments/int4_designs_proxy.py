"""Which 4-bit KV cache holds quality: KIVI's or KVQuant's? A CPU proxy, not a cache layout: the
NLL of every prediction of one LENGTH-token prose text (experiments/key_smoothing_proxy.py's text
and fp32 forward, no key smoothing) when each K and V write of the cache is rounded to 4 bits and
back in one of several ways, against the fp32 cache.

  python -m experiments.int4_designs_proxy --model qwen2.5-coder-1.5b --length 1024

A variant is KEYS/VALUES (or a preset's name, PRESETS), each side a base and +flags:
  fp, int8, row        as stored, the 8-bit cache's rounding, int4 symmetric (15 levels) per
                       (token, KV head)
  chanG[-pre][+sink]   keys per channel over groups of G tokens, asymmetric (min/max, 16 levels):
                       KIVI (arXiv 2402.02750), on the cached post-RoPE keys or (-pre) before RoPE
  tokG                 per token over groups of G channels, asymmetric: KIVI's values (G = 128:
                       the whole head, KVQuant's values)
  cal[-post]           keys per channel, asymmetric, the range calibrated per layer, KV head and
                       channel on another text (seed 7), before RoPE (-post: after): KVQuant
                       (arXiv 2401.18079)
  +sink +out +nuq      the first token kept whole; +out the ~1% largest magnitudes kept whole (keys:
                       past the calibrated 0.5% / 99.5% quantiles of their channel; values: the
                       largest of each row), the range set by the rest; +nuq 16 levels per layer
                       from 1-D k-means over the calibration text's normalized keys or values
A chan / tok side also keeps its last T mod G tokens whole (KIVI's residual; none at T = 1,024).
Every variant rounds the whole text's cache (each query reads every key rounded, a group's range
taken over its own tokens): harsher than a decode, where KIVI keeps the newest tokens whole.

Measured 2026-11-27 (Qwen2.5-Coder-1.5B, 1,023 predictions, fp32 cache 3.77174; 90% bootstrap
intervals over the predictions about +-0.25%): int8 +0.31%; int4 row +278%; KIVI G=32 +0.14%,
+sink +0.23%, pre-RoPE keys +0.21%; KIVI G=128 +0.89%, pre-RoPE +0.45%; KVQuant calibrated
uniform +0.62%, +sink +0.30%, +sink +out +0.53%, +out alone +0.21%, +sink +nuq -0.07%, all four
-0.11%, all four on post-RoPE keys -0.02%; keys alone KIVI-32 +0.10%, KVQuant +0.12%; values
alone tok32 +0.07%, KVQuant's +0.06%. Again 2026-11-28 (--variants kivi-32,chan64/tok64,
chan64-pre/tok64): KIVI G=32 +0.27% [+0.04, +0.51], G=64 -0.03% [-0.28, +0.23], G=64 pre-RoPE
keys +0.11% [-0.12, +0.34] (docs/results/kv_quant/qwen2.5-coder-1.5b/int4_designs_proxy_g64.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_longctx
from experiments.key_rotation_proxy import patched_store
from experiments.key_smoothing_proxy import prose_ids, token_nll
from jax_longctx.core.rope import inv_freq, rotate
from pallas_kernels import quant

PRESETS = {
    "int8": "int8/int8",
    "row": "row/row",
    "kivi-32": "chan32/tok32",
    "kivi-128": "chan128/tok128",
    "kivi-32-pre": "chan32-pre/tok32",
    "kvquant-uniform": "cal/tok128",
    "kvquant-uniform+sink": "cal+sink/tok128+sink",
    "kvquant-uniform+sink+out": "cal+sink+out/tok128+sink+out",
    "kvquant-uniform+out": "cal+out/tok128+out",
    "kvquant-uniform+sink+nuq": "cal+sink+nuq/tok128+sink+nuq",
    "kvquant": "cal+sink+out+nuq/tok128+sink+out+nuq",
    "kvquant-post": "cal-post+sink+out+nuq/tok128+sink+out+nuq",
    "kivi-32+sink": "chan32+sink/tok32+sink",
    "kivi-128-pre": "chan128-pre/tok128",
    "kivi-32-keys": "chan32/fp",
    "kvquant-keys": "cal+sink+out+nuq/fp",
    "kivi-32-values": "fp/tok32",
    "kvquant-values": "fp/tok128+sink+out+nuq",
}
OUT = "docs/results/kv_quant/qwen2.5-coder-1.5b/int4_designs_proxy.json"
LEVELS = 16
UNIFORM = np.linspace(-1.0, 1.0, LEVELS)


def unrope(k, freqs, sign=-1):
  """Keys [B, T, KV, d] cached at positions 0..T-1 rotated back before RoPE (sign 1: again)."""
  return rotate(k, sign * jnp.arange(k.shape[1])[None, :, None], freqs)


def asym(x, axis, levels=UNIFORM, keep=None):
  """x rounded to `levels` of [-1, 1] mapped onto [min, max] over `axis` (asymmetric: a scale
  and zero point); `keep` (bool like x): values left whole and out of the min / max."""
  lo_src = x if keep is None else jnp.where(keep, jnp.inf, x)
  hi_src = x if keep is None else jnp.where(keep, -jnp.inf, x)
  lo, hi = jnp.min(lo_src, axis, keepdims=True), jnp.max(hi_src, axis, keepdims=True)
  y = to_levels(x, (hi + lo) / 2, jnp.maximum((hi - lo) / 2, 1e-12), levels)
  return y if keep is None else jnp.where(keep, x, y)


def to_levels(x, mid, half, levels):
  """x normalized by (x - mid) / half, clipped to [-1, 1], rounded to the nearest of `levels`."""
  z = jnp.clip((x - mid) / half, -1.0, 1.0)
  lv = jnp.asarray(levels, jnp.float32)
  return jnp.take(lv, jnp.argmin(jnp.abs(z[..., None] - lv), axis=-1)) * half + mid


def grouped(x, g, axis, fn):
  """fn over x [B, T, KV, d] in groups of g along `axis` (1: tokens, each group's own range;
  3: channels); along the tokens the last T mod g stay whole (KIVI's residual)."""
  b, t, h, d = x.shape
  if axis == 3:
    return fn(x.reshape(b, t, h, d // g, g), 4).reshape(x.shape)
  n = t // g * g
  head = fn(x[:, :n].reshape(b, t // g, g, h, d), 2).reshape(b, n, h, d)
  return jnp.concatenate([head, x[:, n:]], axis=1)


def row_top(x, frac):
  """The ~frac largest magnitudes of each row [..., d] (at least one)."""
  k = max(1, round(frac * x.shape[-1]))
  thr = jax.lax.top_k(jnp.abs(x), k)[0][..., -1:]
  return jnp.abs(x) >= thr


def kmeans_1d(z, k=LEVELS, iters=60):
  """k levels minimizing the squared rounding error of the 1-D sample z (Lloyd from quantiles)."""
  z = np.sort(z.astype(np.float64))
  c = np.quantile(z, (np.arange(k) + 0.5) / k)
  cum = np.concatenate([[0.0], np.cumsum(z)])
  for _ in range(iters):
    edges = np.searchsorted(z, (c[1:] + c[:-1]) / 2)
    lo, hi = np.concatenate([[0], edges]), np.concatenate([edges, [len(z)]])
    n = hi - lo
    c = np.where(n > 0, (cum[hi] - cum[lo]) / np.maximum(n, 1), c)
  return np.sort(c)


class Calibration:
  """What KVQuant fixes offline on another text: per layer, KV head and channel the keys' range
  (before RoPE, or after with post), with or without the 1% outliers, and per layer the nuq
  levels of the normalized keys and values."""

  def __init__(self, keys_pre, keys_post, values, frac):
    self.keys = {"pre": keys_pre, "post": keys_post}  # [layer] -> [T, KV, d]
    self.values, self.frac, self.memo = values, frac, {}

  def key_range(self, layer, post, out):
    k = self.keys["post" if post else "pre"][layer]
    q = self.frac / 2 if out else 0.0
    return np.quantile(k, q, axis=0), np.quantile(k, 1 - q, axis=0)  # [KV, d] each

  def key_levels(self, layer, post, out):
    key = ("k", layer, post, out)
    if key not in self.memo:
      lo, hi = self.key_range(layer, post, out)
      z = (self.keys["post" if post else "pre"][layer] - (hi + lo) / 2) / ((hi - lo) / 2)
      self.memo[key] = kmeans_1d(z[np.abs(z) <= 1])
    return self.memo[key]

  def value_levels(self, layer, out):
    key = ("v", layer, out)
    if key not in self.memo:  # numpy: called while a forward is traced
      v = self.values[layer]
      k = max(1, round(self.frac * v.shape[-1]))
      thr = -np.partition(-np.abs(v), k - 1, axis=-1)[..., k - 1:k]
      keep = np.abs(v) >= thr if out else np.zeros(v.shape, bool)
      lo = np.min(np.where(keep, np.inf, v), -1, keepdims=True)
      hi = np.max(np.where(keep, -np.inf, v), -1, keepdims=True)
      z = (v - (hi + lo) / 2) / np.maximum((hi - lo) / 2, 1e-12)
      self.memo[key] = kmeans_1d(z[~keep])
    return self.memo[key]


def side(spec, x, layer, cal, freqs, frac):
  """One side (keys or values) [B, T, KV, d] fp32 of a variant, rounded and back."""
  base, *flags = spec.split("+")
  unknown = set(flags) - {"sink", "out", "nuq"}
  if unknown:
    raise SystemExit(f"{spec}: unknown flags {sorted(unknown)}")
  if base == "fp":
    return x
  if base == "int8":
    return quant.dequantize(quant.quantize(x, "int8"))
  if base == "row":
    s = jnp.maximum(jnp.max(jnp.abs(x), -1, keepdims=True) / 7, 1e-12)
    return jnp.clip(jnp.round(x / s), -7, 7) * s
  out, nuq = "out" in flags, "nuq" in flags
  if base.startswith("chan"):
    if out or nuq:
      raise SystemExit(f"{spec}: chan takes +sink only")
    g, pre = base[4:].partition("-")[::2]
    k = unrope(x, freqs) if pre == "pre" else x
    y = grouped(k, int(g), 1, asym)
    y = unrope(y, freqs, 1) if pre == "pre" else y
  elif base.startswith("tok"):
    levels = cal.value_levels(layer, out) if nuq else UNIFORM
    g = int(base[3:])
    y = grouped(x, g, 3, lambda a, ax: asym(a, ax, levels, row_top(a, frac) if out else None))
  elif base in ("cal", "cal-post"):
    post = base == "cal-post"
    k = x if post else unrope(x, freqs)
    lo, hi = (jnp.asarray(a, jnp.float32) for a in cal.key_range(layer, post, out))
    levels = cal.key_levels(layer, post, out) if nuq else UNIFORM
    y = to_levels(k, (hi + lo) / 2, jnp.maximum((hi - lo) / 2, 1e-12), levels)
    if out:
      y = jnp.where((k < lo) | (k > hi), k, y)
    y = y if post else unrope(y, freqs, 1)
  else:
    raise SystemExit(f"unknown side {spec!r}")
  if "sink" in flags:
    y = y.at[:, 0].set(x[:, 0])
  return y


def rel_ci(nll, base, n=2000, seed=0):
  """90% paired bootstrap interval (over predictions) of the mean NLL's change, in %."""
  idx = np.random.default_rng(seed).integers(0, len(base), (n, len(base)))
  rel = 100 * (nll[idx].mean(1) / base[idx].mean(1) - 1)
  return [float(np.percentile(rel, 5)), float(np.percentile(rel, 95))]


def calls_store(fn, layers):
  """A store_like whose call k (layer k // 2, keys then values) writes fn(x, layer, is_key)."""
  calls = itertools.count()

  def store(x, like, heads_axis=None):
    if isinstance(like, quant.Quantized):
      raise SystemExit("run the proxy with a float cache")
    k = next(calls)
    if k >= 2 * layers:
      raise SystemExit(f"store call {k}: more than 2 per layer in one forward")
    return fn(x.astype(jnp.float32), k // 2, k % 2 == 0).astype(like.dtype)
  store.calls = calls
  return store


def calibrate(params, cfg, ids, frac):
  """One fp32 forward of `ids`, recording every write: a Calibration."""
  got, freqs = {}, inv_freq(cfg, len(ids))

  def record(x, layer, is_key):
    parts = (("pre", unrope(x, freqs)), ("post", x)) if is_key else (("v", x),)
    for name, a in parts:
      jax.debug.callback(lambda a, n=name, l=layer: got.__setitem__((n, l), np.asarray(a)[0]), a)
    return x
  with patched_store(calls_store(record, cfg.num_layers)):
    token_nll(params, cfg, ids, "float32")
  if len(got) != 3 * cfg.num_layers:
    raise SystemExit(f"calibration recorded {len(got)} writes, expected {3 * cfg.num_layers}")
  return Calibration(*([got[(n, l)] for l in range(cfg.num_layers)] for n in ("pre", "post", "v")),
                     frac)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--variants", default=",".join(PRESETS))
  p.add_argument("--outlier-fraction", type=float, default=0.01)
  p.add_argument("--out", default=OUT)
  args = p.parse_args()
  lm = jax_longctx.load(args.model, dtype="float32", smooth_keys=False)
  params, cfg = lm.params, lm.config
  ids = prose_ids(lm.tokenizer, args.length, seed=0)
  freqs = inv_freq(cfg, len(ids))
  base = token_nll(params, cfg, ids, "float32")
  print(f"fp32: mean NLL {base.mean():.5f} over {len(base)} predictions", flush=True)
  results = {"fp32": {"mean_nll": float(base.mean()), "rel_pct": 0.0,
                      "details": {"predictions": len(base), "model": args.model}}}
  cal = None
  if any("cal" in PRESETS.get(v, v) or "nuq" in PRESETS.get(v, v)
         for v in args.variants.split(",")):
    cal = calibrate(params, cfg, prose_ids(lm.tokenizer, args.length, seed=7),
                    args.outlier_fraction)
  for variant in args.variants.split(","):
    spec = PRESETS.get(variant, variant)
    k_spec, _, v_spec = spec.partition("/")
    store = calls_store(lambda x, layer, is_key: side(
        k_spec if is_key else v_spec, x, layer, cal, freqs, args.outlier_fraction),
        cfg.num_layers)
    with patched_store(store):
      nll = token_nll(params, cfg, ids, "float32")
    n_calls = next(store.calls)
    if n_calls % (2 * cfg.num_layers):
      raise SystemExit(f"{variant}: {n_calls} store calls, not 2 per layer")
    rel, ci = 100 * (nll.mean() / base.mean() - 1), rel_ci(nll, base)
    results[variant] = {"mean_nll": float(nll.mean()), "rel_pct": float(rel),
                        "details": {"keys": k_spec, "values": v_spec, "ci90_pct": ci,
                                    "outlier_fraction": args.outlier_fraction}}
    print(f"{variant} ({spec}): mean NLL {nll.mean():.5f}, {rel:+.3f}% "
          f"[{ci[0]:+.3f}, {ci[1]:+.3f}]", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
