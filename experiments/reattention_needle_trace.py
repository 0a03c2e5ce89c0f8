"""Which layers of ReAttention select the needle: a diagnostic for passkey / niah failures.

    python experiments/reattention_needle_trace.py --model default --task passkey --length 32k \
        --depth 0.5 --steps 8

Runs one sample through ReAttention (prefill, then greedy decoding) and records, for the last
prompt chunk and every decode step, which fraction of the needle's tokens each layer's scope
holds (the needle = the prompt tokens that spell the expected answer). Prints a layer x step
table (100 = every needle token attended) and the answer.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx import load

from jax_longctx.app import tasks
from jax_longctx.run.generation import Sampling, decode_loop, prefill
from jax_longctx.methods import get

from experiments import scope_trace


def answer_positions(tokenizer, ids, answers) -> list[int]:
  """Token positions of every occurrence of the expected answers in the prompt."""
  pieces = [tokenizer.decode([t]) for t in ids]
  starts = np.cumsum([0] + [len(x) for x in pieces])
  text = "".join(pieces)
  out = set()
  for answer in answers:
    at = text.find(answer)
    while at >= 0:
      out.update(i for i in range(len(ids)) if starts[i] < at + len(answer) and starts[i + 1] > at)
      at = text.find(answer, at + 1)
  if not out:
    raise SystemExit(f"answers {answers} not found in the prompt")
  return sorted(out)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="default")
  p.add_argument("--task", default="passkey")
  p.add_argument("--length", default="32k")
  p.add_argument("--depth", type=float, default=0.5)
  p.add_argument("--seed", type=int, default=1)
  p.add_argument("--steps", type=int, default=8)
  args = p.parse_args()
  lm = load(args.model)
  task = tasks.get(args.task)
  sample = task.make(lm.tokenizer, tasks.parse_length(args.length), args.depth, args.seed,
                     chat=True)
  ids = lm.tokenizer.encode(sample.prompt)
  needle = answer_positions(lm.tokenizer, ids, sample.expected)
  method = get("reattention_traced", steps="all", from_position=len(ids) - 1)
  cache_len = len(ids) + args.steps + 1
  cache, last = prefill(lm.params, lm.config, [ids], method, cache_len=cache_len)
  out, steps, _ = decode_loop(lm.params, cache, last, jnp.asarray([-1], jnp.int32),
                              jax.random.key(0), cfg=lm.config, method=method,
                              max_new_tokens=args.steps, sampling=Sampling())
  trace = {(layer, last): 100.0 * np.isin(needle, slots).mean()
           for (_, layer, last), slots in scope_trace.taken().items()}
  print(f"{args.task} {args.length} depth {args.depth}: needle tokens {needle[0]}..{needle[-1]} "
        f"of {len(ids)}; answer {lm.tokenizer.decode(np.asarray(out)[0].tolist())!r}, "
        f"expected {sample.expected}")
  steps_seen = sorted({s for _, s in trace})
  print("layer | " + " | ".join(f"q@{s}" for s in steps_seen))
  for layer in range(lm.config.num_layers):
    print(f"{layer:5d} | " + " | ".join(f"{trace.get((layer, s), float('nan')):5.0f}"
                                        for s in steps_seen))
  sys.stdout.flush()


if __name__ == "__main__":
  main()
