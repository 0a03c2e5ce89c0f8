"""Decode attention over a 4-bit cache (quant4: KIVI's layout): the kernel that reads its tiles
(attention/int4_decode.py, KernelOptions.int4_decode_kernel) checked against the reference on
the device, then timed against the same call over bf16 and int8 K/V and over the 4-bit cache's
bf16 copy (read.four_bit_copies, the route without the kernel).

    python -m benchmarks.int4_kernels --out $OUT/int4_kernels.json     # one GPU
    python -m benchmarks.int4_kernels --smoke --out /tmp/i4.json       # CPU, tiny, interpreted

check: 2 sequences (the second with its residual group open), keys with outlier channels; the
largest error of the kernel (bf16 queries) and of the copy route against the fp32 reference over
the dequantized cache. write: the one-token write kernel against the jnp write over 40 steps
(entries that differ a leaf, and by how much). decode: Llama-3.1-8B's attention shape (32
query heads over 8 KV heads, d 128, batch 1) over 32K / 128K / 1M keys, back-to-back calls
(bench_measure.timed), each with the bytes the cache holds over its time beside the device's
copy bandwidth measured in the same run.
scores: a decode step's top-4 over 4-bit keys, the kernel scoring their codes against the copy
route, at 128K and 2M keys.
chunk: a 4096-query prefill chunk (chunk_attention, as full attention's prefill runs it) at
offsets 28K and 124K over bf16, int8 and the 4-bit cache, the last read by the tile kernel
(attention/int4_chunk.py, KernelOptions.int4_chunk_kernel: "tiles") and through its bf16 copy
("copy"); first the kernel's largest error against the copy route at a 1K offset.
tiles: the kernel's default tiling and TILE_SWEEP's (keys a step, warps, key splits, stages) at
32K and 128K keys.
--formats: the 4-bit formats the cases run over (quant4.FORMATS; default int4).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax

from benchmarks.common import copy_bandwidth, device_facts, printable, run_cases_to_json
from benchmarks.quant_kernels import _err, _nbytes, _timed_record

H, KV, D = 32, 8, 128
BACKEND = "auto"  # --smoke: "gpu", the kernels interpreted on CPU
SIZES = dict(check=1000, decode=(32768, 131072, 1048576), tiles=(32768, 131072),
             scores=(131072, 2097152), chunk=4096, offsets=(28672, 126976))
FORMATS = ("int4",)  # --formats: the 4-bit formats (quant4.FORMATS) each case runs over


def _cache(seed, b, t, dtype, open_tokens: int = 5):
  """(q [b, 1, H, D] bf16, k, v) in `dtype`: bfloat16, int8, or a 4-bit format (quant4.FORMATS:
  quant4.GroupedKeys with its last group open, `open_tokens` short of full, and quant4.Int4
  values)."""
  import jax.numpy as jnp
  from pallas_kernels import quant, quant4
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, 1, H, D), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, KV, t, D), jnp.float32)
  k = k.at[..., :4].multiply(30.0)  # outlier channels, as real keys have (KIVI)
  v = jax.random.normal(keys[2], (b, KV, t, D), jnp.float32)
  if dtype == "bfloat16":
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  if dtype not in quant4.FORMATS:
    return q, quant.quantize(k, dtype), quant.quantize(v, dtype)
  fmt = quant4.format_of(dtype)
  g, sd = fmt.group, fmt.scale_dtype
  last = (t - open_tokens) // g
  grouped = quant4.GroupedKeys(quant4.quantize(k, g, axis=2, scale_dtype=sd),
                               k[:, :, last * g:(last + 1) * g].astype(jnp.bfloat16),
                               jnp.full((b,), last, jnp.int32))
  return q, grouped, quant4.quantize(v, min(g, D), scale_dtype=sd)


def _route(tiles: bool, option: str = "int4_decode_kernel"):
  from pallas_kernels import KernelOptions, Route
  return Route(backend=BACKEND, kernels=KernelOptions(**{option: tiles}))


def check():
  import jax.numpy as jnp
  from pallas_kernels import Route, flash_attention, quant4
  recs = []
  for fmt in FORMATS:
    t = SIZES["check"] // 128 * 128
    q, k, v = _cache(1, 2, t, fmt, open_tokens=11)
    pos = jnp.asarray([t - 12, t // 3])  # the second sequence's keys stop inside main's groups
    kw = dict(causal=True, q_offset=pos, kv_len=pos + 1, kv_layout="BHTD")
    ref = flash_attention(q.astype(jnp.float32), quant4.load(k, jnp.float32),
                          quant4.dequantize(v, jnp.float32), route=Route(backend="reference"),
                          **kw)
    for name, tiles, tiling in (("kernel", True, IMPLS["tiles"]),
                                ("mosaic", True, IMPLS["mosaic"]), ("copy", False, None)):
      got = flash_attention(q, k, v, route=_route(tiles), tiling=tiling, **kw)
      recs.append({"check": "decode", "dtype": fmt, "route": name,
                   "out_err": _err(got[0], ref[0]), "lse_err": _err(got[1], ref[1])})
  return recs


def check_write(steps: int = 40):
  """The one-token write kernel (decode/int4_write.py) against the jnp write, step after step
  from a prompt of 2 sequences (one closing a group at the first step): the stored leaves'
  differing entries (codes, scales, zero points, residual), which the kernel is built to
  make none; for each of FORMATS."""
  return [rec for name in FORMATS for rec in _check_write(name, steps)]


def _check_write(name, steps):
  import jax.numpy as jnp
  import numpy as np
  from jax_longctx.ops.cache import KVCache
  from pallas_kernels import Route, quant4
  fmt = quant4.format_of(name)
  t = SIZES["check"] // 128 * 128
  cache = KVCache(quant4.zeros_grouped_keys((2, KV, t, D), jnp.bfloat16, fmt.group,
                                            fmt.scale_dtype),
                  quant4.zeros_values((2, KV, t, D), min(fmt.group, D), fmt.scale_dtype))
  rng = jax.random.split(jax.random.key(3), 2 * steps + 1)
  prompt = jax.random.normal(rng[0], (2, t // 2, KV, D), jnp.float32).at[..., :4].multiply(30)
  lengths = jnp.asarray([31, t // 2 - 9])
  routes = {name: Route(backend=BACKEND, cache_write_backend=w)
            for name, w in (("jnp", None), ("kernel", BACKEND))}
  cache = cache.write(jnp.broadcast_to(jnp.arange(t // 2), (2, t // 2)), prompt, prompt,
                      route=routes["jnp"], valid=jnp.arange(t // 2)[None] < lengths[:, None])
  step = jax.jit(lambda c, pos, k, v, route: c.write(pos, k, v, route=route,
                                                     valid=jnp.ones((2, 1), bool)),
                 static_argnames="route")
  got = {name: cache for name in routes}
  for i in range(steps):
    k, v = (jax.random.normal(r, (2, 1, KV, D), jnp.bfloat16) for r in rng[1 + 2 * i:3 + 2 * i])
    got = {name: step(got[name], (lengths + i)[:, None], k, v, route)
           for name, route in routes.items()}
  recs = []
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got["kernel"]),
                          jax.tree.leaves(got["jnp"])):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.uint8:  # packed codes: compared code by code
      a, b = (np.asarray(quant4.unpack(x)).astype(np.int32) for x in (a, b))
    a, b = a.astype(np.float64), b.astype(np.float64)
    diff = np.abs(a - b)
    recs.append({"check": "write", "dtype": name, "leaf": jax.tree_util.keystr(path),
                 "steps": steps,
                 "entries": a.size, "differing": int(np.sum(a != b)),
                 "max_abs_diff": float(diff.max()),
                 "max_rel_diff": float((diff / np.maximum(np.abs(b), 1e-30)).max())})
  return recs


def _decode_fn(pos, route, tiling=None):
  import jax
  from pallas_kernels import flash_attention
  return jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, q_offset=pos,
                                                 kv_len=pos + 1, kv_layout="BHTD", route=route,
                                                 tiling=tiling))


def _progress(rec):
  """A record to stderr as it is measured (the case's JSON is written when the case ends)."""
  print(printable(rec), file=sys.stderr, flush=True)


def _impls():
  """The 4-bit decode kernels time_decode runs, by route name: "tiles" int4_decode's Triton
  kernel, "mosaic" mgpu_int4_decode (where it takes the call: else Triton's again)."""
  from pallas_kernels.gpu import Tiling
  return {"tiles": Tiling(impl="triton"), "mosaic": Tiling(impl="mosaic")}


IMPLS = _impls()


def time_decode(reps, bw):
  import jax.numpy as jnp
  recs = []
  for t in SIZES["decode"]:
    pos = jnp.asarray([t - 6])
    for dtype, route in (("bfloat16", "kernel"), ("int8", "kernel"), (FORMATS[0], "copy"),
                         *((fmt, tiles) for fmt in FORMATS for tiles in IMPLS)):
      q, k, v = _cache(4, 1, t, dtype)
      rec = {"kernel": "decode_attention", "keys": t, "dtype": dtype, "route": route}
      try:
        fn = _decode_fn(pos, _route(route != "copy"), IMPLS.get(route))
        recs.append(_timed_record(rec, fn, (q, k, v), _nbytes(k, v), reps, bw))
      except Exception as e:  # noqa: BLE001 - a route out of memory at 1M is a result
        recs.append({**rec, "error": str(e)[:300]})
      _progress(recs[-1])
      del q, k, v
  return recs


# The tilings time_tiles sweeps beside the kernel's default: (keys a step, warps, programs a GPU
# core the key splits aim for, pipeline stages), around the default (one group, one warp, 8 a
# core) and the earlier 4-warp forms. 256 keys a step left out: slower at 32K on an H200 (0.110
# ms against 0.070-0.100) and over a minute to compile each.
TILE_SWEEP = ((32, 1, 4, 3), (32, 1, 8, 2), (32, 1, 8, 4), (32, 1, 16, 3), (32, 2, 8, 3),
              (64, 1, 4, 3), (64, 1, 8, 3), (64, 1, 16, 3), (64, 2, 4, 2), (64, 2, 4, 3),
              (64, 2, 4, 4), (64, 2, 8, 3), (128, 2, 4, 3), (128, 2, 8, 3), (128, 4, 2, 3))


def time_tiles(reps, bw):
  """The kernel's default tiling, then TILE_SWEEP's, over one 4-bit cache a key count and
  format."""
  import jax.numpy as jnp
  from pallas_kernels.gpu import Tiling, split_plan
  recs = []
  for t, fmt in itertools.product(SIZES["tiles"], FORMATS):
    pos = jnp.asarray([t - 6])
    q, k, v = _cache(8, 1, t, fmt)
    for bk, warps, per_core, stages in ((None,) * 4,) + TILE_SWEEP:
      if bk is not None and bk % k.main.group:
        continue
      tl = None if bk is None else Tiling(block_keys=bk, num_warps=warps, num_stages=stages,
                                          key_splits=split_plan(KV, t, bk, None, per_core)[1])
      rec = {"keys": t, "dtype": fmt, "tiling": "default" if tl is None else {
          "block_keys": bk, "warps": warps, "stages": stages, "key_splits": tl.key_splits}}
      try:
        recs.append(_timed_record(rec, _decode_fn(pos, _route(True), tl), (q, k, v),
                                  _nbytes(k, v), reps, bw))
      except Exception as e:  # noqa: BLE001 - a tiling that does not launch is a result
        recs.append({**rec, "error": str(e)[:300]})
      _progress(recs[-1])
    del q, k, v
  return recs


# The Mosaic 4-bit decode kernel's configs mosaic_tiles sweeps beside its default: (keys a tile,
# dequantized tiles in flight, tiles landing ahead, CTAs a core the split plan aims at).
MOSAIC_SWEEP = ((64, 2, 3, 2), (64, 2, 4, 1), (64, 3, 6, 1), (64, 4, 4, 1), (128, 2, 2, 1),
                (128, 2, 3, 1))


def time_mosaic_tiles(reps, bw):
  """mgpu_int4_decode's default config, then MOSAIC_SWEEP's (where its SMEM fits), over one
  4-bit cache a key count."""
  import jax.numpy as jnp
  from pallas_kernels.attention import mgpu_decode, mgpu_int4_decode
  recs = []
  for t in SIZES["tiles"]:
    pos = jnp.asarray([t - 6])
    q, k, v = _cache(8, 1, t, FORMATS[0])
    for sweep in ((None,) + MOSAIC_SWEEP):
      cfg = mgpu_int4_decode.DEFAULT_CONFIG if sweep is None else mgpu_decode.DecodeConfig(
          block_kv=sweep[0], stages=sweep[1], landing=sweep[2], per_core=sweep[3])
      rec = {"keys": t, "dtype": FORMATS[0], "kernel": "mgpu_int4_decode",
             "config": "default" if sweep is None else dict(zip(
                 ("block_kv", "stages", "landing", "per_core"), sweep))}
      if why := mgpu_int4_decode.unsupported(q, k, v, config=cfg):
        recs.append({**rec, "error": why})
        continue
      fn = jax.jit(lambda q, k, v, cfg=cfg: mgpu_int4_decode.attention(
          q, k, v, pos, pos + 1, causal=True, scale=D ** -0.5, merge_kernel=True, config=cfg,
          interpret=BACKEND == "gpu"))
      try:
        recs.append(_timed_record(rec, fn, (q, k, v), _nbytes(k, v), reps, bw))
      except Exception as e:  # noqa: BLE001 - a config that does not launch is a result
        recs.append({**rec, "error": str(e)[:300]})
      _progress(recs[-1])
    del q, k, v
  return recs


def time_scores(reps, bw):
  """A decode step's top-4 over 4-bit keys (topk_scores, one query token): the kernel scoring the
  codes (topk/int4_scores.py) against the copy route (KernelOptions.int4_topk_scores off: the
  keys copied to bf16 first, in segments past topk_dequantize_bytes); `bytes` the keys' codes,
  scales and zero points; `differing_rows`: query rows whose 4 indices differ between them."""
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels import KernelOptions, Route, topk_scores
  recs = []
  for t, fmt in itertools.product(SIZES["scores"], FORMATS):
    pos = jnp.asarray([t - 6])
    q, k, _ = _cache(6, 1, t, fmt)
    read = k.main.codes.nbytes + k.main.scale.nbytes + k.main.zero.nbytes
    picked = {}
    for route in ("scores", "copy"):
      r = Route(backend=BACKEND, kernels=KernelOptions(int4_topk_scores=route == "scores"))
      fn = jax.jit(lambda q, k, r=r: topk_scores(q, k, 4, scale=1.0, valid_len=pos + 1,
                                                 kv_layout="BHTD", route=r))
      picked[route] = np.sort(np.asarray(fn(q, k)[1]), axis=-1)
      recs.append(_timed_record({"case": "decode_topk", "keys": t, "dtype": fmt, "route": route},
                                fn, (q, k),
                                read, reps, bw))
      _progress(recs[-1])
    recs[-1]["differing_rows"] = int(np.sum(np.any(picked["scores"] != picked["copy"], -1)))
    del q, k
  return recs


def _chunk_inputs(off, dtype):
  """(q [1, C, H, D] bf16, cache keys and values over off + C slots in `dtype`, the chunk's own
  keys and values [1, C, KV, D] bf16), C = SIZES["chunk"]."""
  import jax.numpy as jnp
  c = SIZES["chunk"]
  _, k, v = _cache(11, 1, off + c, dtype)
  keys = jax.random.split(jax.random.key(12), 3)
  q, kc, vc = (jax.random.normal(key, (1, c, n, D), jnp.float32).astype(jnp.bfloat16)
               for key, n in zip(keys, (H, KV, KV)))
  return q, k, v, kc, vc


def _chunk_fn(off, route):
  import jax.numpy as jnp
  from pallas_kernels import chunk_attention
  return jax.jit(lambda q, k, v, kc, vc: chunk_attention(q, k, v, kc, vc, jnp.asarray([off]),
                                                         kv_layout="BHTD", route=route))


def time_chunk(reps):
  """The prefill chunk over the 4-bit cache's tiles against its copy route and the bf16 / int8
  caches (module docstring); `tflops` counts the chunk's causal products."""
  import numpy as np
  from benchmarks.common import median_time
  recs = []
  for fmt in FORMATS:
    off = SIZES["check"] // 128 * 128  # the cache whole groups (an open residual all the same)
    args = _chunk_inputs(off, fmt)
    copy = _chunk_fn(off, _route(False, "int4_chunk_kernel"))(*args)
    got = _chunk_fn(off, _route(True, "int4_chunk_kernel"))(*args)
    largest = float(np.max(np.abs(np.asarray(copy[0], np.float32))))
    recs.append({"check": "chunk", "dtype": fmt, "offset": off, "largest_out": largest,
                 "out_err": _err(got[0], copy[0]), "lse_err": _err(got[1], copy[1])})
    _progress(recs[-1])
  c = SIZES["chunk"]
  for off in SIZES["offsets"]:
    for dtype, route in (("bfloat16", "kernel"), ("int8", "kernel"),
                         *((fmt, r) for fmt in FORMATS for r in ("copy", "tiles"))):
      args = _chunk_inputs(off, dtype)
      fn = _chunk_fn(off, _route(route == "tiles", "int4_chunk_kernel"))
      med, _ = median_time(lambda: jax.block_until_ready(fn(*args)), warmup=2, reps=reps)
      recs.append({"kernel": "prefill_chunk", "offset": off, "dtype": dtype, "route": route,
                   "ms": med * 1e3, "tflops": 4 * c * H * D * (off + c / 2) / med / 1e12})
      _progress(recs[-1])
      del args
  return recs


def main() -> None:
  global H, KV, D, BACKEND, FORMATS
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--only", default="", help="comma list of cases (check, write, decode, tiles, "
                 "scores, chunk)")
  p.add_argument("--keys", default="", help="comma list of key counts for decode and tiles "
                 "(default: 32768,131072,1048576 and 32768,131072)")
  p.add_argument("--formats", default="int4", help="comma list of 4-bit formats "
                 "(quant4.FORMATS: int4, int4_fp16, int4_g64_fp16)")
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, kernels interpreted")
  args = p.parse_args()
  FORMATS = tuple(args.formats.split(","))
  if args.keys:
    keys = tuple(int(n) for n in args.keys.split(","))
    SIZES.update(decode=keys, tiles=keys, scores=keys)
  if args.smoke:
    H, KV, D = 8, 2, 64
    SIZES.update(check=256, decode=(512,), tiles=(512,), scores=(512,), chunk=64,
                 offsets=(192,))
    BACKEND, args.reps = "gpu", 1
  bw = 1.0 if args.smoke else copy_bandwidth()
  cases = {"check": check, "write": check_write, "decode": lambda: time_decode(args.reps, bw),
           "tiles": lambda: time_tiles(args.reps, bw),
           "mosaic_tiles": lambda: time_mosaic_tiles(args.reps, bw),
           "scores": lambda: time_scores(args.reps, bw),
           "chunk": lambda: time_chunk(args.reps)}
  failed = run_cases_to_json(cases, args.out, {**device_facts(), "copy_bw": bw,
                                               "heads": f"{H}/{KV}", "head_dim": D}, args.only)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
