"""topk_scores with strided segments ("columns") against contiguous ones ("segments"), and the
rescoring stage alone, in one run.

    python -m experiments.topk_columns --out $OUT/topk_columns.jsonl [--keys 131072,1048576]

512 queries x `keys` keys, 32 query / 8 KV heads, d=128, top 4 (ReAttention's scoring of a
prefill chunk), keys bf16, int8 and E4M3 (8-bit on the tensor cores), normal random inputs:
  time      median ms of topk_scores after warm-up per (keys, KernelOptions.topk_many_rows,
            window of the strided segments, --variants: KernelOptions / Tiling of the Mosaic
            kernel, e.g. its compute warpgroups), with the config that ran;
  exact     integer inputs (every score exact): each variant's indices and scores against the
            reference's, bf16 and int8 keys (the GPU check of the kernel's forms);
  agree     int8 at 32K keys: the share of (query, head) rows whose chosen set equals the
            dequantize-first reference's, per selection (the quantized queries reorder near-ties,
            which stage 2's exact scores of more candidates undo);
  stage2    topk_segments.best_keys alone: 2,048 rows a KV head at 128K keys, 64, 128 or
            256 candidates a row, on 1, 2, 4 or 8 warps;
  parts     "columns" at the longest `keys` with its insertions replaced by a running max
            (results meaningless): what the sorted sets' upkeep costs;
  splits    KernelOptions.topk_balanced_splits on and off at the longest `keys` for the query /
            KV heads of the 3B shape (24 / 8) and Qwen2.5-Coder-1.5B (12 / 2), bf16 and int8,
            and on integer inputs (every score exact) whether the balanced result equals the
            reference's;
  words     stage 2 over keys of 2^31 elements (2M keys of 8 KV heads): XLA's gathers
            (best_keys_xla, the route by default) against the Triton kernel over the keys as
            int32 words (KernelOptions.topk_rescore_words), int8 and bf16, 1,536 rows a KV head
            (a 512-token chunk of 24 / 8 heads) and 256 candidates a row; and on integer inputs
            whether the two agree exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp

from jax_longctx.app.bench_kernels import normal, small_ints
from jax_longctx.app.bench_measure import device_facts, timed
from pallas_kernels import Route, quant, topk_scores
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from pallas_kernels.topk import mgpu_select, topk_segments
from pallas_kernels.topk import topk as topk_module

H, KV, D, LQ = 32, 8, 128, 512
WORDS_KEYS = 1 << 21  # 2^31 elements over 8 KV heads of 128


def route(many_rows, window=0, **options):
  return Route(backend="gpu", kernels=KernelOptions(
      topk_eight_bit="products", topk_many_rows=many_rows, topk_column_window=window or 0,
      **options))


def variants(args) -> dict:
  """--variants: name -> {"options": KernelOptions fields, "tiling": Tiling fields (impl
  "mosaic")}; {"kept": {}} when not given."""
  named = json.loads(args.variants) if args.variants else {"kept": {}}
  return {name: (v.get("options", {}), Tiling(impl="mosaic", **v["tiling"]) if v.get("tiling")
                 else None) for name, v in named.items()}


def emit(out, rec):
  print(json.dumps(rec), flush=True)
  out.write(json.dumps(rec) + "\n")
  out.flush()


def stage2(out, key, args):
  kq, kk, kc = jax.random.split(key, 3)
  t = 131072
  qr = normal(kq, (1, KV, 2048, D))
  kf = normal(kk, (1, t, KV, D), jnp.float32)
  for name, k in (("int8", quant.quantize(kf, "int8")), ("bf16", kf.astype(jnp.bfloat16))):
    for n in (64, 128, 256):
      cand = jax.random.randint(kc, (1, KV, 2048, n), 0, t, jnp.int32)
      for warps in (1, 2, 4, 8):
        fn = jax.jit(lambda qr, k, c, w=warps: topk_segments.best_keys(
            qr, k, c, 4, scale=0.1, kv_layout="BTHD", interpret=False, warps=w))
        emit(out, {"case": "stage2", "keys": name, "n": n, "warps": warps,
                   "ms": timed(fn, qr, k, cand, reps=args.reps, inner=3) * 1e3})


def agree(out, key, args):
  kq, kk = jax.random.split(key)
  q = normal(kq, (1, LQ, H, D))
  k = quant.quantize(normal(kk, (1, 32768, KV, D), jnp.float32), "int8")
  ri = topk_scores(q, k, 4, scale=D ** -0.5, route=Route(backend="reference"))[1]
  for many_rows, (label, (options, tiling)) in itertools.product(("segments", "columns"),
                                                                 variants(args).items()):
    i = topk_scores(q, k, 4, scale=D ** -0.5, route=route(many_rows, **options),
                    tiling=tiling)[1]
    emit(out, {"case": "agree", "keys": "int8", "kv_len": 32768, "many_rows": many_rows,
               "variant": label,
               "rows_equal": float(jnp.mean(jnp.all(jnp.sort(i, -1) == jnp.sort(ri, -1), -1)))})


def exact(out, key, args):
  """Integer inputs (every score exact; int8 keys and the queries' 8-bit rows at scale 1, one
  query channel at +-127): each --variants' result against the
  reference, indices and scores equal: 2 sequences of 65,536 and 40,000 keys, a prefix and a
  suffix excluded, 512 queries, top 4."""
  kq, kk = jax.random.split(key)
  t = 65536
  q = small_ints(kq, (2, LQ, H, D)).astype(jnp.float32)
  q = q.at[..., 5].set(127 * jnp.sign(q[..., 5])).astype(jnp.bfloat16)  # 8-bit rows at scale 1
  kf = small_ints(kk, (2, t, KV, D)).astype(jnp.float32)
  kw = dict(valid_len=jnp.array([t, 40000]), exclude_prefix=7, exclude_suffix=300)
  want = topk_scores(q, kf.astype(jnp.bfloat16), 4, route=Route(backend="reference"), **kw)
  keys = {"bf16": kf.astype(jnp.bfloat16),
          "int8": quant.Quantized(kf.astype(jnp.int8), jnp.ones((2, t, KV, 1), jnp.float32))}
  for (name, k), (label, (options, tiling)) in itertools.product(keys.items(),
                                                                 variants(args).items()):
    r = route("columns", **options)
    got = topk_scores(q, k, 4, route=r, tiling=tiling, **kw)
    config = topk_module._mosaic_config(r.variant(), q, k, LQ * H // KV, 4, tiling, keys=t,
                                        options=r.kernels)
    emit(out, {"case": "exact", "keys": name, "variant": label,
               "config": config and dataclasses.asdict(config),
               "equal": bool(jnp.all(got[1] == want[1]) & jnp.all(got[0] == want[0]))})


def times(out, key, args):
  windows = [int(w) for w in args.windows.split(",")]
  for t in (int(x) for x in args.keys.split(",")):
    kq, kk = jax.random.split(jax.random.fold_in(key, t))
    q = normal(kq, (1, LQ, H, D))
    kf = normal(kk, (1, t, KV, D), jnp.float32)
    keys = {"bf16": kf.astype(jnp.bfloat16), "int8": quant.quantize(kf, "int8"),
            "float8_e4m3fn": quant.quantize(kf, "float8_e4m3fn")}
    del kf
    for name, k in keys.items():
      for (many_rows, window), (label, (options, tiling)) in itertools.product(
          ([("segments", None)] if "segments" in args.selections else []) + [
              ("columns", w) for w in windows if "columns" in args.selections],
          variants(args).items()):
        r = route(many_rows, window, **options)
        config = topk_module._mosaic_config(r.variant(), q, k, LQ * H // KV, 4, tiling, keys=t,
                                            options=r.kernels)
        rec = {"case": "time", "kv_len": t, "keys": name, "many_rows": many_rows,
               "window": window, "top_k": 4, "variant": label,
               "config": config and dataclasses.asdict(config)}
        if config is None:  # the Mosaic kernel cannot take it: not timed (Triton would run)
          emit(out, dict(rec, unsupported=True))
          continue
        fn = jax.jit(lambda q, k, r=r, tiling=tiling: topk_scores(
            q, k, 4, scale=D ** -0.5, route=r, tiling=tiling))
        ms = timed(fn, q, k, reps=args.reps, inner=3) * 1e3
        emit(out, dict(rec, ms=ms, tflops=2 * LQ * t * D * H / ms / 1e9))
    del keys


def parts(out, key, args):
  t = max(int(x) for x in args.keys.split(","))
  kq, kk = jax.random.split(jax.random.fold_in(key, t))
  q = normal(kq, (1, LQ, H, D))
  kf = normal(kk, (1, t, KV, D), jnp.float32)
  keys = {"bf16": kf.astype(jnp.bfloat16), "int8": quant.quantize(kf, "int8")}
  del kf
  insert = mgpu_select._insert
  for upkeep in ("sorted sets", "running max only"):
    if upkeep != "sorted sets":
      mgpu_select._insert = lambda vals, firsts, m, first: (  # noqa: E731
          [jax.numpy.maximum(vals[0], m)] + vals[1:], firsts)
    jax.clear_caches()
    for name, k in keys.items():
      fn = jax.jit(lambda q, k: topk_scores(q, k, 4, scale=D ** -0.5, route=route("columns")))
      emit(out, {"case": "parts", "kv_len": t, "keys": name, "upkeep": upkeep,
                 "ms": timed(fn, q, k, reps=args.reps, inner=3) * 1e3})
  mgpu_select._insert = insert
  jax.clear_caches()


def splits(out, key, args):
  t = max(int(x) for x in args.keys.split(","))
  for h, kv in ((24, 8), (12, 2)):
    kq, kk = jax.random.split(jax.random.fold_in(key, h))
    q = normal(kq, (1, LQ, h, D))
    kf = normal(kk, (1, t, kv, D), jnp.float32)
    keys = {"bf16": kf.astype(jnp.bfloat16), "int8": quant.quantize(kf, "int8")}
    del kf
    for name, k in keys.items():
      for balanced in (True, False):
        r = Route(backend="gpu", kernels=KernelOptions(topk_eight_bit="products",
                                                       topk_balanced_splits=balanced))
        fn = jax.jit(lambda q, k, r=r: topk_scores(q, k, 4, scale=D ** -0.5, route=r))
        emit(out, {"case": "splits", "kv_len": t, "heads": h, "kv_heads": kv, "keys": name,
                   "balanced": balanced, "ms": timed(fn, q, k, reps=args.reps, inner=3) * 1e3})
    del keys
    qi = small_ints(kq, (2, LQ, h, D)).astype(jnp.bfloat16)
    ki = small_ints(kk, (2, 65536, kv, D)).astype(jnp.bfloat16)
    kw = dict(valid_len=jnp.array([65536, 40000]), exclude_prefix=100, exclude_suffix=4096)
    got = topk_scores(qi, ki, 4, route=route("columns"), **kw)
    want = topk_scores(qi, ki, 4, route=Route(backend="reference"), **kw)
    emit(out, {"case": "splits_exact", "heads": h, "kv_heads": kv,
               "equal": bool(jnp.all(got[1] == want[1]) & jnp.all(got[0] == want[0]))})


def words(out, key, args):
  t, rows, n = WORDS_KEYS, 1536, 256
  kq, kk = jax.random.split(key)
  # distinct candidates a row (steps of 8,191 < t / 255), some rows short of n (-1)
  start = jax.random.randint(kq, (1, KV, rows, 1), 0, t, jnp.int32)
  cand = (start + 8191 * jnp.arange(n, dtype=jnp.int32)) % t
  cand = jnp.where(jnp.arange(n) < n - (start % 40), cand, -1)
  for exact in (False, True):
    qr = (small_ints(kq, (1, KV, rows, D)) if exact else normal(kq, (1, KV, rows, D))
          ).astype(jnp.bfloat16)
    kf = (small_ints(kk, (1, t, KV, D)) if exact else normal(kk, (1, t, KV, D))
          ).astype(jnp.float32)
    for name in ("int8", "bf16"):
      k = (kf.astype(jnp.bfloat16) if name == "bf16" else  # integers at scale 1: exact
           quant.Quantized(kf.astype(jnp.int8), jnp.ones((1, t, KV, 1), jnp.float32)) if exact
           else quant.quantize(kf, "int8"))
      xla = jax.jit(lambda qr, k, c: topk_segments.best_keys_xla(
          qr, k, c, 4, scale=None, kv_layout="BTHD"))
      tri = jax.jit(lambda qr, k, c, w=topk_segments.rescore_warps(n, name == "int8"): (
          topk_segments.best_keys(qr, k, c, 4, scale=None, kv_layout="BTHD", interpret=False,
                                  warps=w, packed=True)))
      if exact:
        a, b = xla(qr, k, cand), tri(qr, k, cand)
        emit(out, {"case": "words_exact", "keys": name, "equal": bool(
            jnp.all(a[0] == b[0]) & jnp.all(a[1] == b[1]))})
      else:
        for route_name, fn in (("xla", xla), ("words", tri)):
          emit(out, {"case": "words", "kv_len": t, "keys": name, "route": route_name,
                     "ms": timed(fn, qr, k, cand, reps=args.reps, inner=3) * 1e3})
      del k
    del kf


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--keys", default="131072,524288,1048576")
  p.add_argument("--windows", default="0", help="KernelOptions.topk_column_window values "
                 "(0: the default, by the key axis)")
  p.add_argument("--selections", default="segments,columns")
  p.add_argument("--variants", default="", help='JSON: name -> {"options": {KernelOptions '
                 'fields}, "tiling": {Tiling fields}} (agree, time), e.g. \'{"two": {}, '
                 '"three": {"options": {"topk_warpgroups": 3}}}\'')
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--cases", default="agree,time,stage2")
  args = p.parse_args()
  key = jax.random.PRNGKey(0)
  with open(args.out, "w") as out:
    emit(out, {"facts": device_facts()})
    cases = {"agree": agree, "exact": exact, "time": times, "stage2": stage2, "parts": parts,
             "splits": splits, "words": words}
    for case in args.cases.split(","):
      cases[case](out, key, args)


if __name__ == "__main__":
  main()
