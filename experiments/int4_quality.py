"""int4's quality, measured before building it (issue 54: a 4-bit cache is optional, "build it only
if its quality holds; otherwise say what it measured"; its own target: pooled NLL within +0.5%).

No int4 storage exists: this runs an `eval` sweep with `--kv-dtype int8` while the cache's one
quantizer (`pallas_kernels.quant.quantize`, which every cache write calls) rounds to 4-bit
levels instead, so every method, kernel, key smoothing and KV offset runs unchanged:

- `row`: 15 levels (-7..7) with the int8 format's one scale per (token, KV head): exactly what a
  packed int4 cache with a scale per row would store.
- `g32`: 15 levels with a scale per 32 channels (4 scales a 128-channel row), its dequantized
  values then stored in int8 with the row's scale. That adds int8's rounding (at most half an
  int8 step) to each value, so it bounds a grouped int4 cache's error from above, by what the
  int8 cache itself costs (+0.02-0.06% NLL on Qwen2.5-Coder-1.5B).

    python experiments/int4_quality.py --levels g32 --out OUT -- --model qwen2.5-coder-1.5b \\
        --dtype bfloat16 --methods full --task ppl --samples 100 --task-arg n_scored=256 \\
        --lengths 16k --cache-len 18432

writes OUT/results.jsonl with `kv_dtype` "int4_row" / "int4_g32" (and method labels to match),
and with `--base DIR` (the same sweep's records in the model's dtype) prints the pooled NLL
against them with its paired-bootstrap interval, as `jax_longctx.app.report` does for 8 bits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

LEVELS = 7.0  # symmetric 4-bit levels, as int8 uses +-127
GROUP = 32


def _levels(x):
  """x [..., n] fp32 -> (integers in [-7, 7] as fp32, scale [..., 1]): x ~= values * scale."""
  import jax.numpy as jnp
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, amax / LEVELS, 1.0)
  return jnp.clip(jnp.round(x / scale), -LEVELS, LEVELS), scale


def int4_quantize(levels: str):
  """A stand-in for quant.quantize that rounds int8 requests to 4-bit levels (see above)."""
  import jax.numpy as jnp

  from pallas_kernels import quant
  eight_bit = quant.quantize

  def quantize(x, dtype):
    if jnp.dtype(dtype).name != "int8":
      return eight_bit(x, dtype)
    xf = x.astype(jnp.float32)
    if levels == "row":
      values, scale = _levels(xf)
      return quant.Quantized(values.astype(jnp.int8), scale)
    values, scale = _levels(xf.reshape(*xf.shape[:-1], xf.shape[-1] // GROUP, GROUP))
    return eight_bit((values * scale).reshape(xf.shape), dtype)

  return quantize


def relabel(path: str, levels: str) -> None:
  """The sweep's int8 labels as what its cache held."""
  records = [json.loads(line) for line in open(path)]
  name = f"int4_{levels}"
  for r in records:
    if r.get("kv_dtype") == "int8":
      r["kv_dtype"] = name
      r["method"] = f"{r['method'].removesuffix(' int8')} {name}"
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  os.replace(path + ".tmp", path)


def compare(out: str, base_dir: str) -> list[str]:
  """The pooled NLL of each int4 cell in out/results.jsonl against the same method's cell in the
  model's dtype in base_dir/results.jsonl (the texts both ran): printed and written to
  out/int4_vs_base.md."""
  from jax_longctx.app.gap_stats import LEVEL, nll_by_seed, paired_relative
  from pallas_kernels.quant import EIGHT_BIT, KV_DTYPES
  model_dtypes = set(KV_DTYPES) - set(EIGHT_BIT)
  load = lambda d: [json.loads(line) for line in open(os.path.join(d, "results.jsonl"))]  # noqa: E731
  mine, base = load(out), load(base_dir)
  lines = []
  for r in sorted({(r["method"], r["length"], r["kv_dtype"]) for r in mine
                  if r["task"] == "ppl" and r["kv_dtype"].startswith("int4")}):
    method, n, kv = r
    plain = method.removesuffix(" " + kv)
    base_labels = {b["method"] for b in base if b["length"] == n
                   and b.get("kv_dtype") in model_dtypes and b["method"].startswith(plain)}
    for label in sorted(base_labels):
      gap = paired_relative(nll_by_seed(mine, method, n), nll_by_seed(base, label, n))
      if gap is not None:
        lines.append(f"- {method} vs {label} at {n} tokens: pooled NLL {100 * gap.value:+.3f}% "
                     f"[{100 * gap.low:+.3f}, {100 * gap.high:+.3f}] ({LEVEL:.0%} paired "
                     f"bootstrap) over {gap.n_texts} texts")
  print("\n".join(lines))
  with open(os.path.join(out, "int4_vs_base.md"), "w") as f:
    f.write(f"# int4 (simulated: experiments/int4_quality.py) against {base_dir}\n\n")
    f.writelines(line + "\n" for line in lines)
  return lines


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--levels", choices=("row", "g32"), required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--base", help="a sweep's directory with the same texts in the model's dtype")
  p.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then `eval` arguments")
  args = p.parse_args(argv)
  from jax_longctx.app import cli
  from pallas_kernels import quant
  quant.quantize = int4_quantize(args.levels)
  eval_args = [a for a in args.eval_args if a != "--"]
  rc = cli.main(["eval", *eval_args, "--kv-dtype", "int8", "--out", args.out])
  relabel(os.path.join(args.out, "results.jsonl"), args.levels)
  if args.base:
    compare(args.out, args.base)
  return rc


if __name__ == "__main__":
  sys.exit(main())
