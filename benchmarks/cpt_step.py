"""Step time, model FLOPs utilization and peak memory of a continued-pretraining step.

    python -m benchmarks.cpt_step --config train_cpt/configs/llama3.1-8b_refreshkv_paper.toml \
        --out $OUT/cpt_step.json [--set KEY=VALUE ...]

The config's model (the paper's: random weights of the Llama-3.1-8B shape, L 8092 + S 50, K 2048,
remat per layer, chunked cross-entropy), fsdp over every device, one row per device per micro-batch
and `--accumulation` micro-batches per step (default 1; the paper's 64 rows on 4 devices are 16).
The step runs `--warmup` times (compile included), then `--steps` times: the median is the step
time; a step that does not fit the devices' memory is recorded as `"fits": false` with the error's
first line. In the same process, a bf16 [8192 x 8192] x [8192 x 8192] matmul on every device gives
the measured GEMM rate MFU is also taken against (beside the data-sheet peak); FLOPs are
`train_cpt.loop.flops_per_step` (3 x the forward; remat's recomputation is not counted). Peak
memory: `memory_stats()` of each device after the steps. `--smoke` runs a 2-layer model at L 64 on
CPU to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.common import device_facts, median_time, write_json

SMOKE = {"model": "random:smoke", "prefix_len": 64, "suffix_len": 8, "top_k": 16,
         "compute_dtype": "float32", "loss_chunk": 16}


def gemm_rate(n: int = 8192) -> float:
  """Measured bf16 FLOP/s of one n x n x n matmul on each device, summed over the devices."""
  import jax
  import jax.numpy as jnp

  mesh_rates = []
  for dev in jax.devices():
    a, b = (jax.device_put(jnp.ones((n, n), jnp.bfloat16), dev) for _ in range(2))
    f = jax.jit(lambda a, b: a @ b)
    t, _ = median_time(lambda: f(a, b).block_until_ready(), warmup=3, reps=10)
    mesh_rates.append(2 * n ** 3 / t)
    del a, b
  return sum(mesh_rates)


def _say(line: str) -> None:  # progress, so a run stopped at its time limit shows how far it got
  print(line, file=sys.stderr, flush=True)


def measure(args) -> dict:
  import jax
  import numpy as np

  from train_cpt import sharding
  from train_cpt import state as state_lib
  from train_cpt.config import load_config
  from train_cpt.loop import _peak_flops, flops_per_step, jit_step
  from train_cpt.optimizer import optimizer

  n = len(jax.devices())
  sets = dict(a.split("=", 1) for a in args.set)
  overrides = {"fsdp": 0, "micro_batch": n, "global_batch": n * args.accumulation,
               "steps": 1000, **(SMOKE if args.smoke else {}), **sets}
  cfg = load_config(args.config, overrides)
  source = state_lib.Source(cfg)
  mesh, opt = state_lib.training_mesh(cfg), optimizer(cfg)
  t0 = time.perf_counter()
  state = state_lib.init_state(source.params(mesh), opt, mesh)
  jax.block_until_ready(state)
  _say(f"state made in {time.perf_counter() - t0:.1f} s")
  step = jit_step(cfg, source.config, opt, state)
  rng = np.random.default_rng(0)
  batch = jax.device_put(rng.integers(0, source.config.vocab_size, (
      cfg.accumulation, cfg.micro_batch, cfg.row_len), dtype=np.int32),
                         sharding.batch_sharding(mesh))
  times = []
  for i in range(args.warmup + args.steps):
    t0 = time.perf_counter()
    params, opt_state, loss, _ = step(state["params"], state["opt_state"], batch)
    loss = float(loss)  # waits for the step
    if i >= args.warmup:
      times.append(time.perf_counter() - t0)
    _say(f"step {i + 1}{' (warm-up)' if i < args.warmup else ''}: "
         f"{time.perf_counter() - t0:.2f} s, loss {loss:.4f}")
    state = {"params": params, "opt_state": opt_state}
  step_s = statistics.median(times)
  flops = flops_per_step(cfg, source.config)
  rate, peak = gemm_rate(args.gemm_n), _peak_flops()
  stats = [d.memory_stats() or {} for d in jax.devices()]
  return {"fits": True, "model": cfg.model, "devices": n, "moments_dtype": cfg.moments_dtype,
          "row_len": cfg.row_len, "top_k": cfg.top_k,
          "micro_batch": cfg.micro_batch, "accumulation": cfg.accumulation, "remat": cfg.remat,
          "loss_chunk": cfg.loss_chunk, "prefix_block": cfg.prefix_block,
          "compute_dtype": cfg.compute_dtype, "step_s": step_s, "step_s_all": times,
          "tokens_per_s": cfg.global_batch * cfg.row_len / step_s, "last_loss": loss,
          "model_flops_per_step": flops, "gemm_flops_per_s": rate,
          "mfu_vs_measured_gemm": flops / step_s / rate,
          "mfu_vs_datasheet": flops / step_s / peak if peak else None,
          "peak_bytes_per_device": [s.get("peak_bytes_in_use") for s in stats],
          "bytes_limit_per_device": [s.get("bytes_limit") for s in stats],
          "settings": sets, **device_facts()}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default="train_cpt/configs/llama3.1-8b_refreshkv_paper.toml")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a train_cpt setting; repeat for several")
  p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--gemm-n", type=int, default=8192)
  p.add_argument("--smoke", action="store_true", help="a 2-layer model on CPU (checks the script)")
  p.add_argument("--out", default="cpt_step.json")
  args = p.parse_args()
  if args.smoke:
    # A preset for the smoke run only: the 135M's shape with 2 layers.
    from jax_longctx.core.config import PRESETS, preset
    PRESETS["smoke"] = preset("smollm2-135m", num_layers=2)
    args.warmup, args.steps, args.gemm_n = 1, 2, 256
  try:
    rec = measure(args)
  except Exception as e:  # out of device memory: recorded (what "does not fit" was measured as)
    if "RESOURCE_EXHAUSTED" not in str(e) and "Out of memory" not in str(e):
      raise
    rec = {"fits": False, "error": str(e).strip().splitlines()[0][:500], "config": args.config,
           "settings": dict(a.split("=", 1) for a in args.set), **device_facts()}
  write_json(args.out, rec)
  print(json.dumps({k: v for k, v in rec.items() if k != "step_s_all"}), flush=True)


if __name__ == "__main__":
  main()
