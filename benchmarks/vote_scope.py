"""pallas_kernels/vote_scope.py against the jnp scope it would replace, alone (one H200 call):

    PYTHONPATH=. python benchmarks/vote_scope.py

One decode step's 128 votes (Llama-3.1-8B: 32 heads x top-4) at 32K, ReAttention's defaults;
each variant runs 200 times in one jitted loop, median of 5, microseconds per call.
"""
import time, json, sys, numpy as np, jax, jax.numpy as jnp
from pallas_kernels.vote_scope import voted_scope
from jax_longctx.methods import reattention_scope as rs
rng = np.random.default_rng(0)
b, v = 1, 128
hi = np.array([32768 - 4096], np.int32); seq_end = np.array([32768], np.int32); fq = seq_end - 1
votes = rng.integers(32, hi[0], size=(b, v)).astype(np.int32)
votes[:, ::3] = votes[:, 1::3][:, :votes[:, ::3].shape[1]]  # duplicates
votes = jnp.asarray(votes); bounds = jnp.asarray(np.stack([hi, seq_end, fq], 1))
hp = dict(n_global=32, n_local=4096, span=32, clip=127, size=8192)
def bench(f, n=200):
  g = jax.jit(lambda vo: jax.lax.fori_loop(0, n, lambda i, acc: acc + jnp.sum(f(vo + (i % 2) * 0)[0]), jnp.int32(0)))
  jax.block_until_ready(g(votes)); ts = []
  for _ in range(5):
    t = time.perf_counter(); jax.block_until_ready(g(votes)); ts.append(time.perf_counter() - t)
  return sorted(ts)[2] / n * 1e6
def jnp_path(vo):
  sc = rs.assemble(*rs.span_runs(rs.most_voted(vo, 127), jnp.int32(32), jnp.asarray(hi), 32), 32, 4096, 8192, jnp.asarray(seq_end), jnp.asarray(fq))
  return sc.idx, sc.length
print("jnp", round(bench(jnp_path), 2), flush=True)
for nw in (4, 8, 16):
  for blk in (64, 128, 256):
    try:
      us = bench(lambda vo: voted_scope(vo, bounds, block=blk, num_warps=nw, **hp))
      print("kernel warps", nw, "block", blk, round(us, 2), flush=True)
    except Exception as e:
      print("fail", nw, blk, str(e)[:200], flush=True)
