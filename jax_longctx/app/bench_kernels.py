"""The Pallas kernels' timed cases, each against its anchor on the same inputs: top-k scoring
against einsum + jax.lax.top_k, flash attention against cuDNN, decode attention against the
copy bandwidth, gathered attention against dense attention over as many keys, prefill chunk by
chunk against one causal cuDNN call; and the checks of the GPU kernels against their jnp
references on the device. `jax-longctx bench kernels` runs them (`run_kernels`).

Shapes: one layer of Llama-3.1-8B (32 query / 8 KV heads, d=128, bf16, batch 1). Times are
`bench_measure.timed`: jitted, warmed up, the median of `--reps` groups of back-to-back calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.app.bench_measure import timed
from pallas_kernels import Route, chunk_attention, flash_attention, gathered_attention, topk_scores
from pallas_kernels.topk import topk_blocks
from pallas_kernels.options import DEFAULT, KernelOptions

H, KV, D = 32, 8, 128
BF = jnp.bfloat16


def _tiling(tiling) -> dict:
  return {} if tiling is None else {"tiling": {k: v for k, v in vars(tiling).items() if v is not None}}


def normal(key, shape, dtype=BF):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def small_ints(key, shape):
  """Nonzero integers in [-3, 3] (exact dot products, plenty of ties) as bf16."""
  k1, k2 = jax.random.split(key)
  mag = jax.random.randint(k1, shape, 1, 4)
  sign = jnp.where(jax.random.bernoulli(k2, 0.5, shape), 1, -1)
  return (mag * sign).astype(BF)


def bench_topk(key, lq, t, top_k, args, anchor=True, tiling=None,
               options: KernelOptions = DEFAULT):
  kq, kk = jax.random.split(key)
  q, k = normal(kq, (1, lq, H, D)), normal(kk, (1, t, KV, D))
  ours = jax.jit(lambda q, k: topk_scores(q, k, top_k, route=Route(backend="gpu", kernels=options),
                                          tiling=tiling))
  rec = {"case": "topk_scores", "q_len": lq, "kv_len": t, "top_k": top_k, **_tiling(tiling)}
  flops = 2 * H * lq * t * D  # the products q.k alone, for every kernel timed here
  rec["ms"] = timed(ours, q, k, reps=args.reps, inner=args.inner) * 1e3
  rec["tflops"] = flops / rec["ms"] / 1e9
  if args.bw:
    rec["k_read_ms"] = k.size * 2 / args.bw * 1e3
  # The kernel's own running set beside the default: the fused Triton kernel for decode rows
  # (default: topk_blocks), the Mosaic kernel's rounds for prefill chunks (default: segments).
  beside = (KernelOptions(topk_few_rows="kernel") if lq * (H // KV) <= topk_blocks.MAX_ROWS
            else KernelOptions(topk_many_rows="kernel") if top_k > 1 else None)
  if beside is not None and options == DEFAULT:
    route = Route(backend="gpu", kernels=beside)
    kernel = jax.jit(lambda q, k: topk_scores(q, k, top_k, route=route, tiling=tiling))
    rec["kernel_ms"] = timed(kernel, q, k, reps=args.reps, inner=args.inner) * 1e3
    rec["kernel_over_ours"] = rec["kernel_ms"] / rec["ms"]
    if rec.get("k_read_ms"):
      rec["ours_over_k_read"] = rec["ms"] / rec["k_read_ms"]
  versus = getattr(args, "versus", None)  # another kernel on the same inputs (benchmarks/)
  if anchor and versus is not None and lq > 1:
    rec.update(versus(q, k, top_k, ours(q, k)[1], args))
    if "authors_ms" in rec:
      rec["authors_tflops"] = flops / rec["authors_ms"] / 1e9
      rec["ours_over_authors"] = rec["ms"] / rec["authors_ms"]
  if anchor:
    def einsum_topk(q, k):
      s = jnp.einsum("bqkgd,btkd->bqkgt", q.reshape(1, lq, KV, H // KV, D), k,
                     preferred_element_type=jnp.float32)
      return jax.lax.top_k(s, top_k)
    rec["anchor_ms"] = timed(jax.jit(einsum_topk), q, k, reps=args.reps, inner=1) * 1e3
    rec["speedup"] = rec["anchor_ms"] / rec["ms"]
  return rec


def bench_prefill(key, t, args, tiling=None, cudnn=True):
  ks = jax.random.split(key, 3)
  q, k, v = normal(ks[0], (1, t, H, D)), normal(ks[1], (1, t, KV, D)), normal(ks[2], (1, t, KV, D))
  flops = 4 * H * D * t * (t + 1) / 2
  rec = {"case": "flash_prefill_causal", "kv_len": t, **_tiling(tiling)}
  for name, cud in (("ours", False), ("cudnn", True))[: 2 if cudnn else 1]:
    fn = jax.jit(lambda q, k, v, c=cud: flash_attention(q, k, v, causal=True,
                                                        route=Route(backend="gpu"),
                                                        use_cudnn=c, tiling=tiling))
    rec[f"{name}_ms"] = timed(fn, q, k, v, reps=args.reps, inner=args.inner) * 1e3
    rec[f"{name}_tflops"] = flops / rec[f"{name}_ms"] / 1e9
  if cudnn:
    rec["ratio_to_cudnn"] = rec["ours_tflops"] / rec["cudnn_tflops"]
  return rec


def bench_decode(key, t, args, tiling=None):
  ks = jax.random.split(key, 3)
  q, k, v = normal(ks[0], (1, 1, H, D)), normal(ks[1], (1, t, KV, D)), normal(ks[2], (1, t, KV, D))
  fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=False, route=Route(backend="gpu"),
                                               tiling=tiling))
  rec = {"case": "flash_decode", "kv_len": t, **_tiling(tiling)}
  rec["ms"] = timed(fn, q, k, v, reps=args.reps, inner=args.inner) * 1e3
  rec["bytes"] = 2 * k.size * 2
  rec["fraction_of_bw"] = rec["bytes"] / (rec["ms"] / 1e3) / args.bw
  return rec


def bench_gathered(key, t, n, args, tiling=None, rope=False):
  """rope: keys rotated in the kernel at their entry (ReAttention's decode, BHTD cache)."""
  ks = jax.random.split(key, 4)
  layout = "BHTD" if rope else "BTHD"
  kv_shape = (1, KV, t, D) if rope else (1, t, KV, D)
  q, k, v = normal(ks[0], (1, 1, H, D)), normal(ks[1], kv_shape), normal(ks[2], kv_shape)
  idx = jnp.sort(jax.vmap(lambda kk: jax.random.choice(kk, t, (n,), replace=False))(
      jax.random.split(ks[3], KV)), axis=-1)[None].astype(jnp.int32)
  freqs = 1.0 / 500000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D) if rope else None
  fn = jax.jit(lambda q, k, v, i: gathered_attention(q, k, v, i, route=Route(backend="gpu"),
                                                     tiling=tiling,
                                                     kv_layout=layout, key_rope_freqs=freqs))
  rec = {"case": "gathered_attention" + ("_rope" if rope else ""), "kv_len": t, "selected": n,
         **_tiling(tiling)}
  rec["ms"] = timed(fn, q, k, v, idx, reps=args.reps, inner=args.inner) * 1e3
  kd, vd = (k[:, :, :n], v[:, :, :n]) if rope else (k[:, :n], v[:, :n])
  dense = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=False, route=Route(backend="gpu"),
                                                  kv_layout=layout))
  rec["dense_ms"] = timed(dense, q, kd, vd, reps=args.reps, inner=args.inner) * 1e3
  rec["ratio_to_dense"] = rec["ms"] / rec["dense_ms"]
  return rec


def check_topk(key):
  kq, kk = jax.random.split(key)
  q, k = small_ints(kq, (2, 64, H, D)), small_ints(kk, (2, 20000, KV, D))
  kw = dict(valid_len=jnp.array([20000, 13001]), exclude_prefix=4, exclude_suffix=64)
  out = {}
  for lq, case in ((64, "prefill"), (1, "decode")):  # decode: the blocks path (topk_blocks)
    for top_k in (1, 4, 128):
      v, i = topk_scores(q[:, :lq], k, top_k, route=Route(backend="gpu"), **kw)
      rv, ri = topk_scores(q[:, :lq], k, top_k, route=Route(backend="reference"), **kw)
      out[f"{case}_top{top_k}_index_equal"] = float(jnp.mean(i == ri))
      out[f"{case}_top{top_k}_score_maxdiff"] = float(jnp.max(jnp.abs(v - rv)))
  # Both above use XLA's top_k on this device; decode's blocks path relies on its order among
  # equal scores, so it is also checked against numpy's (score desc, index asc).
  i = topk_scores(q[:, :1], k, 4, route=Route(backend="gpu"), **kw)[1]
  numpy_i = _numpy_top4(q[:, :1], k, kw["exclude_prefix"], kw["valid_len"] - kw["exclude_suffix"])
  out["decode_top4_index_equal_numpy"] = float(np.mean(np.asarray(i) == numpy_i))
  i = topk_scores(q, k, 4, route=Route(backend="gpu"), **kw)[1]  # prefill rows: the segments path
  numpy_i = _numpy_top4(q, k, kw["exclude_prefix"], kw["valid_len"] - kw["exclude_suffix"])
  out["prefill_top4_index_equal_numpy"] = float(np.mean(np.asarray(i) == numpy_i))
  return out


def _numpy_top4(q, k, lo: int, hi):
  """The top 4 of keys lo <= t < hi[b] ranked by numpy: exact integer scores, ties to the lower
  index (a stable sort of the negated scores)."""
  qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, lq, h, d = qn.shape
  s = np.einsum("bqkgd,btkd->bqkgt", qn.reshape(b, lq, KV, h // KV, d), kn).reshape(b, lq, h, -1)
  t = np.arange(s.shape[-1])
  for bi, end in enumerate(np.asarray(hi)):
    s[bi, ..., (t < lo) | (t >= end)] = -np.inf
  return np.argsort(-s, axis=-1, kind="stable")[..., :4]


def check_attention(key):
  ks = jax.random.split(key, 4)
  q, k, v = normal(ks[0], (2, 300, H, D)), normal(ks[1], (2, 5000, KV, D)), normal(ks[2], (2, 5000, KV, D))
  kw = dict(causal=True, q_offset=jnp.array([4700, 100]), kv_len=jnp.array([5000, 400]))
  o, l = flash_attention(q, k, v, route=Route(backend="gpu"), use_cudnn=False, **kw)
  ro, rl = flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                           route=Route(backend="reference"), **kw)
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b))  # noqa
  res = {"flash_rel_err": rel(o, ro), "flash_lse_maxdiff": float(jnp.max(jnp.abs(l - rl)))}
  oc, lc = flash_attention(q, k, v, causal=True, route=Route(backend="gpu"), use_cudnn=True)
  rc, rlc = flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                            causal=True, route=Route(backend="reference"))
  res.update(cudnn_rel_err=rel(oc, rc), cudnn_lse_maxdiff=float(jnp.max(jnp.abs(lc - rlc))))
  idx = jax.random.randint(ks[3], (2, KV, 700), 0, 5000)
  valid = jax.random.bernoulli(ks[3], 0.8, idx.shape)
  go, gl = gathered_attention(q[:, :1], k, v, idx, valid, route=Route(backend="gpu"))
  gro, grl = gathered_attention(q[:, :1].astype(jnp.float32), k.astype(jnp.float32),
                                v.astype(jnp.float32), idx, valid, route=Route(backend="reference"))
  res.update(gathered_rel_err=rel(go, gro), gathered_lse_maxdiff=float(jnp.max(jnp.abs(gl - grl))))
  return res


def topk_shapes(quick=False, smoke=False) -> dict[str, list[tuple[int, int, int]]]:
  """(queries, keys, top_k) of the timed top-k cases by case name: prefill chunks of 512 queries
  and one-token decode, top-1 beside top-4 (the two the ReAttention authors' kernel does), decode
  at ReAttention's 32K / 128K and top-128 for decode. smoke: keys / 512 and 128 queries (the
  authors' query tile)."""
  long = 1 << (18 if quick else 20)
  shapes = {"topk_prefill": [(512, t, tk) for t in (131072, 524288) for tk in (4, 1)]
                           + [(512, 32768, 4)],
            "topk_decode": [(1, t, tk) for t in (32768, 131072) for tk in (4, 1)]
                           + [(1, long, tk) for tk in (4, 1, 128)]}
  if smoke:
    shapes = {name: [(min(lq, 128), t // 512, tk) for lq, t, tk in cases]
              for name, cases in shapes.items()}
  return shapes


def chunked(q, k, v, *, chunk: int, use_cudnn: bool):
  """Every chunk of q [1, L, H, d] over the cache k/v [1, KV, L, d]; out [1, L, H, d]."""
  length = q.shape[1]

  def body(i, out):
    off = i * chunk
    qc = jax.lax.dynamic_slice_in_dim(q, off, chunk, axis=1)
    kc = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(k, off, chunk, axis=2), 1, 2)
    vc = jnp.swapaxes(jax.lax.dynamic_slice_in_dim(v, off, chunk, axis=2), 1, 2)
    o, _ = chunk_attention(qc, k, v, kc, vc, off, kv_layout="BHTD", use_cudnn=use_cudnn,
                           route=Route())
    return jax.lax.dynamic_update_slice_in_dim(out, o, off, axis=1)

  return jax.lax.fori_loop(0, length // chunk, body, jnp.zeros_like(q))


def one_call(q, k, v):
  return jax.nn.dot_product_attention(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                      is_causal=True, implementation="cudnn")


def bench_chunked_prefill(key, length: int, chunks, args) -> list[dict]:
  """A whole prompt's attention chunk by chunk (each chunk's offset traced, as the model's
  prefill runs it) through cuDNN and through the Pallas kernel, against one causal cuDNN call
  over the whole prompt; TFLOP/s count causal attention's 2 * L^2 * H * d for every route, and
  each route's output is checked against the one call's first."""
  keys = jax.random.split(key, 3)
  q = normal(keys[0], (1, length, H, D))
  k, v = (normal(x, (1, KV, length, D)) for x in keys[1:])
  flops = 2.0 * length * length * H * D
  anchor = jax.jit(one_call)
  ref = anchor(q, k, v)
  t_one = timed(anchor, q, k, v, reps=args.reps, inner=1)
  base = {"case": "chunked_prefill", "length": length, "cudnn_one_call_ms": t_one * 1e3,
          "cudnn_one_call_tflops": flops / t_one / 1e12}
  recs = []
  for chunk in chunks:
    for route, use_cudnn in (("cudnn_chunks", True), ("pallas_chunks", False)):
      rec = {**base, "chunk": chunk, "route": route}
      try:
        fn = jax.jit(lambda q, k, v, c=chunk, u=use_cudnn: chunked(q, k, v, chunk=c, use_cudnn=u))
        rec["max_abs_diff_vs_one_call"] = float(jnp.max(jnp.abs(
            fn(q, k, v).astype(jnp.float32) - ref.astype(jnp.float32))))
        t = timed(fn, q, k, v, reps=args.reps, inner=1)
        rec.update(ms=t * 1e3, tflops=flops / t / 1e12, of_one_call=t_one / t)
      except Exception as e:  # noqa: BLE001 - one failing route is a result, not a crash
        rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      recs.append(rec)
  return recs


def kernel_cases(key, args, smoke: bool = False) -> dict:
  """Case name -> a function returning its record(s). args: reps, inner, quick, bw (the copy
  bandwidth, or None), optionally versus (another top-k kernel timed beside ours). smoke: the
  top-k cases alone at tiny shapes (on a CPU the kernels are interpreted: their times mean
  nothing, the command is checked)."""
  long = 1 << (18 if args.quick else 20)
  topk = {name: lambda shapes=shapes: [bench_topk(key, *shape, args) for shape in shapes]
          for name, shapes in topk_shapes(args.quick, smoke).items()}
  if smoke:
    return topk
  return {
      "check_topk": lambda: {"case": "check_topk", **check_topk(key)},
      "check_attention": lambda: {"case": "check_attention", **check_attention(key)},
      **topk,
      "flash_prefill": lambda: [bench_prefill(key, t, args) for t in (16384, 32768)],
      "flash_decode": lambda: [bench_decode(key, t, args) for t in (131072, long)],
      "gathered": lambda: [bench_gathered(key, long, 8192, args)],
      "chunked_prefill": lambda: [r for t in (16384, 32768)
                                  for r in bench_chunked_prefill(key, t, (512, 2048, 4096), args)],
  }
