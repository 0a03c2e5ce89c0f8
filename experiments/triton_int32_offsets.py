"""Which decode-step kernel faults over an int8 cache of more than 2^31 elements, one case a
process (a fault poisons the process's GPU context).

    for c in write gathered topk_decode flash_decode; do
      python -m experiments.triton_int32_offsets $c >> $OUT/triton_int32_offsets.jsonl; done

The cache: [1, 8, 2M + 64, 128] int8 with its scales (the 3B shape's at 2M tokens, BHTD), one
JSON line a case: ok, or the error. write: a one-token cache write at the last slot; gathered:
gathered attention over its last 256 keys; topk_decode: a decode step's top-64; flash_decode:
one-token attention over all of it. Written to find why ReAttention's 2M-token decode faulted
(BENCHMARKS.md "The top-k's segments strided by column"); the routes past 2^31 elements
(gpu.triton_indexable) came of it. Run with the limit in place, write and gathered no longer
reach their Triton kernels.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import (Route, flash_attention, gathered_attention, quant, topk_scores,
                            write_one_token)

T, KV, D, H = 2097152 + 64, 8, 128, 24


def cache(key):
  values = jax.random.randint(key, (1, KV, T, D), -127, 127, jnp.int8)
  return quant.Quantized(values, jnp.ones((1, KV, T, 1), jnp.float32))


def run(case: str):
  route, key = Route(backend="gpu"), jax.random.PRNGKey(0)
  q = jax.random.normal(key, (1, 1, H, D), jnp.bfloat16)
  if case == "write":
    new = jax.random.normal(key, (1, KV, D), jnp.bfloat16)
    step = jax.jit(lambda k, v, p: write_one_token(k, v, p, new, new, route=route),
                   donate_argnums=(0, 1))
    k, _ = step(cache(key), cache(key), jnp.array([T - 1], jnp.int32))
    return float(k.values[0, KV - 1, T - 1].astype(jnp.float32).sum())
  if case == "gathered":
    idx = jnp.broadcast_to(jnp.arange(T - 256, T, dtype=jnp.int32), (1, KV, 256))
    out, _ = gathered_attention(q, cache(key), cache(key), idx, kv_layout="BHTD", route=route)
    return float(jnp.sum(out.astype(jnp.float32)))
  if case == "topk_decode":
    return int(jnp.max(topk_scores(q, cache(key), 64, kv_layout="BHTD", route=route)[1]))
  if case == "flash_decode":
    out, _ = flash_attention(q, cache(key), cache(key), causal=False, kv_layout="BHTD",
                             route=route)
    return float(jnp.sum(out.astype(jnp.float32)))
  raise SystemExit(f"unknown case {case!r}: write, gathered, topk_decode or flash_decode")


def main():
  case = sys.argv[1]
  try:
    rec = {"case": case, "ok": True, "out": run(case)}
  except Exception as e:  # a fault surfaces as a runtime error: record it, one line
    rec = {"case": case, "ok": False, "error": str(e)[:300]}
  print(json.dumps(rec), flush=True)


if __name__ == "__main__":
  main()
