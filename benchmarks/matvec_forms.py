"""One device's output projection at decode under tensor parallelism, in the forms XLA could get.

    python -m benchmarks.matvec_forms --out $OUT/matvec_forms.json        # one GPU, seconds
    python -m benchmarks.matvec_forms --smoke --out /tmp/matvec.json       # CPU: the script runs

Why: on 2 H100s the 8B's decode step at `model=2` spent 16 us a layer in its output projection,
[1 x 2048] x [2048 x 4096] a device, where one GPU's [1 x 4096] x [4096 x 4096] took 13.8 us
(BENCHMARKS.md "Tensor and data parallel on 2 GPUs"): its optimized HLO has the dot rewritten
into a multiply and a column reduction (XLA's GPU simplifier strength-reduces dots it deems too
small for a GEMM; one GPU's stays a GEMM). Each
shape (Llama-3.1-8B and 3.2-3B, one GPU and a device of `model=2`) is timed in three forms:
- `model`: the model's einsum, `bshk,hkd->bsd` with the weight [H, hd, D] (what runs today);
- `transposed`: the weight stored [D, H, hd], `bshk,dhk->bsd`: a reduction, if there is one,
  runs along rows (contiguous), the layout XLA's row reductions read at full width;
- `padded`: the single row padded to 128 rows with zeros, big enough to stay a GEMM.
Each record: median microseconds a call over `--reps` launches of 64 chained calls, each with a
weight of its own (a decode step's worth; a call includes the one small kernel that feeds its
output to the next call's input), the weight bytes over that time against the copy bandwidth
measured in the same run, and what XLA compiled it to (`gemm`, `reduce`, `dot` or `other`, from
the optimized HLO).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import (copy_bandwidth, device_facts, median_time,
                               run_cases_to_json)

# (name, query heads a device, head dim, hidden size)
SHAPES = (("llama-3.1-8b", 32, 128, 4096), ("llama-3.1-8b/model=2", 16, 128, 4096),
          ("llama-3.2-3b", 24, 128, 3072), ("llama-3.2-3b/model=2", 12, 128, 3072))
FORMS = ("model", "transposed", "padded")
CHAIN = 64  # calls a timed launch makes, one after the other (a decode step's 2 x 32 layers)
PAD_ROWS = 128


def compiled_as(text: str) -> str:
  """What the optimized HLO does with the dot: a GEMM (cuBLAS or a Triton GEMM fusion), a plain
  dot, a reduction (the dot rewritten to multiply + reduce), or something else."""
  if "gemm" in text or "cublas" in text or "__triton_gemm" in text:
    return "gemm"
  if " dot(" in text:
    return "dot"  # left to the backend's dot (the CPU's)
  return "reduce" if "reduce(" in text else "other"


def form_fn(form: str):
  import jax
  import jax.numpy as jnp

  def one(x, w):  # x [B, 1, H, hd]
    if form == "model":
      return jnp.einsum("bshk,hkd->bsd", x, w)
    if form == "transposed":
      return jnp.einsum("bshk,dhk->bsd", x, w)
    rows = jnp.pad(x, ((0, 0), (0, PAD_ROWS - x.shape[1]), (0, 0), (0, 0)))
    return jnp.einsum("bshk,hkd->bsd", rows, w)[:, :1]

  def chain(x, ws):
    def body(x, w):  # the output feeds the next call's input, as layers do
      y = one(x, w)
      return x + y[..., :1, None].astype(x.dtype) * 1e-3, None
    return jax.lax.scan(body, x, ws)[0]
  return jax.jit(one), jax.jit(chain)


def time_forms(reps: int, bw: float, shapes=SHAPES) -> list[dict]:
  import jax
  import jax.numpy as jnp
  recs = []
  for name, h, hd, d in shapes:
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (1, 1, h, hd), jnp.float32).astype(jnp.bfloat16)
    # A weight per chained call (as layers have): one reused would stay in the L2 cache.
    stack = jax.random.normal(kw, (CHAIN, h, hd, d), jnp.float32).astype(jnp.bfloat16)
    w_model = stack[0]
    for form in FORMS:
      w, ws = ((jnp.transpose(w_model, (2, 0, 1)), jnp.transpose(stack, (0, 3, 1, 2)))
               if form == "transposed" else (w_model, stack))
      one, chain = form_fn(form)
      ref = jnp.einsum("bshk,hkd->bsd", x.astype(jnp.float32), w_model.astype(jnp.float32))
      err = float(jnp.max(jnp.abs(one(x, w).astype(jnp.float32) - ref)))
      text = one.lower(x, w).compile().as_text()
      med, _ = median_time(lambda: jax.block_until_ready(chain(x, ws)), warmup=2, reps=reps)
      us = med / CHAIN * 1e6
      recs.append({"shape": name, "heads": h, "hidden": d, "form": form,
                   "compiled_as": compiled_as(text), "us": us, "max_abs_err": err,
                   "of_copy_bw": w.nbytes / (us * 1e-6) / bw})
  return recs


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--smoke", action="store_true", help="small shapes on CPU (checks the script)")
  args = p.parse_args()
  shapes = (("tiny", 4, 16, 64),) if args.smoke else SHAPES
  bw = 1.0 if args.smoke else copy_bandwidth()
  failed = run_cases_to_json({"forms": lambda: time_forms(1 if args.smoke else args.reps, bw,
                                                          shapes)},
                             args.out, {**device_facts(), "copy_bw": bw}, "")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
