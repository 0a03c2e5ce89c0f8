"""The prefill top-k's stage 2 alone (topk_segments.best_keys) over its launch settings.

    python -m benchmarks.topk_rescore --contexts 8192,32768 --out $OUT/topk_rescore.jsonl

A 512-query chunk of the 8B shape (32 query / 8 kv heads, d 128, bf16; 2,048 rows a kv head)
with top-4: each row scores its 4 segments' 64 keys again, gathered from a BHTD cache of
`context` keys (random segments among the candidates). For each (rows a program, warps) this
times the kernel (20 calls in one jitted loop, median of 10 after warm-up) and checks it
returns the keys the first setting returns.
"""

from __future__ import annotations

import argparse

from benchmarks.common import device_facts, median_time, write_json

CALLS = 20
SETTINGS = [(8, 4), (1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 2), (8, 8), (16, 8)]


def measure(context: int, top_k: int = 4) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.topk import topk_segments

  kvh, rows, d, seg = 8, 2048, 128, topk_segments.SEGMENT
  keys = jax.random.split(jax.random.key(context), 2)
  k = jax.random.normal(keys[0], (1, kvh, context, d), jnp.bfloat16)
  qr = jax.random.normal(keys[1], (1, kvh, rows, d), jnp.bfloat16)
  rng = np.random.default_rng(0)
  n_seg = (context - 4096 - 32) // seg
  firsts = np.stack([rng.choice(n_seg, top_k, replace=False) for _ in range(kvh * rows)])
  firsts = 32 + seg * firsts.reshape(1, kvh, rows, top_k)
  cand = jnp.asarray((firsts[..., None] + np.arange(seg)).reshape(1, kvh, rows, -1), jnp.int32)
  out = []
  base = None
  for r, w in SETTINGS:
    def one(q, kk, c, r=r, w=w):
      return topk_segments.best_keys(q, kk, c, top_k, scale=None, kv_layout="BHTD",
                                     interpret=False, rows=r, warps=w)

    @jax.jit
    def looped(q, kk, c, one=one):  # CALLS calls in one dispatch; each depends on the last
      def body(i, acc):
        return acc + one(q + (acc % 2).astype(q.dtype), kk, c)[1][0, 0, 0, 0]
      return jax.lax.fori_loop(0, CALLS, body, jnp.int32(0))

    got = jax.jit(one)(qr, k, cand)
    base = got if base is None else base
    t, _ = median_time(lambda: jax.block_until_ready(looped(qr, k, cand)), warmup=2, reps=10)
    out.append({"context": context, "rows": r, "warps": w, "ms": t / CALLS * 1e3,
                "same": bool(jnp.array_equal(got[1], base[1]))})
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--contexts", default="8192,32768")
  p.add_argument("--out", default="topk_rescore.jsonl")
  args = p.parse_args()
  for context in map(int, args.contexts.split(",")):
    for rec in measure(context):
      rec.update(device_facts())
      write_json(args.out, rec)
      print(rec, flush=True)


if __name__ == "__main__":
  main()
