"""Pallas kernels against their anchors on one GPU, in one call.

    python benchmarks/kernels.py --out $OUT/kernels.jsonl [--quick] [--authors-topk PATH] [--smoke]

Shapes follow issue 3 (32 query / 8 KV heads, d=128, bf16, batch 1). Each case first checks the
GPU kernel against the jnp reference on the device, then times it: jitted, warmed up, median of
`--reps` groups of back-to-back calls. Anchors in the same run: einsum + jax.lax.top_k, cuDNN
attention, and the device-to-device copy bandwidth (torch copy_). Cases are independent: one that
fails is recorded with its error and the rest still run.

--authors-topk PATH: the ReAttention authors' Triton score + top-k (benchmarks/authors_topk.py
says where it comes from; not vendored) timed beside ours in each top-1 / top-4 case, on the same
inputs: authors_ms, authors_tflops, ours_over_authors (ms ratio) and the share of rows each
kernel selects exactly (authors_rows_exact, ours_rows_exact). Without torch CUDA + triton or the
file, one stderr line says so and those fields are absent.
--smoke: the top-k cases at tiny shapes on a CPU, the kernels interpreted: checks the script
before it spends device time; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import authors_topk, common  # noqa: E402
from benchmarks.kernel_cases import (D, KV, H, bench_decode, bench_gathered,  # noqa: E402
                                     bench_prefill, bench_topk, normal, small_ints)
from benchmarks.kernel_cases import timed  # noqa: E402,F401 - prefill_attention.py, mgpu_*.py
from benchmarks.kernel_sweep import sweep_cases  # noqa: E402
from pallas_kernels import flash_attention, gathered_attention, topk_scores  # noqa: E402


def check_topk(key):
  kq, kk = jax.random.split(key)
  q, k = small_ints(kq, (2, 64, H, D)), small_ints(kk, (2, 20000, KV, D))
  kw = dict(valid_len=jnp.array([20000, 13001]), exclude_prefix=4, exclude_suffix=64)
  out = {}
  for lq, case in ((64, "prefill"), (1, "decode")):  # decode: the blocks path (topk_blocks)
    for top_k in (1, 4, 128):
      v, i = topk_scores(q[:, :lq], k, top_k, backend="gpu", **kw)
      rv, ri = topk_scores(q[:, :lq], k, top_k, backend="reference", **kw)
      out[f"{case}_top{top_k}_index_equal"] = float(jnp.mean(i == ri))
      out[f"{case}_top{top_k}_score_maxdiff"] = float(jnp.max(jnp.abs(v - rv)))
  # Both above use XLA's top_k on this device; decode's blocks path relies on its order among
  # equal scores, so it is also checked against numpy's (score desc, index asc).
  i = topk_scores(q[:, :1], k, 4, backend="gpu", **kw)[1]
  numpy_i = _numpy_top4(q[:, :1], k, kw["exclude_prefix"], kw["valid_len"] - kw["exclude_suffix"])
  out["decode_top4_index_equal_numpy"] = float(np.mean(np.asarray(i) == numpy_i))
  i = topk_scores(q, k, 4, backend="gpu", **kw)[1]  # prefill rows: the segments path
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
  o, l = flash_attention(q, k, v, backend="gpu", use_cudnn=False, **kw)
  ro, rl = flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                           backend="reference", **kw)
  rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b))  # noqa
  res = {"flash_rel_err": rel(o, ro), "flash_lse_maxdiff": float(jnp.max(jnp.abs(l - rl)))}
  oc, lc = flash_attention(q, k, v, causal=True, backend="gpu", use_cudnn=True)
  rc, rlc = flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                            causal=True, backend="reference")
  res.update(cudnn_rel_err=rel(oc, rc), cudnn_lse_maxdiff=float(jnp.max(jnp.abs(lc - rlc))))
  idx = jax.random.randint(ks[3], (2, KV, 700), 0, 5000)
  valid = jax.random.bernoulli(ks[3], 0.8, idx.shape)
  go, gl = gathered_attention(q[:, :1], k, v, idx, valid, backend="gpu")
  gro, grl = gathered_attention(q[:, :1].astype(jnp.float32), k.astype(jnp.float32),
                                v.astype(jnp.float32), idx, valid, backend="reference")
  res.update(gathered_rel_err=rel(go, gro), gathered_lse_maxdiff=float(jnp.max(jnp.abs(gl - grl))))
  return res


def topk_shapes(quick=False, smoke=False) -> dict[str, list[tuple[int, int, int]]]:
  """(queries, keys, top_k) of the timed top-k cases by case name: issue 3's shapes, with top-1
  beside top-4 (the two the authors' kernel does), decode at ReAttention's 32K / 128K and top-128
  for decode. smoke: keys / 512 and
  128 queries (the authors' query tile)."""
  long = 1 << (18 if quick else 20)
  shapes = {"topk_prefill": [(512, t, tk) for t in (131072, 524288) for tk in (4, 1)]
                           + [(512, 32768, 4)],
            "topk_decode": [(1, t, tk) for t in (32768, 131072) for tk in (4, 1)]
                           + [(1, long, tk) for tk in (4, 1, 128)]}
  if smoke:
    shapes = {name: [(min(lq, 128), t // 512, tk) for lq, t, tk in cases]
              for name, cases in shapes.items()}
  return shapes


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="smaller shapes (smoke run)")
  p.add_argument("--only", default="", help="comma list of case names to run")
  p.add_argument("--sweep", action="store_true", help="time tiling variants (kernel_sweep.py)")
  p.add_argument("--authors-topk", metavar="PATH", default="",
                 help="the ReAttention authors' einsum_topk_fuse20240907.py (an anchor)")
  p.add_argument("--smoke", action="store_true", help="top-k cases, tiny shapes, on CPU")
  args = p.parse_args()
  if args.smoke:
    args.reps, args.inner = 1, 1
  args.bw = None if args.smoke else common.copy_bandwidth()
  args.authors = authors_topk.load(args.authors_topk) if args.authors_topk else None
  facts = {**common.device_facts(), "copy_bw": args.bw}
  print(json.dumps(facts), flush=True)
  key = jax.random.PRNGKey(0)
  long = 1 << (18 if args.quick else 20)
  topk = {name: lambda shapes=shapes: [bench_topk(key, *shape, args) for shape in shapes]
          for name, shapes in topk_shapes(args.quick, args.smoke).items()}
  cases = {
      "check_topk": lambda: {"case": "check_topk", **check_topk(key)},
      "check_attention": lambda: {"case": "check_attention", **check_attention(key)},
      **topk,
      "flash_prefill": lambda: [bench_prefill(key, t, args) for t in (16384, 32768)],
      "flash_decode": lambda: [bench_decode(key, t, args) for t in (131072, long)],
      "gathered": lambda: [bench_gathered(key, long, 8192, args)],
  }
  if args.sweep:
    cases = sweep_cases(key, args)
  if args.smoke:
    cases = topk

  def record(rec):
    rec.update(facts)
    common.write_json(args.out, rec)
    print(common.printable(rec, facts), flush=True)

  common.run_cases(cases, args.only, record)


if __name__ == "__main__":
  main()
