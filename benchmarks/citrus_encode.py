"""Time to encode a long document and its instruction: CItruS variants against full prefill.

    python -m benchmarks.citrus_encode --model llama-3.1-8b --contexts 32768,131072 \
        --methods full,citrus_standard,citrus_shared,citrus_individual,h2o_shared \
        --out $OUT/citrus_encode.jsonl

Random bf16 weights at the named shape. Each method runs in its own process (peak memory is
per method, over all its contexts). A two-chunk document first compiles every step; then each
context is encoded `--reps` times (median reported): the document in the method's chunks (full
attention: chunks of 512 through the flash kernel), the instruction passes, the final eviction
and the instruction itself, up to the logits of its last token.
"""

from __future__ import annotations

import argparse

from benchmarks.common import (child_result, device_facts, jax_peak_bytes,
                               median_time, run_child, write_json)


def child(args) -> None:
  import jax
  import numpy as np

  from jax_longctx import preset
  from jax_longctx.run.generation import prefill
  from jax_longctx.methods import get, parse_method_args
  from jax_longctx.model import random_params

  cfg = preset(args.model, dtype="bfloat16")
  method = get(args.method, **parse_method_args(args.method_arg))
  params = random_params(cfg)
  rng = np.random.default_rng(0)
  instruction = [rng.integers(0, cfg.vocab_size, args.instruction).tolist()]
  contexts = [int(c) for c in args.contexts.split(",")]
  cache_len = max(contexts) + args.instruction + 64

  def encode(n):
    doc = [rng.integers(0, cfg.vocab_size, n).tolist()]
    cache, last = prefill(params, cfg, doc, method, cache_len=cache_len,
                          decode_room=32, instructions=instruction)
    jax.block_until_ready((cache, last))

  encode(1024)  # compiles every step
  for n in contexts:
    rec = {"model": args.model, "method": args.method, "hparams": method.hparams(), "context": n,
           "instruction_tokens": args.instruction}
    try:
      med, times = median_time(lambda: encode(n), warmup=0, reps=args.reps if n <= 32768 else 1)
      rec.update({"encode_s": med, "times_s": times, "tok_s": n / med})
    except Exception as e:  # out of memory is a result
      rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec.update({"peak_bytes": jax_peak_bytes(), **device_facts()})
    child_result(rec)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="llama-3.1-8b")
  p.add_argument("--contexts", default="32768,131072")
  p.add_argument("--methods",
                 default="full,citrus_standard,citrus_shared,citrus_individual,h2o_shared")
  p.add_argument("--method-arg", action="append", default=[], metavar="METHOD.KEY=VALUE")
  p.add_argument("--instruction", type=int, default=32, help="instruction tokens")
  p.add_argument("--reps", type=int, default=3, help="repetitions up to 32K (one beyond)")
  p.add_argument("--out", default="citrus_encode.jsonl")
  p.add_argument("--child", action="store_true")
  p.add_argument("--method", default="full")
  args = p.parse_args()
  if args.child:
    return child(args)
  for method in args.methods.split(","):
    margs = [a.split(".", 1)[1] for a in args.method_arg if a.startswith(method + ".")]
    run = run_child(__file__, ["--model", args.model, "--method", method,
                               "--contexts", args.contexts, "--instruction", str(args.instruction),
                               "--reps", str(args.reps)] + [f"--method-arg={a}" for a in margs])
    if not run.records:
      print(f"{method}: no result\n{run.stderr[-2000:]}", flush=True)
    for rec in run.records:
      write_json(args.out, rec)
      print(f"{method:18s} {rec['context']:>7d}  "
            + (f"{rec['encode_s']:.2f} s  {rec['tok_s']:.0f} tok/s  peak "
               f"{(rec['peak_bytes'] or 0) / 2**30:.1f} GiB" if "encode_s" in rec else
               rec.get("error", "")), flush=True)


if __name__ == "__main__":
  main()
