"""Where the Mosaic top-k kernel's time goes over 8-bit keys: variants with one stage left out.

    python -m experiments.topk8_costs --out $OUT/topk8_costs.json [--keys 131072]

No GPU counters are read; the time of a stage is the difference between a variant that does it
and one that leaves it out (the device method's "time variants that leave one stage out").
512 queries x `keys` keys, 32 query / 8 KV heads, d=128, top 4 and top 1, on one GPU:
  full          topk_scores as a run takes it (bf16 keys; 8-bit keys on the tensor cores);
  max_only      the selection replaced by a running row max (KernelOptions topk_selection);
  no_scale      max_only without the per-key scale (its SMEM row, broadcast and multiply);
  no_convert    no_scale without the int32 -> fp32 conversion (int8: a bitcast instead);
  full_no_scale the full selection without the per-key scale (what keys requantized to one scale
                per tile or per tensor would cost).
Results of every variant but `full` are meaningless (wrong scores); only their times count.
--configs times `full` only, over Mosaic configs block_q x block_kv x stages (e.g. 64x256x3),
bf16 keys at the default config beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import jax
import jax.numpy as jnp
from jax import lax

from jax_longctx.app.bench_kernels import normal
from jax_longctx.app.bench_measure import device_facts, timed
from pallas_kernels import Route, mgpu_common, quant, topk_scores
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions

H, KV, D, LQ = 32, 8, 128, 512
PRODUCTS = Route(backend="gpu", kernels=KernelOptions(topk_eight_bit="products"))


@contextlib.contextmanager
def patched(no_scale: bool, no_convert: bool):
  """The kernel's per-key scale and / or int32 conversion left out (trace-time patches)."""
  columns, convert = mgpu_common.Ops.columns, mgpu_common.int_to_f32
  if no_scale:
    mgpu_common.Ops.columns = lambda self, x, shape: jnp.float32(1.0)
  if no_convert:
    mgpu_common.int_to_f32 = lambda x: lax.bitcast_convert_type(x, jnp.float32)
  try:
    yield
  finally:
    mgpu_common.Ops.columns, mgpu_common.int_to_f32 = columns, convert


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--keys", type=int, default=131072)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--configs", default="", help="comma list of BQxBKxSTAGES: full only")
  args = p.parse_args()
  if args.configs:
    return configs(args)
  kq, kk = jax.random.split(jax.random.PRNGKey(0))
  q = normal(kq, (1, LQ, H, D))
  kf = normal(kk, (1, args.keys, KV, D), jnp.float32)
  keys = {"bf16": kf.astype(jnp.bfloat16), "int8": quant.quantize(kf, "int8"),
          "float8_e4m3fn": quant.quantize(kf, "float8_e4m3fn")}
  variants = {"full": ("exact", False, False), "max_only": ("max_only", False, False),
              "no_scale": ("max_only", True, False), "no_convert": ("max_only", True, True),
              "full_no_scale": ("exact", True, False)}
  records = []
  flops = 2 * LQ * args.keys * D * H
  for top_k in (4, 1):
    for name, k in keys.items():
      for variant, (selection, no_scale, no_convert) in variants.items():
        if name == "bf16" and variant not in ("full", "max_only"):
          continue
        if name != "int8" and variant == "no_convert":
          continue
        route = Route(backend="gpu", kernels=KernelOptions(topk_selection=selection,
                                                           topk_eight_bit="products"))
        with patched(no_scale, no_convert):
          fn = jax.jit(lambda q, k, route=route: topk_scores(q, k, top_k, scale=D ** -0.5,
                                                             route=route))
          ms = timed(fn, q, k, reps=args.reps, inner=3) * 1e3
        rec = {"keys": name, "variant": variant, "top_k": top_k, "kv_len": args.keys, "ms": ms,
               "tflops": flops / ms / 1e9}
        print(json.dumps(rec), flush=True)
        records.append(rec)
  with open(args.out, "w") as f:
    json.dump({"facts": device_facts(), "records": records}, f, indent=1)


def configs(args):
  kq, kk = jax.random.split(jax.random.PRNGKey(0))
  q = normal(kq, (1, LQ, H, D))
  kf = normal(kk, (1, args.keys, KV, D), jnp.float32)
  keys = {"int8": quant.quantize(kf, "int8"), "float8_e4m3fn": quant.quantize(kf, "float8_e4m3fn")}
  points = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
  records, flops = [], 2 * LQ * args.keys * D * H
  for top_k in (4, 1):
    runs = [("bf16", kf.astype(jnp.bfloat16), None)]
    runs += [(n, k, c) for n, k in keys.items() for c in points]
    for name, k, c in runs:
      tiling = None if c is None else Tiling(impl="mosaic", block_rows=c[0], block_keys=c[1],
                                             num_stages=c[2])
      fn = jax.jit(lambda q, k, tiling=tiling: topk_scores(
          q, k, top_k, scale=D ** -0.5, route=PRODUCTS, tiling=tiling))
      try:
        ms = timed(fn, q, k, reps=args.reps, inner=3) * 1e3
        rec = {"keys": name, "config": c, "top_k": top_k, "kv_len": args.keys, "ms": ms,
               "tflops": flops / ms / 1e9}
      except Exception as e:  # a config that does not lower or fit: say so, go on
        rec = {"keys": name, "config": c, "top_k": top_k, "error": f"{type(e).__name__}: {e}"[:300]}
      print(json.dumps(rec), flush=True)
      records.append(rec)
  with open(args.out, "w") as f:
    json.dump({"facts": device_facts(), "records": records}, f, indent=1)


if __name__ == "__main__":
  main()
