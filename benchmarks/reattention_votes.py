"""What ReAttention's vote count costs for a prefill chunk: sorting the votes, or a histogram.

    python -m benchmarks.reattention_votes --tokens 8192,32768,131072,1048576 \
        --out $OUT/reattention_votes.jsonl

A 512-query chunk of a 32-head model with top-4 casts 65,536 votes (token indices) a layer;
`most_voted` keeps the `clip` most voted. For each cache length (n_tokens) and vote pattern
(`spread`: votes uniform over the candidates, as random weights give; `clustered`: drawn from
512 tokens, as real attention's repeated choices) this times, per layer (32 calls in one jitted
loop), `most_voted_sorted` (sort, runs, top_k over the counts), `most_voted_counted` (a
scatter-add histogram over the cache's slots, its best blocks and slots picked by comparing
pairs; `_blocks`: by `lax.top_k` through block maxima instead; `_top_k`: by one `lax.top_k`
over all slots; `_b32`: 32-slot blocks; `_d4096`: rows up to 4,096 sorted whole)
and the same histogram with the radix select (`ops.top_n`), and checks that all keep the same
tokens.
"""

from __future__ import annotations

import argparse

from benchmarks.common import device_facts, median_time, write_json

LAYERS = 32


def radix_counted(votes, clip: int, n_tokens: int):
  """most_voted_counted with the radix select over the histogram (a trial variant)."""
  import jax.numpy as jnp

  from jax_longctx.methods.reattention_scope import _NONE
  from jax_longctx.ops.top_n import top_n

  b = votes.shape[0]
  slot = jnp.where(votes >= 0, votes, n_tokens)
  counts = jnp.zeros((b, n_tokens + 1), jnp.int32).at[jnp.arange(b)[:, None], slot].add(
      1, mode="drop")[:, :n_tokens]
  top_count, kept = top_n(counts.astype(jnp.float32), min(clip, n_tokens))
  return jnp.sort(jnp.where(top_count > 0, kept, _NONE), axis=-1).astype(jnp.int32)


def measure(n_tokens: int, spread: str, n_votes: int, clip: int) -> dict:
  import jax
  import jax.numpy as jnp

  from jax_longctx.methods.reattention_scope import most_voted_counted, most_voted_sorted

  lo, hi = 32, max(33, n_tokens - 4096)
  key = jax.random.key(n_tokens)
  if spread == "spread":
    votes = jax.random.randint(key, (1, n_votes), lo, hi, jnp.int32)
  else:
    pool = jax.random.randint(key, (512,), lo, hi, jnp.int32)
    votes = pool[jax.random.randint(jax.random.key(1), (1, n_votes), 0, 512)]
  variants = {"sorted": lambda v: most_voted_sorted(v, clip),
              "counted": lambda v: most_voted_counted(v, clip, n_tokens),
              "counted_blocks": lambda v: most_voted_counted(v, clip, n_tokens, pairwise_max=0),
              "counted_top_k": lambda v: most_voted_counted(v, clip, n_tokens, pairwise_max=0,
                                                            direct_max=n_tokens),
              "counted_b32": lambda v: most_voted_counted(v, clip, n_tokens, block=32,
                                                          pairwise_max=0),
              "counted_d4096": lambda v: most_voted_counted(v, clip, n_tokens, direct_max=4096,
                                                            pairwise_max=0),
              "counted_radix": lambda v: radix_counted(v, clip, n_tokens)}
  rec = {"n_tokens": n_tokens, "votes": n_votes, "spread": spread, "clip": clip}
  kept = {}
  for name, fn in variants.items():
    kept[name] = jax.jit(fn)(votes)

    @jax.jit
    def looped(v, fn=fn):
      def body(i, acc):  # the votes depend on i, so the loop cannot be hoisted
        return acc + jnp.sum(fn(jnp.where(v == i, -1, v)) & 1)
      return jax.lax.fori_loop(0, LAYERS, body, jnp.int32(0))

    t, _ = median_time(lambda: jax.block_until_ready(looped(votes)), warmup=2, reps=10)
    rec[f"{name}_ms"] = t / LAYERS * 1e3
  rec["same"] = all(bool(jnp.array_equal(kept["sorted"], k)) for k in kept.values())
  return rec


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--tokens", default="8192,32768,131072,1048576")
  p.add_argument("--votes", type=int, default=512 * 32 * 4)
  p.add_argument("--clip", type=int, default=127)
  p.add_argument("--out", default="reattention_votes.jsonl")
  args = p.parse_args()
  for n_tokens in map(int, args.tokens.split(",")):
    for spread in ("spread", "clustered"):
      rec = measure(n_tokens, spread, args.votes, args.clip)
      rec.update(device_facts())
      write_json(args.out, rec)
      print(rec, flush=True)


if __name__ == "__main__":
  main()
