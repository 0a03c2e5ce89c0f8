"""Tiling variants of the GPU kernels, timed by benchmarks/kernels.py --sweep.

Used to pick the defaults in pallas_kernels; the chosen ones and their numbers are in
BENCHMARKS.md. `topk_gemm_only` runs the Triton top-k with KernelOptions(topk_selection=
"max_only"), a running max in place of the running top-k: the kernel's speed without the
selection, i.e. the matrix-product ceiling of this loop (its results are meaningless).
"""

from __future__ import annotations

from jax_longctx.app import bench_kernels as kb
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions

# Triton named: on Hopper the default (Mosaic) would take these 512-query calls and ignore the
# Triton tilings swept (benchmarks/mgpu_topk.py times Mosaic's own gemm_only and tilings).
TRITON = KernelOptions(topk_impl="triton")
GEMM_ONLY = KernelOptions(topk_impl="triton", topk_selection="max_only")


def _gemm_only(key, args, tilings):
  recs = [kb.bench_topk(key, 512, 131072, 4, args, anchor=False, tiling=t, options=GEMM_ONLY)
          for t in tilings]
  for r in recs:
    r["case"] = "topk_gemm_only"
  return recs


def _each(fn, tilings):
  """fn(tiling) for each tiling; a tiling that fails (e.g. too much shared memory) is recorded."""
  recs = []
  for t in tilings:
    try:
      recs.append(fn(t))
    except Exception as e:  # noqa: BLE001
      recs.append({"case": "sweep", "tiling": vars(t), "error": f"{type(e).__name__}: {e}"[:500]})
  return recs


def sweep_cases(key, args):
  long = 1 << (18 if args.quick else 20)
  prefill = [Tiling(), Tiling(block_keys=64), Tiling(block_rows=64, num_warps=4),
             Tiling(block_rows=64, block_keys=64, num_warps=4),
             Tiling(block_rows=64, block_keys=64, num_warps=4, num_stages=2),
             Tiling(block_rows=64, block_keys=64, num_warps=4, num_stages=4),
             Tiling(block_rows=32, block_keys=64, num_warps=4),
             Tiling(block_rows=64, block_keys=32, num_warps=4)]
  decode = [Tiling(), Tiling(block_keys=256, num_warps=4), Tiling(block_keys=512, num_warps=4),
            Tiling(block_keys=256, num_warps=4, key_splits=132),
            Tiling(block_keys=512, num_warps=4, key_splits=132),
            Tiling(block_keys=256, num_warps=4, num_stages=4, key_splits=264)]
  flash_dec = [Tiling(), Tiling(key_splits=264, num_warps=4, num_stages=4),
               Tiling(key_splits=264, num_warps=4, num_stages=3),
               Tiling(block_keys=256, num_warps=4), Tiling(block_keys=256, num_warps=4, key_splits=132),
               Tiling(block_keys=256, num_warps=4, key_splits=264),
               Tiling(block_keys=128, num_warps=4, num_stages=3),
               Tiling(block_keys=64, num_warps=4, num_stages=4, key_splits=264)]
  flash_pre = [Tiling(), Tiling(num_stages=3), Tiling(block_keys=128, num_stages=3),
               Tiling(num_stages=4), Tiling(block_rows=64, num_warps=4, num_stages=3)]
  gathered = [Tiling(), Tiling(block_keys=128), Tiling(block_keys=128, key_splits=264),
              Tiling(block_keys=32, key_splits=264)]
  # ReAttention's decode scoring: one query over a 32K cache (the split count sets parallelism)
  decode_32k = [Tiling(), Tiling(key_splits=64), Tiling(key_splits=128),
                Tiling(block_keys=128, key_splits=128), Tiling(block_keys=128, key_splits=256),
                Tiling(block_keys=64, key_splits=256), Tiling(block_keys=64, key_splits=512),
                Tiling(block_keys=128, key_splits=256, num_warps=2)]
  gathered_rope = [Tiling(), Tiling(block_keys=64), Tiling(block_keys=32),
                   Tiling(block_keys=64, num_warps=8), Tiling(block_keys=32, num_warps=8),
                   Tiling(block_keys=64, key_splits=264), Tiling(block_keys=32, key_splits=264)]
  return {
      "topk_gemm_only": lambda: _gemm_only(key, args, prefill[:4]),
      "topk_prefill": lambda: _each(
          lambda t: kb.bench_topk(key, 512, 131072, 4, args, anchor=False, tiling=t,
                                  options=TRITON), prefill),
      "topk_decode": lambda: _each(
          lambda t: kb.bench_topk(key, 1, long, 4, args, anchor=False, tiling=t), decode),
      "topk_decode_32k": lambda: _each(
          lambda t: kb.bench_topk(key, 1, 32768, 4, args, anchor=False, tiling=t), decode_32k),
      "flash_decode": lambda: [r for n in (131072, long) for r in _each(
          lambda t, n=n: kb.bench_decode(key, n, args, tiling=t), flash_dec)],
      "flash_prefill": lambda: _each(
          lambda t: kb.bench_prefill(key, 16384, args, tiling=t, cudnn=False), flash_pre),
      "gathered": lambda: _each(lambda t: kb.bench_gathered(key, long, 8192, args, tiling=t),
                                gathered),
      # ReAttention's decode: an 8K scope of a 32K pre-RoPE cache, rotated in the kernel
      "gathered_rope": lambda: _each(
          lambda t: kb.bench_gathered(key, 32768, 8192, args, tiling=t, rope=True), gathered_rope),
  }
