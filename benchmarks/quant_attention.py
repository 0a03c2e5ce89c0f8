"""Attention over a quantized KV cache (int8 / float8_e4m3fn values, an fp32 scale per key and kv
head) on one GPU: checked against the reference, then timed beside the bf16 cache.

    python benchmarks/quant_attention.py --out $OUT/quant_attention.json [--sweep] [--only NAMES]

One layer of the 8B shape (32 query / 8 KV heads, d=128, bf16 q, batch 1), the cache in the
library's layout (BHTD).
1. check_<int8|fp8>: every kernel that reads a quantized cache against the jnp reference, which
   dequantizes to bf16 first (keys with two outlier channels 30x larger, lengths off the tiles,
   two sequences): Triton split-K decode, the Mosaic GPU prefill kernel and the Triton one on a
   chunk at an offset, gathered attention rotating its keys, the one-token cache write (exact).
   Max abs errors are recorded; a check over tolerance fails the case: out 5e-2 and relative
   norm 1e-2; LSE 5e-2 for the kernels that scale scores by the fp32 scales (the reference rounds
   each dequantized element to bf16 first: with 30x outlier channels that moved the LSE by 3.3e-2
   in the --smoke run), 1e-3 for those that dequantize as the reference does (Mosaic, rotated
   keys; tests/kernels/test_quantized_attention.py). Errors against the fp32 definition (q and
   the dequantized K/V in fp32) are recorded beside them (`*_vs_fp32`), not required.
2. decode_<32k|128k|1m>: one query over T keys, bf16 vs int8 vs fp8: median ms, bytes read
   (values + scales, K and V: 2 T KV (d + 4) for 8 bits, 2 T KV d 2 for bf16), achieved
   bandwidth, the fraction of this run's copy bandwidth (torch copy_, the HBM bound) and the
   speedup over bf16 (target >= 1.28x at 128K and >= 0.88 of the bound).
3. chunk_<28k|124k>: a 4096-query chunk at offset 28K / 124K (the cache 32K / 128K) through
   `chunk_attention` (on Hopper the Mosaic kernel, dequantizing tiles into SMEM for 8 bits) and
   the Triton kernel with the offset (the fallback), bf16 vs int8 vs fp8, TFLOP/s.
--sweep: decode tilings (key tile, key splits) over an int8 cache at 128K and 1M.
Times: medians of --reps (21) groups of back-to-back calls after warm-up (kernels.timed). The
JSON file is rewritten after every case; a failing case is recorded and the rest still run.
--smoke: tiny shapes on a CPU, kernels interpreted: checks the script; its times mean nothing.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.kernels import normal, timed  # noqa: E402
from benchmarks.mgpu_attention import Mismatch, causal_pairs, errors, mosaic_tiling  # noqa: E402
from pallas_kernels import (cache_write, chunk_attention, flash_attention,  # noqa: E402
                            gathered_attention, mgpu_flash, quant)
from pallas_kernels.flash import mosaic_serves  # noqa: E402
from pallas_kernels.gpu import Tiling  # noqa: E402

H, KV, D = 32, 8, 128
BF = jnp.bfloat16
KV_DTYPES = {"bf16": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
SMOKE = False
SHRINK = 256
OUT_ATOL, OUT_REL = 5e-2, 1e-2
LSE_ATOL = {"scaled": 5e-2, "dequantized": 1e-3}


def n(length: int) -> int:
  """A length, shrunk for --smoke."""
  return max(64, length // SHRINK) if SMOKE else length


def cache(key, b, t, kv_dtype):
  """K (two outlier channels, 30x) and V [b, KV, t, D] in bf16, or quantized to kv_dtype."""
  kk, kv = jax.random.split(key)
  k = normal(kk, (b, KV, t, D)) * jnp.ones(D, BF).at[jnp.array([3, 17])].set(30.0)
  v = normal(kv, (b, KV, t, D))
  if kv_dtype is None:
    return k, v
  return quant.quantize(k, kv_dtype), quant.quantize(v, kv_dtype)


def require(err: dict, what: str, lse_atol: float) -> dict:
  ok = (err["out_max_abs"] <= OUT_ATOL and err["out_rel_norm"] <= OUT_REL
        and err["lse_max_abs"] <= lse_atol and err["lse_inf_agree"])
  print(f"{'ok' if ok else 'MISMATCH'} {what}: {err}", flush=True)
  if not ok:
    raise Mismatch(f"MISMATCH {what}: {err}", {**err, "passed": False})
  return {**err, "passed": True}


def check(key, name: str):
  """Every quantized kernel against the reference on the device (see the module doc)."""
  kv_dtype = KV_DTYPES[name]
  ks = jax.random.split(key, 4)
  t = n(20000) // 8 * 8 + 5 if not SMOKE else 205  # not a multiple of any tile
  k, v = cache(ks[0], 2, t, kv_dtype)
  q = normal(ks[1], (2, n(1024), H, D))
  rec = {"case": f"check_{name}"}

  def vs_reference(what, got, lse, q, k, v, **kw):
    """got against the reference (required) and against the fp32 definition (recorded)."""
    f32 = [quant.dequantize(x) for x in (q, k, v)]
    rec[f"{what}_vs_fp32"] = errors(got, flash_attention(*f32, backend="reference", **kw))
    want = flash_attention(q, k, v, backend="reference", **kw)
    rec[what] = require(errors(got, want), f"{what} {name}", LSE_ATOL[lse])

  pos = jnp.array([t - 1, t // 3])
  decode = dict(causal=True, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD")
  vs_reference("decode_triton", flash_attention(q[:, :1], k, v, backend="gpu", **decode),
               "scaled", q[:, :1], k, v, **decode)
  t8 = t // 8 * 8  # the Mosaic kernel's BHTD keys: a multiple of 8
  off = jnp.array([t8 - q.shape[1], n(3000)])
  chunk = dict(causal=True, q_offset=off, kv_len=off + q.shape[1], kv_layout="BHTD")
  k8, v8 = (quant.per_row(lambda x: x[:, :, :t8], x) for x in (k, v))
  for impl, tiling, lse in (("mosaic", mosaic_tiling(), "dequantized"),
                            ("triton", Tiling(impl="triton"), "scaled")):
    got = flash_attention(q, k8, v8, backend="gpu", tiling=tiling, **chunk)
    vs_reference(f"chunk_{impl}", got, lse, q, k8, v8, **chunk)
  idx = jax.random.randint(ks[2], (2, KV, n(2000)), 0, t)
  freqs = 1.0 / 500000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D)
  kw = dict(kv_layout="BHTD", key_rope_freqs=freqs)
  got = gathered_attention(q[:, :1], k, v, idx, backend="gpu", **kw)
  want = gathered_attention(q[:, :1], k, v, idx, backend="reference", **kw)
  rec["gathered_rope"] = require(errors(got, want), f"gathered rope {name}", 1e-3)
  new = normal(ks[3], (2, KV, D))
  got = jax.jit(lambda *a: cache_write.write_one_token(*a, backend="gpu"))(k, v, pos, new, new)
  want = cache_write.reference(k, v, pos, new, new)
  rec["cache_write_equal"] = all(bool(jnp.array_equal(a, b)) for a, b in
                                 zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  if not rec["cache_write_equal"]:
    raise Mismatch(f"MISMATCH cache_write {name}", rec)
  return rec


def bench_decode(key, t, args, tiling=None, dtypes=tuple(KV_DTYPES)):
  t = n(t)
  q = normal(key, (1, 1, H, D))
  pos = jnp.array([t - 1])
  fn = jax.jit(lambda q, k, v, p: flash_attention(q, k, v, q_offset=p, kv_len=p + 1,
                                                  kv_layout="BHTD", backend="gpu", tiling=tiling))
  rec = {"case": "decode", "kv_len": t, "copy_bw": args.bw,
         **({"tiling": {f: x for f, x in vars(tiling).items() if x is not None}} if tiling else {})}
  for name in dtypes:
    k, v = cache(jax.random.fold_in(key, t), 1, t, KV_DTYPES[name])  # distinct K, V buffers
    ms = timed(fn, q, k, v, pos, reps=args.reps, inner=args.inner) * 1e3
    nbytes = quant.nbytes(k) + quant.nbytes(v)  # values and scales
    rec.update({f"{name}_ms": ms, f"{name}_bytes": nbytes,
                f"{name}_tb_per_s": nbytes / ms / 1e9})
    if args.bw:
      rec[f"{name}_of_copy_bw"] = nbytes / (ms / 1e3) / args.bw
    del k, v
  for name in dtypes:
    if name != "bf16" and "bf16_ms" in rec:
      rec[f"{name}_speedup"] = rec["bf16_ms"] / rec[f"{name}_ms"]
  return rec


def bench_chunk(key, t, args, chunk=4096):
  t, chunk = n(t), n(chunk)
  off = t - chunk
  q = normal(key, (1, chunk, H, D))
  offs = jnp.array([off], jnp.int32)
  flops = 4 * D * H * causal_pairs(chunk, off, t)
  rec = {"case": "chunk", "cache": t, "chunk": chunk, "q_offset": off}
  own = jnp.zeros((1, chunk, KV, D), BF)  # the chunk's own keys as arrays (cuDNN route only)
  routes = {
      "chunk_attention": lambda q, k, v, o: chunk_attention(q, k, v, own, own, o,
                                                            kv_layout="BHTD"),
      "triton": lambda q, k, v, o: flash_attention(q, k, v, q_offset=o, kv_len=o + chunk,
                                                   kv_layout="BHTD", backend="gpu",
                                                   use_cudnn=False, tiling=Tiling(impl="triton")),
  }
  if SMOKE:  # off a GPU, chunk_attention would run the reference: ask for the Mosaic kernel
    routes["chunk_attention"] = lambda q, k, v, o: flash_attention(
        q, k, v, q_offset=o, kv_len=o + chunk, kv_layout="BHTD", backend="gpu",
        tiling=mosaic_tiling())
  for name, kv_dtype in KV_DTYPES.items():
    k, v = cache(jax.random.fold_in(key, t), 1, t, kv_dtype)
    rec[f"{name}_mosaic_serves"] = bool(mosaic_serves(q, k, v, kv_layout="BHTD"))
    for route, fn in routes.items():
      ms = timed(jax.jit(fn), q, k, v, offs, reps=args.reps, inner=args.inner) * 1e3
      rec[f"{name}_{route}_ms"] = ms
      rec[f"{name}_{route}_tflops"] = flops / ms / 1e9
    del k, v
  for name in ("int8", "fp8"):
    rec[f"{name}_over_bf16"] = rec["bf16_chunk_attention_ms"] / rec[f"{name}_chunk_attention_ms"]
  return rec


def sweep(key, args):
  tilings = [Tiling(block_keys=bk, key_splits=s) for bk in (64, 128, 256) for s in (None, 64, 128)]
  return {f"sweep_{t // 1024}k_bk{tl.block_keys}_s{tl.key_splits or 'auto'}":
          (lambda t=t, tl=tl: bench_decode(key, t, args, tiling=tl, dtypes=("int8",)))
          for t in (131072, 1 << 20) for tl in tilings}


def cases(key, args) -> dict:
  args.reps = max(args.reps, 1 if SMOKE else 21)
  args.bw = None if SMOKE else common.copy_bandwidth()
  if args.sweep:
    return sweep(key, args)
  return {"check_int8": lambda: check(key, "int8"), "check_fp8": lambda: check(key, "fp8"),
          **{f"decode_{t >> 10}k" if t < 1 << 20 else "decode_1m":
             (lambda t=t: bench_decode(key, t, args)) for t in (32768, 131072, 1 << 20)},
          "chunk_28k": lambda: bench_chunk(key, 32768, args),
          "chunk_124k": lambda: bench_chunk(key, 131072, args)}


def _smoke():
  global SMOKE, H, KV
  SMOKE, H, KV = True, 4, 2


def main():
  common.kernel_benchmark_main(__doc__, cases, mgpu_flash.DEFAULT_CONFIG, inner=5,
                               sweep_help="decode tilings over an int8 cache", smoke=_smoke)


if __name__ == "__main__":
  main()
