"""topk_scores over 8-bit keys on the 8-bit tensor cores, against bf16 and dequantize-first.

    python -m benchmarks.topk8 --out $OUT/topk8.json [--only NAMES] [--smoke]

Shapes of one layer: 32 query / 8 KV heads, d=128, batch 1, 512 queries (ReAttention's scoring of
a prefill chunk).
1. rate_*: the measured matrix rate of bf16, int8 (s32 accumulation) and E4M3 (fp32) products,
   8192^3 through XLA (cuBLAS): the ceilings the kernels are compared with.
2. check_exact_*: keys and queries whose rows quantize with scale 1 (an entry at the format's
   largest value besides integers in [-3, 3]): every score is an integer, so the tensor-core
   kernel must equal the dequantize-first reference, indices and scores (2 sequences of
   different valid lengths, prefix / suffix excluded, top 1 and 4). A mismatch fails the case.
3. agree_*: normal inputs, 512 queries x 32K keys: the share of (query, head) rows whose chosen
   set equals the dequantize-first reference's (the queries' rounding reorders near-ties), and
   the largest reference-score shortfall of a pick below the reference's k-th score.
4. prefill_<keys>_top<k>: median ms after warm-up of topk_scores over bf16 keys (the Mosaic
   kernel), over 8-bit keys on the tensor cores, and over the same 8-bit keys by the
   dequantize-first route (a bf16 copy within KernelOptions.topk_dequantize_bytes, in segments
   beyond), all in the same run; TFLOP/s count 2 * queries * keys * d * H.
--smoke: tiny shapes on a CPU through jax's Mosaic GPU interpreter (checks the script; times mean
nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import common
from jax_longctx.app.bench_kernels import normal, small_ints
from jax_longctx.app.bench_measure import timed
from pallas_kernels import Route, quant, topk_scores
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from pallas_kernels.topk import mgpu_topk

H, KV, D, LQ = 32, 8, 128, 512
EIGHT_BIT = {"int8": 127.0, "float8_e4m3fn": 448.0}
SMOKE = False
TC = KernelOptions(topk_eight_bit="products")
DEQUANTIZE = KernelOptions(topk_eight_bit="dequantize")


def route(options=TC):
  return Route(backend="gpu", kernels=options)


def tiling():  # off a GPU only an explicit tiling runs the Mosaic kernel (in the interpreter)
  return Tiling(impl="mosaic", block_rows=64, block_keys=64, num_stages=2) if SMOKE else None


def rate(key, dtype_name, args, n=8192):
  n = 256 if SMOKE else n
  ka, kb = jax.random.split(key)
  if dtype_name == "bfloat16":
    a, b, acc = normal(ka, (n, n)), normal(kb, (n, n)), jnp.float32
  else:
    a = quant.quantize(normal(ka, (n, n), jnp.float32), dtype_name).values
    b = quant.quantize(normal(kb, (n, n), jnp.float32), dtype_name).values
    acc = jnp.int32 if dtype_name == "int8" else jnp.float32
  fn = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=acc))
  ms = timed(fn, a, b, reps=args.reps, inner=args.inner) * 1e3
  return {"case": "rate", "dtype": dtype_name, "n": n, "ms": ms, "tflops": 2 * n ** 3 / ms / 1e9}


def exact_rows(key, shape, qmax, channel):
  """Integers in [-3, 3], one channel at the format's largest value (queries and keys apart: the
  E4M3 products' accumulators keep fewer bits than fp32; tests/kernels/test_mgpu_topk8.py)."""
  x = small_ints(key, shape).astype(jnp.float32)
  sign = jnp.where(jax.random.bernoulli(jax.random.fold_in(key, 1), 0.5, shape[:-1]), 1.0, -1.0)
  return x.at[..., channel].set(qmax * sign)


def check_exact(key, dtype_name, top_k):
  kq, kk = jax.random.split(key)
  t = 304 if SMOKE else 20000
  q = exact_rows(kq, (2, 16 if SMOKE else 64, H, D), EIGHT_BIT[dtype_name], 5)
  q = q.astype(jnp.bfloat16)
  k = quant.quantize(exact_rows(kk, (2, t, KV, D), EIGHT_BIT[dtype_name], 6), dtype_name)
  kw = dict(valid_len=jnp.array([t, t * 2 // 3 + 1]), exclude_prefix=4, exclude_suffix=64)
  got = topk_scores(q, k, top_k, route=route(), tiling=tiling(), **kw)
  want = topk_scores(q, k, top_k, route=Route(backend="reference"), **kw)
  rec = {"case": "check_exact", "dtype": dtype_name, "top_k": top_k,
         "index_equal": float(jnp.mean(got[1] == want[1])),
         "score_equal": bool(jnp.all((got[0] == want[0]) | (jnp.isneginf(got[0])
                                                            & jnp.isneginf(want[0]))))}
  if rec["index_equal"] != 1.0 or not rec["score_equal"]:
    raise AssertionError(f"MISMATCH {rec}")
  return rec


def agree(key, dtype_name, top_k):
  kq, kk = jax.random.split(key)
  t = 512 if SMOKE else 32768
  q = normal(kq, (1, 16 if SMOKE else LQ, H, D))
  k = quant.quantize(normal(kk, (1, t, KV, D), jnp.float32), dtype_name)
  _, i = topk_scores(q, k, top_k, scale=D ** -0.5, route=route(), tiling=tiling())
  rv, ri = topk_scores(q, k, top_k, scale=D ** -0.5, route=Route(backend="reference"))
  # the reference's score of each pick: q . dequantized key, as the reference computes it
  kf = quant.dequantize(k, jnp.float32)  # [1, T, KV, D]
  g = jnp.repeat(jnp.arange(KV), H // KV)  # each query head's kv head
  rows = kf[0][i[0], g[None, :, None]]  # [Lq, H, top_k, D]: each pick's key
  picked = jnp.einsum("qhd,qhkd->qhk", q[0].astype(jnp.float32), rows)[None] * D ** -0.5
  same = jnp.all(jnp.sort(i, -1) == jnp.sort(ri, -1), -1)
  return {"case": "agree", "dtype": dtype_name, "top_k": top_k, "keys": t,
          "rows_equal": float(jnp.mean(same)), "rows": int(same.size),
          "max_shortfall": float(jnp.max(rv[..., -1:] - picked)),
          "score_spread": float(jnp.std(rv))}


def prefill(key, t, top_k, args):
  t, lq = (512, 16) if SMOKE else (t, LQ)
  kq, kk = jax.random.split(key)
  q = normal(kq, (1, lq, H, D))
  kf = normal(kk, (1, t, KV, D), jnp.float32)
  k16 = kf.astype(jnp.bfloat16)
  flops = 2 * lq * t * D * H
  rec = {"case": "prefill", "kv_len": t, "q_len": lq, "top_k": top_k}
  runs = {"bf16": (k16, TC)}
  for name in EIGHT_BIT:
    k8 = quant.quantize(kf, name)
    runs[f"{name}_tc"] = (k8, TC)
    runs[f"{name}_dequantize"] = (k8, DEQUANTIZE)
  del kf
  for name, (k, options) in runs.items():
    fn = jax.jit(lambda q, k, options=options: topk_scores(
        q, k, top_k, scale=D ** -0.5, route=route(options), tiling=tiling()))
    rec[f"{name}_ms"] = timed(fn, q, k, reps=args.reps, inner=args.inner) * 1e3
    rec[f"{name}_tflops"] = flops / rec[f"{name}_ms"] / 1e9
  for name in EIGHT_BIT:
    rec[f"{name}_tc_vs_bf16"] = rec["bf16_ms"] / rec[f"{name}_tc_ms"]
    rec[f"{name}_tc_vs_dequantize"] = rec[f"{name}_dequantize_ms"] / rec[f"{name}_tc_ms"]
  return rec


def gemm_only(key, dtype_name, args, t=131072):
  """The tensor-core kernel with its selection swapped for a running max (results
  meaningless): the pipeline and products alone."""
  t = 512 if SMOKE else t
  kq, kk = jax.random.split(key)
  q = normal(kq, (1, 16 if SMOKE else LQ, H, D))
  k = quant.quantize(normal(kk, (1, t, KV, D), jnp.float32), dtype_name)
  opts = KernelOptions(topk_selection="max_only")
  fn = jax.jit(lambda q, k: topk_scores(q, k, 1, route=route(opts), tiling=tiling()))
  ms = timed(fn, q, k, reps=args.reps, inner=args.inner) * 1e3
  return {"case": "gemm_only", "dtype": dtype_name, "kv_len": t, "ms": ms,
          "tflops": 2 * q.shape[1] * t * D * H / ms / 1e9}


def cases(key, args) -> dict:
  out = {f"rate_{n}": (lambda n=n: rate(key, n, args)) for n in ("bfloat16", *EIGHT_BIT)}
  for n in EIGHT_BIT:
    for top_k in (1, 4):
      out[f"check_exact_{n}_top{top_k}"] = lambda n=n, k=top_k: check_exact(key, n, k)
      out[f"agree_{n}_top{top_k}"] = lambda n=n, k=top_k: agree(key, n, k)
  for t, top_k in ((131072, 4), (131072, 1), (524288, 4), (1048576, 4), (1048576, 1)):
    out[f"prefill_{t // 1024}k_top{top_k}"] = lambda t=t, k=top_k: prefill(key, t, k, args)
  for n in EIGHT_BIT:
    out[f"gemm_only_{n}"] = lambda n=n: gemm_only(key, n, args)
  return out


def _smoke():
  global SMOKE, H, KV
  SMOKE, H, KV = True, 4, 1


def main():
  common.kernel_benchmark_main(__doc__, cases, mgpu_topk.DEFAULT_CONFIG, inner=3,
                               sweep_help="(no sweep)", smoke=_smoke)


if __name__ == "__main__":
  main()
