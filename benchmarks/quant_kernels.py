"""The cache-reading kernels over 8-bit K/V (pallas_kernels.quant): checked against the reference
on the device, then timed against the same kernels over bf16 K/V.

    python -m benchmarks.quant_kernels --out $OUT/quant_kernels.json           # one GPU
    python -m benchmarks.quant_kernels --smoke --out /tmp/q.json               # CPU, tiny

Checks (each kernel, int8 and float8_e4m3fn, random inputs with outlier key channels): flash
attention prefill (causal at a query offset, use_cudnn=False: the Triton kernel, which 8-bit K/V
take on a GPU when a chunk does not dequantize the cache first), split-K decode, chunk_attention over a quantized cache, gathered attention
rotating pre-RoPE keys, top-k (Triton prefill rows, decode's block path): the largest error
against the jnp reference that dequantizes first (attention), the share of indices equal to the
reference's (top-k; exact ties cannot be guaranteed on random data, so the scores at the
differing slots are reported too).

Timings (median of --reps after a warm-up; Llama-3.1-8B's attention shape: 32 query heads over 8
KV heads, d 128, batch 1; `--heads 32/4` for what one GPU of the 70B on model=2 holds): decode
attention over 32K / 128K / 1M keys and decode top-4 over the same, timed as back-to-back calls
(`ms`; records before 2026-11-26 timed one waited-for call, kept as `ms_one_call`: its dispatch
and sync set a floor of ~0.14 ms under the 128K figures), each with the bytes it reads (8-bit values and fp32 scales, or bf16) over its time beside
the device's copy bandwidth measured in the same run; a 4096-query prefill chunk at offsets 28K
and 124K (chunk_attention, as full attention's prefill runs it: over an 8-bit cache its
dequantized copy and the bf16 kernel, KernelOptions.prefill_dequantize_bytes) and a 512-query top-4 over 32K /
128K keys. `decode_products`: 8-bit decode attention with its products in bf16 against fp16
(KernelOptions.fp8_fp16_products, int8_fp16_products) and, for int8, int8 x int8 products with
the query rows quantized (decode_int8_products), error and time; each also with the row block
holding copies of the query rows over parts of each key tile (decode_row_groups), and bf16 K/V
with and without them as the anchor.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import (copy_bandwidth, device_facts, median_time,
                               run_cases_to_json)
from jax_longctx.app.bench_measure import timed

DTYPES = ("int8", "float8_e4m3fn")
H, KV, D = 32, 8, 128
SIZES = dict(decode=(32768, 131072, 1048576), chunk=4096, offsets=(28672, 126976),
             topk_rows=512, topk_keys=(32768, 131072), check=1000, tile_keys=(131072, 1048576),
             route_keys=(131072, 1048576))


def _inputs(seed, b, lq, t, dtype):
  import jax
  import jax.numpy as jnp
  from pallas_kernels import quant
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, lq, H, D), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, KV, t, D), jnp.float32)
  k = k.at[..., :4].multiply(30.0)  # outlier channels, as real keys have (KIVI)
  v = jax.random.normal(keys[2], (b, KV, t, D), jnp.float32)
  if dtype == "bfloat16":
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  return q, quant.quantize(k, dtype), quant.quantize(v, dtype)


def _exact(q, k, v):
  """fp32 q and dequantized K / V: the reference's inputs without a rounding to bf16 (the
  kernels keep 8-bit products exact in fp32, the reference's dequantize-to-q.dtype does not)."""
  import jax.numpy as jnp
  from pallas_kernels import quant
  return q.astype(jnp.float32), quant.dequantize(k, jnp.float32), quant.dequantize(v, jnp.float32)


def _err(got, want):
  import numpy as np
  return float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))


def check_attention(backend):
  import jax.numpy as jnp
  from pallas_kernels import Route, chunk_attention, flash_attention, gathered_attention
  t, c = SIZES["check"], 64
  recs = []
  for dtype in DTYPES:
    q, k, v = _inputs(1, 2, c, t, dtype)
    off = jnp.asarray([t - c, (t - c) // 2])
    ref = flash_attention(*_exact(q, k, v), causal=True, q_offset=off, kv_len=off + c,
                          kv_layout="BHTD", route=Route(backend="reference"))
    # 8-bit K/V take the Triton kernel on a GPU (flash._mosaic_config: the Mosaic path hung).
    got = flash_attention(q, k, v, causal=True, q_offset=off, kv_len=off + c, kv_layout="BHTD",
                          route=Route(backend=backend), use_cudnn=False)
    recs.append({"kernel": "prefill", "dtype": dtype, "out_err": _err(got[0], ref[0]),
                 "lse_err": _err(got[1], ref[1])})
    pos = jnp.asarray([t - 1, t // 3])
    ref = flash_attention(*_exact(q[:, :1], k, v), causal=True, q_offset=pos, kv_len=pos + 1,
                          kv_layout="BHTD", route=Route(backend="reference"))
    got = flash_attention(q[:, :1], k, v, causal=True, q_offset=pos, kv_len=pos + 1,
                          kv_layout="BHTD", route=Route(backend=backend))
    recs.append({"kernel": "decode", "dtype": dtype, "out_err": _err(got[0], ref[0]),
                 "lse_err": _err(got[1], ref[1])})
    _, kc, vc = _inputs(2, 2, c, c, "bfloat16")
    kc, vc = jnp.swapaxes(kc, 1, 2), jnp.swapaxes(vc, 1, 2)
    got = chunk_attention(q, k, v, kc, vc, off, kv_layout="BHTD", route=Route(backend=backend))
    ref = chunk_attention(*_exact(q, k, v), kc.astype(jnp.float32), vc.astype(jnp.float32), off,
                          kv_layout="BHTD", route=Route(backend="reference"))
    recs.append({"kernel": "chunk", "dtype": dtype, "out_err": _err(got[0], ref[0]),
                 "lse_err": _err(got[1], ref[1])})
    idx = jnp.broadcast_to(jnp.arange(0, t, 3)[None, None, :], (2, KV, -(-t // 3)))
    valid = idx < jnp.asarray([t, t // 2])[:, None, None]
    freqs = 1.0 / (10000.0 ** (jnp.arange(0, D, 2) / D))
    kw = dict(kv_layout="BHTD", key_rope_freqs=freqs)
    got = gathered_attention(q[:, :1], k, v, idx, valid, route=Route(backend=backend), **kw)
    ref = gathered_attention(*_exact(q[:, :1], k, v), idx, valid, route=Route(backend="reference"),
                             **kw)
    recs.append({"kernel": "gathered_rope", "dtype": dtype, "out_err": _err(got[0], ref[0]),
                 "lse_err": _err(got[1], ref[1])})
  return recs


def check_topk(backend):
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels import Route, topk_scores
  t = SIZES["check"] * 8
  recs = []
  for dtype in DTYPES:
    for lq in (64, 1):
      q, k, _ = _inputs(3, 2, lq, t, dtype)
      kw = dict(valid_len=jnp.asarray([t, t - 777]), exclude_prefix=32, kv_layout="BHTD")
      got = topk_scores(q, k, 4, route=Route(backend=backend), **kw)
      ref = topk_scores(q, k, 4, route=Route(backend="reference"), **kw)
      same = np.asarray(got[1]) == np.asarray(ref[1])
      recs.append({"kernel": f"topk_{'prefill' if lq > 1 else 'decode'}", "dtype": dtype,
                   "indices_equal": float(np.mean(same)),
                   "score_err_where_differing": _err(np.where(same, 0, got[0]),
                                                     np.where(same, 0, ref[0]))})
  return recs


def _nbytes(*xs):
  import jax
  return sum(a.nbytes for x in xs for a in jax.tree.leaves(x))


def _timed_record(rec, fn, args, read, reps, bw):
  """rec with fn(*args)'s time: `ms` per call of back-to-back calls (bench_measure.timed: the
  host's dispatch of one call overlaps the device's work on the last; what a decode step's
  kernel costs), and `ms_one_call`, one call waited for (a dispatch and a sync in it: at 128K
  keys and below this was most of the earlier records' figure). `bytes` read each call, and
  their rate against the copy bandwidth."""
  import jax
  ms = timed(fn, *args, reps=reps, inner=20) * 1e3
  one, _ = median_time(lambda: jax.block_until_ready(fn(*args)), warmup=2, reps=reps)
  return {**rec, "ms": ms, "ms_one_call": one * 1e3, "bytes": read,
          "gb_s": read / ms / 1e6, "of_copy_bw": read / ms * 1e3 / bw}


def time_decode(reps, bw):
  import jax
  import jax.numpy as jnp
  from pallas_kernels import Route, flash_attention, topk_scores
  recs = []
  for t in SIZES["decode"]:
    for dtype in ("bfloat16",) + DTYPES:
      q, k, v = _inputs(4, 1, 1, t, dtype)
      pos = jnp.asarray([t - 1])
      attn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, q_offset=pos,
                                                     kv_len=pos + 1, kv_layout="BHTD", route=Route()))
      recs.append(_timed_record({"kernel": "decode_attention", "keys": t, "dtype": dtype},
                                attn, (q, k, v), _nbytes(k, v), reps, bw))
      top = jax.jit(lambda q, k: topk_scores(q, k, 4, valid_len=pos + 1, kv_layout="BHTD",
                                             scale=1.0, route=Route()))
      recs.append(_timed_record({"kernel": "decode_topk4", "keys": t, "dtype": dtype},
                                top, (q, k), _nbytes(k), reps, bw))
      del q, k, v
  return recs


def time_decode_products(reps, bw):
  """Decode attention over 8-bit K/V with its products in the queries' dtype (bf16: each
  value converted to bf16) against fp16 products (KernelOptions.fp8_fp16_products,
  int8_fp16_products: E4M3 converts to fp16 in one step, int8 by PTX byte permutes): the error
  of each against the fp32 reference that dequantizes first (2 sequences, 1000 keys, outlier key
  channels), then the time of each over 32K / 128K / 1M keys."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels import KernelOptions, Route, flash_attention
  groups = {"decode_row_groups": True}
  variants = {"int8": {"q_dtype": {}, "fp16": {"int8_fp16_products": True},
                       "int8": {"decode_int8_products": True},
                       "int8_groups": {"decode_int8_products": True, **groups},
                       "int8_fp16_groups": {"decode_int8_products": True,
                                            "int8_fp16_products": True, **groups}},
              "float8_e4m3fn": {"q_dtype": {"fp8_fp16_products": False}, "fp16": {},
                                "fp16_groups": groups},
              "bfloat16": {"bf16": {}, "bf16_groups": groups}}
  recs = []
  t = SIZES["check"]
  for dtype, opts in variants.items():
    if dtype == "bfloat16":
      continue  # checked against its own reference elsewhere; timed below as the anchor
    q, k, v = _inputs(5, 2, 1, t, dtype)
    pos = jnp.asarray([t - 1, t // 3])
    ref = flash_attention(*_exact(q, k, v), causal=True, q_offset=pos, kv_len=pos + 1,
                          kv_layout="BHTD", route=Route(backend="reference"))
    for name, o in opts.items():
      got = flash_attention(q, k, v, causal=True, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD",
                            route=Route(kernels=KernelOptions(**o)))
      recs.append({"check": "decode", "dtype": dtype, "products": name,
                   "out_err": _err(got[0], ref[0]), "lse_err": _err(got[1], ref[1])})
  for t in SIZES["decode"]:
    for dtype, opts in variants.items():
      q, k, v = _inputs(4, 1, 1, t, dtype)
      pos = jnp.asarray([t - 1])
      for name, o in opts.items():
        fn = jax.jit(lambda q, k, v, o=KernelOptions(**o): flash_attention(
            q, k, v, causal=True, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD", route=Route(kernels=o)))
        recs.append(_timed_record({"kernel": "decode_attention", "keys": t, "dtype": dtype,
                                   "products": name}, fn, (q, k, v), _nbytes(k, v), reps, bw))
        print(recs[-1], file=sys.stderr, flush=True)  # the case's JSON is written at its end
      del q, k, v
  return recs


def time_decode_tiles(reps, bw):
  """Decode attention over 8-bit K/V at 128K and 1M keys under tilings of the split-K kernel
  (key tile, warps, stages, key splits): an 8-bit tile holds half a bf16 tile's bytes. Key
  splits: the default plan gives 2 programs per SM (one sequence: 8 KV heads x 33 splits on an
  H200), whose tiles run one after the other; more splits put more tiles in flight."""
  import itertools

  import jax
  import jax.numpy as jnp
  from pallas_kernels import Route, flash_attention
  from pallas_kernels.gpu import Tiling
  recs = []
  for t in SIZES["tile_keys"]:
    for dtype in ("bfloat16", "int8"):
      q, k, v = _inputs(8, 1, 1, t, dtype)
      pos = jnp.asarray([t - 1])
      read = _nbytes(k, v)
      for bk, warps, stages, splits in itertools.product((64, 128, 256), (4, 8), (2, 3),
                                                         (None, 66, 132, 264)):
        tl = Tiling(block_keys=bk, num_warps=warps, num_stages=stages, key_splits=splits)
        fn = jax.jit(lambda q, k, v, tl=tl: flash_attention(
            q, k, v, causal=True, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD", tiling=tl, route=Route()))
        rec = {"keys": t, "dtype": dtype, "block_keys": bk, "warps": warps, "stages": stages,
               "key_splits": splits}
        try:
          recs.append(_timed_record(rec, fn, (q, k, v), read, reps, bw))
        except Exception as e:  # noqa: BLE001 - a tiling that does not fit is a result
          recs.append({**rec, "error": str(e)[:200]})
      del q, k, v
  return recs


def time_prefill(reps):
  import jax
  import jax.numpy as jnp
  from pallas_kernels import Route, chunk_attention, topk_scores
  recs = []
  c = SIZES["chunk"]
  for off in SIZES["offsets"]:
    for dtype in ("bfloat16",) + DTYPES:
      q, k, v = _inputs(5, 1, c, off + c, dtype)
      _, kc, vc = _inputs(6, 1, c, c, "bfloat16")
      kc, vc = jnp.swapaxes(kc, 1, 2), jnp.swapaxes(vc, 1, 2)
      fn = jax.jit(lambda q, k, v, kc, vc: chunk_attention(q, k, v, kc, vc, jnp.asarray([off]),
                                                           kv_layout="BHTD", route=Route()))
      med, _ = median_time(lambda: jax.block_until_ready(fn(q, k, v, kc, vc)), warmup=2,
                           reps=reps)
      flops = 4 * c * H * D * (off + c / 2)
      recs.append({"kernel": "prefill_chunk", "offset": off, "dtype": dtype, "ms": med * 1e3,
                   "tflops": flops / med / 1e12})
  for t in SIZES["topk_keys"]:
    for dtype in ("bfloat16",) + DTYPES:
      q, k, _ = _inputs(7, 1, SIZES["topk_rows"], t, dtype)
      fn = jax.jit(lambda q, k: topk_scores(q, k, 4, kv_layout="BHTD", scale=1.0, route=Route()))
      med, _ = median_time(lambda: jax.block_until_ready(fn(q, k)), warmup=2, reps=reps)
      recs.append({"kernel": "prefill_topk4", "keys": t, "dtype": dtype, "ms": med * 1e3,
                   "tflops": 2 * SIZES["topk_rows"] * H * D * t / med / 1e12})
  return recs


def time_topk_routes(reps):
  """ReAttention's prefill scoring over int8 keys by each route of KernelOptions.
  topk_dequantize_bytes: the Triton kernel over 8-bit tiles (0), one bf16 copy and the Mosaic
  kernel (a cap past the copy), the copy a half or a quarter of the keys at a time (segment_keys;
  0: the cap leaves too short a segment, the Triton route),
  against the bf16 keys; the share of rows whose top-4 equals the Triton route's."""
  import jax
  import numpy as np
  from pallas_kernels import KernelOptions, Route, topk_scores
  from pallas_kernels.read import copy_segment
  recs = []
  for t in SIZES["route_keys"]:
    copy = KV * t * D * 2  # the bf16 copy of one sequence's keys
    for dtype, cap in (("bfloat16", 0), ("int8", 0), ("int8", copy), ("int8", copy // 2),
                       ("int8", copy // 4)):
      q, k, _ = _inputs(7, 1, SIZES["topk_rows"], t, dtype)
      fn = jax.jit(lambda q, k, cap=cap: topk_scores(
          q, k, 4, kv_layout="BHTD", scale=1.0, route=Route(kernels=KernelOptions(topk_dequantize_bytes=cap))))
      med, _ = median_time(lambda: jax.block_until_ready(fn(q, k)), warmup=2, reps=reps)
      rec = {"kernel": "prefill_topk4_route", "keys": t, "dtype": dtype,
             "topk_dequantize_bytes": cap, "ms": med * 1e3,
             "segment_keys": copy_segment(cap // (KV * D * 2), t) if dtype == "int8" else None,
             "tflops": 2 * SIZES["topk_rows"] * H * D * t / med / 1e12}
      if dtype == "int8":
        idx = np.asarray(fn(q, k)[1])
        if cap == 0:
          triton = idx
        rec["rows_equal_triton_route"] = float(np.mean(np.all(idx == triton, axis=-1)))
      recs.append(rec)
      del q, k
  return recs


def main() -> None:
  global H, KV, D
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--only", default="", help="comma list of cases")
  p.add_argument("--heads", default=f"{H}/{KV}",
                 help="query heads / KV heads a device holds, e.g. 32/4: the 70B on model=2 "
                      "(default: the 8B on one device)")
  p.add_argument("--tile-keys", default="",
                 help="comma list of key counts for decode_tiles (default: 131072,1048576)")
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, kernels interpreted")
  args = p.parse_args()
  try:
    H, KV = (int(n) for n in args.heads.split("/"))
  except ValueError:
    p.error(f"--heads {args.heads!r}: give query heads / KV heads, e.g. 32/8")
  if H % KV:
    p.error(f"--heads {args.heads}: the KV heads must divide the query heads")
  backend = "auto"
  if args.smoke:
    H, KV, D = H // KV * 2, 2, 16
    SIZES.update(decode=(512,), chunk=64, offsets=(192,), topk_rows=64, topk_keys=(512,),
                 tile_keys=(256,), check=100, route_keys=(512,))
    backend, args.reps = "gpu", 1
  if args.tile_keys:
    SIZES["tile_keys"] = tuple(int(t) for t in args.tile_keys.split(","))
  bw = 1.0 if args.smoke else copy_bandwidth()
  cases = {"check_attention": lambda: check_attention(backend),
           "check_topk": lambda: check_topk(backend),
           "decode": lambda: time_decode(args.reps, bw), "prefill": lambda: time_prefill(args.reps),
           "decode_tiles": lambda: time_decode_tiles(args.reps, bw),
           "decode_products": lambda: time_decode_products(args.reps, bw),
           "topk_routes": lambda: time_topk_routes(args.reps)}
  failed = run_cases_to_json(cases, args.out, {**device_facts(), "copy_bw": bw,
                                               "heads": f"{H}/{KV}", "head_dim": D}, args.only)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
