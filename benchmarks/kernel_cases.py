"""The timed cases of the Pallas kernels on one GPU, each against its anchor: shared by
benchmarks/kernels.py (the default tilings) and benchmarks/kernel_sweep.py (tiling variants).

Shapes follow issue 3 (32 query / 8 KV heads, d=128, bf16, batch 1); `timed` is the median of
`--reps` groups of back-to-back calls of a jitted function, warmed up.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import authors_topk
from pallas_kernels import flash_attention, gathered_attention, topk_blocks, topk_scores
from pallas_kernels.options import DEFAULT, KernelOptions

H, KV, D = 32, 8, 128
BF = jnp.bfloat16


def _tiling(tiling) -> dict:
  return {} if tiling is None else {"tiling": {k: v for k, v in vars(tiling).items() if v is not None}}


def timed(fn, *args, reps: int, inner: int, sync=jax.block_until_ready) -> float:
  """Median seconds per call of jitted fn over `reps` groups of back-to-back calls.

  A group is at least `inner` calls and at least ~20 ms, so that short kernels are timed with
  the GPU busy and clocked up rather than dominated by launch gaps. sync(out) waits for the
  device (authors_topk.sync for torch calls).
  """
  sync(fn(*args))
  t = time.perf_counter()
  sync(fn(*args))
  inner = max(inner, int(0.02 / max(time.perf_counter() - t, 1e-6)))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    sync(out)
    times.append((time.perf_counter() - t) / inner)
  return statistics.median(times)


def normal(key, shape, dtype=BF):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def small_ints(key, shape):
  """Nonzero integers in [-3, 3] (exact dot products, plenty of ties) as bf16."""
  k1, k2 = jax.random.split(key)
  mag = jax.random.randint(k1, shape, 1, 4)
  sign = jnp.where(jax.random.bernoulli(k2, 0.5, shape), 1, -1)
  return (mag * sign).astype(BF)


def bench_topk(key, lq, t, top_k, args, anchor=True, tiling=None,
               options: KernelOptions = DEFAULT):
  kq, kk = jax.random.split(key)
  q, k = normal(kq, (1, lq, H, D)), normal(kk, (1, t, KV, D))
  ours = jax.jit(lambda q, k: topk_scores(q, k, top_k, backend="gpu", tiling=tiling,
                                          options=options))
  rec = {"case": "topk_scores", "q_len": lq, "kv_len": t, "top_k": top_k, **_tiling(tiling)}
  flops = 2 * H * lq * t * D  # the products q.k alone, for every kernel timed here
  rec["ms"] = timed(ours, q, k, reps=args.reps, inner=args.inner) * 1e3
  rec["tflops"] = flops / rec["ms"] / 1e9
  if args.bw:
    rec["k_read_ms"] = k.size * 2 / args.bw * 1e3
  # The kernel's own running set beside the default: the fused Triton kernel for decode rows
  # (default: topk_blocks), the Mosaic kernel's rounds for prefill chunks (default: segments).
  beside = (KernelOptions(topk_few_rows="kernel") if lq * (H // KV) <= topk_blocks.MAX_ROWS
            else KernelOptions(topk_many_rows="kernel") if top_k > 1 else None)
  if beside is not None and options == DEFAULT:
    kernel = jax.jit(lambda q, k: topk_scores(q, k, top_k, backend="gpu", tiling=tiling,
                                              options=beside))
    rec["kernel_ms"] = timed(kernel, q, k, reps=args.reps, inner=args.inner) * 1e3
    rec["kernel_over_ours"] = rec["kernel_ms"] / rec["ms"]
    if rec.get("k_read_ms"):
      rec["ours_over_k_read"] = rec["ms"] / rec["k_read_ms"]
  if (anchor and getattr(args, "authors", None) and top_k in authors_topk.TOP_KS
      and lq > 1):  # the authors' kernel pads a decode query to 128 rows: a prefill kernel
    rec.update(_versus_authors(args, q, k, top_k, ours(q, k)[1]))
    if "authors_ms" in rec:
      rec["authors_tflops"] = flops / rec["authors_ms"] / 1e9
      rec["ours_over_authors"] = rec["ms"] / rec["authors_ms"]
  if anchor:
    def einsum_topk(q, k):
      s = jnp.einsum("bqkgd,btkd->bqkgt", q.reshape(1, lq, KV, H // KV, D), k,
                     preferred_element_type=jnp.float32)
      return jax.lax.top_k(s, top_k)
    rec["anchor_ms"] = timed(jax.jit(einsum_topk), q, k, reps=args.reps, inner=1) * 1e3
    rec["speedup"] = rec["anchor_ms"] / rec["ms"]
  return rec


def _versus_authors(args, q, k, top_k, ours_indices) -> dict:
  """authors_topk.measure's fields, or authors_error: their kernel failing keeps our numbers."""
  timer = lambda call: timed(call, reps=args.reps, inner=args.inner, sync=authors_topk.sync)  # noqa
  try:
    return authors_topk.measure(args.authors, q, k, top_k, timer, ours_indices)
  except Exception as e:  # noqa: BLE001 - an external kernel: recorded, the case goes on
    return {"authors_error": f"{type(e).__name__}: {str(e)[:1000]}"}


def bench_prefill(key, t, args, tiling=None, cudnn=True):
  ks = jax.random.split(key, 3)
  q, k, v = normal(ks[0], (1, t, H, D)), normal(ks[1], (1, t, KV, D)), normal(ks[2], (1, t, KV, D))
  flops = 4 * H * D * t * (t + 1) / 2
  rec = {"case": "flash_prefill_causal", "kv_len": t, **_tiling(tiling)}
  for name, cud in (("ours", False), ("cudnn", True))[: 2 if cudnn else 1]:
    fn = jax.jit(lambda q, k, v, c=cud: flash_attention(q, k, v, causal=True, backend="gpu",
                                                        use_cudnn=c, tiling=tiling))
    rec[f"{name}_ms"] = timed(fn, q, k, v, reps=args.reps, inner=args.inner) * 1e3
    rec[f"{name}_tflops"] = flops / rec[f"{name}_ms"] / 1e9
  if cudnn:
    rec["ratio_to_cudnn"] = rec["ours_tflops"] / rec["cudnn_tflops"]
  return rec


def bench_decode(key, t, args, tiling=None):
  ks = jax.random.split(key, 3)
  q, k, v = normal(ks[0], (1, 1, H, D)), normal(ks[1], (1, t, KV, D)), normal(ks[2], (1, t, KV, D))
  fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=False, backend="gpu", tiling=tiling))
  rec = {"case": "flash_decode", "kv_len": t, **_tiling(tiling)}
  rec["ms"] = timed(fn, q, k, v, reps=args.reps, inner=args.inner) * 1e3
  rec["bytes"] = 2 * k.size * 2
  rec["fraction_of_bw"] = rec["bytes"] / (rec["ms"] / 1e3) / args.bw
  return rec


def bench_gathered(key, t, n, args, tiling=None, rope=False):
  """rope: keys rotated in the kernel at their entry (ReAttention's decode, BHTD cache)."""
  ks = jax.random.split(key, 4)
  layout = "BHTD" if rope else "BTHD"
  kv_shape = (1, KV, t, D) if rope else (1, t, KV, D)
  q, k, v = normal(ks[0], (1, 1, H, D)), normal(ks[1], kv_shape), normal(ks[2], kv_shape)
  idx = jnp.sort(jax.vmap(lambda kk: jax.random.choice(kk, t, (n,), replace=False))(
      jax.random.split(ks[3], KV)), axis=-1)[None].astype(jnp.int32)
  freqs = 1.0 / 500000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D) if rope else None
  fn = jax.jit(lambda q, k, v, i: gathered_attention(q, k, v, i, backend="gpu", tiling=tiling,
                                                     kv_layout=layout, key_rope_freqs=freqs))
  rec = {"case": "gathered_attention" + ("_rope" if rope else ""), "kv_len": t, "selected": n,
         **_tiling(tiling)}
  rec["ms"] = timed(fn, q, k, v, idx, reps=args.reps, inner=args.inner) * 1e3
  kd, vd = (k[:, :, :n], v[:, :, :n]) if rope else (k[:, :n], v[:, :n])
  dense = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=False, backend="gpu",
                                                  kv_layout=layout))
  rec["dense_ms"] = timed(dense, q, kd, vd, reps=args.reps, inner=args.inner) * 1e3
  rec["ratio_to_dense"] = rec["ms"] / rec["dense_ms"]
  return rec
