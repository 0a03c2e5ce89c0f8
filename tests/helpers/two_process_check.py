"""Star Attention (or mesh ReAttention: METHOD reattention_mesh; or SnapKV tensor and data
parallel: METHOD tensor_parallel, rows over data=4 (two groups a process), heads over model=2)
across 2 processes x 4 CPU devices on localhost (jax.distributed, gloo collectives), against the
same run in one process with 8 devices (tests/test_distributed.py):
    python -m tests.helpers.two_process_check PORT PROCESS_ID OUT_DIR METHOD...  (one a process)
    python -m tests.helpers.two_process_check single OUT_DIR METHOD...  (8 devices, one process)
each METHOD in turn in the same process(es), its output in OUT_DIR/METHOD.pPROCESS_ID.npz or
OUT_DIR/METHOD.single.npz.
"""

import os
import sys

import jax
import numpy as np


def run(out_file, method="star"):
  from jax_longctx.core.options import RunOptions
  from jax_longctx.methods import get
  from jax_longctx.run.driver import generate
  from jax_longctx.model import random_params
  from tests.conftest import TINY_LLAMA3, mesh_config
  cfg = mesh_config(**TINY_LLAMA3)
  params = jax.device_get(random_params(cfg, seed=1))  # host copies: replicated inputs
  rng = np.random.default_rng(2)
  contexts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (45, 30)]
  queries = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (4, 6)]
  ctx = RunOptions(mesh="ctx=8")
  if method == "star":
    run = generate(params, cfg, contexts, get("star", block_size=8), max_new_tokens=5,
                   instructions=queries, options=ctx)
    rows, logits = run.tokens, run.logits
  elif method == "tensor_parallel":  # 2 prompts padded to 4 rows; weights placed from the host
    from jax_longctx.run.driver import uncached_logits
    prompts = [c + q for c, q in zip(contexts, queries)]
    options = RunOptions(mesh="data=4,model=2")
    rows = generate(params, cfg, prompts, get("snapkv", budget=16, window=4), max_new_tokens=5,
                    cache_len=128, options=options).tokens
    logits = uncached_logits(params, cfg, np.asarray([p[:32] for p in prompts]), options)
  else:  # a 128-token cache, 16 tokens a device, each process holding half of it
    settings = get(method, n_global=4, n_local=16, span=4, top_k=2, clip=3, chunk=8)
    prompts = [c + q for c, q in zip(contexts, queries)]
    run = generate(params, cfg, prompts, settings, max_new_tokens=5, cache_len=128, options=ctx)
    rows, logits = run.tokens, run.logits
  np.savez(out_file, tokens=np.asarray(rows), logits=np.asarray(logits))
  print("OK")


if __name__ == "__main__":
  if sys.argv[1] == "single":
    side, out_dir, methods = "single", sys.argv[2], sys.argv[3:]
  else:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=2,
                               process_id=int(sys.argv[2]), local_device_ids=[0, 1, 2, 3])
    side, out_dir, methods = f"p{sys.argv[2]}", sys.argv[3], sys.argv[4:]
  for name in methods:
    run(os.path.join(out_dir, f"{name}.{side}.npz"), name)
