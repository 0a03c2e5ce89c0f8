"""`generate`: the one public generation entry (`jax_longctx.generate`), under the API
(`LM.generate`), the CLI and the evaluation sweeps; and `continuation_nll` for perplexity.

Every method takes the same road: the host side of a mesh (`sharding.HostBatch`: the weights
placed, the batch padded over `data`), the one prefill router (`generation.prefill`, which
checks the prompts and picks chunks, CItruS' instruction passes or Star's blocks by what the
method declares), the decode loop, and the padding rows dropped. A method that `splits_tokens`
(Star, ring, mesh ReAttention) runs without a mesh over every device on `ctx`. Token ids in,
token ids out: text (chat templates, the instruction split) is the caller's.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.core.axes import ROWS
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import axis_size
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.methods.base import Method, get
from jax_longctx.model import forward
from jax_longctx.run import sharding
from jax_longctx.run.generation import (DecodeAhead, GenerationError, GenerationResult, Sampling,
                                        decode, prefill, teacher_forced_nll)
from jax_longctx.run.sharding import HostBatch, mesh_step

__all__ = ["continuation_nll", "generate", "uncached_logits"]


def run_options(method: Method, options: RunOptions) -> RunOptions:
  """The options a method runs with: a method that splits the tokens, given no mesh, gets every
  device on `ctx`."""
  if method.splits_tokens and options.mesh is None:
    return options.replace(mesh=f"ctx={len(jax.devices())}")
  return options


def generate(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]], method: Method, *,
             max_new_tokens: int, sampling: Sampling = Sampling(), stop_tokens=(),
             cache_len: int | None = None,
             instructions: Sequence[Sequence[int]] | None = None,
             options: RunOptions = DEFAULT) -> GenerationResult:
  """Up to max_new_tokens for each prompt (token id lists of any lengths), by any method.

  instructions: each prompt's instruction (Star's and ring's query) apart from it, which
  `needs_instruction` methods require. cache_len: None sizes the cache to the longest prompt
  plus max_new_tokens, rounded up to a multiple of 128 (nearby lengths share a compile) and of
  the method's `cache_unit`; a given one is rounded up to the unit. options: how the compiled
  steps are built (`RunOptions`: kernels, prefill chunk, the mesh). On a mesh the weights are
  `model.place`d there (once: placed weights are used as they are) and a batch that does not
  divide over `data` is padded with copies of its last row, whose results are dropped.
  """
  options = run_options(method, options)
  host, params, prompts, instructions = HostBatch.enter(params, cfg, options, prompts,
                                                        instructions)
  # Row lengths, instructions included; `prefill` checks the prompts (once) against the cache.
  lengths = [len(p) for p in prompts]
  if instructions is not None:
    lengths = [n + len(i) for n, i in zip(lengths, instructions)]
  unit = method.cache_unit(axis_size(options.mesh, "ctx"), options.kv_dtype)
  if cache_len is None:
    unit = math.lcm(128, unit)
    cache_len = max(lengths, default=0) + max(max_new_tokens, 1)
  cache_len = -(-cache_len // unit) * unit
  t0 = time.perf_counter()
  # the decode loop compiles on a host thread while the prompt's chunks run
  ahead = DecodeAhead(params, cfg, method, max_new_tokens=max_new_tokens, sampling=sampling,
                      stop_tokens=stop_tokens, options=options)
  cache, last = prefill(params, cfg, prompts, method, cache_len=cache_len,
                        decode_room=max_new_tokens, instructions=instructions, options=options,
                        on_chunk=ahead)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  ahead.wait()
  rows, cache = decode(params, cfg, cache, last, method, max_new_tokens=max_new_tokens,
                       sampling=sampling, stop_tokens=stop_tokens, options=options)
  cache = host.cache(cache)
  return GenerationResult(host.rows(rows), cache, host.rows(lengths), t1 - t0,
                          time.perf_counter() - t1, _report(method, cache, options),
                          host.rows(last))


def _report(method: Method, cache, options: RunOptions) -> dict:
  """The method's report on a run's cache, and the devices a mesh run spanned."""
  report = method.report(cache)
  if options.mesh is not None:
    report["devices"] = options.mesh.size
  return report


def continuation_nll(params, cfg: LlamaConfig, method: Method,
                     prefixes: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                     instructions: Sequence[Sequence[int]] | None = None, *, cache_len: int,
                     options: RunOptions = DEFAULT):
  """Per-token NLL of each row's `targets` (one length for every row) fed after its prefix (any
  lengths; teacher forcing). A method that `needs_instruction` has its eviction steered by each
  row's instruction, which is not encoded: the text goes on right after the prefix. Returns
  (nll [rows, N] float64, a GenerationResult with the timings and the method's report)."""
  if len({len(t) for t in targets}) > 1:
    raise GenerationError("continuation_nll: every row's targets must have one length, got "
                          f"{sorted({len(t) for t in targets})}")
  options = run_options(method, options)
  t0 = time.perf_counter()
  steered = method.needs_instruction
  host, params, prefixes, instructions, rows = HostBatch.enter(
      params, cfg, options, prefixes, instructions if steered else None, targets)
  cache, last = prefill(params, cfg, prefixes, method, cache_len=cache_len,
                        decode_room=len(targets[0]) if steered else None,
                        instructions=instructions, encode_instruction=False, options=options)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  nll, cache = teacher_forced_nll(params, cache, last, np.asarray(rows, np.int32), cfg=cfg,
                                  method=method, options=options)
  cache = host.cache(cache)
  return host.rows(np.asarray(nll, np.float64)), GenerationResult(
      [], cache, host.rows([len(p) for p in prefixes]), t1 - t0, time.perf_counter() - t1,
      _report(method, cache, options))


def uncached_logits(params, cfg: LlamaConfig, ids, options: RunOptions = DEFAULT):
  """[B, L] token ids -> [B, L, V] fp32 logits of one uncached forward (full attention); on a
  mesh the rows are padded over `data` and the padding dropped."""
  full = get("full")
  host, params, rows = HostBatch.enter(params, cfg, options, list(np.asarray(ids, np.int32)))
  ids = np.asarray(rows, np.int32)
  cache = sharding.empty_cache(cfg, full, ids.shape[0], ids.shape[1], ids.shape[1], options)
  return host.rows(_logits(params, jnp.asarray(ids), cache, cfg=cfg, method=full,
                           options=options))


@mesh_step(inputs={"params": "params", "ids": (ROWS,), "cache": "cache"}, outputs="gathered")
def _logits(params, ids, cache, *, cfg: LlamaConfig, method: Method, options: RunOptions):
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
  return forward(params, ids, positions, cache, method, cfg, options=options)[0]
