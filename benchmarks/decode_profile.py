"""Where a decode step's time goes, and which candidate fixes shorten it (issue 21, point 3).

    python -m benchmarks.decode_profile --model llama-3.1-8b --context 32768 --out $OUT/profile
    python -m benchmarks.decode_profile --smoke --out /tmp/profile      # tiny model, on CPU

The decode step is `benchmarks/decode.py`'s (run_jax): random bf16 weights of the named shape,
the `full` method, the same cache length, `generation.decode_loop` over --new-tokens tokens. The
prompt is not prefilled: the cache is set to `context` tokens of zeros (a decode step's work does
not depend on the values; the dense decode path reads every slot of the cache either way), which
saves each variant its prefill compile and run. Each variant runs in its own process (XLA_FLAGS
are read once per process) and writes to --out:

- `VARIANT.json`: ms/token (median of --reps loops, like decode.py), the HBM bound and its share
  (copy bandwidth measured once by torch in the parent), and a profile of one more loop:
  kernels per step, wall / busy / idle ms per step, a histogram of the gaps between kernels and
  which ops the device idled before, ms, GB and achieved TB/s per kind (gemm, fusion, copy,
  memcpy, ...) and per label (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head, rmsnorm,
  rope, attention, cache_write, sample/loop: from each op's source line), and the top ops.
- `VARIANT.hlo.txt.gz`: the compiled decode loop (the profile's op names refer to it).
- `summary.md`: one line per variant, then each variant's tables. `results.jsonl`: all records.

Profiling runs XLA without command buffers (xla_enable_command_buffers_during_profiling is off by
default), so the timed ms/token and the profile's wall time per step may differ a little.

Candidate fixes (--variants, in the order run; each is a flag set of this script):
- `base`: the step as served before 2026-11-26 (the small-kernel switches below are each
  variant's own: off unless named, though on by default in RunOptions / KernelOptions since).
- `fused`: params in `model.fuse_projections`' serving layout: q/k/v one [D, H+2KV, hd] weight,
  gate/up one [D, 2F]. Five matrix-vector products per layer become three; k/v (8 MB each at
  the 8B shape) stop paying a launch and a bandwidth ramp of their own. Equality with the
  unfused model: tests/test_fused_projections.py.
- `pdl`: --xla_gpu_enable_pdl=true: programmatic dependent launch on Hopper: a kernel's launch and
  prologue overlap the previous kernel's tail, a few us per kernel boundary, and a step has
  hundreds of boundaries (the profile counts them). Newer XLA turns it on by default: if this
  version does too, `pdl` equals `base` and `nopdl` shows what it is worth.
- `nopdl`: --xla_gpu_enable_pdl=false, the control for `pdl`.
- `cublas`: --xla_gpu_enable_triton_gemm=false: every M=1 GEMM to cuBLAS (gemv kernels) instead
  of an autotuned Triton GEMM fusion, whose tiles are made for larger M.
- `cublaslt`: --xla_gpu_enable_cublaslt=true: cuBLASLt's GEMM selection for the cuBLAS calls.
- `flash_decode`: decode attention through pallas_kernels.flash_attention (the Triton split-K
  decode kernel, 89-101% of copy bandwidth in benchmarks/kernels.py) instead of the jnp dense
  path with its fp32 score buffers, reading only the slots below the current length.
- `fused_pdl`, `fused_cublas`, `fused_flash`, `all` (fused + pdl + flash_decode): combinations.
- `all_op_by_op`: `all` without command buffers (CUDA graphs): what they save per step.
- `all_exhaustive`: `all` with --xla_gpu_exhaustive_tiling_search=true (the GEMM autotuner tries
  every Triton tiling, so the M=1 projections may find a faster one).
- Decode attention's split plan, each `all` with Route.decode_tiling set (gpu.Tiling;
  today gpu.split_plan gives ~32 splits of 1024 keys at 32K, batch 1, 8 kv heads: 256 programs
  of bk=128, 2 stages, 4 warps, ~135 KiB of shared memory each, so one per SM; the kernel reads
  its 4.3 GB at ~82% of copy rate): `split16` / `split64` / `split128` (key_splits), `bk64`,
  `bk64_split64`, `bk64_s3_split64` (64-key tiles: 2-3 programs per SM, more loads in flight),
  `bk128_s3` (3 pipeline stages), `bk32_s4_split128`, `bk128_w8` (8 warps).
- `merge_kernel`: `all` with KernelOptions.decode_merge_kernel: the key splits merged by one
  Pallas kernel (pallas_kernels/decode/split_merge.py) writing only the real rows in bf16, instead of
  jnp's merge (2 XLA kernels) and the padding-row slice (layout.from_rows): 3 -> 1 kernel per
  layer. Tests: tests/kernels/test_split_merge.py.
- `cache_kernel`: `all` with Route.cache_write_backend="auto": a decode step's
  K/V write as one in-place Pallas kernel per layer (pallas_kernels/decode/cache_write.py: one program
  per sequence x kv head, out-of-range positions dropped) instead of the scatter's ~4 XLA
  kernels (select / concatenate + dynamic-update-slice, for K and for V). Tests:
  tests/kernels/test_cache_write.py, tests/test_decode_knobs.py.
- `add_norm`: `all` with Route.add_norm_backend="auto": each residual add and the
  RMSNorm after it as one Pallas kernel (pallas_kernels/decode/add_rmsnorm.py; writes x + h and the
  normed row), instead of add + reduce + multiply: 64 fewer kernels per step. Tests: tests/kernels/test_add_rmsnorm.py,
  tests/test_decode_knobs.py.
- `q_in_kernel`: `all` with KernelOptions.decode_q_in_kernel: the decode kernel reads the 4
  real query rows of each kv group and repeats them to fill its 16-row tile (a gather load),
  so the XLA pad kernel before it (layout.q_rows, 32/step) goes away. Tests:
  tests/kernels/test_split_merge.py.
- `merge_q` (merge_kernel + q_in_kernel), `small_kernels` (all four): combinations.
Measured and removed: folding the norm scales into the q/k/v and gate/up weights with 1/rms on
the GEMMs' fp32 output (79.8% vs 82.7% of the bound: the fp32-output GEMMs ran slower;
BENCHMARKS.md, commit 0161e5d).
Not tried: --xla_gpu_dot_merger_threshold_mb (merging dots that share x would concatenate the
weights inside every step: the bytes moved twice); command buffers incl. WHILE (measured: 5.84-5.87
vs 5.88 ms, BENCHMARKS.md).

Reading the profile: `idle_ms_per_step` (wall minus busy) is time the GPU ran nothing: launch
gaps between kernels and the loop's per-step host round trip (`gap_pairs` says between which
ops); `by_kind` TB/s against the copy bandwidth says which ops read HBM slowly; kernels/step
times ~1-2 us is what per-kernel ramp and drain can cost even without idle gaps.

One device call (H200, < 9 min: ~30-60 s a variant; no variant starts after --budget-s, and each
finished one is already in $OUT):

    python -m benchmarks.decode_profile --model llama-3.1-8b --context 32768 --new-tokens 32 \
      --reps 3 --budget-s 420 \
      --variants base,fused,flash_decode,pdl,cublas,fused_flash,all,nopdl \
      --out $OUT/decode_profile 2>&1 | tail -30

The small-kernel and split-plan candidates (issue 21, point 3), most telling first:

    python -m benchmarks.decode_profile --model llama-3.1-8b --context 32768 --new-tokens 32 \
      --reps 3 --budget-s 480 --variants all,small_kernels,merge_q,cache_kernel,\
add_norm,split64,bk64_split64,bk128_s3,split16,split128,bk64,bk32_s4_split128,bk128_w8 \
      --out $OUT/decode_small 2>&1 | tail -30
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time

from benchmarks import xplane_summary
from benchmarks.decode_variants import VARIANTS, Variant


def _stage(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def smoke_config():
  from jax_longctx.core.config import LlamaConfig
  return LlamaConfig(vocab_size=320, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=96, max_position_embeddings=4096)


def run_options(variant: Variant, smoke: bool):
  """The RunOptions a variant names (its decode loop compiles with them)."""
  import pallas_kernels
  from jax_longctx.core.options import RunOptions
  kernel_backend = "gpu" if smoke else "auto"  # smoke: the GPU kernels interpreted on CPU
  return RunOptions(route=pallas_kernels.Route(
      kernels=pallas_kernels.KernelOptions(decode_merge_kernel=variant.merge_kernel,
                                           decode_q_in_kernel=variant.q_in_kernel),
      decode_tiling=(pallas_kernels.Tiling(**variant.decode_tiling)
                     if variant.decode_tiling else None),
      cache_write_backend=kernel_backend if variant.cache_kernel else None,
      add_norm_backend=kernel_backend if variant.add_norm else None,
      # `flash`: one-token attention through the flash kernel (what `full` does by itself on
      # GPU); --smoke runs the GPU kernels interpreted on CPU, prefill left on the jnp path.
      backend=kernel_backend, prefill_kernel=False if smoke else None,
      decode_kernel=True if variant.flash else (False if smoke else None)))


def run_child(args, rec: dict) -> None:
  """Times the variant's decode loop, then profiles one more loop; fills `rec` as it goes (a
  profile that fails leaves the timing in it)."""
  import jax
  import jax.numpy as jnp

  from benchmarks.common import jax_peak_bytes, median_time
  from jax_longctx.app.bench_decode import bytes_per_token as _bytes_per_token
  from jax_longctx import preset
  from jax_longctx.run.chunked_prefill import end_prefill
  from jax_longctx.run.generation import Sampling, decode_loop, row_keys
  from jax_longctx.methods import get
  from jax_longctx.model import fuse_projections, new_cache, random_params

  variant = VARIANTS[args.variant]
  fused = variant.fused
  options = run_options(variant, args.smoke)
  cfg = smoke_config() if args.smoke else preset(args.model, dtype="bfloat16")
  method = get("full")
  params = random_params(cfg)
  if fused:
    params = fuse_projections(params)  # the unfused tree is dropped here
  jax.block_until_ready(params)
  _stage("params ready")
  b, ctx, n = args.batch, args.context, args.new_tokens
  cache_len = -(-(ctx + n * (args.reps + 2)) // 128) * 128  # as decode.py
  cache = new_cache(cfg, method, b, cache_len, chunk=args.chunk)
  cache = end_prefill(cache, cfg, method, decode_room=cache_len - ctx, options=options)
  cache = cache.replace(lengths=jnp.full((b,), ctx, jnp.int32))
  last = jax.random.normal(jax.random.key(1), (b, cfg.vocab_size), jnp.float32)
  stops = jnp.asarray([-1], jnp.int32)
  state = {"cache": cache}
  kw = dict(cfg=cfg, method=method, max_new_tokens=n, sampling=Sampling(), options=options)

  def decode():
    out, _, state["cache"] = decode_loop(params, state["cache"], last, stops, row_keys(0, b),
                                         **kw)
    jax.block_until_ready(out)
    state["cache"] = state["cache"].replace(lengths=jnp.full((b,), ctx, jnp.int32))

  t0 = time.perf_counter()
  decode()
  compile_s = time.perf_counter() - t0
  _stage(f"decode compile+run {compile_s:.1f}s")
  med, times = median_time(decode, warmup=0, reps=args.reps)
  wbytes, kvbytes = _bytes_per_token(cfg, ctx, b)
  rec.update({"decode_ms": med / (n - 1) * 1e3, "decode_times_s": times,
              "decode_compile_s": compile_s, "weight_bytes": wbytes, "kv_bytes": kvbytes,
              "peak_bytes": jax_peak_bytes()})
  try:
    profile(args, rec, cfg, fused, decode, lambda: decode_loop.lower(
        params, state["cache"], last, stops, row_keys(0, b), **kw).compile().as_text())
  except Exception as e:  # the timing above stays a result
    import traceback
    traceback.print_exc()
    rec["profile_error"] = f"{type(e).__name__}: {str(e)[:400]}"


def profile(args, rec: dict, cfg, fused: bool, decode, hlo_text) -> None:
  """The compiled loop's HLO to OUT/VARIANT.hlo.txt.gz, one loop traced, the trace summarized."""
  import jax
  try:
    hlo = hlo_text()
    with gzip.open(os.path.join(args.out, f"{args.variant}.hlo.txt.gz"), "wt") as f:
      f.write(hlo)
  except Exception as e:  # no HLO: the profile still counts kernels, without labels or bytes
    hlo, rec["hlo_error"] = "", f"{type(e).__name__}: {str(e)[:300]}"
  trace_dir = tempfile.mkdtemp(prefix=f"trace_{args.variant}_")
  opts = jax.profiler.ProfileOptions()
  opts.python_tracer_level = 0  # Python frames would only slow the host down
  t0 = time.perf_counter()
  jax.profiler.start_trace(trace_dir, profiler_options=opts)
  try:
    decode()
  finally:
    jax.profiler.stop_trace()
  rec["profiled_loop_s"] = time.perf_counter() - t0
  events, plane, host = xplane_summary.kernel_events(xplane_summary.find_xplane(trace_dir),
                                                     module="decode_loop")
  n = args.new_tokens
  ops = xplane_summary.hlo_ops(hlo, xplane_summary.weight_labels(cfg, fused))
  rec["profile"] = {"plane": plane,
                    **xplane_summary.summarize(events, ops, steps=n - 1, host=host)}
  _stage(f"profile: {rec['profile'].get('kernels_per_step')} kernels/step")


def child(args) -> None:
  variant = VARIANTS[args.variant]
  rec = {"variant": args.variant, "xla_flags": variant.flags, "fused": variant.fused,
         "flash_decode": variant.flash, "decode_tiling": variant.decode_tiling,
         "merge_kernel": variant.merge_kernel,
         "cache_kernel": variant.cache_kernel, "add_norm": variant.add_norm,
         "q_in_kernel": variant.q_in_kernel,
         "model": "smoke" if args.smoke else args.model, "context": args.context,
         "batch": args.batch, "new_tokens": args.new_tokens}
  try:
    run_child(args, rec)
  except Exception as e:  # a variant that fails is a result; the others still run
    import traceback
    traceback.print_exc()
    rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
  from benchmarks.common import child_result, device_facts
  rec.update(device_facts())
  child_result(rec)


def _line(rec: dict, base_ms: float | None = None) -> str:
  p = rec.get("profile", {"kernels_per_step": rec.get("profile_error", "-")[:60]})
  if "error" in rec:
    return f"| {rec['variant']} | error: {rec['error'][:120]} ||||||||"
  share = f"{rec['of_bound']:.1%}" if "of_bound" in rec else "-"
  bound = f"{rec['bound_ms']:.3f}" if "bound_ms" in rec else "-"
  delta = f"{rec['decode_ms'] - base_ms:+.3f}" if base_ms else "-"
  return (f"| {rec['variant']} | {rec['decode_ms']:.3f} | {delta} | {bound} | {share} | "
          f"{p.get('kernels_per_step')} | {p.get('wall_ms_per_step')} | "
          f"{p.get('busy_ms_per_step')} | {p.get('idle_ms_per_step')} |")


def write_summary(out: str, recs: list[dict]) -> None:
  base_ms = next((r.get("decode_ms") for r in recs if r["variant"] == "base"), None)
  head = ("| variant | ms/token | vs base | bound ms | of bound | kernels/step | "
          "profiled wall ms/step | busy ms/step | idle ms/step |\n"
          "|---|---|---|---|---|---|---|---|---|\n")
  body = "\n".join(_line(r, base_ms) for r in recs)
  details = "\n".join(xplane_summary.markdown(r["variant"], r["profile"])
                      for r in recs if "profile" in r)
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(f"# Decode profile\n\n{head}{body}\n\n{details}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--model", default="llama-3.1-8b")
  p.add_argument("--context", type=int, default=32768)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--new-tokens", type=int, default=32, help="tokens per decode loop")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--chunk", type=int, default=4096)
  p.add_argument("--variants", default="base,fused", help=", ".join(VARIANTS))
  p.add_argument("--budget-s", type=float, default=480,
                 help="start no further variant after this many seconds")
  p.add_argument("--variant-timeout-s", type=float, default=200)
  p.add_argument("--smoke", action="store_true", help="a 2-layer tiny model (CPU tests)")
  p.add_argument("--out", required=True, help="directory")
  p.add_argument("--child", action="store_true")
  p.add_argument("--variant")
  args = p.parse_args()
  if args.smoke and args.context == 32768:
    args.context = 1024
  os.makedirs(args.out, exist_ok=True)
  if args.child:
    return child(args)
  t_start = time.perf_counter()
  names = args.variants.split(",")
  unknown = [v for v in names if v not in VARIANTS]
  if unknown:
    raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
  from jax_longctx.app.bench_measure import has_cuda as _has_cuda
  from benchmarks import common
  bw = common.copy_bandwidth() if _has_cuda() else None
  cache_dir = tempfile.mkdtemp(prefix="decode_profile_jax_cache_")  # not under --out: large
  recs = []
  for name in names:
    left = args.budget_s - (time.perf_counter() - t_start)
    if left <= 0:
      recs.append({"variant": name, "error": "skipped: --budget-s spent"})
      continue
    env = dict(os.environ)
    # shared by the children: what a variant compiled with the same flags is not compiled again
    env.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", "")] + VARIANTS[name].flags).strip()
    _stage(f"variant {name}: XLA_FLAGS={env['XLA_FLAGS']!r}")
    run = common.run_child(__file__, [
        "--variant", name, "--model", args.model, "--context", str(args.context),
        "--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
        "--reps", str(args.reps), "--chunk", str(args.chunk), "--out", args.out,
        *(["--smoke"] if args.smoke else [])], env=env,
        timeout=min(left + 60, args.variant_timeout_s))
    if run.timed_out:
      rec = {"variant": name, "error": "timed out"}
    else:
      rec = run.records[-1] if run.records else {"variant": name, "error": run.stderr[-600:]}
      if "error" in rec:
        rec["stderr_tail"] = run.stderr[-1500:]
    if bw and "decode_ms" in rec:
      rec["copy_bw"] = bw
      rec["bound_ms"] = (rec["weight_bytes"] + rec["kv_bytes"]) / bw * 1e3
      rec["of_bound"] = rec["bound_ms"] / rec["decode_ms"]
    recs.append(rec)
    common.write_json(os.path.join(args.out, "results.jsonl"), rec)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
      json.dump(rec, f, indent=1)
    write_summary(args.out, recs)
    print(_line(rec), flush=True)
  write_summary(args.out, recs)
  _stage(f"done in {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
  main()
