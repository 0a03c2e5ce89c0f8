"""`generate`: the one public generation entry (`jax_longctx.generate`), under the API
(`LM.generate`), the CLI and the evaluation sweeps; and `continuation_nll` for perplexity.

It routes by what the method declares: a `MeshMethod` runs over a mesh of every device, through
`distributed.generate_sharded` when it has a `layer_method` (mesh ReAttention) and
`distributed.generate_distributed` otherwise (Star, ring); a per-layer `Method` through the one
prefill road (`generation.prefill`, which checks the prompts) and the decode loop. Token ids in,
token ids out: text (chat templates, the instruction split) is the caller's.
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jax_longctx.core.config import LlamaConfig
from jax_longctx.run.distributed import (cache_unit, generate_distributed, generate_sharded,
                                     replicate, sharded)
from jax_longctx.run.generation import (GenerationError, GenerationResult, Sampling, decode,
                                    prefill, teacher_forced_nll)
from jax_longctx.methods.base import MeshMethod, Method, RegisteredMethod
from jax_longctx.core.options import DEFAULT, RunOptions

__all__ = ["continuation_nll", "generate"]


def generate(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]],
             method: RegisteredMethod, *, max_new_tokens: int, sampling: Sampling = Sampling(),
             stop_tokens=(), cache_len: int | None = None,
             instructions: Sequence[Sequence[int]] | None = None,
             options: RunOptions = DEFAULT) -> GenerationResult:
  """Up to max_new_tokens for each prompt (token id lists of any lengths), by any method.

  instructions: each prompt's instruction (a mesh method's query) apart from it, which
  `needs_instruction` methods require. cache_len: None sizes the cache to the longest prompt
  plus max_new_tokens, rounded up to a multiple of 128 (nearby lengths share a compile).
  options: how the compiled steps are built (`RunOptions`: kernels, prefill chunk).
  """
  if isinstance(method, MeshMethod):
    return _on_mesh(params, cfg, method, prompts, instructions, max_new_tokens=max_new_tokens,
                    sampling=sampling, stop_tokens=stop_tokens, cache_len=cache_len,
                    options=options)
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
  return GenerationResult(rows, cache, lengths, t1 - t0,
                          time.perf_counter() - t1, method.report(cache))


def _on_mesh(params, cfg, method: MeshMethod, contexts, queries, *, cache_len: int | None,
             options: RunOptions, **kw) -> GenerationResult:
  """The context over every device of a one-axis mesh: a sharded cache for a method with a
  `layer_method` (the instruction, if given apart, follows its prompt), else the query and answer
  replicated (Star, ring)."""
  mesh = Mesh(np.array(jax.devices()), ("ctx",))
  n_dev = len(jax.devices())
  layer = method.layer_method()
  if layer is not None:
    prompts = contexts if queries is None else [list(c) + list(q)
                                                for c, q in zip(contexts, queries)]
    if cache_len is not None:  # the driver sizes caches itself: round up to equal shards
      unit = cache_unit(sharded(method), n_dev)
      cache_len = -(-cache_len // unit) * unit
    result = generate_sharded(_replicated(params, mesh), cfg, prompts, method, mesh,
                              cache_len=cache_len, options=options, **kw)
    result.report = {"devices": n_dev}
    return result
  if queries is None:
    raise GenerationError(f"method {method.name!r} needs the instruction apart from the "
                          "document: pass instructions= (or --instruction on the command line)")
  t0 = time.perf_counter()
  rows, _ = generate_distributed(_replicated(params, mesh), cfg, contexts, queries, mesh,
                                 method=method, options=options, **kw)
  return GenerationResult(rows, None, [len(c) for c in contexts], time.perf_counter() - t0, None,
                          {"devices": n_dev})


_REPLICATED: list = []  # [(params, mesh, copies)]: the last weights put on a multi-process mesh


def _replicated(params, mesh):
  """The weights on every device of the mesh. With several processes the mesh spans devices this
  process cannot address, so the copy starts from host arrays (which every process holds alike);
  that costs a trip through the host, so the copy is kept for the next call (a sweep's samples)."""
  if jax.process_count() == 1:
    return replicate(params, mesh)
  if _REPLICATED and _REPLICATED[0][0] is params and _REPLICATED[0][1] == mesh:
    return _REPLICATED[0][2]
  copies = replicate(jax.device_get(params), mesh)
  _REPLICATED[:] = [(params, mesh, copies)]
  return copies


def continuation_nll(params, cfg: LlamaConfig, method: Method, prefix: Sequence[int],
                     targets: Sequence[int], instruction: Sequence[int] | None = None, *,
                     cache_len: int, options: RunOptions = DEFAULT):
  """Per-token NLL of `targets` fed after `prefix` (teacher forcing). A method that
  `needs_instruction` has its eviction steered by `instruction`, which is not encoded: the text
  goes on right after the prefix. Returns (nll [N] float64, a GenerationResult with the timings
  and the method's report)."""
  t0 = time.perf_counter()
  steered = method.needs_instruction
  cache, last = prefill(params, cfg, [prefix], method, cache_len=cache_len,
                        decode_room=len(targets) if steered else None,
                        instructions=[instruction] if steered else None,
                        encode_instruction=False, options=options)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  nll, cache = teacher_forced_nll(params, cache, last, np.asarray([targets], np.int32), cfg=cfg,
                                  method=method, options=options)
  nll = np.asarray(nll[0], np.float64)
  return nll, GenerationResult([], cache, [len(prefix)], t1 - t0, time.perf_counter() - t1,
                               method.report(cache))
