"""A whole prompt's attention run chunk by chunk against one causal cuDNN call, on one GPU.

    python -m benchmarks.prefill_attention --lengths 16384,32768 --chunks 512,2048,4096 \
        --out $OUT/prefill_attention.jsonl

The `chunked_prefill` case of `jax-longctx bench kernels` at the lengths and chunks given
(jax_longctx/app/bench_kernels.py: bench_chunked_prefill). One layer's shapes (32 query / 8 KV
heads, d=128, bf16, batch 1; the cache [B, KV, T, d] as the model keeps it). Each route attends
every chunk of the prompt in one jitted `lax.fori_loop` (the chunk's offset traced, as in the
model's prefill): `chunk_attention` through cuDNN (two calls merged by LSE) and through the
Pallas flash kernel; the anchor is one causal cuDNN call over the whole prompt
(`jax.nn.dot_product_attention`). TFLOP/s count causal attention's FLOPs (2 * L^2 * H * d: QK
and PV over the lower triangle) for every route. Before timing, each route's output is checked
against the anchor on the device (max |diff|, bf16).
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import common
from jax_longctx.app.bench_kernels import bench_chunked_prefill


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--lengths", default="16384,32768")
  p.add_argument("--chunks", default="512,1024,2048,4096")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--out", default="prefill_attention.jsonl")
  args = p.parse_args()
  facts = common.device_facts()
  chunks = [int(c) for c in args.chunks.split(",")]
  for length in map(int, args.lengths.split(",")):
    for rec in bench_chunked_prefill(jax.random.key(length), length, chunks, args):
      rec.update(facts)
      common.write_json(args.out, rec)
      print(rec, flush=True)


if __name__ == "__main__":
  main()
