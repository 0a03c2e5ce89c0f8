"""What one layer of a RefreshKV decode step costs, part by part.

    python -m benchmarks.refreshkv_step --model llama-3.1-8b --contexts 32768,131072 \
        --out $OUT/refreshkv_step.jsonl

For one layer at the named shape (bf16, batch 1, a random full cache C_f filled to the
context, K = context / 8): exact attention over C_f (`full_attend`); that attention and then the
pooled scores of a refresh (`scores`); the same two from one QK^T in XLA einsums, K read once
(`scores_one_pass`); the top K of L scores by `lax.top_k` (`top_k_sort`) and by the radix select
(`top_n_radix`; its counting passes alone: `radix_threshold`; under each plan of RADIX_PLANS:
`top_n[b<bits>_<counting>_<cumsums>]`, the same tokens under every plan); a partial step (C_p
add, gathered attention, eviction: `partial`). --parts picks parts by name prefix. Each part
runs once per layer inside one
jitted loop, divided by the layer count, so host dispatch is not counted; `*_all_layers`
multiplies back to a whole decode step.
"""

from __future__ import annotations

import argparse

from benchmarks.common import device_facts, median_time, write_json

# (bits, counting, one_cumsum) plans of `top_n` timed beside the default.
RADIX_PLANS = [(4, "compare", False), (4, "compare", True), (4, "rows", True), (8, "rows", True),
               (2, "rows", True), (11, "scatter", True)]


def measure(cfg, context: int, parts: tuple[str, ...] = ("",)) -> dict:
  import jax
  import jax.numpy as jnp

  from jax_longctx.ops.cache import KVCache
  from jax_longctx.methods import AttnContext
  from jax_longctx.methods.full import Full
  from jax_longctx.methods.refreshkv import PartialCache
  from jax_longctx.methods.snapkv import pooled_scores
  from jax_longctx.core.rope import inv_freq
  from jax_longctx.ops.top_n import _nth_largest_key, _ordered_keys, top_n

  keys = jax.random.split(jax.random.key(0), 4)
  shape = (1, cfg.num_kv_heads, context, cfg.head_dim)
  full = KVCache(jax.random.normal(keys[0], shape, jnp.bfloat16),
                 jax.random.normal(keys[1], shape, jnp.bfloat16))
  q = jax.random.normal(keys[2], (1, 1, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
  pos = jnp.full((1, 1), context - 1, jnp.int32)
  ctx = AttnContext(layer=0, q_pos=pos, valid=jnp.ones((1, 1), bool), freqs=inv_freq(cfg),
                    cfg=cfg)
  k_pos = jnp.arange(context, dtype=jnp.int32)[None, :]
  n_top = context // 8
  priority = jax.random.uniform(keys[3], (1, cfg.num_kv_heads, context), jnp.float32)
  part = PartialCache.top(k_pos, priority, n_top)
  n = cfg.num_layers

  def nudged(x, i):  # depends on the iteration, so XLA cannot hoist the work out of the loop
    return x + jnp.asarray(i % 2, x.dtype) * jnp.asarray(1e-3, x.dtype)

  def looped(step):
    @jax.jit
    def run(q, full, priority, part):
      def body(i, acc):
        return acc + step(nudged(q, i), full, nudged(priority, i), part)
      return jax.lax.fori_loop(0, n, body, jnp.float32(0))
    return lambda: jax.block_until_ready(run(q, full, priority, part))

  def attend(q, full, priority, part):
    return jnp.sum(Full().attend_cache(full, q, ctx)[1])

  def scores(q, full, priority, part):
    _, lse = Full().attend_cache(full, q, ctx)
    s = pooled_scores(q, full.k, pos, k_pos, lse, ctx.valid, 7)
    return jnp.sum(s[..., :8]) - jnp.sum(lse)

  def scores_one_pass(q, full, priority, part):  # out and pooled scores from one QK^T in XLA
    b, _, h, d = q.shape
    kvh = full.k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, d)
    s = jnp.einsum("bkgd,bktd->bkgt", qg, full.k, preferred_element_type=jnp.float32) * d**-0.5
    lse = jax.nn.logsumexp(s, axis=-1, keepdims=True)
    p = jnp.exp(s - lse)
    out = jnp.einsum("bkgt,bktd->bkgd", p.astype(full.v.dtype), full.v,
                     preferred_element_type=jnp.float32)
    pooled = jax.lax.reduce_window(jnp.max(p, axis=2), -jnp.inf, jax.lax.max, (1, 1, 7),
                                   (1, 1, 1), "SAME")
    return jnp.sum(out[..., :8]) + jnp.sum(pooled[..., :8])

  def sort_top(q, full, priority, part):
    return jnp.sum(jax.lax.top_k(priority, n_top)[1][..., :8]).astype(jnp.float32)

  def radix_top(q, full, priority, part):
    return jnp.sum(top_n(priority, n_top)[1][..., :8]).astype(jnp.float32)

  def threshold(q, full, priority, part):  # the radix select's counting passes alone
    return jnp.sum(_nth_largest_key(_ordered_keys(priority), n_top)).astype(jnp.float32)

  def partial(q, full, priority, part):
    added = part.add(pos[:, 0], ctx.valid[:, 0])
    out = added.attend_rows(full, q, route=ctx.options.route)
    return jnp.sum(out[..., :8].astype(jnp.float32)) + jnp.sum(added.evict().pos[..., :8])

  def radix_plan(bits, counting, one_cumsum):
    def step(q, full, priority, part):
      idx = top_n(priority, n_top, bits=bits, counting=counting, one_cumsum=one_cumsum)[1]
      return jnp.sum(idx[..., :8]).astype(jnp.float32)
    return (f"top_n[b{bits}_{counting}_{'one' if one_cumsum else 'two'}]", step)

  rec = {"context": context, "top_n": n_top, "layers": n}
  steps = [("full_attend", attend), ("scores", scores), ("scores_one_pass", scores_one_pass),
           ("top_k_sort", sort_top),
           ("top_n_radix", radix_top), ("radix_threshold", threshold), ("partial", partial)]
  steps += [radix_plan(*plan) for plan in RADIX_PLANS]
  for name, step in steps:
    if not any(name.startswith(p) for p in parts):
      continue
    t, _ = median_time(looped(step), warmup=2, reps=10)
    rec[f"{name}_ms"] = t / n * 1e3
    rec[f"{name}_ms_all_layers"] = t * 1e3
  return rec


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="llama-3.1-8b")
  p.add_argument("--contexts", default="32768,131072")
  p.add_argument("--parts", default="", help="comma-separated name prefixes (default: all)")
  p.add_argument("--out", default="refreshkv_step.jsonl")
  args = p.parse_args()

  from jax_longctx import preset

  cfg = preset(args.model, dtype="bfloat16")
  for context in map(int, args.contexts.split(",")):
    rec = {"model": args.model, **measure(cfg, context, tuple(args.parts.split(","))),
           **device_facts()}
    write_json(args.out, rec)
    print(rec, flush=True)


if __name__ == "__main__":
  main()
