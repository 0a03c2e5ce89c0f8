"""Memory of a continued-pretraining step at a model's scale, computed on CPU: no GPU, nothing
allocated.

    python -m benchmarks.cpt_memory --config train_cpt/configs/llama3.1-8b_refreshkv_paper.toml \
        --devices 1,2 --out benchmarks/results/cpt_memory_cpu.json

For each device count, in its own process on that many fake CPU devices, the train step of the
config (fsdp over every device, one row per device) is compiled from abstract arguments and its
`memory_analysis()` read (per device). Two things make XLA:CPU differ from a GPU, and are set so
that the compile says what it can:
- XLA:CPU drops the optimization barriers of `jax.checkpoint` and CSE then merges the recomputed
  forward back into the original, undoing rematerialization (tests/test_cpt_memory.py shows it);
  `--xla_disable_hlo_passes=cse_barrier_expander` keeps them, as XLA:GPU does.
- The prefix's attention on GPU is cuDNN's flash attention (memory O(L)); on CPU the same call
  forms [H, L, L] fp32 scores (8.4 GB a layer at 8K), so the compile runs `prefix_block` query
  rows at a time instead (default 512: 0.5 GB of scores a block, an upper bound for flash).
XLA:CPU also computes bf16 matmuls in fp32 (fp32 copies of bf16 operands), so its temp bytes
are an upper bound for a GPU. Beside them, each record has `analytic`: the step's bytes per
device counted from the shapes (see `analytic_bytes`), the estimate to read for a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks.common import child_result, run_child

GIB = 2 ** 30
# Variants compiled at every device count: the config as written, and without rematerialization
# or the chunked cross-entropy (what the step took before them).
VARIANTS = {"remat+chunked_ce": {}, "no_remat_unchunked_ce": {"remat": "none", "loss_chunk": 0}}


def analytic_bytes(cfg, model_cfg, devices: int, moment_bytes: int = 4) -> dict:
  """Bytes per device of one step with the config's settings, counted from shapes.

  State (sharded over `devices`): fp32 master weights, two AdamW moments of `moment_bytes`
  each. During the step: the fp32 gradient sum of the micro-batches (sharded), the compute-dtype
  copy of the weights (sharded; FSDP gathers two layers' at a time, the one running and the
  next), the compute-dtype gradients of one micro-batch before they are added (bounded by a
  whole tree), the activations kept for the backward pass (remat="layer": the residual stream
  and the MLP output not yet added, 2 x [rows, T, D] a layer; otherwise also the two norms'
  outputs, q/k/v and the attention output, gate, up and their product), one layer recomputed in the backward pass (its MLP's
  three [rows, T, F] and its q/k/v/out projections, each with a gradient of the same size), and
  the cross-entropy chunk (fp32 logits, their exp and their gradient: 3 x [rows, chunk, V]).
  Not counted: XLA's fusion temporaries and the AdamW update, taken as fused leaf by leaf.
  """
  import numpy as np

  p = model_cfg.num_params()
  c = np.dtype(cfg.compute_dtype).itemsize
  rows, t = cfg.micro_batch // devices, cfg.row_len
  d, f, layers = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_layers
  per_layer = (p - model_cfg.vocab_size * d * (1 + (not model_cfg.tie_word_embeddings))) / layers
  qkvo = (2 * model_cfg.num_heads + 2 * model_cfg.num_kv_heads) * model_cfg.head_dim
  chunk = cfg.loss_chunk or t
  out = {
      "master_weights_fp32": 4 * p / devices,
      "adamw_moments": 2 * moment_bytes * p / devices,
      "gradient_sum_fp32": 4 * p / devices,
      "compute_weights": c * p / devices + (2 * c * per_layer if devices > 1 else 0),
      "micro_batch_gradients": c * p / devices,
      "saved_activations": layers * rows * t * c * (2 * d if cfg.remat == "layer" else
                                                     4 * d + qkvo + 3 * f),
      "one_layer_recomputed": 2 * rows * t * (3 * f + qkvo) * c,
      "cross_entropy_chunk": 3 * rows * chunk * model_cfg.vocab_size * 4,
  }
  out["total"] = sum(out.values())
  return out


def child(args) -> None:
  import jax

  from train_cpt import state as state_lib
  from train_cpt.config import load_config
  from train_cpt.loop import jit_step
  from train_cpt.optimizer import optimizer

  n = len(jax.devices())
  sets = dict(a.split("=", 1) for a in args.set)
  for name, variant in VARIANTS.items():
    if args.only and name not in args.only.split(","):
      continue
    cfg = load_config(args.config, {"fsdp": 0, "micro_batch": n, "prefix_block": args.prefix_block,
                                    **variant, **sets})
    source = state_lib.Source(cfg)
    mesh, opt = state_lib.training_mesh(cfg), optimizer(cfg)
    state = state_lib.abstract_state(source.config, opt, mesh)
    t0 = time.time()
    compiled = jit_step(cfg, source.config, opt, state).lower(
        state["params"], state["opt_state"], state_lib.abstract_batch(cfg, mesh)).compile()
    mem = compiled.memory_analysis()
    rec = {"variant": name, "devices": n, "model": cfg.model, "row_len": cfg.row_len,
           "micro_batch_per_device": cfg.micro_batch // n, "remat": cfg.remat,
           "loss_chunk": cfg.loss_chunk, "prefix_block": cfg.prefix_block,
           "compute_dtype": cfg.compute_dtype, "compile_s": round(time.time() - t0, 1),
           "xla_cpu": {k: getattr(mem, f"{k}_size_in_bytes") for k in
                       ("argument", "output", "alias", "temp", "generated_code")},
           "analytic": analytic_bytes(cfg, source.config, n),
           "analytic_bf16_moments": analytic_bytes(cfg, source.config, n, moment_bytes=2),
           "analytic_8bit_moments": analytic_bytes(cfg, source.config, n, moment_bytes=1),
           "jax": jax.__version__}
    child_result(rec)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default="train_cpt/configs/llama3.1-8b_refreshkv_paper.toml")
  p.add_argument("--devices", default="1,2")
  p.add_argument("--prefix-block", type=int, default=512)
  p.add_argument("--only", default="", help="comma list of variants (default: all)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--out", default="cpt_memory_cpu.json")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return child(args)
  records = []
  for n in map(int, args.devices.split(",")):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"--xla_force_host_platform_device_count={n} "
        "--xla_disable_hlo_passes=cse_barrier_expander"))
    done = run_child(__file__, ["--config", args.config, "--prefix-block", str(args.prefix_block),
                                "--only", args.only, *[x for s in args.set for x in ("--set", s)]],
                     cwd=ROOT, env=env)
    if done.returncode:
      raise SystemExit(done.stderr[-3000:])
    for r in done.records:
      records.append(r)
      print(f"{r['devices']} device(s) {r['variant']}: temp "
            f"{r['xla_cpu']['temp'] / GIB:.1f} GiB, arguments "
            f"{r['xla_cpu']['argument'] / GIB:.1f} GiB; analytic "
            f"{r['analytic']['total'] / GIB:.1f} GiB ({r['compile_s']} s)", flush=True)
  with open(args.out, "w") as f:
    json.dump({"command": " ".join(sys.argv), "records": records}, f, indent=1)


if __name__ == "__main__":
  main()
