"""One-token GEMV x [N, K] @ w [K, F] (bf16): XLA's jnp.dot against each config of
pallas_kernels.gemv.SWEEP, with an elementwise copy of the weight as the bandwidth anchor.

    python benchmarks/gemv.py --out $OUT/gemv.json          # H200: the decode projections
    python benchmarks/gemv.py --smoke --out /tmp/gemv.json  # tiny shapes on CPU (interpreted)

Each timed call runs --ops independent products, each on its own x and its own weight copy (so
no weight is served from the 50-60 MB L2, and XLA's dot merger finds no shared operand to merge
two dots by); ms is the median call over --reps after a warm-up, divided by --ops, so launch gaps
between kernels count as in a decode step. TB/s: weight bytes read per second (the copy: bytes
read + written, `w * s` with a runtime scalar s, one XLA elementwise kernel per weight);
of_copy: the one over the other, as decode_profile.py compares an op's TB/s with the copy
bandwidth (a pure read can pass 100%). err: max |y - reference| (jnp.dot with fp32
accumulation, same inputs). "does not tile": gemv would run the reference (not timed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import device_facts, median_time  # noqa: E402

SHAPES = ((1, 4096, 6144), (1, 4096, 4096), (1, 4096, 28672), (1, 14336, 4096))
SMOKE_SHAPES = ((1, 256, 256), (3, 256, 128))


def _inputs(n, k, f, ops, copies, seed=0):
  import jax
  import jax.numpy as jnp
  kx, kw = jax.random.split(jax.random.key(seed))
  xs = [jax.random.normal(jax.random.fold_in(kx, i), (n, k), jnp.float32).astype(jnp.bfloat16)
        for i in range(ops)]  # separate buffers: slicing one in the jit would add a kernel each
  ws = [(jax.random.normal(jax.random.fold_in(kw, i), (k, f), jnp.float32) * 0.02)
        .astype(jnp.bfloat16) for i in range(copies)]
  return xs, ws


def _timed(fn, *args, reps):
  import jax
  out = jax.block_until_ready(fn(*args))  # compile + warm-up
  med, _ = median_time(lambda: jax.block_until_ready(fn(*args)), warmup=1, reps=reps)
  return med, out


def bench_shape(n, k, f, configs, args):
  import jax
  import jax.numpy as jnp
  from pallas_kernels import gemv
  wbytes = k * f * 2
  copies = args.ops
  xs, ws = _inputs(n, k, f, args.ops, copies)
  ref = gemv.reference(xs[0], ws[0]).astype(jnp.float32)
  shape = {"n": n, "k": k, "f": f, "weight_bytes": wbytes, "ops": args.ops, "copies": copies}

  def many(product):
    return jax.jit(lambda xs, ws: tuple(product(xs[i], ws[i % copies]) for i in range(args.ops)))

  scale = jnp.asarray(1.0, jnp.bfloat16)
  copy = jax.jit(lambda s, ws: tuple(ws[i % copies] * s for i in range(args.ops)))
  t_copy, _ = _timed(copy, scale, ws, reps=args.reps)
  copy_bw = 2 * wbytes * args.ops / t_copy
  recs = [{**shape, "case": "copy", "ms": t_copy / args.ops * 1e3, "TB_s": copy_bw / 1e12}]

  def record(case, fn, cfg=None):
    t, out = _timed(fn, xs, ws, reps=args.reps)
    err = float(jnp.max(jnp.abs(out[0].astype(jnp.float32) - ref)))
    rate = wbytes * args.ops / t
    recs.append({**shape, "case": case, "config": cfg, "ms": t / args.ops * 1e3,
                 "TB_s": rate / 1e12, "of_copy": rate / copy_bw, "err": err})

  record("xla_dot", many(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                         .astype(x.dtype)))
  backend = "gpu" if args.smoke else "auto"
  for cfg in configs:
    c = dataclasses.asdict(cfg)
    if not gemv.tiles(k, f, cfg):
      recs.append({**shape, "case": "gemv", "config": c, "tiles": False})
      continue
    try:
      record("gemv", many(lambda x, w, cfg=cfg: gemv.gemv(x, w, backend=backend, config=cfg)),
             c)
    except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result
      recs.append({**shape, "case": "gemv", "config": c,
                   "error": f"{type(e).__name__}: {str(e)[:300]}"})
  return recs


def markdown(recs) -> str:
  lines = ["| N x K x F | case | config (bf, splits, bk, warps, stages, dot) | us | TB/s | "
           "of copy | max abs err |", "|---|---|---|---|---|---|---|"]
  for r in recs:
    c = r.get("config")
    cfg = ", ".join(str(v) for v in c.values()) if c else "-"
    if "ms" not in r:
      note = r.get("error", "does not tile")[:80]
      lines.append(f"| {r['n']}x{r['k']}x{r['f']} | {r['case']} | {cfg} | {note} ||||")
      continue
    of = f"{r['of_copy']:.1%}" if "of_copy" in r else "-"
    err = f"{r['err']:.3g}" if "err" in r else "-"
    lines.append(f"| {r['n']}x{r['k']}x{r['f']} | {r['case']} | {cfg} | {r['ms'] * 1e3:.2f} | "
                 f"{r['TB_s']:.3f} | {of} | {err} |")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="JSON file")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--ops", type=int, default=32,
                 help="products (and weight copies) per timed call")
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script)")
  args = p.parse_args()
  from pallas_kernels import gemv
  shapes, configs = SHAPES, gemv.SWEEP
  if args.smoke:
    args.reps, args.ops = 1, 2
    shapes = SMOKE_SHAPES
    configs = (gemv.GemvConfig(64, 2, 64, 4, 2), gemv.GemvConfig(64, 2, 64, 4, 2, dot=True),
               gemv.DEFAULT)
  facts = {**device_facts(), "default_config": dataclasses.asdict(gemv.DEFAULT)}
  print(json.dumps(facts), flush=True)
  recs = []
  for n, k, f in shapes:
    recs += bench_shape(n, k, f, configs, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:  # rewritten after each shape: a cut-off run keeps its part
      json.dump({"facts": facts, "records": recs}, fh, indent=1)
    print(markdown([r for r in recs if (r["n"], r["k"], r["f"]) == (n, k, f)]), flush=True)


if __name__ == "__main__":
  main()
