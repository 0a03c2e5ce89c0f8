"""Which layers of a CItruS cache still hold the needle when the answer starts: a diagnostic.

    python experiments/citrus_needle_trace.py --model default --length 8k --depth 0.1 \
        --seed 0 --method citrus_shared [--method-arg n_sink=4]

Runs one passkey sample through the document chunks, the instruction passes and the final
eviction, then prints per layer how many of the 16 tokens from "The pass key is <key>" the
answering cache keeps and its first kept positions (attention sinks), then the greedy answer.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx import load

from jax_longctx.app import tasks
from jax_longctx.run.generation import Sampling, decode_loop, prefill
from jax_longctx.methods import get, parse_method_args

NEEDLE_TOKENS = 16


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="default")
  p.add_argument("--length", default="8k")
  p.add_argument("--depth", type=float, default=0.1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--method", default="citrus_shared")
  p.add_argument("--method-arg", action="append", default=[])
  args = p.parse_args()
  lm = load(args.model)
  length = tasks.parse_length(args.length)
  sample = tasks.get("passkey").make(lm.tokenizer, length, args.depth, args.seed, chat=True)
  doc, ins = lm.apart(sample.document, sample.instruction)
  key = sample.expected[0]
  start = len(lm.tokenizer.encode(sample.document[:sample.document.index(f"The pass key is {key}")]))
  needle = set(range(start, start + NEEDLE_TOKENS))
  method = get(args.method, **parse_method_args(args.method_arg))
  cache, last = prefill(lm.params, lm.config, [doc], method, cache_len=length + 1024,
                        decode_room=12, instructions=[ins])
  print(f"{args.method} {method.hparams()} passkey {args.length} depth {args.depth} "
        f"seed {args.seed}: needle at tokens {start}..{start + NEEDLE_TOKENS - 1}")
  print("layer  needle tokens kept  first kept positions")
  for layer, state in enumerate(cache.state):
    c = method.answer_cache(state)
    kept = np.asarray(c.pos[0])[:int(c.n[0])].tolist()
    print(f"{layer:5d}  {len(needle & set(kept)):8d}/{NEEDLE_TOKENS}     {kept[:6]}")
  out, steps, _ = decode_loop(lm.params, cache, last, jnp.asarray(lm.stop_tokens()),
                              jax.random.key(0), cfg=lm.config, method=method, max_new_tokens=12,
                              sampling=Sampling())
  print(f"expected {key}; answer: {lm.tokenizer.decode(np.asarray(out)[0, :int(steps)])!r}")


if __name__ == "__main__":
  main()
