"""Would a rotation save the E4M3 cache on Qwen2? A CPU proxy, not a cache layout: the NLL of every
prediction of one LENGTH-token prose text (experiments/key_smoothing_proxy.py's text and fp32
forward) when each K/V row the cache stores is rounded through an 8-bit dtype, as is or after an
orthonormal Hadamard rotation of the head dim (QuaRot's remedy for outlier channels; the rotation
is undone on reading, so q . k is unchanged up to the rounding), against the fp32 cache.

  python experiments/key_rotation_proxy.py --model qwen2.5-coder-1.5b --length 1024 \
      --variants "float8_e4m3fn:plain,float8_e4m3fn:hadamard,float8_e4m3fn:centered,float8_e4m3fn:calibrated"

Measured 2026-11-26 (Qwen2.5-Coder-1.5B, 1,023 predictions, fp32 3.77174): E4M3 plain +8.04%,
hadamard +50.2%, centered -0.35%, calibrated -0.24%; int8 plain +0.31%, hadamard -0.05%,
centered +0.18%, calibrated +0.27%.

Each variant rounds K and V as the 8-bit cache does (a scale per row, symmetric: quant.quantize)
inside the fp32 cache's writes, so its `plain` rows check the proxy against the real 8-bit cache
(key_smoothing_proxy.py measured E4M3 +8.0%, int8 +0.28% on this text). `centered` takes each
channel's mean over the rows of one write (the whole text in this forward; both KV heads) out
before rounding: not causal, an indicator of what storing keys less their bias could buy;
`calibrated` takes out each channel's mean over another text (key_smoothing_proxy's calibration
text, seed 7), a constant per layer, KV head and channel, as a cache layout could. Post-RoPE keys only:
a cache of pre-RoPE keys (ReAttention) cannot take a rotation that mixes RoPE pairs.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import jax_longctx
from jax_longctx.ops import cache as cache_ops
from experiments.key_smoothing_proxy import prose_ids, token_nll
from pallas_kernels import quant


HOW = ("plain", "hadamard", "centered", "calibrated")


def hadamard(n: int) -> np.ndarray:
  """The orthonormal Sylvester Hadamard matrix of size n (a power of two): symmetric, H @ H = I."""
  h = np.ones((1, 1))
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  if h.shape[0] != n:
    raise SystemExit(f"head dim {n} is not a power of two")
  return h / np.sqrt(n)


def channel_means(params, cfg, ids) -> dict[int, np.ndarray]:
  """Each store call's channel means over its rows (call k of a forward: layer k // 2, K then
  V) on the text `ids`: the offsets a `calibrated` variant takes out."""
  means, calls = {}, itertools.count()

  def record(x, like, heads_axis=None):
    k, m = next(calls), jnp.mean(x.astype(jnp.float32).reshape(-1, x.shape[-1]), axis=0)
    jax.debug.callback(lambda m, k=k: means.__setitem__(k, np.asarray(m)), m)
    return x.astype(like.dtype)
  with patched_store(record):
    token_nll(params, cfg, ids, "float32")
  return means


@contextlib.contextmanager
def patched_store(store):
  original = (quant.store_like, cache_ops.store_like)
  quant.store_like = cache_ops.store_like = store
  jax.clear_caches()  # the forward is jitted: trace it again with this store
  try:
    yield
  finally:
    quant.store_like, cache_ops.store_like = original
    jax.clear_caches()


def rounding_store(dtype: str, rotation, centering):
  """A store_like that writes x rounded through `dtype` (after `rotation`, undone on the way
  back; or less an offset a channel, added back: "own" each write's mean over its rows, a dict
  the calibrated means by call) into a cache of the model's dtype."""
  calls = itertools.count()

  def store(x, like, heads_axis=None):
    if isinstance(like, quant.Quantized):
      raise SystemExit("run the proxy with a float cache")
    xf = x.astype(jnp.float32)
    k = next(calls)
    if centering == "own":
      mean = jnp.mean(xf.reshape(-1, xf.shape[-1]), axis=0)
    else:
      mean = jnp.asarray(centering[k]) if centering is not None else 0.0
    xf = xf - mean
    if rotation is not None:
      xf = xf @ rotation
    y = quant.dequantize(quant.quantize(xf, dtype), jnp.float32)
    if rotation is not None:
      y = y @ rotation
    return (y + mean).astype(like.dtype)
  return store


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--variants", default=",".join(f"{d}:{h}" for d in ("float8_e4m3fn", "int8")
                                                 for h in HOW))
  args = p.parse_args()
  for variant in args.variants.split(","):
    if variant.partition(":")[2] not in HOW:
      p.error(f"variant {variant!r}: DTYPE:HOW with HOW one of {', '.join(HOW)}")
  lm = jax_longctx.load(args.model, dtype="float32", smooth_keys=False)
  params, cfg = lm.params, lm.config
  ids = prose_ids(lm.tokenizer, args.length, seed=0)
  base = token_nll(params, cfg, ids, "float32")
  print(f"fp32: mean NLL {base.mean():.5f} over {len(base)} predictions", flush=True)
  rotation = jnp.asarray(hadamard(cfg.head_dim), jnp.float32)
  means = None
  for variant in args.variants.split(","):
    dtype, _, how = variant.partition(":")
    if how == "calibrated" and means is None:
      means = channel_means(params, cfg, prose_ids(lm.tokenizer, args.length, seed=7))
    centering = {"centered": "own", "calibrated": means}.get(how)
    with patched_store(rounding_store(dtype, rotation if how == "hadamard" else None, centering)):
      nll = token_nll(params, cfg, ids, "float32")
    print(f"{variant}: mean NLL {nll.mean():.5f}, {100 * (nll.mean() / base.mean() - 1):+.3f}%",
          flush=True)


if __name__ == "__main__":
  main()
