"""Where the Mosaic decode kernel's time goes (attention/mgpu_decode.py): its configs, and variants
with one stage left out.

    python -m experiments.mgpu_decode_costs --out $OUT/costs.jsonl \
        [--keys 131072] [--configs 64x3x2x2,128x2x2x1] [--leave-out none,convert,pv,max]

Llama-3.1-8B's attention shape (32 query / 8 KV heads, d 128) over an int8 cache, batch 1, the
kernel and its merge in a jitted loop (benchmarks/decode_loop.py's measure: µs a call, median of
--reps loops of --steps calls). Configs are BLOCK_KVxSTAGESxLANDINGxPER_CORE[xa] (DecodeConfig;
xa: Mosaic's automatic barriers on). Stages left
out (trace-time patches; every result but `none`'s is wrong, only its time counts):
  convert     the value tile's conversion into SMEM (by the TMA warpgroup);
  pv          P^T's store and the O^T += V^T P^T product;
  max         the column max across the warpgroup (the running max stays as it was);
  scores      the key product (zeros instead);
  compute     everything the compute warpgroup does but wait for its tiles and free them;
  keys, values  (--cache int4) the key / value tiles' dequantization (by their warpgroups);
  residual    (--cache int4) the residual group's XLA work (read as empty);
joined by "+", several at once (compute+convert: the TMA streams alone). No GPU counters are
read; a stage's time is the difference of a variant that does it and one that leaves it out (the
device method's "time variants that leave one stage out").
"""

from __future__ import annotations

import argparse
import contextlib
import json
from unittest import mock

import jax
import jax.numpy as jnp

from benchmarks.decode_loop import time_loop
from jax_longctx.app.bench_measure import device_facts
from pallas_kernels import quant, quant4
from pallas_kernels.attention import (mgpu_decode, mgpu_decode_compute, mgpu_decode_ops,
                                      mgpu_int4_decode, mgpu_int4_tiles)
from pallas_kernels.mgpu_common import plgpu

H, KV, D = 32, 8, 128


def _waits_only(i, state, *, smem, barriers, cfg, **_):
  """A step that only waits for the slot's key tile, both scales and the converted value tile,
  and frees them: the TMA warpgroup's pipeline alone."""
  slot = jax.lax.rem(i, jnp.int32(cfg.stages))
  for ready in (barriers.k, barriers.k_scale, barriers.v_scale, barriers.v):
    if ready is not None:  # the 4-bit kernel's tiles come with no scales
      plgpu.barrier_wait(ready.at[slot])
  plgpu.barrier_arrive(barriers.k_free.at[slot])
  plgpu.barrier_arrive(barriers.v_free.at[slot])
  return state


def _no_scores(self, k_tile, q_smem, *, after_issue):
  """Scores without the key product (zeros)."""
  after_issue()
  return self.layout(jnp.zeros((self.bk, mgpu_decode.ROWS), jnp.float32), plgpu.Layout.WGMMA)


def _no_residual(qr, *_, **__):
  """The 4-bit kernel's residual group read as empty (its XLA work left out)."""
  b, kvh, rows, d = qr.shape
  return (jnp.zeros((b, kvh, d, rows), jnp.float32),
          jnp.full((b, kvh, rows), -jnp.inf, jnp.float32))


STAGES = ("convert", "compute", "scores", "pv", "max")  # the 8-bit kernel's
INT4_STAGES = ("keys", "values", "residual", "compute", "scores", "pv", "max")  # 4-bit


def leaving_out(stage: str):
  """A context in which the kernel's module has `stage` left out: one of STAGES, several joined
  by "+" (compute+convert: the TMA streams alone), or none (nothing patched)."""
  ops = mgpu_decode_ops.DecodeOps
  patches = {"convert": (mgpu_decode, "_convert", lambda *a, **k: None),
             "compute": (mgpu_decode_compute, "_step", _waits_only),
             "scores": (ops, "scores", _no_scores),
             "pv": (ops, "accumulate", lambda self, acc, p, v, pt: acc),
             "max": (ops, "column_max", lambda self, s, exchange: self.layout(
                 jnp.zeros((mgpu_decode.ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(0)))}
  noop = lambda *a, **k: None  # noqa: E731
  patches.update(keys=(mgpu_int4_tiles, "dequantize_keys", noop),
                 values=(mgpu_int4_tiles, "dequantize_values", noop),
                 residual=(mgpu_int4_decode, "_residual", _no_residual))
  names = [name for name in stage.split("+") if name != "none"]
  if unknown := [name for name in names if name not in patches]:
    # refused before any patch is made: one made and never undone (the refusal leaving the
    # stack unexited) left `compute` patched for every later trace in the process
    raise ValueError(f"--leave-out {stage!r}: {unknown[0]!r} is not one of none, "
                     f"{', '.join(patches)}")
  stack = contextlib.ExitStack()
  for name in names:
    stack.enter_context(mock.patch.object(*patches[name]))
  return stack


def time_config(q, k, v, config, stage: str, *, steps: int, reps: int) -> float:
  pos = jnp.full((q.shape[0],), k.shape[2] - 1, jnp.int32)

  def attend(q, k, v):
    if quant4.is_int4(k):
      return mgpu_int4_decode.attention(q, k, v, pos, pos + 1, causal=True, scale=D ** -0.5,
                                        merge_kernel=True, config=config)[0]
    return mgpu_decode.attention(q, k, v, pos, pos + 1, causal=True, scale=D ** -0.5,
                                 kv_layout="BHTD", merge_kernel=True, config=config)[0]

  jax.clear_caches()  # the kernel's jit would otherwise serve the previous variant's compile
  with leaving_out(stage):  # the patches act while the loop is traced (its first call)
    return time_loop(attend, q, k, v, steps=steps, reps=reps, warmup=1)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--keys", type=int, default=131072)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--configs", default="64x3x2x2")
  p.add_argument("--cache", default="int8", choices=("int8", "int4"),
                 help="int4: attention/mgpu_int4_decode.py over the 'int4' format")
  p.add_argument("--leave-out", default="none,convert,pv,max")
  p.add_argument("--steps", type=int, default=64)
  p.add_argument("--reps", type=int, default=5)
  args = p.parse_args()
  keys = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(keys[0], (args.batch, 1, H, D), jnp.float32).astype(jnp.bfloat16)
  k, v = (jax.random.normal(key, (args.batch, KV, args.keys, D)) for key in keys[1:])
  if args.cache == "int4":  # the 'int4' format, every key group written (no residual open)
    valid = jnp.ones((args.batch, args.keys), bool)
    k = quant4.grouped_keys_written_whole(k, valid, jnp.bfloat16)
    v = quant4.quantize(v, quant4.GROUP)
  else:
    k, v = (quant.quantize(x, jnp.int8) for x in (k, v))
  facts = device_facts()
  with open(args.out, "a") as out:
    for spec in args.configs.split(","):
      bk, stages, landing, per_core = map(int, spec.split("x")[:4])
      config = mgpu_decode.DecodeConfig(block_kv=bk, stages=stages, landing=landing,
                                        per_core=per_core, auto_barriers=spec.endswith("xa"))
      for stage in args.leave_out.split(","):
        rec = {"keys": args.keys, "batch": args.batch, "config": spec, "left_out": stage}
        try:
          rec["us"] = round(time_config(q, k, v, config, stage, steps=args.steps,
                                        reps=args.reps) * 1e6, 2)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
          rec["error"] = str(e)[:300]
        rec.update(facts)
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
  main()
