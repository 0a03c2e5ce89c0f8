"""Mesh ReAttention at multi-million-token contexts: prefill tok/s, decode ms/token, peak memory
per device, with the pre-RoPE cache split along the tokens over N devices (issue 26).

    python -m benchmarks.reattention_mesh --out $OUT/reattention_mesh.json          # 2^21, all GPUs
    python -m benchmarks.reattention_mesh --contexts 1048576 --devices 4,1 --out ...  # 4 GPUs, then 1
    python -m benchmarks.reattention_mesh --contexts 1048576 --shard-blocks 0,2048 --out ...  # layouts
    python -m benchmarks.reattention_mesh --contexts 262144 --devices 2 --model-splits 1,2 --out ...
    python -m benchmarks.reattention_mesh --smoke --out /tmp/smoke.json             # CPU, tiny

Random bf16 weights at the Llama-3.2-3B shape (speed does not depend on the values), replicated
on the first N local devices; ReAttention at the paper's settings (scope 32 + 127 x 32 + 4096 =
8192 tokens, top-4; `--method resa_mesh` adds RESA's prior). One random prompt of C tokens per
context, prefilled in `--chunk`-token chunks (the first chunk compiles: prefill tok/s counts the
chunks after it; `prefill_s` is the whole prefill), then `--decode-reps` timed runs of
`--decode-tokens` greedy tokens after one warm-up run (the on-device decode loop; ms/token = run
time / tokens, the median reported). `--shard-blocks`: the cache's layouts over the devices
(`reattention_mesh.shard_block`; 0 contiguous shards, else blocks of that many tokens dealt in
turn). `--model-splits`: the devices as `ctx` x `model` (M > 1 splits the weights, heads and
dense work M ways, Megatron-style, and the tokens over the other N / M devices; 1: every device
holds the whole model). Each (context, mesh size, layout, split) runs in its own process, so
`peak_bytes` (per device, from its memory stats) is that run's. Progress lines go to stderr; the
JSON file `--out` is rewritten after every run ({facts, records}), so a run cut off keeps what
it measured.
--smoke: a tiny model of the same layout on 8 fake CPU devices (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from benchmarks.common import (bytes_on, child_result, device_facts, kernel_options,
                               run_child)

SMOKE_DEVICES = 8
# A tiny model of the 3B layout (GQA, llama3 RoPE) and a ReAttention scope to match: selection
# happens from 48 tokens on.
SMOKE_MODEL = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=128)
SMOKE_METHOD = dict(n_global=4, n_local=32, span=4, top_k=2, clip=3, chunk=16)


def _stage(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _peaks(devices) -> list:
  """Peak bytes in use on each device (None where the platform keeps no statistics)."""
  return [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]


def child(args) -> dict:
  import jax
  import numpy as np

  from jax_longctx import preset
  from jax_longctx.core.mesh import make_mesh
  from jax_longctx.core.options import RunOptions
  from jax_longctx.run.generation import decode, prefill
  from jax_longctx.methods import get
  from jax_longctx.model import random_on_mesh
  from pallas_kernels import Route

  cfg = preset(args.model, dtype="bfloat16")
  settings = dict(SMOKE_METHOD) if args.smoke else {}
  if args.smoke:
    cfg = cfg.replace(**SMOKE_MODEL)
  if args.chunk:
    settings["chunk"] = args.chunk
  if args.vote_stride:
    settings["vote_stride"] = args.vote_stride
  method = (get(args.method, base_args=tuple(settings.items()), shard_block=args.shard_blocks)
            if args.method == "resa_mesh" else
            get(args.method, shard_block=args.shard_blocks, **settings))
  chunk = method.prefill_chunk
  devices = jax.local_devices()[:args.devices or None]
  if args.devices and len(devices) < args.devices:
    raise SystemExit(f"{args.devices} devices asked for, {len(devices)} visible")
  n_dev, c, m = len(devices), args.context, args.model_splits
  if n_dev % m:
    raise SystemExit(f"--model-splits {m} does not divide {n_dev} devices")
  mesh = make_mesh(f"ctx={n_dev // m},model={m}", devices)
  options = RunOptions(mesh=mesh, kv_dtype=args.kv_dtype or None,
                       route=Route(kernels=kernel_options(args.kernel_option)))
  room = args.decode_tokens * (args.decode_reps + 1)
  unit = math.lcm(128, method.cache_unit(n_dev // m, options.kv_dtype))
  cache_len = -(-(c + room) // unit) * unit
  _stage(f"context {c} over ctx={n_dev // m} x model={m}: cache {cache_len} slots "
         f"({cache_len // (n_dev // m)} a ctx shard), {args.method}, chunk {chunk}, "
         f"shard_block {args.shard_blocks}")
  # drawn straight into their shards (copied along ctx, split along model): no device holds the
  # whole model, so the 70B shape runs on model=2 or 4
  params = random_on_mesh(cfg, options.mesh)
  prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, c).tolist()
  marks = {}

  def on_chunk(i, n, last, _cache):
    if i == 0 or i == n - 1 or (i + 1) % max(1, n // 20) == 0:
      jax.block_until_ready(last)
      now = time.perf_counter()
      marks.setdefault("first", now)
      done = (i + 1) * chunk
      rate = (i * chunk / (now - marks["first"])) if i else 0.0
      _stage(f"prefill {min(done, c)}/{c} tokens, {now - marks['t0']:.1f} s, "
             f"{rate:.0f} tok/s after the first chunk")

  marks["t0"] = time.perf_counter()
  cache, last = prefill(params, cfg, [prompt], method, cache_len=cache_len, options=options,
                        on_chunk=on_chunk)
  jax.block_until_ready((cache, last))  # RESA's end of prefill included
  t_end = time.perf_counter()
  n_chunks = -(-c // chunk)
  cache_bytes = bytes_on(cache, devices[0])  # a device's share
  weights_bytes = bytes_on(params, devices[0])
  rec = {"model": args.model, "method": args.method, "smoke": args.smoke, "devices": n_dev,
         "model_split": m,
         "context": c, "cache_len": cache_len, "chunk": chunk, "hparams": method.hparams(),
         "kv_dtype": options.kv_dtype, "kernel_options": args.kernel_option,
         "cache_bytes_per_device": cache_bytes,
         "resident_bytes_per_device": cache_bytes + weights_bytes,
         "prefill_s": t_end - marks["t0"], "first_chunk_s": marks["first"] - marks["t0"],
         "prefill_tok_s": ((n_chunks - 1) * chunk / (t_end - marks["first"])
                           if n_chunks > 1 else None)}
  _stage(f"prefill done: {rec['prefill_s']:.1f} s; decoding")

  def decode_run():
    nonlocal cache
    t = time.perf_counter()
    rows, cache = decode(params, cfg, cache, last, method, max_new_tokens=args.decode_tokens,
                         options=options)
    return time.perf_counter() - t, rows  # rows are host lists: the run has finished

  warm_s, _ = decode_run()  # compiles
  runs = [decode_run()[0] for _ in range(args.decode_reps)]
  ms = sorted(1e3 * t / args.decode_tokens for t in runs)
  rec.update({"decode_warmup_s": warm_s, "decode_ms_per_token": statistics.median(ms),
              "decode_ms_per_token_runs": ms, "decode_tokens": args.decode_tokens,
              "peak_bytes": _peaks(devices), **device_facts()})
  _stage(f"decode {rec['decode_ms_per_token']:.2f} ms/token (median of {len(ms)} runs)")
  return rec


def _run_child(args, context: int, devices: int, block: int, split: int) -> dict:
  """One context on one mesh size, layout and model split in its own process (its peak memory
  alone); its record, or its error."""
  cmd = ["--context", str(context), "--method", args.method, "--model", args.model,
         "--devices", str(devices), "--shard-blocks", str(block), "--chunk", str(args.chunk),
         "--model-splits", str(split),
         "--decode-tokens", str(args.decode_tokens), "--decode-reps", str(args.decode_reps),
         "--kv-dtype", args.kv_dtype, "--vote-stride", str(args.vote_stride),
         *(f"--kernel-option={o}" for o in args.kernel_option)]
  env = dict(os.environ)
  if args.smoke:
    cmd.append("--smoke")
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={SMOKE_DEVICES}")
  # progress passes through; the tail is kept for an error
  run = run_child(__file__, cmd, env=env, echo_stderr=True)
  if run.records:
    return run.records[0]
  return {"context": context, "devices": devices, "shard_block": block, "model_split": split,
          "error": f"exit {run.returncode}: {run.stderr[-2000:]}"}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="llama-3.2-3b", help="model shape (random weights)")
  p.add_argument("--method", default="reattention_mesh", choices=["reattention_mesh", "resa_mesh"],
                 help="resa_mesh: RESA's prior over it (lam 1)")
  p.add_argument("--contexts", default=str(2 ** 21), help="comma list of prompt lengths")
  p.add_argument("--devices", default="0",
                 help="comma list of mesh sizes, each run per context (0: every local device); "
                      "e.g. 4,1 measures the speed-up over one device in the same run")
  p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (<= n_local)")
  p.add_argument("--shard-blocks", default="0",
                 help="comma list of layouts, each run per context and mesh size: 0 contiguous "
                      "shards, else a block size (a multiple of --chunk) dealt to the devices")
  p.add_argument("--model-splits", default="1",
                 help="comma list of model-axis sizes, each run per mesh size: the devices as "
                      "ctx=N/M x model=M (M > 1 splits the weights and dense work)")
  p.add_argument("--decode-tokens", type=int, default=32, help="tokens per timed decode run")
  p.add_argument("--kv-dtype", default="", help="the cache in 8 bits: int8 or float8_e4m3fn")
  p.add_argument("--vote-stride", type=int, default=0, help="ReAttention's vote_stride (0: its own)")
  p.add_argument("--kernel-option", action="append", default=[], metavar="KEY=VALUE",
                 help="a KernelOptions field, e.g. topk_dequantize_bytes=1073741824")
  p.add_argument("--decode-reps", type=int, default=5, help="timed decode runs after one warm-up")
  p.add_argument("--out", help="JSON file, rewritten after every context (required)")
  p.add_argument("--smoke", action="store_true", help="tiny model on 8 fake CPU devices")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    args.devices, args.shard_blocks = int(args.devices), int(args.shard_blocks)
    args.model_splits = int(args.model_splits)
    child_result(child(args))
    return
  if not args.out:
    p.error("--out is required")
  if args.smoke:
    args.chunk = SMOKE_METHOD["chunk"]
    args.decode_tokens, args.decode_reps = 4, 2
    if args.contexts == str(2 ** 21):
      args.contexts = "200,520"
  records = []
  runs = [(int(c), int(n), int(b), int(m)) for c in args.contexts.split(",")
          for n in args.devices.split(",") for b in args.shard_blocks.split(",")
          for m in args.model_splits.split(",") if int(n) == 0 or int(n) % int(m) == 0]
  for context, devices, block, split in runs:
    records.append(_run_child(args, context, devices, block, split))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump({"argv": sys.argv[1:], "records": records}, f, indent=1)
    print(json.dumps(records[-1]), flush=True)
  if any("error" in r for r in records):
    sys.exit(1)


if __name__ == "__main__":
  main()
