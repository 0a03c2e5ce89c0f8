"""Split-K decode attention over bf16, int8, E4M3 and 4-bit K/V, called a few times each: the
program that Nsight Compute profiles to say what holds the 8-bit decode kernel under the copy
bandwidth (BENCHMARKS.md, "Profiled: what holds int8 decode"). One query token, Llama-3.1-8B's
attention shape (32 query heads over 8 KV heads, d 128), --batch sequences (1), --keys keys. On the
GPU machine:

    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none -k regex:kernel -c 12 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section LaunchStats --csv --page details \
        python -m benchmarks.decode_ncu --keys 1048576 > $OUT/ncu.csv

`-k regex:kernel` keeps the Pallas kernels (the split kernel is named `kernel`, the merge
`_kernel`) and `-c` stops after them: without both, ncu replayed every launch of the JAX program
(the inputs' generation too) and reported nothing in 400 s. Each dtype's kernel runs --calls times
after its compile, so the report holds each kernel --calls times; quant_kernels.py times the same
calls without the profiler. `--dtypes int4`: the kernel reading the 4-bit tiles (int4_decode; its
cache as benchmarks/int4_kernels.py builds it), timed there. `--kernel-option KEY=VALUE`
(repeatable): the calls under those KernelOptions (e.g. `decode_row_groups=true`), so two
invocations profile a kernel with and without an option.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import int4_kernels
from benchmarks.quant_kernels import _inputs


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--keys", type=int, default=1 << 20)
  p.add_argument("--calls", type=int, default=2)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--dtypes", default="bfloat16,int8,float8_e4m3fn")
  p.add_argument("--kernel-option", action="append", default=[], metavar="KEY=VALUE")
  args = p.parse_args()
  import jax
  import jax.numpy as jnp
  from jax_longctx.app.bench_measure import kernel_options
  from pallas_kernels import Route, flash_attention
  route = Route(kernels=kernel_options(args.kernel_option))
  t = args.keys
  pos = jnp.full((args.batch,), t - 1, jnp.int32)
  for dtype in args.dtypes.split(","):
    if dtype == "int4":
      q, k, v = int4_kernels._cache(1, args.batch, t, dtype)
    else:
      q, k, v = _inputs(4, args.batch, 1, t, dtype)
    q, k, v = jax.block_until_ready((q, k, v))
    attn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, q_offset=pos,
                                                   kv_len=pos + 1, kv_layout="BHTD", route=route))
    for _ in range(args.calls):
      jax.block_until_ready(attn(q, k, v))
    print(f"{dtype}: {args.calls} calls over {t} keys", file=sys.stderr, flush=True)
    del q, k, v


if __name__ == "__main__":
  main()
