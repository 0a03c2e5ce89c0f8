"""One setting of the decode benchmark: prefill tokens/s and decode ms/token of a model with a
method, in this process (`measure_decode`), or transformers' on the same shape
(`measure_transformers`), the anchor. `jax-longctx bench` runs each setting in a child process
of its own through `python -m jax_longctx.app.bench_decode SETTING_JSON`.

The weights: a named shape (`jax_longctx.preset`) drawn at random (speed does not depend on the
values), straight into their shards on a mesh, or a model `load` reads. Decode is timed after a
prefill over a random prompt, or with `fill_cache` over a cache filled with random keys and
values (for contexts whose prefill would not fit a run)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

from jax_longctx.app.bench_measure import (ChunkTrace, bytes_on, device_facts,
                                           device_kernel_times, jax_peak_bytes, median_time,
                                           option_fields, run_options)
from jax_longctx.app.bench_process import child_result


@dataclasses.dataclass
class DecodeSetting:
  """What one run measures. kernel_options / run_options: KEY=VALUE strings of KernelOptions /
  RunOptions fields; decode_tiling: KEY=VALUE,... of gpu.Tiling; shape: KEY=VALUE strings that
  change the named shape's config (e.g. num_layers=2 for a quick run)."""
  model: str = "llama-3.1-8b"
  context: int = 8192
  batch: int = 1
  impl: str = "jax"  # or "hf": transformers on the same shape
  method: str = "full"
  label: str = ""
  method_args: list = dataclasses.field(default_factory=list)
  mesh: str = ""
  kv_dtype: str = ""
  new_tokens: int = 64
  reps: int = 3
  chunk: int = 4096
  warmup_prefill: bool = True
  fill_cache: bool = False
  key_smoothing: bool = False
  kernel_profile: int = 0
  prefill_profile: int = 0
  prefill_profile_at: float = 1.0
  kernel_options: list = dataclasses.field(default_factory=list)
  run_options: list = dataclasses.field(default_factory=list)
  decode_tiling: str = ""
  shape: list = dataclasses.field(default_factory=list)


def model_config(setting: DecodeSetting):
  """The named shape's config (bf16), with the setting's shape changes."""
  from jax_longctx import LlamaConfig, preset
  cfg = preset(setting.model, dtype="bfloat16")
  return cfg.replace(**option_fields(LlamaConfig, setting.shape, "--shape", default=cfg))


def is_shape(model: str) -> bool:
  from jax_longctx.core.config import PRESETS
  return model.lower() in PRESETS


def bytes_per_token(cfg, ctx: int, batch: int, kv_dtype: str | None = None) -> tuple[int, int]:
  """(weight bytes read per decode step, KV bytes read per step): the weights in their dtype,
  the cache in it too or, 8-bit, a byte a value and an fp32 scale per (token, KV head), or,
  4-bit, half a byte a value and a scale and zero point per group of values (quant4.py)."""
  import numpy as np
  from pallas_kernels import quant4
  item = np.dtype(cfg.jnp_dtype).itemsize
  weights = cfg.num_params() - cfg.vocab_size * cfg.hidden_size  # embedding: one row per token
  if cfg.tie_word_embeddings:
    weights += cfg.vocab_size * cfg.hidden_size  # ... unless it is also the output head
  rows = 2 * cfg.num_layers * batch * cfg.num_kv_heads * ctx  # K and V rows of head_dim values
  if kv_dtype in quant4.FORMATS:  # a K or a V row: half of a token's in one KV head
    per_row = quant4.format_of(kv_dtype).row_bytes(cfg.head_dim) // 2
  else:
    per_row = item * cfg.head_dim if kv_dtype is None else cfg.head_dim + 4
  return item * weights, rows * per_row


def prefill_flops_per_token(cfg, ctx: int) -> float:
  """TFLOPs per prompt token: 2 per weight, the embedding and the output head excluded (both
  sides compute logits for the last token only), plus causal attention's 2 * ctx * H * d per
  layer (QK and PV over the lower triangle, averaged over the prompt)."""
  heads = 1 if cfg.tie_word_embeddings else 2
  weights = cfg.num_params() - heads * cfg.vocab_size * cfg.hidden_size
  attn = 2 * ctx * cfg.num_heads * cfg.head_dim * cfg.num_layers
  return (2 * weights + attn) / 1e12


def stage(msg: str) -> None:
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
  from pallas_kernels import quant4

  chunk = method.prefill_chunk or options.prefill_chunk  # as a prefill would make the cache
  cache = sharding.empty_cache(cfg, method, batch, cache_len, chunk, options)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(cache)) + 1))

  @functools.lru_cache(maxsize=None)
  def drawer(shape, dtype, where):  # one compiled draw per kind of buffer, not per buffer
    if jnp.issubdtype(dtype, jnp.floating):  # (E4M3 drawn in bf16: random has no 8-bit floats)
      draw = lambda key: jax.random.normal(  # noqa: E731
          key, shape, jnp.bfloat16 if dtype.itemsize == 1 else dtype).astype(dtype)
    elif dtype == jnp.uint8:  # 4-bit codes: any byte is two
      draw = lambda key: jax.random.bits(key, shape, jnp.uint8)  # noqa: E731
    else:  # 8-bit values in [-127, 127], as quantization writes them
      draw = lambda key: jnp.maximum(  # noqa: E731
          jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8), dtype), -127)
    return jax.jit(draw, out_shardings=where)

  def drawn(x):
    shape, dtype, where = x.shape, x.dtype, x.sharding
    x.delete()
    return jax.block_until_ready(drawer(shape, dtype, where)(next(keys)))

  def constant(x, value):  # x's buffer freed before its replacement is made, as drawn's
    shape, dtype, where = x.shape, x.dtype, x.sharding
    x.delete()
    return jax.block_until_ready(jnp.full(shape, value, dtype, device=where))

  def one(x):
    if isinstance(x, Quantized):  # 8-bit values of any magnitude, scales of a bf16 K's rows
      # (a pre-RoPE key buffer's offset, which the model sets every step, kept but committed)
      return dataclasses.replace(x, values=drawn(x.values), scale=constant(x.scale, 0.02),
                                 offset=None if x.offset is None
                                 else jax.device_put(x.offset, x.offset.sharding))
    if isinstance(x, quant4.Int4):  # any codes; ranges of a bf16 K's values
      return dataclasses.replace(x, codes=drawn(x.codes), scale=constant(x.scale, 0.004),
                                 zero=constant(x.zero, -0.03))
    if isinstance(x, quant4.GroupedKeys):  # full groups up to the length, the residual after
      return quant4.GroupedKeys(one(x.main), drawn(x.residual),
                                constant(x.residual_group, ctx // x.main.group))
    return drawn(x) if x.ndim == 4 else x
  state = jax.tree.map(one, cache.state,
                       is_leaf=lambda x: isinstance(x, Quantized) or quant4.is_int4(x))
  # every buffer placed where the empty one was (committed): an uncommitted one is a different
  # program for jit than the decode step's own output, and the first timed loop recompiled
  return cache.replace(state=state, lengths=constant(cache.lengths, ctx))


def _weights(s: DecodeSetting, options):
  """(config, params) as generation runs them: a shape's random weights (fused on GPU, as
  `load(serving=True)` makes them) or a loaded model."""
  from jax_longctx.app.api import load
  from jax_longctx.model import random_on_mesh, random_params, serving_params

  if not is_shape(s.model):
    lm = load(s.model, serving=True, mesh=options.mesh, kv_dtype=options.kv_dtype,
              smooth_keys=s.key_smoothing)
    return lm.config, lm.params
  # key_smoothing: the model as an 8-bit `load` makes it, key smoothing and KV offsets (factors
  # 1 and random offsets here; the operations the attention layers add are the same whatever
  # their values)
  cfg = model_config(s).replace(key_smoothing=s.key_smoothing, kv_offsets=s.key_smoothing)
  mesh = options.mesh
  return cfg, serving_params(random_params(cfg) if mesh is None else random_on_mesh(cfg, mesh),
                             mesh)


def measure_decode(s: DecodeSetting) -> dict:
  """Prefill and decode of one setting in this process: the fields of its record."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jax_longctx.methods import get, parse_method_args
  from jax_longctx.run.generation import DecodeAhead, Sampling, decode_loop, loop_inputs, prefill

  method = get(s.method, **parse_method_args(s.method_args))
  options = run_options(mesh=s.mesh, kv_dtype=s.kv_dtype, chunk=min(s.chunk, s.context),
                        kernel_option=s.kernel_options, run_option=s.run_options,
                        decode_tiling=s.decode_tiling)
  mesh = options.mesh
  stage("weights")
  cfg, params = _weights(s, options)
  jax.block_until_ready(params)
  peak_params = jax_peak_bytes()  # what placing (and fusing) the weights took, before any step
  devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
  # in use once the weights are ready, against their bytes: the allocator's blocks handed out
  # whole show as the difference (model.fuse_placed)
  params_ready = {"in_use_after_params_per_device": [
                      (d.memory_stats() or {}).get("bytes_in_use") for d in devices],
                  "params_bytes_per_device": [bytes_on(params, d) for d in devices]}
  stage("params ready")
  b, ctx = s.batch, s.context
  chunk = method.prefill_chunk or options.prefill_chunk  # as generation.prefill chooses it
  loops = s.reps + 2 + (2 if s.kernel_profile else 0)  # the decode loops the cache takes
  cache_len = -(-(ctx + s.new_tokens * loops) // 128) * 128
  # rows of an int32 array, not lists: prefill copies them into its padded array by memcpy, so
  # the timed prefill holds no per-token host work
  prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, ctx)).astype(np.int32)

  kw = dict(cfg=cfg, method=method, max_new_tokens=s.new_tokens, sampling=Sampling(),
            options=options)
  ahead = {}

  def run_prefill(time_first: bool, compile_decode: bool, trace: ChunkTrace | None = None):
    """(cache, last, seconds, host enqueue seconds, seconds of the first chunk). time_first:
    the first chunk (which compiles) is waited for and left out of the seconds. compile_decode:
    the decode loop compiles on a host thread meanwhile (`DecodeAhead`), as `generate` runs it
    (the first prefill only: a warm, timed one has no thread beside it). trace: a `ChunkTrace`
    (--prefill-profile) told of every chunk."""
    clock = {"t0": time.perf_counter(), "host": 0.0, "first": 0.0}
    clock["prev"] = clock["t0"]

    def on_chunk(i, n, last, _cache):
      now = time.perf_counter()
      clock["host"] += now - clock["prev"]  # the call returned before the device was done
      if (i == 0 and time_first) or (n >= 64 and i % (n // 8) == 0):
        jax.block_until_ready(last)
        if i == 0 and time_first:
          clock["first"] = time.perf_counter() - clock["t0"]
        if n >= 64:  # long prefills (1M) show where they are
          stage(f"prefill chunk {i}/{n}, {time.perf_counter() - clock['t0']:.1f}s")
      if trace:
        trace(i, n, last)
      clock["prev"] = time.perf_counter()

    hook = on_chunk
    if compile_decode:
      ahead["loop"] = hook = DecodeAhead(params, **kw, then=on_chunk)
    cache, last = prefill(params, cfg, prompts, method, cache_len=cache_len, options=options,
                          on_chunk=hook)
    jax.block_until_ready((cache, last))
    seconds = time.perf_counter() - clock["t0"] - clock["first"]
    if trace:
      trace.close(last)
    return cache, last, seconds, clock["host"], clock["first"]

  # --prefill-profile: chunks of the timed prefill run traced (inside its timing)
  trace = ChunkTrace(s.prefill_profile, s.prefill_profile_at) if s.prefill_profile else None
  if s.fill_cache:  # no prefill: random K/V in the cache, every row at the context's length
    cache = filled_cache(cfg, method, b, ctx, cache_len, options)
    last = jnp.zeros((b, cfg.vocab_size))
    stage("cache filled")
    first = prefill_s = host_s = 0.0
    timed_tokens = 0
  elif s.warmup_prefill:  # a whole prefill compiles; the next one is timed, every chunk of it
    cache, last, first, _, _ = run_prefill(False, True)
    del cache, last
    cache, last, prefill_s, host_s, _ = run_prefill(False, False, trace)
    timed_tokens = ctx
  else:  # very long prompts: the first chunk compiles and is left out of the timing
    cache, last, prefill_s, host_s, first = run_prefill(True, True, trace)
    timed_tokens = ctx - chunk
  profile = trace.report(s.kernel_profile or 16) if trace else {}
  stage(f"prefill {prefill_s:.1f}s (compile run {first:.1f}s)")
  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
  state = {"cache": cache}

  def decode():  # as generation.decode calls the loop
    out, _, state["cache"] = decode_loop(params, *loop_inputs(state["cache"], last, Sampling(), ()),
                                         **kw)
    jax.block_until_ready(out)

  t0 = time.perf_counter()
  if "loop" in ahead:
    ahead["loop"].wait()
  ahead_wait_s = time.perf_counter() - t0
  if os.environ.get("JAX_LONGCTX_DUMP_HLO"):  # where XLA copies buffers shows there
    compiled = decode_loop.lower(params, *loop_inputs(cache, last, Sampling(), ()), **kw).compile()
    dump = os.path.join(os.environ["JAX_LONGCTX_DUMP_HLO"], f"{s.label or s.method}_{ctx}.hlo.txt")
    with open(dump, "w") as f:
      f.write(compiled.as_text())
    stage(f"decode program: {compiled.memory_analysis()}")  # temp, donated (alias) bytes
  t0 = time.perf_counter()
  decode()
  decode_compile_s = time.perf_counter() - t0
  compiled_ahead = "loop" in ahead and ahead["loop"].compile is not None
  stage(f"decode {'run (compiled during the prefill)' if compiled_ahead else 'compile+run'} "
        f"{decode_compile_s:.1f}s")
  med, times = median_time(decode, warmup=0, reps=s.reps)
  per_token = med / (s.new_tokens - 1)
  wbytes, kvbytes = bytes_per_token(cfg, ctx, b, options.kv_dtype)
  if mesh is not None:  # what one device reads: its weights, its rows' KV of its heads
    model, data = (mesh.shape[a] for a in ("model", "data"))
    wbytes, kvbytes = wbytes // model, kvbytes * max(model // cfg.num_kv_heads, 1) // (model * data)
  # A method that keeps fewer slots than the context (SnapKV's budget, a streaming window) reads
  # at most what one device holds of its cache.
  kvbytes = min(kvbytes, bytes_on(state["cache"], devices[0]))
  kernels = (device_kernel_times(decode, calls=1, per_call=s.new_tokens - 1)[:s.kernel_profile]
             if s.kernel_profile else None)
  weights_total = sum(x.nbytes for x in jax.tree.leaves(params))
  return {**method.report(state["cache"]), "hparams": method.hparams(),
          "kv_dtype": options.kv_dtype, "fill_cache": s.fill_cache, "cache_bytes": cache_bytes,
          "peak_bytes_after_params": peak_params, **params_ready,
          "weights_bytes_total": weights_total, "resident_bytes": cache_bytes + weights_total,
          "prefill_tok_s": b * timed_tokens / prefill_s if prefill_s else None,
          "prefill_warmup": s.warmup_prefill, "prefill_chunk": chunk, "prefill_s": prefill_s,
          "prefill_host_enqueue_s": host_s, "prefill_first_chunk_s": first,
          "prefill_flops_per_token": prefill_flops_per_token(cfg, ctx) * 1e12,
          "decode_ms": per_token * 1e3, "decode_times_s": times,
          "decode_compile_s": decode_compile_s, "decode_compiled_ahead": compiled_ahead,
          "decode_ahead_wait_s": ahead_wait_s,
          **({"kernels_per_token": kernels} if kernels is not None else {}),
          **profile,
          "weight_bytes": wbytes, "kv_bytes": kvbytes, "peak_bytes": jax_peak_bytes(),
          "device_count": len(devices),
          "peak_bytes_per_device": [(d.memory_stats() or {}).get("peak_bytes_in_use")
                                    for d in devices],
          "variant": {k: v for k, v in os.environ.items()
                      if k.startswith("JAX_LONGCTX_") or k == "XLA_FLAGS"}}


def measure_transformers(s: DecodeSetting) -> dict:
  """transformers (sdpa attention) on the same shape with random weights: the anchor. Prefill
  of the whole prompt in one call after a short warm-up; decode the median of its steps after
  the first two."""
  import torch
  from transformers import LlamaConfig as HFConfig
  from transformers import LlamaForCausalLM

  cfg = model_config(s)
  hf = HFConfig(**{k: v for k, v in cfg.to_hf().items() if v is not None})
  hf._attn_implementation = "sdpa"
  dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: quick checks of the command only
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(dev):
    model = LlamaForCausalLM(hf).eval()
  b, ctx = s.batch, s.context
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
    for _ in range(s.new_tokens):
      t0 = time.perf_counter()
      out = model(tok, past_key_values=cache, use_cache=True)
      tok = out.logits[:, -1:].argmax(-1)
      sync()
      times.append(time.perf_counter() - t0)
  times = sorted(times[2:])
  wbytes, kvbytes = bytes_per_token(cfg, ctx, b)
  return {"prefill_tok_s": b * ctx / prefill_s, "decode_ms": times[len(times) // 2] * 1e3,
          "prefill_flops_per_token": prefill_flops_per_token(cfg, ctx) * 1e12,
          "weight_bytes": wbytes, "kv_bytes": kvbytes,
          "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else None,
          "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
          "torch": torch.__version__}


def record_of(s: DecodeSetting) -> dict:
  """The setting's record: what it ran, then what it measured, or the error it stopped at (out
  of memory at a large batch x context is a result, not a crash)."""
  from importlib.metadata import version
  rec = {"impl": s.impl, "model": s.model, "context": s.context, "batch": s.batch,
         "new_tokens": s.new_tokens, "method": s.method, "method_args": s.method_args,
         "label": s.label or s.method, "mesh": s.mesh or None,
         "kernel_options": s.kernel_options, "run_options": s.run_options,
         "decode_tiling": s.decode_tiling or None, "key_smoothing": s.key_smoothing,
         "shape": s.shape, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  try:
    rec.update(measure_decode(s) if s.impl == "jax" else measure_transformers(s))
  except Exception as e:  # noqa: BLE001 - recorded
    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  if s.impl == "jax":
    rec.update(device_facts())
  else:  # jax left uninitialized: on a GPU it would take most of the memory transformers needs
    rec["jax"] = version("jax")
  return rec


if __name__ == "__main__":  # a child of `jax-longctx bench`: one setting, one record
  child_result(record_of(DecodeSetting(**json.loads(sys.argv[1]))))
