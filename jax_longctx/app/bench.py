"""`jax-longctx bench`: how fast a model prefills and decodes, or how fast the kernels run, each
beside what bounds it, measured in the same run.

    jax-longctx bench --model llama-3.1-8b --contexts 32768,131072 --batches 1,8 --impls jax,hf
    jax-longctx bench --model llama-3.1-70b --meshes "model=2" --batches 1       # 2 GPUs
    jax-longctx bench --kv-dtypes "none;int8" --contexts 131072                   # 8-bit cache
    jax-longctx bench kernels --only topk_decode,flash_prefill                   # the kernels

A model run: every (impl, method, mesh, kv dtype, context, batch) in a child process of its own
(its peak memory is its own; one that runs out of memory is a row with its error). Decode is the
median of --reps loops of --new-tokens steps after a compiling one; prefill a whole second
prompt after one that compiles. The anchors, on an NVIDIA GPU: `of bound` is the HBM bound
(bytes of weights + KV cache read per step, over the device-to-device copy bandwidth measured
in the same run) over the measured step; `of GEMM` the prefill's FLOP rate over a dense bf16
GEMM's measured then (every device's, on a mesh); `--impls hf` times transformers on the same
shape. Both count what full attention does (the whole cache read a step; dense causal attention's
FLOPs), so a method that reads or computes less (ReAttention's few keys a step; its 8-bit scoring
at twice the bf16 rate) can pass 100%: there they say how far it runs past full attention's
bound, not how near its own. Each row is a line of --out (JSONL), with the device and the JAX
version. Where the time goes: `--kernel-profile N` records a decode step's N longest device
kernels (a traced loop after the timed ones), `--prefill-profile K` the timed prefill's last K
chunks' (`prefill_kernels_per_chunk`; the trace lies inside the prefill's timing), with how busy
the devices were over them (`prefill_busy_us_per_chunk` of `prefill_span_us_per_chunk`: the rest
is idle time between kernels); `--prefill-profile-at F` ends those chunks at that fraction of
the prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from jax_longctx.app.bench_decode import DecodeSetting
from jax_longctx.app.bench_measure import copy_bandwidth, gemm_tflops, has_cuda, write_json
from jax_longctx.app.bench_process import run_cases, run_child

SUMMARY = "measure prefill and decode speed (or the kernels') against the device's bounds"
COLUMNS = ("setting", "prefill tok/s", "of GEMM", "decode ms/step", "of bound", "peak per GPU")
KERNEL_COLUMNS = ("case", "shape", "ms", "anchor", "anchor ms", "anchor / ours")
# Each kernel case's own time, then its anchor's, by the fields its record names them.
_OURS = ("ms", "ours_ms")
_ANCHORS = (("anchor_ms", "einsum + top_k"), ("cudnn_ms", "cuDNN"), ("dense_ms", "dense"),
            ("cudnn_one_call_ms", "cuDNN, one call"), ("k_read_ms", "copy of K"))
_SHAPE = ("q_len", "kv_len", "length", "chunk", "top_k", "selected", "route")


def _fraction(text: str) -> float:
  """A fraction in (0, 1], for --prefill-profile-at."""
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a fraction of the prompt in (0, 1]")
  return value


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("what", nargs="?", choices=["model", "kernels"], default="model",
                 help="a model's prefill and decode, or the Pallas kernels against their "
                      "anchors (einsum + lax.top_k, cuDNN, a dense read)")
  p.add_argument("--model", default="llama-3.1-8b",
                 help="a model shape with random weights (llama-3.2-1b, llama-3.2-3b, "
                      "llama-3.1-8b, llama-3.1-70b, smollm2-135m, qwen2.5-coder-1.5b), a bundled "
                      "model or a checkpoint")
  p.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE",
                 help="change a field of the shape's config, e.g. num_layers=2 for a quick run; "
                      "repeat for several (default: the shape as named)")
  p.add_argument("--contexts", default="8192,32768,131072", help="prompt lengths, comma list")
  p.add_argument("--batches", default="1,8", help="rows, comma list")
  p.add_argument("--skip", default="131072x8", help="CONTEXTxBATCH pairs that cannot fit")
  p.add_argument("--impls", default="jax",
                 help="jax (this library), hf (transformers on the same shape, where installed)")
  p.add_argument("--methods", default="full",
                 help="methods to time, comma list; LABEL:NAME for a variant")
  p.add_argument("--method-arg", action="append", default=[], metavar="LABEL.KEY=VALUE",
                 help="a hyper-parameter of one method label's runs (default: the method's own)")
  p.add_argument("--meshes", default="none",
                 help="';'-separated device meshes, e.g. 'none;model=2;data=2' (none: one device)")
  p.add_argument("--kv-dtypes", default="none",
                 help="';'-separated cache dtypes: none (the model's), int8, float8_e4m3fn, int4 "
                      "(or int4_fp16, int4_g64_fp16)")
  p.add_argument("--kernel-option", action="append", default=[], metavar="LABEL.KEY=VALUE",
                 help="a KernelOptions field for one method label's runs, e.g. "
                      "blocks.topk_few_rows=kernel with --methods blocks:reattention (default: the "
                      "run's own choice)")
  p.add_argument("--run-option", action="append", default=[], metavar="KEY=VALUE",
                 help="a RunOptions or Route field for every run, e.g. add_norm_backend=auto "
                      "(default: none set)")
  p.add_argument("--decode-tiling", default=None, metavar="KEY=VALUE,...",
                 help="Route.decode_tiling for every run, e.g. block_keys=64,num_stages=3 "
                      "(default: the kernel's own split plan)")
  p.add_argument("--fill-cache", action="store_true",
                 help="decode only, over a cache filled with random K/V (no prefill)")
  p.add_argument("--key-smoothing", action="store_true",
                 help="the weights with key smoothing and KV offsets, as an 8-bit load makes them")
  p.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                 help="record the N longest device kernels of a decode step (a traced loop "
                      "after the timed ones)")
  p.add_argument("--prefill-profile", type=int, default=0, metavar="K",
                 help="trace the timed prefill's last K chunks: the device kernels' microseconds "
                      "a chunk, the --kernel-profile N longest (16 if not given); the trace and "
                      "a wait for the chunks before it lie inside the prefill's timing")
  p.add_argument("--prefill-profile-at", type=_fraction, default=1.0, metavar="F",
                 help="--prefill-profile's K chunks end at this fraction of the prompt's chunks "
                      "(default 1: the last); e.g. 0.25 where the key axes are a quarter long")
  p.add_argument("--new-tokens", type=int, default=64, help="decode steps a timed loop")
  p.add_argument("--reps", type=int, default=3, help="timed runs; the median is reported")
  p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens)")
  p.add_argument("--warmup-prefill", action=argparse.BooleanOptionalAction, default=True,
                 help="time a whole second prefill (--no-warmup-prefill: all chunks but the "
                      "first, which compiles; for prompts too long to prefill twice)")
  p.add_argument("--only", default=None,
                 help="kernels: the cases to run, comma list (default: all)")
  p.add_argument("--quick", action="store_true", help="kernels: smaller shapes")
  p.add_argument("--inner", type=int, default=5, help="kernels: calls per timed group at least")
  p.add_argument("--out", default="bench.jsonl", help="JSONL file the records are appended to")


def settings(args) -> list[DecodeSetting]:
  """Every setting the options name, in the order they run."""
  skip = set(filter(None, args.skip.split(",")))
  meshes = ["" if m.strip() == "none" else m.strip() for m in args.meshes.split(";")]
  kvs = ["" if m.strip() == "none" else m.strip() for m in args.kv_dtypes.split(";")]
  common = dict(model=args.model, shape=args.shape, new_tokens=args.new_tokens, reps=args.reps,
                chunk=args.chunk, warmup_prefill=args.warmup_prefill,
                fill_cache=args.fill_cache, key_smoothing=args.key_smoothing,
                kernel_profile=args.kernel_profile, prefill_profile=args.prefill_profile,
                prefill_profile_at=args.prefill_profile_at,
                run_options=args.run_option,
                decode_tiling=args.decode_tiling or "")
  runs = [("hf", "full", "", "") if impl == "hf" else ("jax", m, mesh, kv)
          for impl in args.impls.split(",")
          for m in (args.methods.split(",") if impl == "jax" else ["full"])
          for mesh in (meshes if impl == "jax" else [""])
          for kv in (kvs if impl == "jax" else [""])]
  out = []
  for impl, entry, mesh, kv in runs:
    label, _, method = entry.rpartition(":")
    label = label or method
    mine = lambda pairs: [a.split(".", 1)[1] for a in pairs if a.startswith(label + ".")]  # noqa
    for ctx in map(int, args.contexts.split(",")):
      for b in map(int, args.batches.split(",")):
        if f"{ctx}x{b}" not in skip:
          out.append(DecodeSetting(
              impl=impl, method=method, label=label, mesh=mesh, kv_dtype=kv, context=ctx,
              batch=b, method_args=mine(args.method_arg),
              kernel_options=mine(args.kernel_option), **common))
  return out


def with_anchors(rec: dict, bw: float | None, gemm: float | None) -> dict:
  """The record's shares of the anchors measured in this run."""
  if gemm and rec.get("prefill_tok_s"):  # (None with --fill-cache)
    rec["gemm_tflops"] = gemm
    rec["prefill_tflops"] = rec["prefill_tok_s"] * rec["prefill_flops_per_token"] / 1e12
    rec["prefill_of_gemm"] = rec["prefill_tflops"] / (gemm * rec.get("device_count", 1))
  if bw and "decode_ms" in rec:
    rec["copy_bw"] = bw
    rec["bound_ms"] = (rec["weight_bytes"] + rec["kv_bytes"]) / bw * 1e3
    rec["of_bound"] = rec["bound_ms"] / rec["decode_ms"]
  return rec


def _context(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def table_row(rec: dict) -> str:
  """One row of the table BENCHMARKS.md shows ('-' where a value was not measured)."""
  where = "transformers" if rec["impl"] == "hf" else (
      f"`{rec['mesh']}`" if rec.get("mesh") else "one device")
  name = ", ".join(filter(None, [rec.get("label"), rec.get("kv_dtype") or None,
                                 _context(rec["context"]), f"batch {rec['batch']}", where]))
  if "error" in rec:
    return f"| {name} | {rec['error'][:80]} | | | | |"
  pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
  tok_s = rec.get("prefill_tok_s")
  peaks = [p for p in rec.get("peak_bytes_per_device") or [rec.get("peak_bytes")] if p]
  peak = " / ".join(f"{p / 1e9:.1f}" for p in peaks) + " GB" if peaks else "-"
  return (f"| {name} | {'-' if tok_s is None else f'{tok_s:,.0f}'} | "
          f"{pct(rec.get('prefill_of_gemm'))} | {rec['decode_ms']:.3f} | "
          f"{pct(rec.get('of_bound'))} | {peak} |")


def _child_env() -> dict:
  """This process's environment, with this package importable from a source tree too."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  path = os.environ.get("PYTHONPATH")
  return dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))


def run_model(args) -> int:
  """Every setting in a child process, with the anchors; prints the table as rows finish."""
  cuda = has_cuda()
  bw = copy_bandwidth() if cuda else None
  gemm = gemm_tflops() if cuda else None
  print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS), flush=True)
  failed = 0
  for s in settings(args):
    run = run_child(["-m", "jax_longctx.app.bench_decode", json.dumps(dataclasses.asdict(s))],
                    env=_child_env(), echo_stderr=True)
    rec = run.records[-1] if run.records else {
        "impl": s.impl, "label": s.label, "context": s.context, "batch": s.batch,
        "mesh": s.mesh or None, "error": run.stderr[-500:]}
    rec = with_anchors(rec, bw, gemm)
    failed += "error" in rec
    write_json(args.out, rec)
    print(table_row(rec), flush=True)
  print(f"records: {args.out}", file=sys.stderr)
  return 1 if failed else 0


def kernel_row(rec: dict) -> str:
  """A kernel case's row: its time beside its anchor's (a check case: its error or `checked`)."""
  shape = ", ".join(f"{k} {rec[k]}" for k in _SHAPE if k in rec)
  if "error" in rec:
    return f"| {rec['name']} | {shape} | {rec['error'][:80]} | | | |"
  ours = next((rec[k] for k in _OURS if k in rec), None)
  if ours is None:
    return f"| {rec['name']} | {shape} | checked | | | |"
  name, ms = next(((n, rec[k]) for k, n in _ANCHORS if k in rec), ("-", None))
  ratio = "-" if ms is None else f"{ms / ours:.2f}x"
  return (f"| {rec['name']} | {shape} | {ours:.4f} | {name} | "
          f"{'-' if ms is None else f'{ms:.4f}'} | {ratio} |")


def run_kernels(args) -> int:
  """The kernels' cases on this device (on one without a GPU: the top-k cases at tiny shapes,
  interpreted, which checks the command), each a row of the table and a record of --out."""
  import jax

  from jax_longctx.app.bench_kernels import kernel_cases
  from jax_longctx.app.bench_measure import device_facts, printable

  smoke = jax.default_backend() != "gpu"
  args.bw = None if smoke or not has_cuda() else copy_bandwidth()
  facts = {**device_facts(), "copy_bw": args.bw}
  print(printable(facts), file=sys.stderr, flush=True)
  print("| " + " | ".join(KERNEL_COLUMNS) + " |\n|" + "---|" * len(KERNEL_COLUMNS), flush=True)

  def record(rec):
    rec.update(facts)
    write_json(args.out, rec)
    print(kernel_row(rec), flush=True)

  failed = run_cases(kernel_cases(jax.random.PRNGKey(0), args, smoke), args.only or "", record)
  return 1 if failed else 0


def cmd_bench(args) -> int:
  return run_kernels(args) if args.what == "kernels" else run_model(args)
