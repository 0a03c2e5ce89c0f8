"""The one generation driver under the API (`LM.generate`), the CLI and the evaluation sweeps.

It routes by what the method declares: a `MeshMethod` runs over a mesh of every device, through
`distributed.generate_sharded` when it has a `layer_method` (mesh ReAttention) and
`distributed.generate_distributed` otherwise (Star, ring), a per-layer `Method` through
`generation.generate`; prompt checks and stop-token trimming happen there, once. Token ids in,
token ids out: text (chat templates, the instruction split) is the caller's.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jax_longctx.cache import Cache
from jax_longctx.config import LlamaConfig
from jax_longctx.distributed import (cache_unit, generate_distributed, generate_sharded,
                                     replicate, sharded)
from jax_longctx.generation import (GenerationError, Sampling, generate, prefill,
                                    teacher_forced_nll)
from jax_longctx.methods.base import MeshMethod, Method, RegisteredMethod


@dataclasses.dataclass
class Generated:
  tokens: list[list[int]]  # new tokens per prompt, stop token excluded
  prefill_s: float  # mesh methods: the whole run
  decode_s: float | None  # None where the two phases are not timed apart (mesh methods)
  report: dict[str, Any]  # what the run says about itself (Method.report; devices of a mesh)
  cache: Cache | None = None  # per-layer methods: the cache after decoding


def generate_tokens(params, cfg: LlamaConfig, method: RegisteredMethod,
                    prompts: Sequence[Sequence[int]],
                    instructions: Sequence[Sequence[int]] | None = None, *, max_new_tokens: int,
                    sampling: Sampling = Sampling(), stop_tokens=(),
                    chunk_size: int | None = None, cache_len: int | None = None) -> Generated:
  """Up to max_new_tokens for each prompt, by whatever route the method takes.

  instructions: each prompt's instruction (a mesh method's query) apart from it, which
  `needs_instruction` methods require."""
  if isinstance(method, MeshMethod):
    return _on_mesh(params, cfg, method, prompts, instructions, max_new_tokens=max_new_tokens,
                    sampling=sampling, stop_tokens=stop_tokens, cache_len=cache_len)
  result = generate(params, cfg, prompts, method, max_new_tokens=max_new_tokens,
                    sampling=sampling, stop_tokens=stop_tokens, chunk_size=chunk_size,
                    cache_len=cache_len, instructions=instructions)
  return Generated(result.tokens, result.prefill_s, result.decode_s,
                   method.report(result.cache), result.cache)


def _on_mesh(params, cfg, method: MeshMethod, contexts, queries, *, cache_len: int | None,
             **kw) -> Generated:
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
                              cache_len=cache_len, **kw)
    return Generated(result.tokens, result.prefill_s, result.decode_s, {"devices": n_dev})
  if queries is None:
    raise GenerationError(f"method {method.name!r} needs the instruction apart from the "
                          "document: pass instructions= (or --instruction on the command line)")
  t0 = time.perf_counter()
  rows, _ = generate_distributed(_replicated(params, mesh), cfg, contexts, queries, mesh,
                                 method=method, **kw)
  return Generated(rows, time.perf_counter() - t0, None, {"devices": n_dev})


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
                     cache_len: int, chunk_size: int | None = None):
  """Per-token NLL of `targets` fed after `prefix` (teacher forcing). A method that
  `needs_instruction` has its eviction steered by `instruction`, which is not encoded: the text
  goes on right after the prefix. Returns (nll [N] float64, Generated-style timings and report)."""
  t0 = time.perf_counter()
  if method.needs_instruction:
    cache, last = prefill(params, cfg, [prefix], method, cache_len=cache_len,
                          chunk_size=chunk_size, decode_room=len(targets),
                          instructions=[instruction], encode_instruction=False)
  else:
    cache, last = prefill(params, cfg, [prefix], method, cache_len=cache_len,
                          chunk_size=chunk_size)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  nll, cache = teacher_forced_nll(params, cache, last, np.asarray([targets], np.int32), cfg=cfg,
                                  method=method)
  nll = np.asarray(nll[0], np.float64)
  return nll, Generated([], t1 - t0, time.perf_counter() - t1, method.report(cache), cache)
