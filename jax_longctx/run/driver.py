"""`generate`: the one public generation entry (`jax_longctx.generate`), under the API
(`LM.generate`), the CLI and the evaluation sweeps; and `continuation_nll` for perplexity.

It routes by what the method declares: a `MeshMethod` runs over a mesh of every device, through
`distributed.generate_sharded` when it has a `layer_method` (mesh ReAttention) and
`distributed.generate_distributed` otherwise (Star, ring); a per-layer `Method` through the one
prefill road (`generation.prefill`, which checks the prompts) and the decode loop. Token ids in,
token ids out: text (chat templates, the instruction split) is the caller's.
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import axis_size, make_mesh
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.methods.base import MeshMethod, Method, RegisteredMethod, get
from jax_longctx.model import forward
from jax_longctx.run import sharding
from jax_longctx.run.distributed import (cache_unit, generate_distributed, generate_sharded,
                                         sharded)
from jax_longctx.run.generation import (GenerationError, GenerationResult, Sampling, decode,
                                        prefill, teacher_forced_nll)

__all__ = ["continuation_nll", "generate", "uncached_logits"]


def generate(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]],
             method: RegisteredMethod, *, max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_tokens=(), cache_len: int | None = None,
             instructions: Sequence[Sequence[int]] | None = None,
             options: RunOptions = DEFAULT) -> GenerationResult:
  """Up to max_new_tokens for each prompt (token id lists of any lengths), by any method.

  instructions: each prompt's instruction (a mesh method's query) apart from it, which
  `needs_instruction` methods require. cache_len: None sizes the cache to the longest prompt
  plus max_new_tokens, rounded up to a multiple of 128 (nearby lengths share a compile).
  options: how the compiled steps are built (`RunOptions`: kernels, prefill chunk, the mesh).
  On a mesh the weights are `model.place`d there (once: placed weights are used as they are)
  and a batch that does not divide over `data` is padded with copies of its last row, whose
  results are dropped.
  """
  if isinstance(method, MeshMethod):
    return _on_mesh(params, cfg, method, prompts, instructions, max_new_tokens=max_new_tokens,
                    sampling=sampling, stop_tokens=stop_tokens, cache_len=cache_len,
                    options=options)
  n = len(prompts)
  if options.mesh is not None and n:
    params = sharding.placed(params, cfg, options.mesh)
    prompts, instructions = sharding.pad_rows(prompts, options), (
        None if instructions is None else sharding.pad_rows(instructions, options))
  # Row lengths, instructions included; `prefill` checks the prompts (once) against the cache.
  lengths = [len(p) for p in prompts]
  if instructions is not None:
    lengths = [n + len(i) for n, i in zip(lengths, instructions)]
  if cache_len is None:
    cache_len = -(-(max(lengths, default=0) + max(max_new_tokens, 1)) // 128) * 128
  t0 = time.perf_counter()
  cache, last = prefill(params, cfg, prompts, method, cache_len=cache_len,
                        decode_room=max_new_tokens, instructions=instructions, options=options)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  rows, cache = decode(params, cfg, cache, last, method, max_new_tokens=max_new_tokens,
                       sampling=sampling, stop_tokens=stop_tokens, options=options)
  if len(rows) > n:  # the padding rows go
    rows, cache, lengths = rows[:n], sharding.first_rows(cache, n), lengths[:n]
  return GenerationResult(rows, cache, lengths, t1 - t0,
                          time.perf_counter() - t1, method.report(cache))


def _on_mesh(params, cfg, method: MeshMethod, contexts, queries, *, cache_len: int | None,
             options: RunOptions, **kw) -> GenerationResult:
  """The context over the mesh's `ctx` axis (and the heads over `model`): `options.mesh`, or
  every device on `ctx`. A sharded cache for a method with a `layer_method` (the instruction, if
  given apart, follows its prompt), else the query and answer replicated (Star, ring)."""
  mesh = options.mesh if options.mesh is not None else make_mesh(f"ctx={len(jax.devices())}")
  options = options.replace(mesh=mesh)
  n_dev = mesh.size
  params = sharding.placed(params, cfg, mesh)
  layer = method.layer_method()
  if layer is not None:
    prompts = contexts if queries is None else [list(c) + list(q)
                                                for c, q in zip(contexts, queries)]
    if cache_len is not None:  # the driver sizes caches itself: round up to equal shards
      unit = cache_unit(sharded(method), axis_size(mesh, "ctx"))
      cache_len = -(-cache_len // unit) * unit
    result = generate_sharded(params, cfg, prompts, method, mesh, cache_len=cache_len,
                              options=options, **kw)
    result.report = {"devices": n_dev}
    return result
  if queries is None:
    raise GenerationError(f"method {method.name!r} needs the instruction apart from the "
                          "document: pass instructions= (or --instruction on the command line)")
  t0 = time.perf_counter()
  rows, _ = generate_distributed(params, cfg, contexts, queries, mesh, method=method,
                                 options=options, **kw)
  return GenerationResult(rows, None, [len(c) for c in contexts], time.perf_counter() - t0, None,
                          {"devices": n_dev})


def continuation_nll(params, cfg: LlamaConfig, method: Method, prefix: Sequence[int],
                     targets: Sequence[int], instruction: Sequence[int] | None = None, *,
                     cache_len: int, options: RunOptions = DEFAULT):
  """Per-token NLL of `targets` fed after `prefix` (teacher forcing). A method that
  `needs_instruction` has its eviction steered by `instruction`, which is not encoded: the text
  goes on right after the prefix. Returns (nll [N] float64, a GenerationResult with the timings
  and the method's report)."""
  t0 = time.perf_counter()
  steered = method.needs_instruction
  prefixes, instructions, rows = [prefix], [instruction] if steered else None, [targets]
  if options.mesh is not None:  # one row, copied to fill the data axis
    params = sharding.placed(params, cfg, options.mesh)
    prefixes, rows = sharding.pad_rows(prefixes, options), sharding.pad_rows(rows, options)
    instructions = instructions and sharding.pad_rows(instructions, options)
  cache, last = prefill(params, cfg, prefixes, method, cache_len=cache_len,
                        decode_room=len(targets) if steered else None,
                        instructions=instructions, encode_instruction=False, options=options)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  nll, cache = teacher_forced_nll(params, cache, last, np.asarray(rows, np.int32), cfg=cfg,
                                  method=method, options=options)
  nll = np.asarray(nll[0], np.float64)
  if len(prefixes) > 1:
    cache = sharding.first_rows(cache, 1)
  return nll, GenerationResult([], cache, [len(prefix)], t1 - t0, time.perf_counter() - t1,
                               method.report(cache))


def uncached_logits(params, cfg: LlamaConfig, ids, options: RunOptions = DEFAULT):
  """[B, L] token ids -> [B, L, V] fp32 logits of one uncached forward (full attention); on a
  mesh the rows are padded over `data` and the padding dropped."""
  ids = np.asarray(ids, np.int32)
  b = ids.shape[0]
  full = get("full")
  if options.mesh is not None:
    params = sharding.placed(params, cfg, options.mesh)
    ids = np.asarray(sharding.pad_rows(list(ids), options))
  cache = sharding.empty_cache(cfg, full, ids.shape[0], ids.shape[1], ids.shape[1], options)
  return _logits(params, jnp.asarray(ids), cache, cfg=cfg, method=full, options=options)[:b]


@functools.partial(jax.jit, static_argnames=("cfg", "method", "options"))
def _logits(params, ids, cache, *, cfg: LlamaConfig, method: Method, options: RunOptions):
  def body(params, ids, cache):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return sharding.all_rows(forward(params, ids, positions, cache, method, cfg,
                                     options=options)[0], options)

  specs = (None, None) if options.mesh is None else (
      sharding.params(params), sharding.cache_specs(cache, options.mesh))
  return sharding.per_device(body, options, (specs[0], P("data"), specs[1]), sharding.ALL)(
      params, ids, cache)
