"""The fused score + top-k over bf16, int8 and E4M3 keys, called a few times each: the program
that Nsight Compute profiles to say what holds the 8-bit top-k under its tensor-core rate
(BENCHMARKS.md, "The 8-bit top-k under Nsight Compute"). A ReAttention prefill chunk's scoring:
512 queries, 32 query heads over 8 KV heads, d 128, top 4, --keys keys, batch 1, normal random
inputs, the route's defaults (strided segments, the 8-bit products). On the GPU machine:

    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none -k regex:mosaic -c 6 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
        --section WarpStateStats --section Occupancy --section LaunchStats --csv --page details \
        python -m benchmarks.topk_ncu --keys 131072 > $OUT/ncu.csv

`-k regex:mosaic` keeps the Mosaic kernels (stage 1 of the top-k; stage 2 is a Triton kernel
named `kernel`) and `-c` stops after them. Each dtype's call runs --calls times after its
compile, so the report holds each stage-1 kernel --calls times, in --dtypes' order;
experiments/topk_columns.py times the same calls without the profiler. `--kernel-option
KEY=VALUE` (repeatable): the calls under those KernelOptions.
"""

from __future__ import annotations

import argparse
import sys


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--keys", type=int, default=1 << 17)
  p.add_argument("--calls", type=int, default=2)
  p.add_argument("--top-k", type=int, default=4)
  p.add_argument("--dtypes", default="bfloat16,int8,float8_e4m3fn")
  p.add_argument("--kernel-option", action="append", default=[], metavar="KEY=VALUE")
  args = p.parse_args()
  import jax
  import jax.numpy as jnp
  from jax_longctx.app.bench_kernels import normal
  from jax_longctx.app.bench_measure import kernel_options
  from pallas_kernels import Route, quant, topk_scores
  route = Route(backend="gpu", kernels=kernel_options(args.kernel_option))
  kq, kk = jax.random.split(jax.random.PRNGKey(0))
  q = normal(kq, (1, 512, 32, 128))
  for dtype in args.dtypes.split(","):
    kf = normal(kk, (1, args.keys, 8, 128), jnp.float32)
    k = kf.astype(jnp.bfloat16) if dtype == "bfloat16" else quant.quantize(kf, dtype)
    k = jax.block_until_ready(k)
    del kf
    fn = jax.jit(lambda q, k: topk_scores(q, k, args.top_k, scale=128 ** -0.5, route=route))
    for _ in range(args.calls):
      jax.block_until_ready(fn(q, k))
    print(f"{dtype}: {args.calls} calls over {args.keys} keys", file=sys.stderr, flush=True)
    del k


if __name__ == "__main__":
  main()
