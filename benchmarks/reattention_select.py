"""What ReAttention's selection costs per layer, beside the attention it feeds.

    python -m benchmarks.reattention_select --model llama-3.1-8b --contexts 32768,131072 \
        --out $OUT/reattention_select.jsonl

For one layer at the named shape (bf16, batch 1, random pre-RoPE cache filled to the context):
`select_ms` times the selection alone (top-k scoring kernel, votes, spans, scope) and
`layer_ms` the whole attention step (selection + gather + RoPE + attention), and `prefix_ms` the
selection's stages cumulatively (score: the top-k kernel; vote: + vote counting and clip; spans:
+ span expansion; select: + the compacted scope), for a decode step (1 query) and a prefill
chunk (512 queries). Each is run once per layer inside one jitted loop and divided by the layer
count, so host dispatch is not counted. `select_ms_topk_kernel`: the selection with the top-k
kernels' own running sets (KernelOptions topk_few_rows / topk_many_rows = "kernel": the fused
Triton kernel for 1 query, the Mosaic kernel's rounds for 512);
`select_ops`: the kernels one selection launches (benchmarks.common.launched_ops); with
--profile, `select_kernels`: each device kernel's microseconds per selection from a profiler
trace (benchmarks.common.device_kernel_times). Multiply by the layer count and divide by the decode
step that benchmarks/decode.py measures to get the share of the step spent selecting.
"""

from __future__ import annotations

import argparse
import functools

from benchmarks.common import (device_facts, device_kernel_times, launched_ops,
                               median_time, write_json)


def measure(cfg, method, context: int, n_q: int, profile: bool = False) -> dict:
  import jax
  import jax.numpy as jnp

  from jax_longctx.ops.cache import KVCache
  from jax_longctx.methods import AttnContext
  from jax_longctx.methods.reattention_scope import (most_voted, pairwise_items, select_scope,
                                                     span_runs, vote)
  from jax_longctx.core.rope import inv_freq
  from pallas_kernels import KernelOptions, Route

  ROUTE = Route()  # the default run's route, as the layer step below runs (AttnContext's options)

  keys = jax.random.split(jax.random.key(0), 5)
  shape = (1, cfg.num_kv_heads, context, cfg.head_dim)
  state = KVCache(jax.random.normal(keys[0], shape, jnp.bfloat16),
                  jax.random.normal(keys[1], shape, jnp.bfloat16))
  q = jax.random.normal(keys[2], (1, n_q, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[3], (1, n_q, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[4], k.shape, jnp.bfloat16)
  pos = (context - n_q + jnp.arange(n_q, dtype=jnp.int32))[None, :]
  valid = jnp.ones(pos.shape, bool)
  hp = dict(n_global=method.n_global, n_local=method.n_local, span=method.span,
            top_k=method.top_k, clip=method.clip, route=ROUTE)
  n = cfg.num_layers  # one call runs the step once per layer, as a decode step does

  def nudged(x, i):  # depends on the iteration, so XLA cannot hoist the work out of the loop
    return x + jnp.asarray(i % 2, x.dtype) * jnp.asarray(1e-3, x.dtype)

  seq_end, lo = pos[:, -1] + 1, method.n_global
  hi = seq_end - method.n_local
  stages = {  # prefixes of the selection, each reduced to a scalar XLA cannot skip
      "score": lambda q, kc: jnp.sum(vote(q, kc, lo, hi, valid, method.top_k, route=ROUTE)),
      "vote": lambda q, kc: jnp.sum(most_voted(
          vote(q, kc, lo, hi, valid, method.top_k, route=ROUTE), method.clip, kc.shape[2],
          pairwise_items(ROUTE))),
      "spans": lambda q, kc: jnp.sum(span_runs(most_voted(
          vote(q, kc, lo, hi, valid, method.top_k, route=ROUTE), method.clip, kc.shape[2],
          pairwise_items(ROUTE)),
          jnp.int32(lo), hi, method.span)[0]),
      "select": lambda q, kc: jnp.sum(select_scope(q, kc, pos, valid, **hp).idx),
  }

  def looped(stage):
    @jax.jit
    def run(q, k_cache):
      def body(i, acc):
        return acc + stage(nudged(q, i), k_cache).astype(jnp.int32)
      return jax.lax.fori_loop(0, n, body, jnp.int32(0))
    return run

  select = looped(stages["select"])
  one_select = jax.jit(lambda q, kc: select_scope(q, kc, pos, valid, **hp).idx)
  kernel_select = looped(lambda q, kc: jnp.sum(select_scope(  # the kernels' own running sets
      q, kc, pos, valid, **{**hp, "route": Route(
          kernels=KernelOptions(topk_few_rows="kernel", topk_many_rows="kernel"))}).idx))

  @functools.partial(jax.jit, donate_argnums=0)  # the cache is updated in place, as in decoding
  def layer(state, q, k, v):
    ctx = AttnContext(layer=0, q_pos=pos, valid=valid, freqs=inv_freq(cfg), cfg=cfg)

    def body(i, carry):
      state, acc = carry
      out, state = method.prefill(state, nudged(q, i), k, v, ctx)
      return state, acc + jnp.sum(out[:, :, 0, 0].astype(jnp.float32))
    return jax.lax.fori_loop(0, n, body, (state, jnp.float32(0)))

  box = {"state": state}

  def run_select():
    jax.block_until_ready(select(q, box["state"].k))

  def run_layer():
    box["state"], acc = layer(box["state"], q, k, v)
    jax.block_until_ready(acc)

  sel, _ = median_time(run_select, warmup=2, reps=10)
  kernel_sel, _ = median_time(lambda: jax.block_until_ready(kernel_select(q, box["state"].k)),
                              warmup=2, reps=10)
  full, _ = median_time(run_layer, warmup=2, reps=10)
  sel, full = sel / n, full / n
  prefix_ms = {}
  for name, stage in stages.items():
    fn = looped(stage)
    prefix_ms[name] = median_time(lambda: jax.block_until_ready(fn(q, box["state"].k)),
                                  warmup=2, reps=10)[0] / n * 1e3
  kernels = device_kernel_times(run_select, calls=3, per_call=n) if profile else None
  return {"context": context, "queries": n_q, "select_ms": sel * 1e3, "layer_ms": full * 1e3,
          "layers": cfg.num_layers, "select_ms_all_layers": sel * 1e3 * cfg.num_layers,
          "prefix_ms": prefix_ms, "select_ms_topk_kernel": kernel_sel / n * 1e3,
          "select_ops": launched_ops(one_select, q, box["state"].k), "select_kernels": kernels}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="llama-3.1-8b")
  p.add_argument("--contexts", default="32768,131072")
  p.add_argument("--queries", default="1,512")
  p.add_argument("--out", default="reattention_select.jsonl")
  p.add_argument("--profile", action="store_true",
                 help="select_kernels: each device kernel's time per selection (profiler trace)")
  args = p.parse_args()

  from jax_longctx import preset
  from jax_longctx.methods import get

  cfg = preset(args.model, dtype="bfloat16")
  method = get("reattention")
  for context in map(int, args.contexts.split(",")):
    for n_q in map(int, args.queries.split(",")):
      rec = {"model": args.model, "hparams": method.hparams()}
      try:
        rec.update(measure(cfg, method, context, n_q, args.profile))
      except Exception as e:  # a failed configuration is a result to record
        rec.update(context=context, queries=n_q, error=f"{type(e).__name__}: {str(e)[:300]}")
      rec.update(device_facts())
      write_json(args.out, rec)
      print(rec, flush=True)


if __name__ == "__main__":
  main()
