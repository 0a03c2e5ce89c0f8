"""Prefill tokens/s and decode ms/token: jax-longctx (full attention) against transformers.

    python benchmarks/decode.py --model llama-3.1-8b --contexts 8192,32768,131072 \
        --batches 1,8 --impls jax,hf --out $OUT/decode.jsonl
    python benchmarks/decode.py --model llama-3.1-70b --meshes model=2 --impls jax ...   # 2 GPUs
    python benchmarks/decode.py --meshes "none;model=2;data=2" --batches 8 ...  # 1 GPU vs 2
    python benchmarks/decode.py --kv-dtypes "none;int8;float8_e4m3fn" ...  # the cache in 8 bits
    python benchmarks/decode.py --contexts 1048576 --fill-cache ...  # decode only, no prefill
    python benchmarks/decode.py --run-option add_norm_backend=auto ...  # a RunOptions switch
    python benchmarks/decode.py --meshes "none;model=2" --fill-cache --kernel-profile 15 ...
        # where a step's time goes, per device: the all-reduces of tensor parallel show there

Random bf16 weights at the named model's shape (speed does not depend on the values). Each
(impl, context, batch) runs in its own process so peak memory is per configuration. Decode is
timed after prefill over the real prompt; `bound_ms` is the HBM bound: bytes of weights + KV
cache read per token over the copy bandwidth measured in the same run. On a mesh (`--meshes`,
core/mesh.py) the weights are drawn straight into their shards and the bound is the bytes one
device reads (its weights and its part of the KV) over one device's bandwidth; the prefill's
share of the GEMM rate counts every device's. With
JAX_LONGCTX_DUMP_HLO=DIR each run also writes its compiled decode loop to DIR/LABEL_CONTEXT.hlo.txt
(where XLA copies buffers shows there). `--kv-dtypes` stores the cache in 8 bits
(RunOptions.kv_dtype); its bound counts the bytes it reads (8-bit values and fp32 scales).
`--fill-cache` skips the prefill: the cache is filled with random keys and values (quantized as
the run stores them) and decode is timed over it, for contexts whose prefill would not fit a
command. Every record has the peak memory beside its weights and cache (`resident_bytes`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.common import (bytes_on, child_result, device_facts, jax_peak_bytes,  # noqa: E402
                               kernel_options, median_time, option_fields, run_child,
                               write_json)


def _bytes_per_token(cfg, ctx: int, batch: int, kv_dtype: str | None = None) -> tuple[int, int]:
  """(weight bytes read per decode step, KV bytes read per step): bf16 weights, the cache in
  bf16 or, 8-bit, a byte a value and an fp32 scale per (token, KV head)."""
  weights = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # embedding: one row per token
  if cfg.tie_word_embeddings:
    weights += cfg.vocab_size * cfg.hidden_size  # ... unless it is also the output head
  rows = 2 * cfg.num_layers * batch * cfg.num_kv_heads * ctx  # K and V rows of head_dim values
  per_row = 2 * cfg.head_dim if kv_dtype is None else cfg.head_dim + 4
  return 2 * weights, rows * per_row


def _prefill_flops_per_token(model: str, ctx: int) -> float:
  """TFLOPs per prompt token: 2 per weight, the embedding and the output head excluded (both
  sides compute logits for the last token only), plus causal attention's 2 * ctx * H * d per
  layer (QK and PV over the lower triangle, averaged over the prompt)."""
  from jax_longctx import preset
  cfg = preset(model)
  heads = 1 if cfg.tie_word_embeddings else 2
  weights = cfg.num_params() - heads * cfg.vocab_size * cfg.hidden_size
  attn = 2 * ctx * cfg.num_heads * cfg.head_dim * cfg.num_layers
  return (2 * weights + attn) / 1e12


def _stage(msg: str) -> None:
  """A progress line on stderr, with each device's memory in use and its peak so far."""
  import jax
  mem = []
  for d in jax.local_devices():
    stats = d.memory_stats() or {}
    if stats:
      used, peak = (stats.get(k, 0) / 1e9 for k in ("bytes_in_use", "peak_bytes_in_use"))
      mem.append(f"{used:.2f} GB in use, peak {peak:.2f}")
  mem = f" [{' | '.join(mem)}]" if mem else ""
  print(f"[{time.strftime('%H:%M:%S')}] {msg}{mem}", file=sys.stderr, flush=True)


def filled_cache(cfg, method, batch: int, ctx: int, cache_len: int, options):
  """An empty cache of `method` with every K/V buffer filled with random values (stored as the
  run stores them) and every row's length ctx: what decode reads after a prefill, without one.
  One buffer at a time: each empty buffer is freed before its random one is drawn (in its
  dtype, no wider temporary), so the fill never holds more than the cache and one buffer."""
  import jax
  import jax.numpy as jnp

  from jax_longctx.ops.cache import Quantized
  from jax_longctx.run import sharding

  cache = sharding.empty_cache(cfg, method, batch, cache_len, 4096, options)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(cache)) + 1))

  def drawn(x):
    shape, dtype, where = x.shape, x.dtype, x.sharding
    x.delete()
    if jnp.issubdtype(dtype, jnp.floating):  # (E4M3 drawn in bf16: random has no 8-bit floats)
      draw = lambda key: jax.random.normal(  # noqa: E731
          key, shape, jnp.bfloat16 if dtype.itemsize == 1 else dtype).astype(dtype)
    else:  # 8-bit values in [-127, 127], as quantization writes them
      draw = lambda key: jnp.maximum(  # noqa: E731
          jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8), dtype), -127)
    return jax.block_until_ready(jax.jit(draw, out_shardings=where)(next(keys)))

  def one(x):
    if isinstance(x, Quantized):  # 8-bit values of any magnitude, scales of a bf16 K's rows
      return Quantized(drawn(x.values), jnp.full_like(x.scale, 0.02))
    return drawn(x) if x.ndim == 4 else x
  state = jax.tree.map(one, cache.state, is_leaf=lambda x: isinstance(x, Quantized))
  return cache.replace(state=state, lengths=jnp.full((batch,), ctx, jnp.int32))


def run_jax(args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jax_longctx import preset
  from jax_longctx.core.options import RunOptions
  from jax_longctx.methods import get, parse_method_args
  from jax_longctx.model import random_on_mesh, random_params, serving_params
  from jax_longctx.run import sharding
  from jax_longctx.run.chunked_prefill import end_prefill, prefill_step
  from jax_longctx.run.generation import Sampling, decode_loop, row_keys

  # --key-smoothing: the model as an 8-bit `load` makes it, key smoothing and KV offsets (factors
  # 1 and random offsets here; the operations the attention layers add are the same whatever
  # their values)
  cfg = preset(args.model, dtype="bfloat16").replace(key_smoothing=args.key_smoothing,
                                                     kv_offsets=args.key_smoothing)
  method = get(args.method, **parse_method_args(args.method_arg))
  tiling = None
  if args.decode_tiling:
    from pallas_kernels.gpu import Tiling
    tiling = Tiling(**option_fields(Tiling, args.decode_tiling.split(","), "--decode-tiling"))
  options = RunOptions(mesh=args.mesh or None, kernels=kernel_options(args.kernel_option),
                       kv_dtype=args.kv_dtype or None, decode_tiling=tiling,
                       **option_fields(RunOptions, args.run_option, "--run-option"))
  mesh = options.mesh
  _stage("random params")
  # as `load(serving=True)`: fused on GPU
  params = serving_params(random_params(cfg) if mesh is None else random_on_mesh(cfg, mesh), mesh)
  jax.block_until_ready(params)
  peak_params = jax_peak_bytes()  # what placing (and fusing) the weights took, before any step
  devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
  # in use once the weights are ready, against their bytes: the allocator's blocks handed out
  # whole show as the difference (model.fuse_placed)
  params_ready = {"in_use_after_params_per_device": [
                      (d.memory_stats() or {}).get("bytes_in_use") for d in devices],
                  "params_bytes_per_device": [bytes_on(params, d) for d in devices]}
  _stage("params ready")
  b, ctx = args.batch, args.context
  chunk = method.prefill_chunk or args.chunk  # as generation.prefill: the method's own, if any
  loops = args.reps + 2 + (2 if args.kernel_profile else 0)  # the decode loops the cache takes
  cache_len = -(-(ctx + args.new_tokens * loops) // 128) * 128
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, ctx)).astype(np.int32)
  plen = jnp.full((b,), ctx, jnp.int32)
  tokens = jnp.asarray(tokens)
  n_chunks = ctx // chunk

  def run_prefill(first_chunk: int, cache, last):
    """Chunks first_chunk.. of the prompt; returns (cache, last, seconds, host enqueue seconds)."""
    t0 = time.perf_counter()
    host_s = 0.0  # the host's time in the calls (they return before the GPU is done)
    for c in range(first_chunk, n_chunks):
      t_call = time.perf_counter()
      cache, last = prefill_step(params, tokens[:, c * chunk:(c + 1) * chunk],
                                  jnp.int32(c * chunk), plen, cache, last, cfg=cfg, method=method,
                                  options=options)
      host_s += time.perf_counter() - t_call
      if n_chunks >= 64 and c % (n_chunks // 8) == 0:  # long prefills (1M) show where they are
        jax.block_until_ready(last)
        _stage(f"prefill chunk {c}/{n_chunks}, {time.perf_counter() - t0:.1f}s")
    jax.block_until_ready(last)
    cache = end_prefill(cache, cfg, method, decode_room=cache_len - ctx, options=options)
    jax.block_until_ready(cache)
    return cache, last, time.perf_counter() - t0, host_s

  def fresh():
    return (sharding.empty_cache(cfg, method, b, cache_len, chunk, options),
            jnp.zeros((b, cfg.vocab_size)))

  if args.fill_cache:  # no prefill: random K/V in the cache, every row at the context's length
    cache = filled_cache(cfg, method, b, ctx, cache_len, options)
    last = jnp.zeros((b, cfg.vocab_size))
    _stage("cache filled")
    first = prefill_s = host_s = 0.0
    timed_tokens = 0
  elif args.warmup_prefill:  # a whole prefill compiles; the next one is timed, every chunk of it
    cache, last, first, _ = run_prefill(0, *fresh())
    del cache, last
    cache, last, prefill_s, host_s = run_prefill(0, *fresh())
    timed_tokens = n_chunks * chunk
  else:  # very long prompts: the first chunk compiles and is left out of the timing
    t0 = time.perf_counter()
    cache, last = prefill_step(params, tokens[:, :chunk], jnp.int32(0), plen,
                                *fresh(), cfg=cfg, method=method, options=options)
    jax.block_until_ready(last)
    first = time.perf_counter() - t0
    cache, last, prefill_s, host_s = run_prefill(1, cache, last)
    timed_tokens = (n_chunks - 1) * chunk
  _stage(f"prefill {prefill_s:.1f}s (compile run {first:.1f}s)")
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
  stops = jnp.asarray([-1], jnp.int32)
  state = {"cache": cache}

  def decode():
    out, steps, state["cache"] = decode_loop(
        params, state["cache"], last, stops, row_keys(0, b), cfg=cfg, method=method,
        max_new_tokens=args.new_tokens, sampling=Sampling(), options=options)
    jax.block_until_ready(out)

  if os.environ.get("JAX_LONGCTX_DUMP_HLO"):
    hlo = decode_loop.lower(params, cache, last, stops, row_keys(0, b), cfg=cfg, method=method,
                            max_new_tokens=args.new_tokens, sampling=Sampling(),
                            options=options).compile().as_text()
    dump = os.path.join(os.environ["JAX_LONGCTX_DUMP_HLO"], f"{args.label}_{ctx}.hlo.txt")
    with open(dump, "w") as f:
      f.write(hlo)
  t0 = time.perf_counter()
  decode()
  decode_compile_s = time.perf_counter() - t0
  _stage(f"decode compile+run {decode_compile_s:.1f}s")
  med, times = median_time(decode, warmup=0, reps=args.reps)
  per_token = med / (args.new_tokens - 1)
  wbytes, kvbytes = _bytes_per_token(cfg, ctx, b, options.kv_dtype)
  if mesh is not None:  # what one device reads: its weights, its rows' KV of its heads
    model, data = (mesh.shape[a] for a in ("model", "data"))
    wbytes, kvbytes = wbytes // model, kvbytes * max(model // cfg.num_kv_heads, 1) // (model * data)
  # A method that keeps fewer slots than the context (SnapKV's budget, a streaming window) reads
  # at most what one device holds of its cache.
  kvbytes = min(kvbytes, bytes_on(state["cache"], jax.devices()[0] if mesh is None
                                  else mesh.devices.flat[0]))
  kernels = (common.device_kernel_times(decode, calls=1, per_call=args.new_tokens - 1)
             [:args.kernel_profile] if args.kernel_profile else None)
  report = method.report(state["cache"])
  weights_total = sum(x.nbytes for x in jax.tree.leaves(params))
  return {**report, "hparams": method.hparams(), "kv_dtype": options.kv_dtype,
          "fill_cache": args.fill_cache, "cache_bytes": cache_bytes,
          "peak_bytes_after_params": peak_params, **params_ready,
          "weights_bytes_total": weights_total, "resident_bytes": cache_bytes + weights_total,
          "prefill_tok_s": b * timed_tokens / prefill_s if prefill_s else None,
          "prefill_warmup": args.warmup_prefill,
          "prefill_chunk": chunk, "prefill_s": prefill_s, "prefill_host_enqueue_s": host_s,
          "prefill_first_chunk_s": first, "decode_ms": per_token * 1e3,
          "decode_times_s": times, "decode_compile_s": decode_compile_s,
          **({"kernels_per_token": kernels} if kernels is not None else {}),
          "weight_bytes": wbytes, "kv_bytes": kvbytes, "peak_bytes": jax_peak_bytes(),
          "device_count": 1 if mesh is None else mesh.size,
          "peak_bytes_per_device": [(d.memory_stats() or {}).get("peak_bytes_in_use")
                                    for d in (jax.devices()[:1] if mesh is None
                                              else mesh.devices.flat)],
          "variant": {k: v for k, v in os.environ.items()
                      if k.startswith("JAX_LONGCTX_") or k == "XLA_FLAGS"}}


def run_hf(args) -> dict:
  import torch
  from transformers import LlamaConfig as HFConfig
  from transformers import LlamaForCausalLM

  from jax_longctx import preset

  cfg = preset(args.model, dtype="bfloat16")
  hf = HFConfig(**{k: v for k, v in cfg.to_hf().items() if v is not None})
  hf._attn_implementation = "sdpa"
  dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke tests of this script only
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(dev):
    model = LlamaForCausalLM(hf).eval()
  b, ctx = args.batch, args.context
  ids = torch.randint(0, cfg.vocab_size, (b, ctx), device=dev)
  with torch.no_grad():
    model(ids[:, :256], logits_to_keep=1)  # warm-up
    sync()
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    sync()
    prefill_s = time.perf_counter() - t0
    cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(args.new_tokens):
      t0 = time.perf_counter()
      out = model(tok, past_key_values=cache, use_cache=True)
      tok = out.logits[:, -1:].argmax(-1)
      sync()
      times.append(time.perf_counter() - t0)
  times = sorted(times[2:])
  wbytes, kvbytes = _bytes_per_token(cfg, ctx, b)
  return {"prefill_tok_s": b * ctx / prefill_s, "decode_ms": times[len(times) // 2] * 1e3,
          "weight_bytes": wbytes, "kv_bytes": kvbytes,
          "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else None,
          "torch": torch.__version__}


def _has_cuda() -> bool:
  try:
    import torch
    return torch.cuda.is_available()
  except ImportError:
    return False


def child(args) -> None:
  rec = {"impl": args.impl, "model": args.model, "context": args.context, "batch": args.batch,
         "new_tokens": args.new_tokens, "method": args.method, "method_args": args.method_arg,
         "label": args.label or args.method, "mesh": args.mesh or None,
         "kernel_options": args.kernel_option, "run_options": args.run_option,
         "decode_tiling": args.decode_tiling or None,
         "key_smoothing": args.key_smoothing, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  try:
    rec.update(run_jax(args) if args.impl == "jax" else run_hf(args))
  except Exception as e:  # out of memory at large batch x context is a result, not a crash
    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  rec.update(device_facts() if args.impl == "jax" else {})
  child_result(rec)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="llama-3.1-8b")
  p.add_argument("--contexts", default="8192,32768,131072")
  p.add_argument("--batches", default="1,8")
  p.add_argument("--impls", default="jax,hf")
  p.add_argument("--methods", default="full",
                 help="jax-longctx methods to time (jax impl only); label:name for variants")
  p.add_argument("--method-arg", action="append", default=[], metavar="METHOD.KEY=VALUE")
  p.add_argument("--kernel-option", action="append", default=[], metavar="METHOD.KEY=VALUE",
                 help="a KernelOptions field for one method label's runs, e.g. "
                      "blocks.topk_few_rows=kernel with --methods blocks:reattention")
  p.add_argument("--run-option", action="append", default=[], metavar="KEY=VALUE",
                 help="a RunOptions field for every run, e.g. add_norm_backend=auto "
                      "(core/options.py says what each does)")
  p.add_argument("--decode-tiling", default="", metavar="KEY=VALUE,...",
                 help="RunOptions.decode_tiling for every run (gpu.Tiling fields), e.g. "
                      "block_keys=64,num_stages=3")
  p.add_argument("--skip", default="131072x8", help="context x batch pairs that cannot fit")
  p.add_argument("--meshes", default="none",
                 help="';'-separated device meshes for the jax impl, e.g. 'none;model=2;data=2' "
                      "(none: one device)")
  p.add_argument("--kv-dtypes", default="none",
                 help="';'-separated cache dtypes for the jax impl: none (the model's), int8, "
                      "float8_e4m3fn")
  p.add_argument("--fill-cache", action="store_true",
                 help="decode only, over a cache filled with random K/V (no prefill)")
  p.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                 help="record the N longest device kernels of a decode step (a traced loop "
                      "after the timed ones; per device on a mesh: the collectives show there)")
  p.add_argument("--key-smoothing", action="store_true",
                 help="the weights with key smoothing and KV offsets (run/key_smoothing.py), "
                      "as an 8-bit load makes them")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--chunk", type=int, default=4096)
  p.add_argument("--warmup-prefill", action=argparse.BooleanOptionalAction, default=True,
                 help="time a whole second prefill (--no-warmup-prefill: all chunks but the "
                      "first, which compiles; for prompts too long to prefill twice)")
  p.add_argument("--out", default="decode.jsonl")
  p.add_argument("--child", action="store_true")
  p.add_argument("--impl")
  p.add_argument("--method", default="full")
  p.add_argument("--label")
  p.add_argument("--context", type=int)
  p.add_argument("--batch", type=int)
  p.add_argument("--mesh", default="")
  p.add_argument("--kv-dtype", default="")
  args = p.parse_args()
  if args.child:
    return child(args)
  skip = set(args.skip.split(",")) if args.skip else set()
  bw = common.copy_bandwidth() if _has_cuda() else None
  gemm = common.gemm_tflops() if _has_cuda() else None
  meshes = ["" if m.strip() == "none" else m.strip() for m in args.meshes.split(";")]
  kvs = ["" if m.strip() == "none" else m.strip() for m in args.kv_dtypes.split(";")]
  runs = [("hf", "full", "", "") if impl == "hf" else ("jax", m, mesh, kv)
          for impl in args.impls.split(",")
          for m in (args.methods.split(",") if impl == "jax" else ["full"])
          for mesh in (meshes if impl == "jax" else [""])
          for kv in (kvs if impl == "jax" else [""])]
  for impl, entry, mesh, kv in runs:
    label, _, method = entry.rpartition(":")
    label = label or method
    margs = [a.split(".", 1)[1] for a in args.method_arg if a.startswith(label + ".")]
    kopts = [a.split(".", 1)[1] for a in args.kernel_option if a.startswith(label + ".")]
    for ctx in map(int, args.contexts.split(",")):
      for b in map(int, args.batches.split(",")):
        if f"{ctx}x{b}" in skip:
          continue
        run = run_child(__file__, [
            "--impl", impl, "--context", str(ctx), "--batch", str(b), "--model", args.model,
            "--new-tokens", str(args.new_tokens), "--reps", str(args.reps),
            "--chunk", str(args.chunk), "--method", method,
            "--warmup-prefill" if args.warmup_prefill else "--no-warmup-prefill",
            "--label", label, "--mesh", mesh, "--kv-dtype", kv,
            *(["--fill-cache"] if args.fill_cache else []),
            *(["--key-smoothing"] if args.key_smoothing else []),
            "--kernel-profile", str(args.kernel_profile),
            *[x for a in margs for x in ("--method-arg", a)],
            *[x for a in kopts for x in ("--kernel-option", a)],
            *[x for a in args.run_option for x in ("--run-option", a)],
            "--decode-tiling", args.decode_tiling], echo_stderr=True)
        rec = run.records[-1] if run.records else {
            "impl": impl, "context": ctx, "batch": b, "error": run.stderr[-500:]}
        if gemm and rec.get("prefill_tok_s"):  # (None with --fill-cache)
          rec["gemm_tflops"] = gemm
          rec["prefill_tflops"] = rec["prefill_tok_s"] * _prefill_flops_per_token(args.model, ctx)
          rec["prefill_of_gemm"] = rec["prefill_tflops"] / (gemm * rec.get("device_count", 1))
        if bw and "decode_ms" in rec:
          rec["copy_bw"] = bw
          rec["bound_ms"] = (rec["weight_bytes"] + rec["kv_bytes"]) / bw * 1e3
          rec["of_bound"] = rec["bound_ms"] / rec["decode_ms"]
        write_json(args.out, rec)
        print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, list)}), flush=True)


if __name__ == "__main__":
  main()
