"""A decode step's exact top-k (one query, 32 query / 8 kv heads, d 128, bf16, BHTD keys as
ReAttention caches them) by each GPU route of `topk_scores` (KernelOptions.topk_few_rows).

    python -m benchmarks.topk_decode --out $OUT/topk_decode.jsonl [--contexts 32768,131072,1048576]
        [--top-k 4]   # a comma list: each k against every context

"blocks": XLA's product and block maxima, then the pick in one Pallas kernel (topk_blocks.py);
"blocks_jnp": the same with the pick as jnp (a sort, a gather, a CUB top-k); "kernel": the fused
Triton kernel. Candidates 32 <= t < T - 4096 (ReAttention's). Each timing runs 32 calls in one
jitted loop, each depending on the last (microseconds per call, median of 10 loops after 2),
with the device kernels of 3 more loops (`kernels`, microseconds per call); `same_as_blocks`:
whether a route's indices equal the default's.
"""

from __future__ import annotations

import argparse

from benchmarks.common import (device_facts, device_kernel_times, median_time,
                               write_json)

CALLS = 32
ROUTES = ("blocks", "blocks_jnp", "kernel")


def measure(keys: int, top_k: int = 4) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from pallas_kernels import KernelOptions, Route, topk_scores

  ks = jax.random.split(jax.random.key(0), 2)
  q = jax.random.normal(ks[0], (1, 1, 32, 128), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, 8, keys, 128), jnp.bfloat16)
  lo, hi = jnp.array([32], jnp.int32), jnp.array([keys - 4096], jnp.int32)
  recs, first = [], None
  for route in ROUTES:
    options = KernelOptions(topk_few_rows=route)

    def call(q, k, options=options):
      return topk_scores(q, k, top_k, scale=1.0, valid_len=hi, exclude_prefix=lo,
                         kv_layout="BHTD", route=Route(backend="gpu", kernels=options))

    @jax.jit
    def loop(q, k, call=call):
      def body(_, acc):
        return acc + (call(q + (acc % 2).astype(q.dtype), k)[1][0, 0, 0, 0] > 0).astype(jnp.int32)
      return jax.lax.fori_loop(0, CALLS, body, jnp.int32(0))

    idx = jax.jit(call)(q, k)[1]
    first = idx if first is None else first
    run = lambda: jax.block_until_ready(loop(q, k))  # noqa: E731
    t, _ = median_time(run, warmup=2, reps=10)
    kernels = device_kernel_times(run, calls=3, per_call=CALLS)
    recs.append({"keys": keys, "top_k": top_k, "route": route, "us": t / CALLS * 1e6,
                 "same_as_blocks": bool(jnp.all(idx == first)),
                 "kernels": [{"kernel": x["kernel"][:60], "us": x["us"]} for x in kernels]})
  return recs


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--contexts", default="32768,131072,1048576")
  p.add_argument("--top-k", default="4")
  p.add_argument("--out", default="topk_decode.jsonl")
  args = p.parse_args()
  for keys in map(int, args.contexts.split(",")):
    for rec in (r for k in map(int, args.top_k.split(",")) for r in measure(keys, k)):
      rec.update(device_facts())
      write_json(args.out, rec)
      print({k: v for k, v in rec.items() if k != "kernels"}, flush=True)


if __name__ == "__main__":
  main()
