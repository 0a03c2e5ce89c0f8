"""Does a constant key offset still help E4M3 far from position 0? A CPU proxy for the cache layout
that stores post-RoPE keys less one constant vector per (layer, KV head, channel).

key_rotation_proxy.py found that taking each channel's mean (calibrated on another text) out of
the stored keys and values before E4M3 rounding takes Qwen2.5-Coder-1.5B's NLL from +8.0% to
-0.24%; but it calibrated and measured at the same positions (0..1K). Post-RoPE, a pre-RoPE
bias b becomes R(p) b, which turns with the position p: over a cache of T positions the best
constant is the average rotation A(T) b (per RoPE pair, mean cos and sin of w p over [0, T)),
which keeps the slow pairs' bias and drops the fast ones'. This proxy places the text at
positions P..P+LENGTH (RoPE is relative: the fp32 NLL is the same at any P) and rounds every
stored K/V row through E4M3 or int8 after taking out:

  plain        nothing;
  same_place   the post-RoPE means of another text at the same positions (what a calibration at
               the right place could do; not a constant for a long cache);
  spread:T     A(T) b_k for keys (b_k: the pre-RoPE keys' means on another text) and the values'
               means: one constant for a cache of T positions.

  python experiments/key_offset_proxy.py --offsets 0,16384,30720 --variants \
      "float8_e4m3fn:plain,float8_e4m3fn:same_place,float8_e4m3fn:spread:32768"

Measured 2026-11-26 (Qwen2.5-Coder-1.5B, 1,023 predictions; at positions 0 / 16K / 30K): plain
+8.04% / +5.95% / +6.46%; same_place -0.24% / -0.25% / +0.39%; spread:32768 -0.06% / +0.21% /
+0.24%; spread:1024 -0.16% / +0.06% / +0.05%; spread:4096 (16K, 30K) +0.11% / -0.08%;
spread:1 (16K, 30K) -0.03% / +0.17%. The library's key offset (run/key_smoothing.py) is the
cached keys' mean over its 1K-token calibration prompt, about spread:1024.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import jax_longctx
from jax_longctx.core import rope
from experiments.key_rotation_proxy import channel_means, patched_store, rounding_store
from experiments.key_smoothing_proxy import prose_ids, token_nll


@contextlib.contextmanager
def shifted_positions(offset: int, on_keys=None, kv_heads: int = 0):
  """Every RoPE rotation at position + offset; on_keys(x) sees each pre-RoPE key tensor (the
  rotations of kv_heads heads) before it turns."""
  original = rope.rotate

  def rotate(x, positions, freqs):
    if on_keys is not None and x.shape[-2] == kv_heads:
      on_keys(x)
    return original(x, positions + offset, freqs)
  rope.rotate = rotate
  jax.clear_caches()
  try:
    yield
  finally:
    rope.rotate = original
    jax.clear_caches()


def pre_rope_key_means(params, cfg, ids) -> list[np.ndarray]:
  """Per layer [KV, hd]: the pre-RoPE keys' mean over the tokens of `ids`."""
  means, calls = {}, itertools.count()

  def record(x):
    k = next(calls)
    m = jnp.mean(x.astype(jnp.float32).reshape(-1, *x.shape[-2:]), axis=0)
    jax.debug.callback(lambda m, k=k: means.__setitem__(k, np.asarray(m)), m)
  with shifted_positions(0, record, cfg.num_kv_heads):
    token_nll(params, cfg, ids, "float32")
  return [means[k] for k in sorted(means)]


def spread(b: np.ndarray, freqs: np.ndarray, t: int) -> np.ndarray:
  """A(T) b: b [..., hd] rotated by every position in [0, T), averaged."""
  p = np.arange(t, dtype=np.float64)[:, None] * freqs[None].astype(np.float64)
  c, s = np.cos(p).mean(0), np.sin(p).mean(0)
  x1, x2 = np.split(b, 2, axis=-1)
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--offsets", default="0,16384,30720")
  p.add_argument("--variants", default="float8_e4m3fn:plain,float8_e4m3fn:same_place,"
                 "float8_e4m3fn:spread:32768")
  args = p.parse_args()
  lm = jax_longctx.load(args.model, dtype="float32", smooth_keys=False)
  params, cfg = lm.params, lm.config
  ids, other = (prose_ids(lm.tokenizer, args.length, seed=s) for s in (0, 7))
  freqs = np.asarray(rope.inv_freq(cfg))
  b_k = pre_rope_key_means(params, cfg, other)
  post = channel_means(params, cfg, other)  # at positions 0..: values' means are position-free
  for offset in (int(o) for o in args.offsets.split(",")):
    with shifted_positions(offset):
      base = token_nll(params, cfg, ids, "float32")
      same = channel_means(params, cfg, other)
    print(f"offset {offset}: fp32 mean NLL {base.mean():.5f}", flush=True)
    for variant in args.variants.split(","):
      dtype, _, how = variant.partition(":")
      if how == "plain":
        centering = None
      elif how == "same_place":
        centering = same
      elif how.startswith("spread:"):
        t = int(how.split(":")[1])
        centering = {}
        for layer, b in enumerate(b_k):  # store calls: layer k's K (2k) then V (2k + 1)
          centering[2 * layer] = spread(b, freqs, t)
          centering[2 * layer + 1] = post[2 * layer + 1]
      else:
        raise SystemExit(f"unknown variant {variant}")
      with shifted_positions(offset), patched_store(rounding_store(dtype, None, centering)):
        nll = token_nll(params, cfg, ids, "float32")
      print(f"  {variant}: {100 * (nll.mean() / base.mean() - 1):+.3f}%", flush=True)


if __name__ == "__main__":
  main()
