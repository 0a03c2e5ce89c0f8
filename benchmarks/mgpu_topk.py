"""The Mosaic GPU top-k kernel (pallas_kernels/topk/mgpu_topk.py) on one Hopper GPU: checked, then timed.

    python -m benchmarks.mgpu_topk --out $OUT/mgpu_topk.json [--sweep] [--only NAMES] [--smoke]

Shapes of one layer: 32 query / 8 KV heads, d=128, bf16, batch 1, unless a case says otherwise.
1. check_*: `topk_scores(..., tiling=Tiling(impl="mosaic"))` against the jnp reference on the
   GPU, on nonzero integer inputs in [-3, 3] (every score exact, many ties): indices and scores
   must be equal. 2 sequences of different valid lengths, exclude prefix / suffix, top_k 1 / 4 /
   16, both key layouts, d 64 and 128, GQA groups 4 and 1; a ties case (37 distinct keys
   repeated); fp16 with a scale. A mismatch fails loudly (the case records it; exit status 1).
2. prefill_128k / prefill_512k: 512 queries x 128K / 512K keys, top-4: median ms after warm-up
   of the Mosaic kernel beside the Triton kernel and einsum + lax.top_k, in the same run.
   TFLOP/s count 2 * queries * keys * d * H. Decode (1 query) never runs the Mosaic kernel.
3. gemm_only_128k: the kernel with a running max in place of the selection
   (KernelOptions(topk_selection="max_only"): pipeline + products alone, the bound for what a
   cheaper selection could gain; its results are meaningless).
--sweep: 512 x 128K over block_kv 64/128/256, stages 2-4, key splits and lowering semantics (each
output checked against the default config's).
Every case runs in its own try/except (benchmarks/common.run_cases_to_json); the JSON file is rewritten
after every case. --smoke: tiny shapes on a CPU, the kernel in jax's Mosaic GPU interpreter:
checks this script end to end before it spends device time; its times mean nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks import common
from jax_longctx.app.bench_kernels import normal, small_ints
from jax_longctx.app.bench_measure import timed
from pallas_kernels import Route, resolve, topk_scores
from pallas_kernels.topk import mgpu_topk
from pallas_kernels.topk import topk as ts_module
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import DEFAULT, KernelOptions

H, KV, D = 32, 8, 128
BF = jnp.bfloat16
SMOKE = False  # --smoke: lengths divided by SHRINK, fewer heads
SHRINK = 256


class Mismatch(AssertionError):
  def __init__(self, message: str, record: dict):
    super().__init__(message)
    self.record = record


def n(length: int) -> int:
  """A sequence length, shrunk for --smoke."""
  return max(130, length // SHRINK) if SMOKE else length


def mosaic(config=None, key_splits=None) -> Tiling:
  c = config or mgpu_topk.DEFAULT_CONFIG
  return Tiling(impl="mosaic", block_rows=c.block_q, block_keys=c.block_kv, num_stages=c.stages,
                key_splits=key_splits)


def keys(key, b, t, *, d=D, kv=None, kv_layout="BTHD", ints=True, dtype=BF):
  kv = kv or KV
  shape = (b, t, kv, d) if kv_layout == "BTHD" else (b, kv, t, d)
  return small_ints(key, shape) if ints else normal(key, shape, dtype)


def require_mosaic(q, k, top_k, tiling, kv_layout="BTHD"):
  """Fails unless topk_scores runs this call on the Mosaic kernel (not a silent Triton fallback)."""
  rows = q.shape[1] * q.shape[2] // k.shape[2 if kv_layout == "BTHD" else 1]
  if ts_module._mosaic_config(resolve("gpu"), q, k, rows, top_k, tiling) is None:
    raise RuntimeError(f"topk_scores would not run {q.shape} x {k.shape} top {top_k} on Mosaic: "
                       f"{mgpu_topk.unsupported(q, k, top_k, config=mgpu_topk.DEFAULT_CONFIG)}")


def check(key, *, top_k, kv_layout="BTHD", d=D, kv=None, lq=64, ties=False, dtype=None):
  """Mosaic vs reference, indices and scores equal (integer inputs; fp16: scores to 1e-5)."""
  kq, kk = jax.random.split(key)
  kv = kv or KV
  q = small_ints(kq, (2, 64 * kv // H if SMOKE else lq, H, d))
  t = n(20000)
  if ties:  # 37 distinct keys repeated along the key axis
    k = jnp.tile(keys(kk, 2, 37, d=d, kv=kv, kv_layout="BTHD"), (1, -(-t // 37), 1, 1))[:, :t]
    k = k if kv_layout == "BTHD" else jnp.swapaxes(k, 1, 2)
  else:
    k = keys(kk, 2, t, d=d, kv=kv, kv_layout=kv_layout)
  kw = dict(valid_len=jnp.array([t, t * 2 // 3 + 1]), exclude_prefix=4, exclude_suffix=64,
            kv_layout=kv_layout, scale=None)
  if dtype is not None:
    q, k, kw["scale"] = q.astype(dtype), k.astype(dtype), 0.125
  require_mosaic(q, k, top_k, mosaic(), kv_layout)
  got = topk_scores(q, k, top_k, route=Route(backend="gpu"), tiling=mosaic(), **kw)
  want = topk_scores(q, k, top_k, route=Route(backend="reference"), **kw)
  rec = {"case": "check", "top_k": top_k, "kv_layout": kv_layout, "d": d, "group": H // kv,
         "ties": ties, "dtype": jnp.dtype(q.dtype).name,
         "index_equal": float(jnp.mean(got[1] == want[1])),
         "score_max_abs": float(jnp.max(jnp.where(jnp.isfinite(want[0]),
                                                  jnp.abs(got[0] - want[0]), 0.0))),
         "inf_agree": bool(jnp.all(jnp.isneginf(got[0]) == jnp.isneginf(want[0])))}
  ok = rec["index_equal"] == 1.0 and rec["score_max_abs"] == 0.0 and rec["inf_agree"]
  print(f"{'ok' if ok else 'MISMATCH'} {rec}", flush=True)
  if not ok:
    raise Mismatch(f"MISMATCH {rec}", {**rec, "passed": False})
  return {**rec, "passed": True}


def bench(key, t, args, *, top_k=4, lq=512, config=None, key_splits=None, anchors=True,
          options: KernelOptions = DEFAULT):
  lq, t = (16, n(t)) if SMOKE else (lq, t)
  kq, kk = jax.random.split(key)
  q, k = normal(kq, (1, lq, H, D)), normal(kk, (1, t, KV, D))
  flops = 2 * lq * t * D * H
  rec = {"case": f"prefill_{t // 1024}k", "q_len": lq, "kv_len": t, "top_k": top_k}
  if config is not None or key_splits is not None:
    rec.update(config=vars(config or mgpu_topk.DEFAULT_CONFIG), key_splits=key_splits)
  require_mosaic(q, k, top_k, mosaic(config, key_splits))
  routes = {"mosaic": lambda q, k: topk_scores(q, k, top_k, route=Route(backend="gpu",
                                                                        kernels=options),
                                               tiling=mosaic(config, key_splits))}
  if anchors:
    routes["triton"] = lambda q, k: topk_scores(q, k, top_k, route=Route(backend="gpu"),
                                                tiling=Tiling(impl="triton"))

    def einsum_topk(q, k):
      s = jnp.einsum("bqkgd,btkd->bqkgt", q.reshape(1, lq, KV, H // KV, D), k,
                     preferred_element_type=jnp.float32)
      return jax.lax.top_k(s, top_k)
    routes["einsum_top_k"] = einsum_topk
  outs = {}
  for name, fn in routes.items():
    try:
      fn = jax.jit(fn)
      outs[name] = fn(q, k)
      rec[f"{name}_ms"] = timed(fn, q, k, reps=args.reps, inner=args.inner) * 1e3
      rec[f"{name}_tflops"] = flops / rec[f"{name}_ms"] / 1e9
    except Exception as e:  # an anchor that does not fit must not hide the kernel's time
      if name == "mosaic":
        raise
      rec[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
  if "triton" in outs:  # float inputs: near-ties may swap; scores must agree
    rec["score_max_abs_vs_triton"] = float(jnp.max(jnp.abs(outs["mosaic"][0] - outs["triton"][0])))
    rec["speedup_vs_triton"] = rec["triton_ms"] / rec["mosaic_ms"]
  rec["meets_400_tflops"] = rec["mosaic_tflops"] >= 400
  return rec


def gemm_only(key, args, t=131072):
  """The kernel with its selection swapped for a running row max (results meaningless): what the
  pipeline and the products cost alone, i.e. the most the selection could still gain."""
  rec = bench(key, t, args, anchors=False, options=KernelOptions(topk_selection="max_only"))
  return {**rec, "case": "gemm_only"}


def sweep(key, args):
  points = [(mgpu_topk.Config(64, bk, st), None) for bk in (64, 128, 256) for st in (2, 3, 4)]
  points = [(c, s) for c, s in points if mgpu_topk.smem_bytes(c, D, 4) <= mgpu_topk.SMEM_LIMIT]
  base = mgpu_topk.DEFAULT_CONFIG
  points += [(base, s) for s in (1, 2, 4)]
  points += [(mgpu_topk.Config(base.block_q, base.block_kv, base.stages, semantics=s), None)
             for s in ("lane", "warpgroup")]
  return {f"sweep_kv{c.block_kv}_s{c.stages}_{c.semantics or 'default'}_splits{s or 'auto'}":
          (lambda c=c, s=s: bench(key, 131072, args, config=c, key_splits=s, anchors=False))
          for c, s in points}


def cases(key, args) -> dict:
  checks = {
      "check_top4_bthd_d128_g4": lambda: check(key, top_k=4),
      "check_top1_bhtd_d128_g4": lambda: check(key, top_k=1, kv_layout="BHTD"),
      "check_top16_bthd_d64_g1": lambda: check(key, top_k=16, d=64, kv=H, lq=256),
      "check_ties_top16_bhtd": lambda: check(key, top_k=16, kv_layout="BHTD", ties=True),
      "check_fp16_scaled_top4": lambda: check(key, top_k=4, dtype=jnp.float16),
  }
  if args.sweep:
    return {"check_top4_bthd_d128_g4": checks["check_top4_bthd_d128_g4"], **sweep(key, args)}
  return {**checks, "prefill_128k": lambda: bench(key, 131072, args),
          "prefill_512k": lambda: bench(key, 524288, args),
          "gemm_only_128k": lambda: gemm_only(key, args)}


def _smoke():
  global SMOKE, H, KV
  SMOKE, H, KV = True, 4, 1


def main():
  common.kernel_benchmark_main(__doc__, cases, mgpu_topk.DEFAULT_CONFIG, inner=3,
                               sweep_help="tiling / splits / semantics sweep", smoke=_smoke)


if __name__ == "__main__":
  main()
