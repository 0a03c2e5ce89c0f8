"""Star Attention on the default model against Star written a second time over transformers'
Llama (tests/helpers/hf_reference.hf_star), to tell the method's failures from ours; full
attention too.
Star (the one driver, `ctx=4`) runs on 4 fake CPU devices.

    PYTHONPATH=. python experiments/star_hf_reference.py --task passkey --depths 0.1,0.5,0.9
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--task", default="passkey")
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--depths", default="0.1,0.5,0.9")
  p.add_argument("--blocks", type=int, default=4)
  p.add_argument("--new-tokens", type=int, default=10)
  args = p.parse_args()

  from transformers import LlamaForCausalLM

  from checkpoints_convert import export_hf
  from jax_longctx.app import api
  from jax_longctx.core.options import RunOptions
  from jax_longctx.methods import get
  from jax_longctx.run.driver import generate
  from jax_longctx.app.tasks import get as get_task
  from tests.helpers.hf_reference import hf_star

  lm = api.load("default", dtype="float32")
  hf_dir = os.path.join(tempfile.mkdtemp(), "hf")
  export_hf(lm.params, lm.config, hf_dir, tokenizer_dir=lm.path)
  model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                           attn_implementation="sdpa").eval()
  task = get_task(args.task)
  options = RunOptions(mesh="ctx=4")
  for seed, depth in enumerate(float(d) for d in args.depths.split(",")):
    sample = task.make(lm.tokenizer, args.length, depth, seed, chat=True)
    doc, query = lm.apart(sample.document, sample.instruction)
    star = get("star", block_size=-(-len(doc) // args.blocks))
    rows = generate(lm.params, lm.config, [doc], star, max_new_tokens=args.new_tokens,
                    instructions=[query], options=options).tokens
    ours = lm.tokenizer.decode(rows[0])
    block = -(-len(doc) // args.blocks)
    ref = lm.tokenizer.decode(hf_star(model, doc, query, block, block, args.new_tokens)[1])
    full = lm.tokenizer.decode(hf_star(model, doc, query, len(doc), 0, args.new_tokens)[1])
    print(f"depth {depth} expected {sample.expected}\n  ours (star): {ours!r}\n"
          f"  transformers star: {ref!r}\n  transformers full: {full!r}", flush=True)


if __name__ == "__main__":
  main()
