"""Pallas kernels against their anchors on one GPU, in one call: `jax-longctx bench kernels` with
this script's extras (the ReAttention authors' top-k beside ours, the tiling sweep).

    python -m benchmarks.kernels --out $OUT/kernels.jsonl [--quick] [--authors-topk PATH] [--smoke]

The cases and their anchors are jax_longctx/app/bench_kernels.py's: each GPU kernel first
checked against its jnp reference on the device, then timed (jitted, warmed up, median of
`--reps` groups of back-to-back calls) beside einsum + jax.lax.top_k, cuDNN attention or the
device-to-device copy bandwidth (torch copy_) measured in the same run. Cases are independent:
one that fails is recorded with its error and the rest still run.

--authors-topk PATH: the ReAttention authors' Triton score + top-k (benchmarks/authors_topk.py
says where it comes from; not vendored) timed beside ours in each top-1 / top-4 case, on the same
inputs: authors_ms, authors_tflops, ours_over_authors (ms ratio) and the share of rows each
kernel selects exactly (authors_rows_exact, ours_rows_exact). Without torch CUDA + triton or the
file, one stderr line says so and those fields are absent.
--sweep: tiling variants (benchmarks/kernel_sweep.py) in place of the cases.
--smoke: the top-k cases at tiny shapes on a CPU, the kernels interpreted: checks the script
before it spends device time; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json

import jax

from benchmarks import authors_topk, common
from benchmarks.kernel_sweep import sweep_cases
from jax_longctx.app.bench_kernels import kernel_cases, topk_shapes  # noqa: F401 - tests read it


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
  p.add_argument("--only", default="", help="comma list of case names to run")
  p.add_argument("--sweep", action="store_true", help="time tiling variants (kernel_sweep.py)")
  p.add_argument("--authors-topk", metavar="PATH", default="",
                 help="the ReAttention authors' einsum_topk_fuse20240907.py (an anchor)")
  p.add_argument("--smoke", action="store_true", help="top-k cases, tiny shapes, on CPU")
  args = p.parse_args()
  if args.smoke:
    args.reps, args.inner = 1, 1
  args.bw = None if args.smoke else common.copy_bandwidth()
  authors = authors_topk.load(args.authors_topk) if args.authors_topk else None
  args.versus = authors_topk.versus(authors) if authors is not None else None
  facts = {**common.device_facts(), "copy_bw": args.bw}
  print(json.dumps(facts), flush=True)
  key = jax.random.PRNGKey(0)
  cases = (sweep_cases(key, args) if args.sweep and not args.smoke
           else kernel_cases(key, args, smoke=args.smoke))

  def record(rec):
    rec.update(facts)
    common.write_json(args.out, rec)
    print(common.printable(rec, facts), flush=True)

  common.run_cases(cases, args.only, record)


if __name__ == "__main__":
  main()
