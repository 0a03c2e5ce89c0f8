"""Which of Star Attention's approximated blocks misleads it (docs/CLAIMS.md, Star): a sample's
Star cache with chosen context blocks' KV replaced by the exact KV (full attention's chunked
prefill of the same context: keys after RoPE at slot = position, as Star keeps them), then the
query and greedy decoding as `eval` runs them. A block that turns a wrong answer right when
exact is the one whose approximation made it.

    python experiments/star_block_ablation.py --model qwen2.5-coder-1.5b --length 16k \
        --seeds 1 --depth 0.3 --exact none 3 2 2,3 all \
        --out docs/results/star/ablation/qwen2.5-coder-1.5b_16k_seed1.json

Blocks are numbered from 0 as Star cuts them (a quarter of the context each, by default); block
0 is the anchor and block 1's KV is exact already when the anchor is a whole block. `--exact`
takes variants: `none` (Star itself), `all` (every block exact: full attention's context under
Star's query step), or a comma list of blocks. Runs on one device (CPU: fp32 by default);
prints a line per variant and writes JSON records (the sample, the variant, the prediction, its
score, where each needle sits) after each sample.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def _splice(star, full, blocks, block: int):
  """The Star cache with the context KV of `blocks` taken from full attention's cache (slot =
  position), matched by position; new buffers throughout (the query step donates the cache it
  is given)."""
  import jax
  import jax.numpy as jnp
  out = []
  for s, e in zip(star.state, full.state):
    c = s.context
    pos = c.pos  # [B, T]
    chosen = jnp.zeros(pos.shape, bool)
    for j in blocks:
      chosen |= (pos >= j * block) & (pos < (j + 1) * block)
    idx = jnp.clip(pos, 0, e.k.shape[2] - 1)[:, None, :, None]
    exact = lambda x: jnp.take_along_axis(x, idx, axis=2)  # noqa: E731
    keep = chosen[:, None, :, None]
    context = c.replace(k=jnp.where(keep, exact(e.k), c.k), v=jnp.where(keep, exact(e.v), c.v))
    out.append(s.replace(context=context))
  return jax.tree.map(jnp.copy, star.replace(state=tuple(out)))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="default")
  p.add_argument("--length", default="16k")
  p.add_argument("--depth", type=float, default=0.3)
  p.add_argument("--seeds", default="1,6")
  p.add_argument("--exact", nargs="+", default=["none", "3", "all"])
  p.add_argument("--dtype", default="float32")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)

  from jax_longctx.app.api import load
  from jax_longctx.app.tasks.base import parse_length
  from jax_longctx.app.tasks.niah import Niah
  from jax_longctx.methods import get

  lm = load(args.model, dtype=args.dtype)
  length, task = parse_length(args.length), Niah(variant="multikey")
  star = get("star")
  variants = [v if v in ("none", "all") else tuple(int(b) for b in v.split(","))
              for v in args.exact]
  records = []
  for seed in (int(s) for s in args.seeds.split(",")):
    sample = task.make(lm.tokenizer, length, args.depth, seed, chat=True)
    doc, query = lm.apart(sample.document, sample.instruction)
    lay = star.context_layout(len(doc), 1)
    needles = _needles(lm, sample, lay.block)
    for variant, tokens in zip(variants, ablate(lm, doc, query, variants, task.max_new_tokens)):
      blocks = _blocks(variant, lay)
      prediction = lm.tokenizer.decode(tokens)
      rec = {"seed": seed, "length": length, "depth": args.depth, "exact": list(blocks),
             "prediction": prediction, "expected": list(sample.expected),
             "score": task.score(prediction, sample), "block": lay.block,
             "needles": [{"block": b, "value": v, "asked": v in sample.expected}
                         for b, v in needles]}
      records.append(rec)
      print(f"seed {seed} exact {variant}: {rec['score']:.0%} {prediction.strip()!r} "
            f"(expected {sample.expected}; needles by block {needles})", flush=True)
    if args.out:  # after each sample: a long run that dies keeps what it finished
      with open(args.out, "w") as f:
        json.dump({"model": args.model, "dtype": args.dtype, "records": records}, f, indent=1)
  return 0


def _blocks(variant, lay) -> tuple:
  return (tuple(range(lay.n_blocks)) if variant == "all" else () if variant == "none"
          else tuple(variant))


def ablate(lm, doc, query, variants, max_new_tokens: int) -> list:
  """Greedy tokens of Star on one sequence (document ids, query ids) for each variant: "none",
  "all" or a tuple of blocks whose context KV is full attention's."""
  import jax.numpy as jnp
  import numpy as np

  from jax_longctx.methods import get
  from jax_longctx.run import context_encoding as ce
  from jax_longctx.run import generation
  from jax_longctx.run.driver import generate

  star, options = get("star"), lm.run_options()
  lay = star.context_layout(len(doc), 1)
  context = np.zeros((1, lay.n_blocks * lay.block), np.int32)
  context[0, :len(doc)] = doc
  lengths = np.asarray([len(doc)], np.int32)
  width = -(-len(query) // ce.INSTRUCTION_ROUND) * ce.INSTRUCTION_ROUND
  room = width + max_new_tokens + 64
  star_cache = ce.encode_blocks(
      lm.params, *map(jnp.asarray, ce._rows(context, lengths, lay)), jnp.asarray(lengths),
      cfg=lm.config, method=star, layout=lay, room=room, options=options)
  full_cache, _ = generation.prefill(lm.params, lm.config, [doc], get("full"),
                                     cache_len=len(doc) + room, options=options)
  original, out = generation.prefill_context, []
  try:
    for variant in variants:
      cache = _splice(star_cache, full_cache, _blocks(variant, lay), lay.block)

      def prefill_context(params, cfg, contexts, queries, method, *, decode_room, options,
                          cache=cache):  # the spliced cache instead of phase 1
        q_len = jnp.asarray([len(q) for q in queries], jnp.int32)
        return ce.encode_appended(params, ce.padded(queries, width), q_len, cache, cfg=cfg,
                                  method=method, options=options)

      generation.prefill_context = prefill_context
      run = generate(lm.params, lm.config, [doc], star, instructions=[query],
                     max_new_tokens=max_new_tokens, stop_tokens=lm.stop_tokens(),
                     options=options, cache_len=len(doc) + room)
      out.append(list(run.tokens[0]))
  finally:
    generation.prefill_context = original
  return out


def _needles(lm, sample, block: int):
  """(Star block, value) of each needle: its first token's index in the document // block."""
  doc = sample.document
  out = []
  for m in re.finditer(r"One of the special magic \w+ for \S+ is: (\S+)\. ", doc):
    out.append((len(lm.tokenizer.encode(doc[:m.start()])) // block, m.group(1)))
  return out


if __name__ == "__main__":
  sys.exit(main())
