"""A whole prompt's attention run chunk by chunk against one causal cuDNN call, on one GPU.

    python benchmarks/prefill_attention.py --lengths 16384,32768 --chunks 512,2048,4096 \
        --out $OUT/prefill_attention.jsonl

One layer's shapes (32 query / 8 KV heads, d=128, bf16, batch 1; the cache [B, KV, T, d] as the
model keeps it). Each route attends every chunk of the prompt in one jitted `lax.fori_loop` (the
chunk's offset traced, as in the model's prefill): `chunk_attention` through cuDNN (two calls
merged by LSE) and through the Pallas flash kernel; the anchor is one causal cuDNN call over the
whole prompt (`jax.nn.dot_product_attention`). TFLOP/s count causal attention's FLOPs
(2 * L^2 * H * d: QK and PV over the lower triangle) for every route. Before timing, each route's
output is checked against the anchor on the device (max |diff|, bf16).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.kernels import normal, timed  # noqa: E402
from pallas_kernels import chunk_attention  # noqa: E402

H, KV, D = 32, 8, 128


def chunked(q, k, v, *, chunk: int, use_cudnn: bool):
  """Every chunk of q [1, L, H, d] over the cache k/v [1, KV, L, d]; out [1, L, H, d]."""
  length = q.shape[1]

  def body(i, out):
    off = i * chunk
    qc = jax.lax.dynamic_slice_in_dim(q, off, chunk, axis=1)
    kc = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(k, off, chunk, axis=2), 1, 2)
    vc = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(v, off, chunk, axis=2), 1, 2)
    o, _ = chunk_attention(qc, k, v, kc, vc, off, kv_layout="BHTD", use_cudnn=use_cudnn)
    return jax.lax.dynamic_update_slice_in_dim(out, o, off, axis=1)

  return jax.lax.fori_loop(0, length // chunk, body, jnp.zeros_like(q))


def one_call(q, k, v):
  return jax.nn.dot_product_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                      is_causal=True, implementation="cudnn")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--lengths", default="16384,32768")
  p.add_argument("--chunks", default="512,1024,2048,4096")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--out", default="prefill_attention.jsonl")
  args = p.parse_args()
  facts = common.device_facts()
  for length in map(int, args.lengths.split(",")):
    keys = jax.random.split(jax.random.key(length), 3)
    q = normal(keys[0], (1, length, H, D))
    k, v = (normal(x, (1, KV, length, D)) for x in keys[1:])
    flops = 2.0 * length * length * H * D
    anchor = jax.jit(one_call)
    ref = anchor(q, k, v)
    t_one = timed(anchor, q, k, v, reps=args.reps, inner=1)
    base = {"length": length, **facts, "cudnn_one_call_ms": t_one * 1e3,
            "cudnn_one_call_tflops": flops / t_one / 1e12}
    for chunk in map(int, args.chunks.split(",")):
      for route, use_cudnn in (("cudnn_chunks", True), ("pallas_chunks", False)):
        rec = {**base, "chunk": chunk, "route": route}
        try:
          fn = jax.jit(lambda q, k, v, c=chunk, u=use_cudnn: chunked(q, k, v, chunk=c,
                                                                     use_cudnn=u))
          got = fn(q, k, v)
          rec["max_abs_diff_vs_one_call"] = float(jnp.max(jnp.abs(
              got.astype(jnp.float32) - ref.astype(jnp.float32))))
          t = timed(fn, q, k, v, reps=args.reps, inner=1)
          rec.update(ms=t * 1e3, tflops=flops / t / 1e12, of_one_call=t_one / t)
        except Exception as e:  # noqa: BLE001  (one failing case is a result, not a crash)
          rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        common.write_json(args.out, rec)
        print(rec, flush=True)


if __name__ == "__main__":
  main()
