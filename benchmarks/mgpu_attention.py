"""The Mosaic GPU flash-attention kernel on one Hopper GPU: checked, then timed beside cuDNN.

    python -m benchmarks.mgpu_attention --out $OUT/mgpu.json [--sweep] [--only NAMES]

One layer's shapes (32 query / 8 KV heads, d=128, bf16, batch 1) unless a case says otherwise.
1. check_*: the kernel (through `flash_attention(..., tiling=Tiling(impl="mosaic"))`) against the
   fp32 jnp reference at 2K queries with a query offset, per-sequence kv_len and GQA, in both key
   layouts, d 64 and 128, causal and not, fp16 too; and against cuDNN on a square causal 2K.
   Max abs errors are printed; a mismatch (out > 3e-2 or rel. norm > 1e-2, LSE > 1e-3) fails.
2. causal_16k / causal_32k (and noncausal_16k): median ms after warm-up beside
   `jax.nn.dot_product_attention(implementation="cudnn")` and the Triton kernel, in the same run.
3. chunk_28k: a 4096-query chunk at offset 28672 of a 32K key range, beside `chunk_attention`
   (two cuDNN calls merged by LSE), both key layouts.
4. kv_len_skip: 8K visible keys of a 32K cache against a cache of 8K: equal times mean the kernel
   skips the key blocks past kv_len.
--sweep: causal 16K over block_q 64/128, block_kv 64/128, stages 2/3/4 (what fits in SMEM) and
the two lowering semantics, each output checked against cuDNN's, to pick DEFAULT_CONFIG.
TFLOP/s count 4 * visible (query, key) pairs * d * H. Every case runs in its own try/except: an
error is recorded and the rest still run. The JSON file is rewritten after every case.
--smoke: tiny shapes on a CPU (the kernel in jax's Mosaic GPU interpreter, XLA's attention in place
of cuDNN): checks this script end to end before it spends device time; its times mean nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import common
from jax_longctx.app.bench_kernels import normal
from jax_longctx.app.bench_measure import timed
from pallas_kernels import Route, chunk_attention, flash_attention
from pallas_kernels.attention import mgpu_flash
from pallas_kernels.gpu import Tiling

H, KV, D = 32, 8, 128
BF = jnp.bfloat16
SMOKE = False  # --smoke: shapes divided by SHRINK, reference stand-ins for cuDNN
SHRINK = 64
OUT_ATOL, OUT_REL, LSE_ATOL = 3e-2, 1e-2, 1e-3


class Mismatch(AssertionError):
  """A check failed; `record` keeps what the case measured (timings too) for the JSON."""

  def __init__(self, message: str, record: dict | None = None):
    super().__init__(message)
    self.record = record or {}


def mosaic_tiling(config: mgpu_flash.Config | None = None) -> Tiling:
  c = config or mgpu_flash.DEFAULT_CONFIG
  return Tiling(impl="mosaic", block_rows=c.block_q, block_keys=c.block_kv, num_stages=c.stages)


def n(length: int) -> int:
  """A sequence length, shrunk for --smoke."""
  return max(128, length // SHRINK) if SMOKE else length


def cudnn_attention(q, k, v, *, causal):
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                      implementation=None if SMOKE else "cudnn")


def qkv(key, b, lq, t, *, d=D, kv_layout="BTHD", dtype=BF):
  ks = jax.random.split(key, 3)
  kv_shape = (b, t, KV, d) if kv_layout == "BTHD" else (b, KV, t, d)
  return normal(ks[0], (b, lq, H, d), dtype), normal(ks[1], kv_shape, dtype), \
      normal(ks[2], kv_shape, dtype)


def errors(got, want) -> dict:
  (o, l), (ro, rl) = got, want
  o, ro = o.astype(jnp.float32), ro.astype(jnp.float32)
  finite = jnp.isfinite(rl)
  return {"out_max_abs": float(jnp.max(jnp.abs(o - ro))),
          "out_rel_norm": float(jnp.linalg.norm(o - ro) / jnp.linalg.norm(ro)),
          "lse_max_abs": float(jnp.max(jnp.where(finite, jnp.abs(l - rl), 0.0))),
          "lse_inf_agree": bool(jnp.all(jnp.isneginf(l) == jnp.isneginf(rl)))}


def require(err: dict, what: str, lse: bool = True, record: dict | None = None) -> dict:
  """Raises Mismatch (loudly) unless out and, with lse, the LSE are within tolerance."""
  ok = (err["out_max_abs"] <= OUT_ATOL and err["out_rel_norm"] <= OUT_REL
        and (not lse or (err["lse_max_abs"] <= LSE_ATOL and err["lse_inf_agree"])))
  print(f"{'ok' if ok else 'MISMATCH'} {what}: {err}", flush=True)
  if not ok:
    raise Mismatch(f"MISMATCH {what}: {err}", {**(record or {}), **err, "passed": False})
  return {**err, "passed": True}


def check_reference(key, *, causal, kv_layout, d, dtype=BF):
  """2 sequences: a 2048-query chunk at offsets (2048, 1000) with kv_len (4096, 3000)."""
  q, k, v = qkv(key, 2, n(2048), n(4096), d=d, kv_layout=kv_layout, dtype=dtype)
  kw = dict(causal=causal, q_offset=jnp.array([n(2048), n(1000)]),
            kv_len=jnp.array([n(4096), n(3000)]), kv_layout=kv_layout)
  got = jax.jit(lambda q, k, v: flash_attention(q, k, v, route=Route(backend="gpu"),
                                                use_cudnn=False,
                                                tiling=mosaic_tiling(), **kw))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  want = flash_attention(f32(q), f32(k), f32(v), route=Route(backend="reference"), **kw)
  what = f"vs reference causal={causal} {kv_layout} d={d} {jnp.dtype(dtype).name}"
  return {"case": "check_reference", "causal": causal, "kv_layout": kv_layout, "d": d,
          "dtype": jnp.dtype(dtype).name, **require(errors(got, want), what)}


def check_cudnn(key):
  q, k, v = qkv(key, 1, n(2048), n(2048))
  got = flash_attention(q, k, v, causal=True, route=Route(backend="gpu"), use_cudnn=False,
                        tiling=mosaic_tiling())
  want = flash_attention(q, k, v, causal=True, route=Route(backend="reference" if SMOKE else "gpu"),
                         use_cudnn=True)
  # cuDNN's public LSE comes back in bf16 (~0.03 apart at these values): out only is required.
  return {"case": "check_cudnn", **require(errors(got, want), "vs cuDNN causal 2K", lse=False)}


def causal_pairs(lq: int, q_offset: int, kv_len: int) -> int:
  """(query, key) pairs with key <= q_offset + i and key < kv_len, i < lq."""
  return sum(min(q_offset + i + 1, kv_len) for i in range(lq))


def bench_square(key, t, args, *, causal=True, config=None, anchors=True):
  rec = {"case": f"{'causal' if causal else 'noncausal'}_{t // 1024}k", "kv_len": n(t)}
  t = n(t)
  q, k, v = qkv(key, 1, t, t)
  flops = 4 * D * H * (causal_pairs(t, 0, t) if causal else t * t)
  if config is not None:
    rec["config"] = vars(config)
  routes = {"mosaic": lambda q, k, v: flash_attention(q, k, v, causal=causal,
                                                      route=Route(backend="gpu"),
                                                      use_cudnn=False,
                                                      tiling=mosaic_tiling(config))[0]}
  if anchors:
    routes["cudnn"] = lambda q, k, v: cudnn_attention(q, k, v, causal=causal)
    routes["triton"] = lambda q, k, v: flash_attention(q, k, v, causal=causal,
                                                       route=Route(backend="gpu"),
                                                       use_cudnn=False,
                                                       tiling=Tiling(impl="triton"))[0]
  outs = {}
  for name, fn in routes.items():
    fn = jax.jit(fn)
    outs[name] = fn(q, k, v)
    rec[f"{name}_ms"] = timed(fn, q, k, v, reps=args.reps, inner=args.inner) * 1e3
    rec[f"{name}_tflops"] = flops / rec[f"{name}_ms"] / 1e9
  if anchors:
    rec["ratio_to_cudnn"] = rec["mosaic_tflops"] / rec["cudnn_tflops"]
    rec["meets_0.95"] = rec["ratio_to_cudnn"] >= 0.95
    rec["max_abs_vs_cudnn"] = float(jnp.max(jnp.abs(outs["mosaic"].astype(jnp.float32)
                                                    - outs["cudnn"].astype(jnp.float32))))
  return rec


def bench_chunk(key, args, *, kv_layout, t=32768, chunk=4096):
  t, chunk = n(t), n(chunk)
  off = t - chunk
  q, k, v = qkv(key, 1, chunk, t, kv_layout=kv_layout)
  kc, vc = (x[:, off:] if kv_layout == "BTHD" else jnp.swapaxes(x[:, :, off:], 1, 2)
            for x in (k, v))
  offs = jnp.array([off], jnp.int32)
  flops = 4 * D * H * causal_pairs(chunk, off, t)
  rec = {"case": "chunk_28k", "kv_layout": kv_layout, "chunk": chunk, "q_offset": off}
  mosaic = jax.jit(lambda q, k, v, o: flash_attention(
      q, k, v, causal=True, q_offset=o, kv_len=o + chunk, route=Route(backend="gpu"),
      use_cudnn=False, kv_layout=kv_layout, tiling=mosaic_tiling()))
  two_cudnn = jax.jit(lambda q, k, v, kc, vc, o: chunk_attention(q, k, v, kc, vc, o,
                                                                 kv_layout=kv_layout, route=Route()))
  got, want = mosaic(q, k, v, offs), two_cudnn(q, k, v, kc, vc, offs)
  err = errors(got, want)
  rec["mosaic_ms"] = timed(mosaic, q, k, v, offs, reps=args.reps, inner=args.inner) * 1e3
  rec["chunk_attention_ms"] = timed(two_cudnn, q, k, v, kc, vc, offs, reps=args.reps,
                                    inner=args.inner) * 1e3
  for name in ("mosaic", "chunk_attention"):
    rec[f"{name}_tflops"] = flops / rec[f"{name}_ms"] / 1e9
  rec["ratio_to_chunk_attention"] = rec["chunk_attention_ms"] / rec["mosaic_ms"]
  return {**rec, **require(err, f"chunk_28k {kv_layout} vs chunk_attention", record=rec)}


def bench_kv_len_skip(key, args, *, t=32768, visible=8192, lq=4096):
  """Non-causal: kv_len = 8K of a 32K cache should cost what a cache of 8K costs."""
  t, visible, lq = n(t), n(visible), n(lq)
  q, k, v = qkv(key, 1, lq, t)
  fn = jax.jit(lambda q, k, v, n: flash_attention(q, k, v, causal=False, kv_len=n,
                                                  route=Route(backend="gpu"),
                                                  use_cudnn=False, tiling=mosaic_tiling()))
  cut = jnp.array([visible], jnp.int32)
  rec = {"case": "kv_len_skip", "cache": t, "visible": visible, "q_len": lq}
  rec["cut_ms"] = timed(fn, q, k, v, cut, reps=args.reps, inner=args.inner) * 1e3
  rec["short_ms"] = timed(fn, q, k[:, :visible], v[:, :visible], cut, reps=args.reps,
                          inner=args.inner) * 1e3
  rec["cut_over_short"] = rec["cut_ms"] / rec["short_ms"]
  return rec


def sweep(key, args):
  """Causal 16K over the tilings that fit, each checked against cuDNN's output."""
  configs = [mgpu_flash.Config(bq, bk, st) for bq in (64, 128) for bk in (64, 128)
             for st in (2, 3, 4)]
  configs = [c for c in configs if mgpu_flash.smem_bytes(c, D) <= mgpu_flash.SMEM_LIMIT]
  base = mgpu_flash.DEFAULT_CONFIG
  configs += [mgpu_flash.Config(base.block_q, base.block_kv, base.stages, semantics=s)
              for s in ("lane", "warpgroup")]
  cases = {}
  for c in configs:
    name = f"sweep_q{c.block_q}_kv{c.block_kv}_s{c.stages}_{c.semantics or 'default'}"
    cases[name] = lambda c=c: bench_sweep_point(key, args, c)
  return cases


def bench_sweep_point(key, args, config, t=16384):
  rec = bench_square(key, t, args, config=config, anchors=False)
  q, k, v = qkv(key, 1, n(t), n(t))
  want = cudnn_attention(q, k, v, causal=True)
  got = flash_attention(q, k, v, causal=True, route=Route(backend="gpu"), use_cudnn=False,
                        tiling=mosaic_tiling(config))[0]
  rec["max_abs_vs_cudnn"] = float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                                  - want.astype(jnp.float32))))
  rec["case"] = "sweep"
  return rec


def cases(key, args) -> dict:
  if args.sweep:
    return {"check_cudnn": lambda: check_cudnn(key),
            "cudnn_16k": lambda: cudnn_only(key, 16384, args), **sweep(key, args)}
  checks = {f"check_{'causal' if c else 'full'}_{lay}_d{d}_{jnp.dtype(dt).name}":
            (lambda c=c, lay=lay, d=d, dt=dt: check_reference(key, causal=c, kv_layout=lay, d=d,
                                                              dtype=dt))
            for c, lay, d, dt in [(True, "BTHD", 128, BF), (True, "BHTD", 128, BF),
                                  (False, "BTHD", 64, BF), (True, "BHTD", 64, jnp.float16)]}
  return {**checks, "check_cudnn": lambda: check_cudnn(key),
          "causal_16k": lambda: bench_square(key, 16384, args),
          "causal_32k": lambda: bench_square(key, 32768, args),
          "noncausal_16k": lambda: bench_square(key, 16384, args, causal=False),
          "chunk_28k_bthd": lambda: bench_chunk(key, args, kv_layout="BTHD"),
          "chunk_28k_bhtd": lambda: bench_chunk(key, args, kv_layout="BHTD"),
          "kv_len_skip": lambda: bench_kv_len_skip(key, args)}


def cudnn_only(key, t, args):
  t = n(t)
  q, k, v = qkv(key, 1, t, t)
  fn = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, causal=True))
  ms = timed(fn, q, k, v, reps=args.reps, inner=args.inner) * 1e3
  return {"case": "cudnn_anchor", "kv_len": t, "cudnn_ms": ms,
          "cudnn_tflops": 4 * D * H * causal_pairs(t, 0, t) / ms / 1e9}


def _smoke():
  global SMOKE, H, KV
  SMOKE, H, KV = True, 4, 2


def main():
  common.kernel_benchmark_main(__doc__, cases, mgpu_flash.DEFAULT_CONFIG, inner=5,
                               sweep_help="block sizes / stages / semantics sweep", smoke=_smoke)


if __name__ == "__main__":
  main()
