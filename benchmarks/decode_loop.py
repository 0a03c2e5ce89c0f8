"""One-token decode attention timed inside one jitted loop: kernel variants (KernelOptions, Tiling)
over int8 and bf16 K/V, Llama-3.1-8B's attention shape (32 query / 8 KV heads, d 128), batch 1 (or
--batches: e.g. 14, the most int8 sequences of 128K an H200 holds), with no dispatch floor
(back-to-back calls from the host, as quant_kernels.py times them, sit near ~0.07 ms a call at
32K keys).

    python -m benchmarks.decode_loop --variants '{"default": {}, "groups":
        {"options": {"decode_row_groups": true}}, "splits49": {"tiling": {"key_splits": 49}}}' \
        --keys 32768,131072 --out $OUT/loop.jsonl
    python -m benchmarks.decode_loop --smoke --out /tmp/loop.jsonl          # CPU, tiny

Each loop step runs flash_attention as full attention's decode does (causal, the query at the
last position, BHTD) and feeds its output back into the query scaled by 1e-30 (a dependency, no
change), so a step's time is the attention call's kernels (split-K and merge) and that one small
fusion. `--label` names the tree in the records: for a before / after in one machine, run the
same command again from a directory holding the previous commit's kernels (`git archive REV
pallas_kernels | tar -x -C /tmp/before`, then `cd /tmp/before && PYTHONPATH=$REPO python -m
benchmarks.decode_loop ...`): `python -m` puts the working directory ahead of PYTHONPATH, so a
`PYTHONPATH=/tmp/before:.` run from the repository times the repository's kernels. A variant may
name `"dtype"` to run over that cache only. One JSON record a line: us a call (median of --reps
loops of --steps calls), the K/V bytes over that time; with --check also the call's largest
differences from the jnp reference computing the same products (`err_out`, `err_lse`).
"""

from __future__ import annotations

import argparse
import json

H, KV, D = 32, 8, 128


def _inputs(t: int, dtype: str, batch: int = 1):
  import jax
  import jax.numpy as jnp
  from pallas_kernels import quant
  keys = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(keys[0], (batch, 1, H, D), jnp.float32).astype(jnp.bfloat16)

  def kv(key, outliers):  # one sequence at a time: a batch's fp32 copy need not fit
    x = jax.random.normal(key, (1, KV, t, D), jnp.float32)
    x = x.at[..., :4].multiply(30.0) if outliers else x
    return x.astype(jnp.bfloat16) if dtype == "bfloat16" else quant.quantize(x, dtype)

  k, v = ([kv(jax.random.fold_in(key, i), outliers) for i in range(batch)]
          for key, outliers in ((keys[1], True), (keys[2], False)))
  k, v = (jax.tree.map(lambda *xs: jnp.concatenate(xs), *x) for x in (k, v))
  return q, k, v


def time_variant(q, k, v, spec: dict, *, steps: int, reps: int, backend: str) -> float:
  """Median seconds of one attention call in a loop of `steps` calls."""
  import jax.numpy as jnp
  from pallas_kernels import KernelOptions, Route, flash_attention
  from pallas_kernels.gpu import Tiling
  route = Route(backend=backend, kernels=KernelOptions(**spec.get("options", {})))
  tiling = Tiling(**spec["tiling"]) if spec.get("tiling") else None
  pos = jnp.full((q.shape[0],), _keys(k) - 1, jnp.int32)

  def attend(q, k, v):
    return flash_attention(q, k, v, causal=True, q_offset=pos, kv_len=pos + 1,
                           kv_layout="BHTD", route=route, tiling=tiling)[0]

  return time_loop(attend, q, k, v, steps=steps, reps=reps)


def time_loop(attend, q, k, v, *, steps: int, reps: int, warmup: int = 2) -> float:
  """Median seconds of one attend(q, k, v) -> out in a jitted loop of `steps` calls, each call's
  output fed back into the next query scaled by 1e-30 (a dependency, no change)."""
  import jax
  import jax.numpy as jnp
  from jax_longctx.app.bench_measure import median_time

  @jax.jit
  def loop(q, k, v):
    def body(_, q):
      return q + attend(q, k, v) * jnp.asarray(1e-30, q.dtype)
    return jax.lax.fori_loop(0, steps, body, q)

  sec, _ = median_time(lambda: jax.block_until_ready(loop(q, k, v)), warmup=warmup, reps=reps)
  return sec / steps


def check_variant(q, k, v, spec: dict, *, backend: str) -> dict:
  """Largest differences of one call's (out, lse) from the jnp reference computing the same
  products (int8 keys: the queries quantized per row, as both GPU kernels do by default)."""
  import jax.numpy as jnp
  from pallas_kernels import KernelOptions, Route, flash_attention, quant
  from pallas_kernels.gpu import Tiling
  tiling = Tiling(**spec["tiling"]) if spec.get("tiling") else None
  pos = jnp.full((q.shape[0],), _keys(k) - 1, jnp.int32)

  def call(route, tiling=None):
    out, lse = flash_attention(q, k, v, causal=True, q_offset=pos, kv_len=pos + 1,
                               kv_layout="BHTD", route=route, tiling=tiling)
    return out.astype(jnp.float32), lse

  got = call(Route(backend=backend, kernels=KernelOptions(**spec.get("options", {}))), tiling)
  ref = call(Route(backend="reference",
                   kernels=KernelOptions(decode_int8_products=quant.is_quantized(k))))
  return {f"err_{name}": float(jnp.max(jnp.abs(a - b)))
          for name, a, b in zip(("out", "lse"), got, ref)}


def _keys(k) -> int:
  import jax
  return jax.tree.leaves(k)[0].shape[2]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--variants", default='{"default": {}}',
                 help='JSON: name -> {"options": {...}, "tiling": {...}, "dtype": ...}')
  p.add_argument("--keys", default="32768,131072")
  p.add_argument("--dtypes", default="int8,bfloat16")
  p.add_argument("--batches", default="1", help="sequences a call, e.g. 1,14")
  p.add_argument("--label", default="this tree")
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--out", required=True, help="JSONL file the records are appended to")
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, kernels interpreted")
  p.add_argument("--check", action="store_true",
                 help="also record each variant's largest difference from the jnp reference")
  args = p.parse_args()
  import jax
  from benchmarks.common import device_facts
  variants = json.loads(args.variants)
  keys = [256] if args.smoke else [int(x) for x in args.keys.split(",")]
  steps, reps = (2, 1) if args.smoke else (args.steps, args.reps)
  facts = device_facts()
  cells = [(b, t, dtype) for b in map(int, args.batches.split(",")) for t in keys
           for dtype in args.dtypes.split(",")]
  with open(args.out, "a") as out:
    for batch, t, dtype in cells:
      q, k, v = jax.block_until_ready(_inputs(t, dtype, batch))
      nbytes = sum(a.nbytes for a in jax.tree.leaves((k, v)))
      for name, spec in variants.items():
        if spec.get("dtype", dtype) != dtype:
          continue
        rec = {"tree": args.label, "batch": batch, "keys": t, "dtype": dtype, "variant": name,
               "spec": spec}
        try:
          backend = "gpu" if args.smoke else "auto"
          sec = time_variant(q, k, v, spec, steps=steps, reps=reps, backend=backend)
          rec.update(us=round(sec * 1e6, 2), tb_s=round(nbytes / sec / 1e12, 3))
          if args.check:
            rec.update(check_variant(q, k, v, spec, backend=backend))
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
          rec["error"] = str(e)[:300]
        rec.update(facts)
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
      del q, k, v


if __name__ == "__main__":
  main()
