"""ReAttention's decode attention alone: one query over its 8K scope of a 32K pre-RoPE cache.

    python -m benchmarks.gathered_decode --out $OUT/gathered_decode.jsonl [--context 32768]

`gathered_attention(...,
                    key_rope_freqs=...)` (pallas_kernels/attention/gathered.py) over the paper's
scope layout: the 32 global keys, 127 spans of 32 at random places, the 4,096 local keys (8,192
entries), Llama-3.1-8B's heads (32 query / 8 kv, d 128, bf16, BHTD), for each launch setting
below; beside it, dense flash decode over 8K keys (pallas_kernels.flash_attention) and the
bytes both read (K and V rows) over the copy bandwidth (torch copy_, same run). Each timing runs
the call once per layer (32) inside one jitted loop, each call depending on the last, so host
dispatch is not counted (microseconds per call, median of 10 loops after 2). Every setting's
output is compared with the default's (`max_abs_vs_default`). --profile: each setting's device
kernels, microseconds per call (`kernels`, from a profiler trace).
"""

from __future__ import annotations

import argparse

from benchmarks.common import (copy_bandwidth, device_facts, device_kernel_times,
                               median_time, write_json)

CALLS = 32
H, KV, D = 32, 8, 128
# (block_keys, key_splits, num_warps, num_stages, prefetch); None: the kernel's default
SETTINGS = [(None, None, None, None, None), (128, 32, None, None, None),
            (128, 64, None, None, None), (64, 32, None, None, None), (64, 64, None, None, None),
            (64, 128, None, None, None), (32, 128, None, None, None), (64, 64, 2, None, None),
            (64, 64, 8, None, None), (64, 64, None, 3, None), (128, 16, None, None, True),
            (64, 64, None, None, True)]


def scope_indices(key, t: int, n_global=32, n_local=4096, spans=127, span=32):
  """[1, KV, n] sorted entries as ReAttention's decode scope holds them (distinct spans)."""
  import jax
  import jax.numpy as jnp
  middle = (t - n_local - n_global) // span
  rows = []
  for kk in jax.random.split(key, KV):
    starts = n_global + span * jnp.sort(jax.random.choice(kk, middle, (spans,), replace=False))
    rows.append(jnp.concatenate([jnp.arange(n_global), (starts[:, None] + jnp.arange(span)).ravel(),
                                 jnp.arange(t - n_local, t)]))
  return jnp.stack(rows)[None].astype(jnp.int32)


def measure(context: int, bw: float | None, settings=SETTINGS, profile: bool = False,
            no_rope: bool = False) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from pallas_kernels import Route, flash_attention, gathered_attention
  from pallas_kernels.gpu import Tiling

  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (1, 1, H, D), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, KV, context, D), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, KV, context, D), jnp.bfloat16)
  idx = scope_indices(ks[3], context)
  n = idx.shape[-1]
  freqs = 1.0 / 500000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D)
  moved = 2 * KV * n * D * 2  # K and V rows read, bytes

  def looped(call):
    @jax.jit
    def run(q, k, v):
      def body(i, acc):
        out = call(q + (acc % 2).astype(q.dtype), k, v)
        return acc + (out[0, 0, 0, 0] > 0).astype(jnp.int32)
      return jax.lax.fori_loop(0, CALLS, body, jnp.int32(0))
    return run

  def timed(fn):
    t, _ = median_time(lambda: jax.block_until_ready(fn(q, k, v)), warmup=2, reps=10)
    return t / CALLS * 1e6

  recs = []
  dense = lambda q, k, v: flash_attention(q, k[:, :, :n], v[:, :, :n], causal=False,  # noqa: E731
                                          route=Route(backend="gpu"), kv_layout="BHTD")[0]
  dense_us = timed(looped(dense))
  base = None
  for bk, splits, warps, stages, prefetch in settings:
    kw = {name: val for name, val in (("block_keys", bk), ("key_splits", splits),
                                      ("num_warps", warps), ("num_stages", stages),
                                      ("prefetch", prefetch)) if val is not None}
    tiling = Tiling(**kw) if kw else None
    call = lambda q, k, v, tiling=tiling: gathered_attention(  # noqa: E731
        q, k, v, idx, kv_layout="BHTD", key_rope_freqs=None if no_rope else freqs,
        route=Route(backend="gpu"), tiling=tiling)[0]
    rec = {"context": context, "entries": n, "tiling": kw, "dense_8k_us": dense_us,
           "rope_in_kernel": not no_rope}
    try:
      out = jax.jit(call)(q, k, v).astype(jnp.float32)
      base = out if base is None else base
      fn = looped(call)
      rec["us"] = timed(fn)
      rec["max_abs_vs_default"] = float(jnp.max(jnp.abs(out - base)))
      if profile:
        rec["kernels"] = device_kernel_times(lambda: jax.block_until_ready(fn(q, k, v)), calls=3,
                                             per_call=CALLS)
      if bw:
        rec["share_of_copy_bw"] = moved / (rec["us"] * 1e-6) / bw
    except Exception as e:  # a setting that does not fit is a result
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    recs.append(rec)
  return recs


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--context", type=int, default=32768)
  p.add_argument("--out", default="gathered_decode.jsonl")
  p.add_argument("--profile", action="store_true", help="each setting's device kernels")
  p.add_argument("--only-default", action="store_true", help="time the default setting alone")
  p.add_argument("--no-rope", action="store_true",
                 help="keys taken as rotated already (no RoPE in the kernel): what RoPE costs")
  args = p.parse_args()
  import jax
  bw = copy_bandwidth() if jax.default_backend() == "gpu" else None
  settings = SETTINGS[:1] if args.only_default else SETTINGS
  for rec in measure(args.context, bw, settings, args.profile, args.no_rope):
    rec.update(device_facts(), copy_bw=bw)
    write_json(args.out, rec)
    print(rec, flush=True)


if __name__ == "__main__":
  main()
