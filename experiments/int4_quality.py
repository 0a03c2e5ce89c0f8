"""int4's quality, measured before building it (issue 54: a 4-bit cache is optional, "build it only
if its quality holds; otherwise say what it measured"; its own target: pooled NLL within +0.5%).

No int4 storage exists: this runs an `eval` sweep with `--kv-dtype int8` while every cache write
is rounded to 4-bit levels first, so every method, kernel, key smoothing and KV offset runs
unchanged. Two ways in:

- `row`, `g32` replace the cache's one quantizer (`pallas_kernels.quant.quantize`), symmetric:
  - `row`: 15 levels (-7..7) with the int8 format's one scale per (token, KV head): exactly what
    a packed int4 cache with a scale per row would store.
  - `g32`: 15 levels with a scale per 32 channels (4 scales a 128-channel row).
- `kivi32`, `static` (experiments/int4_designs_proxy.py's two designs that held quality on its
  1K text) wrap `KVCache.write` (ops/cache.py), which gets a step's new keys and values apart,
  [B, S, KV, d] each (S tokens), and `Attention.__call__` (model/decoder.py), whose `ctx.layer`
  and `ctx.valid` say which layer writes and which of its S tokens are real (a prefill chunk's
  tail past the prompt is padding). A traced attention step must make exactly one write and the
  write exactly two `store_like` calls, and every `store_like` must come from such a write (a
  method storing its cache another way would go unrounded): otherwise the run stops. Full
  attention and ReAttention (one device) write this way.
  - `kivi32` (KIVI, arXiv 2402.02750): keys per channel over each group of 32 consecutive tokens
    of a write, asymmetric (the group's min / max: a scale and zero point, 16 levels 0..15);
    values per token over groups of 32 channels, asymmetric. A write's trailing partial group
    (all of a one-token decode write) and a group holding padding stay whole: a real KIVI cache
    keeps that residual whole only until its group fills, so a decode-scored token here reads
    every earlier decoded key whole (KIVI: the last 31 at most): slightly optimistic.
  - `static` (KVQuant's uniform variant, arXiv 2401.18079): keys per channel, uniform asymmetric
    16 levels inside a range (min, max per method, layer, KV head and channel over every real
    token, the first too, as the proxy's) calibrated before the sweep and clipped to it; values
    per token over the whole row, asymmetric. The ranges come from the same `eval` on one
    held-out ppl text a length (`heldout=True`: the prose's last 30%, which no evaluation text
    overlaps, where the proxy's seed-7 text is an evaluation seed's), the hook recording what
    each method's cache stores instead of rounding; saved in OUT/int4_static_ranges.npz.
    ReAttention caches keys before RoPE, as the proxy's `cal` rounded them; full attention
    after, so its ranges are wider (RoPE mixes each channel pair: ~1.7x on SmolLM2-135M).
    `--keep-first` keeps each sequence's first token (keys and values) whole: `static_first`.
  g32, kivi32 and static then store their dequantized values in int8 with the row's scale. That
  adds int8's rounding (at most half an int8 step) to each value, so it bounds the design's error
  from above, by what the int8 cache itself costs (+0.02-0.06% NLL on Qwen2.5-Coder-1.5B).

    python -m experiments.int4_quality --levels g32 --out OUT -- --model qwen2.5-coder-1.5b \\
        --dtype bfloat16 --methods full --task ppl --samples 100 --task-arg n_scored=256 \\
        --lengths 16k --cache-len 18432

    python -m experiments.int4_quality --levels kivi32 --out OUT --base BASE -- \\
        --model qwen2.5-coder-1.5b --dtype bfloat16 --methods full,reattention \\
        --method-arg reattention.n_local=16384 --method-arg reattention.clip=511 --task ppl \\
        --samples 100 --task-arg n_scored=256 --lengths 16k --cache-len 18432

and the same with `--levels static` and `--levels static --keep-first` (each its own OUT; BASE:
`jax-longctx eval` with the same arguments and no --kv-dtype). Writes OUT/results.jsonl with
`kv_dtype` "int4_<levels>" (and method labels to match), and with `--base DIR` (the same sweep's
records in the model's dtype) prints the pooled NLL against them with its paired-bootstrap
interval, as `jax_longctx.app.report` does for 8 bits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from unittest import mock

LEVELS = 7.0  # symmetric 4-bit levels, as int8 uses +-127
GROUP = 32
DESIGNS = ("kivi32", "static")  # the write-hook levels (module doc)


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


def round_write(levels, k, v, valid, positions, key_range=None, keep_first=False):
  """One cache write's keys and values k, v [B, S, KV, d] fp32 as `levels` (kivi32 / static)
  stores them, dequantized; valid [B, S]: its real tokens; positions [B, S]; key_range: static's
  calibrated (lo, hi) [KV, d]. Asymmetric rounding errs by at most half a step, (max - min) / 30
  of the group's (or the calibrated channel's) range."""
  import jax.numpy as jnp

  from experiments.int4_designs_proxy import UNIFORM, asym, grouped, to_levels
  if levels == "kivi32":  # a key group is rounded only if it is full of real tokens
    real = jnp.broadcast_to(valid[:, :, None, None], k.shape).astype(jnp.float32)
    full = grouped(real, GROUP, 1, lambda a, ax: jnp.broadcast_to(jnp.min(a, ax, keepdims=True),
                                                                   a.shape))
    return jnp.where(full > 0, grouped(k, GROUP, 1, asym), k), grouped(v, GROUP, 3, asym)
  lo, hi = (jnp.asarray(a, jnp.float32) for a in key_range)
  kq, vq = to_levels(k, (hi + lo) / 2, jnp.maximum((hi - lo) / 2, 1e-12), UNIFORM), asym(v, -1)
  if keep_first:
    first = (positions == 0)[:, :, None, None]
    kq, vq = jnp.where(first, k, kq), jnp.where(first, v, vq)
  return kq, vq


class WriteHook:
  """kivi32 / static through `KVCache.write` (module doc); record=True: static's calibration,
  each write's key (min, max) over its real tokens into `ranges` {(method, layer): (lo, hi)}
  [KV, d] numpy, the write itself unchanged."""

  def __init__(self, levels, keep_first=False, ranges=None, record=False):
    self.levels, self.keep_first, self.record = levels, keep_first, record
    self.ranges = {} if ranges is None else ranges
    self.steps, self.stores = [], None  # [ctx, method, writes] of the steps being traced

  @contextlib.contextmanager
  def installed(self):
    import jax

    from jax_longctx.model import decoder
    from jax_longctx.ops import cache
    from pallas_kernels import quant
    store = self.store(quant.store_like)
    patches = (mock.patch.object(decoder.Attention, "__call__", self.attention(
                   decoder.Attention.__call__)),
               mock.patch.object(cache.KVCache, "write", self.write(cache.KVCache.write)),
               mock.patch.object(quant, "store_like", store),
               mock.patch.object(cache, "store_like", store))
    jax.clear_caches()  # steps traced without the hooks (or with others) are traced again
    try:
      with contextlib.ExitStack() as stack:
        for patch in patches:
          stack.enter_context(patch)
        yield self
        jax.effects_barrier()  # every recording callback has run
    finally:
      jax.clear_caches()

  def attention(self, call):
    def hooked(attn, x, state, ctx, method, decode):
      self.steps.append([ctx, method, 0])
      try:
        out = call(attn, x, state, ctx, method, decode)
      finally:
        writes = self.steps.pop()[2]
      if writes != 1:
        raise SystemExit(f"int4_quality: {method.name} layer {ctx.layer} made {writes} KVCache "
                         f"writes in one step, not 1: --levels {self.levels} cannot round them")
      return out
    return hooked

  def write(self, write):
    def hooked(kv, positions, k_new, v_new, *, route, valid=None):
      import jax
      import jax.numpy as jnp
      if not self.steps:
        raise SystemExit("int4_quality: a KVCache write outside an attention step")
      step = self.steps[-1]
      ctx, method = step[:2]
      step[2] += 1
      if k_new.ndim != 4 or v_new.shape != k_new.shape or k_new.shape[:2] != ctx.valid.shape:
        raise SystemExit(f"int4_quality: {method.name} writes k {k_new.shape}, v {v_new.shape} "
                         f"for tokens {ctx.valid.shape}: not [B, S, KV, d]")
      key = (method.name, ctx.layer)
      k, v = k_new.astype(jnp.float32), v_new.astype(jnp.float32)
      if self.record:
        real = ctx.valid[:, :, None, None]
        lo = jnp.min(jnp.where(real, k, jnp.inf), (0, 1))
        hi = jnp.max(jnp.where(real, k, -jnp.inf), (0, 1))
        jax.debug.callback(lambda lo, hi, key=key: self.widen(key, lo, hi), lo, hi)
        k, v = k_new, v_new
      else:
        if self.levels == "static" and key not in self.ranges:
          raise SystemExit(f"int4_quality: no calibrated key range for {key}")
        k, v = round_write(self.levels, k, v, ctx.valid, positions, self.ranges.get(key),
                           self.keep_first)
      self.stores = 0
      try:
        out = write(kv, positions, k, v, route=route, valid=valid)
      finally:
        stores, self.stores = self.stores, None
      if stores != 2:
        raise SystemExit(f"int4_quality: a KVCache write made {stores} store calls, not 2")
      return out
    return hooked

  def store(self, store_like):
    def hooked(x, like, heads_axis=None):
      if self.stores is None:
        raise SystemExit("int4_quality: a cache stored outside KVCache.write would go unrounded")
      self.stores += 1
      return store_like(x, like, heads_axis)
    return hooked

  def widen(self, key, lo, hi):
    import numpy as np
    old = self.ranges.get(key)
    self.ranges[key] = ((lo, hi) if old is None
                        else (np.minimum(old[0], lo), np.maximum(old[1], hi)))


def calibrate(eval_args: list[str], out: str) -> dict:
  """static's key ranges: the sweep's eval (its model, methods and cache) on one held-out ppl text
  a length, recording instead of rounding; saved in out/int4_static_ranges.npz."""
  import numpy as np

  from jax_longctx.app import cli
  hook = WriteHook("static", record=True)
  with tempfile.TemporaryDirectory() as tmp, hook.installed():
    rc = cli.main(["eval", *eval_args, "--kv-dtype", "int8", "--task", "ppl", "--task-arg",
                   "heldout=True", "--samples", "1", "--first-sample", "0", "--out", tmp])
  if rc or not hook.ranges or not all(np.isfinite(r).all() for r in hook.ranges.values()):
    raise SystemExit(f"int4_quality: the calibration failed (status {rc}, {len(hook.ranges)} "
                     "layers recorded)")
  os.makedirs(out, exist_ok=True)
  np.savez(os.path.join(out, "int4_static_ranges.npz"),
           **{f"{m}.{layer}.{side}": r[i] for (m, layer), r in hook.ranges.items()
              for i, side in enumerate(("lo", "hi"))})
  return hook.ranges


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
  from jax_longctx.app.records import load_results
  mine, base = (load_results(d, repair=False) for d in (out, base_dir))
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
  p.add_argument("--levels", choices=("row", "g32", *DESIGNS), required=True)
  p.add_argument("--keep-first", action="store_true",
                 help="static: each sequence's first token stored whole")
  p.add_argument("--out", required=True)
  p.add_argument("--base", help="a sweep's directory with the same texts in the model's dtype")
  p.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then `eval` arguments")
  args = p.parse_args(argv)
  if args.keep_first and args.levels != "static":
    p.error("--keep-first is static's")
  from jax_longctx.app import cli
  from pallas_kernels import quant
  eval_args = [a for a in args.eval_args if a != "--"]
  run = ["eval", *eval_args, "--kv-dtype", "int8", "--out", args.out]
  label = args.levels + ("_first" if args.keep_first else "")
  if args.levels in DESIGNS:
    ranges = calibrate(eval_args, args.out) if args.levels == "static" else None
    with WriteHook(args.levels, args.keep_first, ranges).installed():
      rc = cli.main(run)
  else:
    with mock.patch.object(quant, "quantize", int4_quantize(args.levels)):
      rc = cli.main(run)
  from jax_longctx.app.records import unpack_results
  relabel(unpack_results(args.out), label)
  if args.base:
    compare(args.out, args.base)
  return rc


if __name__ == "__main__":
  sys.exit(main())
