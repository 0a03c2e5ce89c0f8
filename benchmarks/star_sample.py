"""Seconds per sample (context encoding + query + generated tokens) for Star Attention and ring
attention over N devices, and for full attention on one device, at the named model shape.

    python -m benchmarks.star_sample --model llama-3.1-8b --devices 4 --methods star,ring \
        --contexts 32768,65536,131072,262144 --out $OUT/star_sample.jsonl
    python -m benchmarks.star_sample --devices 1 --methods full ...

Random bf16 weights, replicated on every device of the mesh (the first N visible devices). One
sample = a random context, a `--query`-token query, then `--new-tokens` greedy tokens (no stop
token, so every sample generates all of them). Star: blocks of a quarter of the context, anchor =
block (the paper's setting), the anchor computed once and sent to every device (`star_rows`: run
in every block's row, as the authors' code does); ring: exact prefill with K/V passed around the
devices; both then run Star's phase 2. Full attention: chunked prefill (`--chunk`) through the flash kernel, then
the library's decode loop. Each method runs in its own process (peak memory is per method); per
context one warm-up sample compiles, then the median of `--reps` samples (one past 64K tokens)
is reported, split into phase 1 (the prefill road: the context, then the query) and phase 2
(generation; before 2026-11-25 the query counted in phase 2).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import (child_result, device_facts, jax_peak_bytes,
                               run_child, write_json)


def _timed(fn):
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def child(args) -> None:
  import jax
  import numpy as np
  from jax.sharding import Mesh

  from jax_longctx import preset
  from jax_longctx.run.sharding import placed
  from jax_longctx.run.generation import Sampling, decode, decode_loop, prefill, row_keys
  from jax_longctx.core.options import RunOptions
  from jax_longctx.methods import get
  from jax_longctx.model import random_params

  cfg = preset(args.model, dtype="bfloat16")
  devices = jax.devices()[:args.devices]
  if len(devices) < args.devices:
    raise SystemExit(f"{args.devices} devices asked for, {len(devices)} visible")
  mesh = Mesh(np.array(devices), ("ctx",))
  params = random_params(cfg)
  if args.method != "full":
    params = placed(params, cfg, mesh)  # copied onto every device of the ctx axis
  rng = np.random.default_rng(0)
  query = rng.integers(0, cfg.vocab_size, args.query).tolist()
  full = get("full")

  def sample(n):
    """(phase-1 seconds, phase-2 seconds) of one sample of an n-token context."""
    context = rng.integers(0, cfg.vocab_size, n).tolist()
    if args.method == "full":
      box = {}
      room = args.query + args.new_tokens
      cache_len = -(-(n + room) // 128) * 128
      t1 = _timed(lambda: box.update(zip(("cache", "last"), jax.block_until_ready(prefill(
          params, cfg, [context + query], full, cache_len=cache_len,
          options=RunOptions(prefill_chunk=args.chunk),
          decode_room=room)))))
      t2 = _timed(lambda: np.asarray(decode_loop(
          params, box["cache"], box["last"], jax.numpy.asarray([-1]), row_keys(0, 1), cfg=cfg,
          method=full, max_new_tokens=args.new_tokens, sampling=Sampling())[0]))
      return t1, t2
    # Phase 1 and the query's forward (the prefill road), then the decode loop.
    name = args.method.removesuffix("_rows")
    method = get(name, **({} if name == "ring" else
                          {"shared_anchor": not args.method.endswith("_rows")}))
    options = RunOptions(mesh=mesh)
    cache_len = -(-(n + args.query + args.new_tokens) // 128) * 128
    box = {}
    t1 = _timed(lambda: box.update(zip(("cache", "last"), jax.block_until_ready(prefill(
        params, cfg, [context], method, cache_len=cache_len, decode_room=args.new_tokens,
        instructions=[query], options=options)))))
    t2 = _timed(lambda: decode(params, cfg, box["cache"], box["last"], method,
                               max_new_tokens=args.new_tokens, options=options))
    return t1, t2

  for n in [int(c) for c in args.contexts.split(",")]:
    rec = {"model": args.model, "method": args.method, "devices": args.devices, "context": n,
           "query_tokens": args.query, "new_tokens": args.new_tokens}
    if args.method == "full":
      rec["chunk"] = args.chunk
    try:
      sample(n)  # compiles
      runs = [sample(n) for _ in range(args.reps if n <= 65536 else 1)]
      totals = sorted(runs, key=sum)
      med = totals[len(totals) // 2]
      rec.update({"sample_s": sum(med), "phase1_s": med[0], "phase2_s": med[1],
                  "samples_s": [sum(r) for r in runs]})
    except Exception as e:  # out of memory is a result
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec.update({"peak_bytes": jax_peak_bytes(), **device_facts()})
    child_result(rec)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="llama-3.1-8b")
  p.add_argument("--devices", type=int, default=4, help="mesh size (full: always 1)")
  p.add_argument("--methods", default="star,ring")
  p.add_argument("--contexts", default="32768,65536,131072,262144")
  p.add_argument("--query", type=int, default=32, help="query tokens")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--chunk", type=int, default=8192, help="full attention's prefill chunk")
  p.add_argument("--reps", type=int, default=3, help="samples timed up to 64K (one beyond)")
  p.add_argument("--out", default="star_sample.jsonl")
  p.add_argument("--child", action="store_true")
  p.add_argument("--method", default="star")
  args = p.parse_args()
  if args.child:
    return child(args)
  for method in args.methods.split(","):
    devices = 1 if method == "full" else args.devices

    def record(rec, method=method, devices=devices):
      write_json(args.out, rec)
      print(f"{method:9s} x{devices} {rec['context']:>7d}  "
            + (f"{rec['sample_s']:.2f} s/sample (phase 1 {rec['phase1_s']:.2f} s, phase 2 "
               f"{rec['phase2_s']:.2f} s)  peak {(rec['peak_bytes'] or 0) / 2**30:.1f} GiB"
               if "sample_s" in rec else rec.get("error", "")), flush=True)

    # Results are written as each context finishes, so a run cut short keeps what it measured.
    run = run_child(__file__, ["--model", args.model, "--method", method,
                               "--devices", str(devices), "--contexts", args.contexts,
                               "--query", str(args.query), "--new-tokens", str(args.new_tokens),
                               "--chunk", str(args.chunk), "--reps", str(args.reps)],
                    on_record=record)
    if not run.records or run.returncode:
      print(f"{method}: exit {run.returncode}\n{run.stderr[-2000:]}", flush=True)


if __name__ == "__main__":
  main()
