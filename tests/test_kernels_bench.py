"""benchmarks/kernels.py's top-k cases on CPU (--smoke) and its anchor of the ReAttention authors'
kernel (benchmarks/authors_topk.py): the notice when it cannot run, their layout, row exactness."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import torch

from benchmarks import authors_topk
from jax_longctx.app import bench_kernels
from pallas_kernels import Route

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_top1_cases_beside_top4():
  shapes = bench_kernels.topk_shapes()
  for t in (131072, 524288):
    assert {(512, t, 1), (512, t, 4)} <= set(shapes["topk_prefill"])
  assert {tk for _, _, tk in shapes["topk_decode"]} == {1, 4, 128}
  assert all(lq == 128 for lq, _, _ in bench_kernels.topk_shapes(smoke=True)["topk_prefill"])


def test_smoke_without_the_authors_file_says_so_once(tmp_path):
  out, missing = tmp_path / "kernels.jsonl", tmp_path / "einsum_topk_fuse20240907.py"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "kernels.py"), "--smoke", "--only",
       "topk_prefill", "--authors-topk", str(missing), "--out", str(out)],
      capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  notices = [line for line in proc.stderr.splitlines() if line.startswith(authors_topk.NOTICE)]
  assert notices == [f"{authors_topk.NOTICE}no file {missing}"]
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert "error" not in json.dumps(recs)
  assert sorted(r["top_k"] for r in recs) == [1, 1, 4, 4, 4]
  assert not [k for r in recs for k in r if k.startswith(("authors", "ours_"))]


def test_load_needs_cuda(tmp_path, capsys):
  path = tmp_path / "einsum_topk_fuse20240907.py"
  path.write_text("def einsum_topk_func(q, k, topk):\n  pass\n")
  if torch.cuda.is_available():
    return  # this machine could run it: nothing to check here
  assert authors_topk.load(str(path)) is None
  assert capsys.readouterr().err == authors_topk.NOTICE + "torch sees no CUDA device\n"


class Emulated:
  """Their einsum_topk_func in torch on CPU, with their layout and checks: exact, or their top-4
  approximation (each 128-key tile's maximum only, then the best top_k tiles)."""

  def __init__(self, tile_max: bool):
    self.tile_max = tile_max

  def einsum_topk_func(self, q, k, topk):
    b, h, lq, d = q.shape
    assert q.is_contiguous() and k.is_contiguous() and lq % 128 == 0 and k.shape[2] % 128 == 0
    s = torch.einsum("bkgqd,bktd->bkgqt", q.float().reshape(b, k.shape[1], -1, lq, d), k.float())
    s = s.reshape(b, h, lq, -1)
    if not self.tile_max:
      return torch.topk(s, topk).indices.int()
    best, where = s.unflatten(-1, (-1, 128)).max(dim=-1)  # [b, h, lq, tiles]
    tiles = torch.topk(best, topk).indices
    return (tiles * 128 + where.gather(-1, tiles)).int()


def _inputs(lq, t):
  kq, kk = jax.random.split(jax.random.PRNGKey(3))
  kb = bench_kernels
  return kb.normal(kq, (1, lq, kb.H, kb.D)), kb.normal(kk, (1, t, kb.KV, kb.D))


def test_measure_maps_layouts_and_counts_exact_rows():
  q, k = _inputs(1, 1024)  # one decode query: padded to their 128-row tile
  ours = bench_kernels.topk_scores(q, k, 4, route=Route(backend="reference"))[1]
  rec = authors_topk.measure(Emulated(False), q, k, 4, timer=lambda call: 2e-3, ours_indices=ours)
  assert rec == {"authors_ms": 2.0, "authors_q_len": 128, "authors_rows_exact": 1.0,
                 "ours_rows_exact": 1.0}


def test_rows_exact_sees_the_tile_approximation():
  q, k = _inputs(128, 1024)
  rec = authors_topk.measure(Emulated(True), q, k, 4, timer=lambda call: 1e-3)
  # A row is exact when its four best keys lie in four different 128-key tiles.
  best = np.asarray(bench_kernels.topk_scores(q, k, 4, route=Route(backend="reference"))[1]) // 128
  expected = np.mean([len(set(row)) == 4 for row in best.reshape(-1, 4)])
  assert 0 < expected < 1 and rec["authors_rows_exact"] == expected
  top1 = authors_topk.measure(Emulated(True), q, k, 1, timer=lambda call: 1e-3)
  assert top1["authors_rows_exact"] == 1.0
