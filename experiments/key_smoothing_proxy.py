"""The CPU proxy behind key smoothing's choices (docs/CLAIMS.md, run/key_smoothing.py): the NLL
of every prediction of one LENGTH-token prose text (one uncached forward, fp32, the cache written
and read in each dtype) against the fp32 cache, with the keys smoothed in several ways.

  python experiments/key_smoothing_proxy.py --model qwen2.5-coder-1.5b --length 1024 \
      --variants "int8,int8:0.5,int8:1,int8:0.5:random,int8:weights,float8_e4m3fn,float8_e4m3fn:0.5"
  ... --int4-sim --variants "int8,int8:0.5,int8:1"     int4's numerics: the int8 grid clipped to +-7

A variant is DTYPE[:STRENGTH[:CALIBRATION[:offsets]]]: CALIBRATION `text` (default: another
prose text, seed 7), `random` (random token ids) or, as STRENGTH, `weights` (each pair's
magnitude estimated from k_proj, the input norm and k_bias alone, as if the normed inputs were
isotropic); `offsets` adds the calibrated key and value offsets (smooth_keys' default), which
the variants without it leave out.
Measured 2026-11-25 (Qwen2.5-Coder-1.5B, 1,023 predictions): int8 +0.28%, int8:1 +0.016%,
int8:0.5 +0.009%, int8:0.5:random +0.017%, int8:1:random +0.10%, int8:weights +0.99%; E4M3 +8.0%,
E4M3:0.5 +8.0%, E4M3:1 +65%; int4 simulated +277%, :0.5 +44%, :1 +196%.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

import jax_longctx
from jax_longctx.app.tasks import text_sources
from jax_longctx.core.options import RunOptions
from jax_longctx.run.driver import uncached_logits
from jax_longctx.run.key_smoothing import smooth_keys, smoothing_from_rms, with_smoothing
from pallas_kernels import quant


def prose_ids(tokenizer, length: int, seed: int) -> np.ndarray:
  text = text_sources.prose()
  start = random.Random(seed).randint(0, len(text) // 2)
  return np.asarray(tokenizer.encode(text[start:start + 8 * length])[1:length + 1], np.int32)


def token_nll(params, cfg, ids, kv_dtype) -> np.ndarray:
  logits = np.asarray(uncached_logits(params, cfg, ids[None], RunOptions(kv_dtype=kv_dtype))[0],
                      np.float64)[:-1]
  top = logits.max(-1)
  lse = top + np.log(np.exp(logits - top[:, None]).sum(-1))
  return lse - logits[np.arange(len(ids) - 1), ids[1:]]


def weight_rms(params, cfg) -> np.ndarray:
  """[layers, KV, hd / 2]: each key pair's RMS if the normed inputs were isotropic (unit
  variance per dimension): sqrt(sum_j (W_jc g_j)^2 + b_c^2), averaged over the pair."""
  out, half = [], cfg.head_dim // 2
  for layer in params["layers"].values():
    w = np.asarray(layer["attn"]["k_proj"]) * np.asarray(layer["attn_norm"]["scale"])[:, None, None]
    var = (w ** 2).sum(0) + (np.asarray(layer["attn"]["k_bias"]) ** 2 if "k_bias" in layer["attn"]
                             else 0.0)
    out.append(np.sqrt((var[:, :half] + var[:, half:]) / 2))
  return np.stack(out)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen2.5-coder-1.5b")
  p.add_argument("--length", type=int, default=1024)
  p.add_argument("--variants", default="int8,int8:0.5,int8:1")
  p.add_argument("--int4-sim", action="store_true")
  args = p.parse_args()
  if args.int4_sim:
    quant._QMAX["int8"] = 7.0  # read when a step is traced: every int8 write rounds to +-7
  lm = jax_longctx.load(args.model, dtype="float32")
  params, cfg, tok = lm.params, lm.config, lm.tokenizer
  ids = prose_ids(tok, args.length, seed=0)
  base = token_nll(params, cfg, ids, "float32")
  calibration = {"text": prose_ids(tok, args.length, seed=7),
                 "random": np.random.default_rng(0).integers(0, cfg.vocab_size, args.length)}
  print(f"fp32: mean NLL {base.mean():.5f} over {len(base)} predictions", flush=True)
  for variant in args.variants.split(","):
    dtype, *how = variant.split(":")
    if not how:
      p_, c_ = params, cfg
    elif how[0] == "weights":
      p_, c_ = with_smoothing(params, cfg, smoothing_from_rms(weight_rms(params, cfg), 1.0))
    else:
      src = calibration[how[1] if len(how) > 1 else "text"]
      p_, c_ = smooth_keys(params, cfg, src, strength=float(how[0]),
                           offsets=how[2:] == ["offsets"])
    nll = token_nll(p_, c_, ids, dtype)
    print(f"{variant}: mean NLL {nll.mean():.5f}, {100 * (nll.mean() / base.mean() - 1):+.3f}%",
          flush=True)


if __name__ == "__main__":
  main()
