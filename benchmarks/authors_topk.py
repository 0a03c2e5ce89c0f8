"""The ReAttention authors' fused score + top-k (Triton, through torch): an anchor for
benchmarks/kernels.py's top-k cases, used when `--authors-topk PATH` names a copy of it.

Their file is not vendored: OpenMOSS/ReAttention at commit 126f9e21a769,
opencompass/opencompass/models/xrliu/re_attention/einsum_topk_fuse20240907.py, which imports
bitonic_merge_wrapper.py from its own folder (copy both into one folder; for a device run put
them in the ignored .devcarry/reattention_authors/ and carry that). It is loaded with importlib
as a module of a stand-in package, so its relative import finds the file beside it.

Their API against ours: `einsum_topk_func(q [B, H, Lq, 128], k [B, KV, T, 128], topk)` returns
int32 indices [B, H, Lq, topk] and no scores; query head h reads KV head h // (H / KV) as ours
does; bf16 or fp16; topk 1 or 4 only; Lq and T multiples of 128, so a decode query is padded
here to 128 rows (`authors_q_len`). Ours takes q [B, Lq, H, d], k [B, T, KV, d] and returns
(scores, indices) [B, Lq, H, top_k]. Their top-1 is exact. Their top-4 merges only each 128-key
tile's maximum into the running four, so a row whose four best keys include two of one tile is
not exact: `authors_rows_exact` measures how often that happens on the benchmark's inputs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

NOTICE = "authors' top-k anchor off: "
TOP_KS = (1, 4)  # what their kernel supports
BLOCK_Q = 128  # their query tile; Lq must be a multiple of it
PACKAGE = "_reattention_authors"


def load(path: str):
  """The authors' module from `path`, or None after one stderr line saying why it is not used."""
  why = _unusable(path)
  if why is None:
    try:
      return _import(path)
    except Exception as e:  # noqa: BLE001 - an external file: any failure turns the anchor off
      why = f"{path} did not load ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
  print(NOTICE + why, file=sys.stderr, flush=True)
  return None


def _unusable(path: str) -> str | None:
  if not os.path.isfile(path):
    return f"no file {path}"
  try:
    import torch
  except ImportError:
    return "torch is not installed"
  if not torch.cuda.is_available():
    return "torch sees no CUDA device"
  if importlib.util.find_spec("triton") is None:
    return "triton is not installed"
  return None


def _import(path: str):
  folder, name = os.path.split(os.path.abspath(path))
  package = types.ModuleType(PACKAGE)
  package.__path__ = [folder]  # `from .bitonic_merge_wrapper import ...` looks here
  sys.modules[PACKAGE] = package
  spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name.removesuffix('.py')}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  if not callable(getattr(module, "einsum_topk_func", None)):
    raise AttributeError(f"{path} has no einsum_topk_func")
  return module


def sync(_out) -> None:
  """Waits for torch's queued GPU work (the `sync` of bench_measure.timed for torch calls)."""
  import torch
  torch.cuda.synchronize()


def measure(module, q, k, top_k: int, timer, ours_indices=None) -> dict:
  """The authors' kernel on the values of jax arrays q [1, Lq, H, D], k [1, T, KV, D] (moved to
  their layout): `timer(call)` seconds as authors_ms, and the share of (head, query) rows whose
  selection is exact, theirs and, given ours_indices [1, Lq, H, top_k], ours."""
  import torch
  qt = torch.from_dlpack(q).permute(0, 2, 1, 3)  # [1, H, Lq, D]
  lq = qt.shape[2]
  padded = torch.nn.functional.pad(qt, (0, 0, 0, -lq % BLOCK_Q)).contiguous()
  kt = torch.from_dlpack(k).permute(0, 2, 1, 3).contiguous()  # [1, KV, T, D]
  call = lambda: module.einsum_topk_func(padded, kt, top_k)  # noqa: E731
  rec = {"authors_ms": timer(call) * 1e3, "authors_q_len": padded.shape[2]}
  rec["authors_rows_exact"] = rows_exact(qt, kt, call()[:, :, :lq], top_k)
  if ours_indices is not None:
    ours = torch.from_dlpack(ours_indices).permute(0, 2, 1, 3)
    rec["ours_rows_exact"] = rows_exact(qt, kt, ours, top_k)
  return rec


def rows_exact(q, k, indices, top_k: int) -> float:
  """Share of rows of indices [1, H, Lq, top_k] whose keys' scores equal the top_k largest of q.k
  (fp32 in torch), compared as sorted scores so that a tie may pick any of the tied keys.

  Equal, not close: a tolerance would pass real misses (one seen at a gap of 6e-4 on random
  inputs). A kernel summing in another order may swap two keys whose scores differ by less than
  its rounding (~1e-5 of ~40), which counts as a miss; on random inputs that is rarer than one
  row in 1e5, and ours_rows_exact would show it. One KV head at a time: all heads' scores at
  512 x 512K would take 32 GiB."""
  import torch
  h, kvh, lq = q.shape[1], k.shape[1], q.shape[2]
  group = h // kvh
  precision = torch.get_float32_matmul_precision()
  torch.set_float32_matmul_precision("highest")  # no TF32: the reference must be exact fp32
  try:
    exact = 0
    for j in range(kvh):
      keys = k[0, j].float()
      for g in range(j * group, (j + 1) * group):
        s = q[0, g].float() @ keys.T  # [Lq, T]
        best = torch.topk(s, top_k).values
        got = torch.sort(s.gather(1, indices[0, g].long()), descending=True).values
        exact += int((got == best).all(dim=1).sum())
  finally:
    torch.set_float32_matmul_precision(precision)
  return exact / (h * lq)


def versus(module):
  """Their kernel as the `versus` hook of jax_longctx.app.bench_kernels.bench_topk: timed beside
  ours on the same inputs in each top-1 / top-4 case (measure's fields, or authors_error: their
  kernel failing keeps our numbers)."""
  from jax_longctx.app.bench_measure import timed

  def measure_beside(q, k, top_k, ours_indices, args) -> dict:
    if top_k not in TOP_KS:
      return {}
    timer = lambda call: timed(call, reps=args.reps, inner=args.inner, sync=sync)  # noqa: E731
    try:
      return measure(module, q, k, top_k, timer, ours_indices)
    except Exception as e:  # noqa: BLE001 - an external kernel: recorded, the case goes on
      return {"authors_error": f"{type(e).__name__}: {str(e)[:1000]}"}
  return measure_beside
