"""Prompt checks and the chunked prefill of a batch of prompts (below `instructed` and
`generation`, which both build on it).

Prompts are left-aligned (every sequence starts at position 0) and consumed in fixed-size chunks;
one jitted chunk step serves all chunks (its start is traced). After the last chunk a method that
`ends_prefill` rewrites each layer's state once (SnapKV compresses there).
"""

from __future__ import annotations

import collections
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jax_longctx.cache import Cache
from jax_longctx.config import LlamaConfig
from jax_longctx.methods.base import Method, MethodError, PrefillEnd, RegisteredMethod
from jax_longctx.model import forward, new_cache


class GenerationError(ValueError):
  """Bad generation input: empty batch or prompt, a prompt that does not fit the cache, ..."""


def default_chunk() -> int:
  """Prefill chunk when neither the caller nor the method names one.

  8192 on GPUs: measured on an H200 (8B shape, batch 1, BENCHMARKS.md), prefill at 32K / 128K ran
  1.10x / 1.04x transformers' speed at 4096, 1.11x / 1.05x at 8192 and 1.12x / 1.05x at 16384,
  with the same peak memory (the cache and weights dominate it); 8192 keeps most of the gain at
  half of 16384's activations. 512 elsewhere: on CPU the jnp attention holds chunk x cache score
  blocks, and TPU chunk sizes are not measured. The platform is the kernels' (`pallas_kernels.
  platform()`), which `pallas_kernels.lowering_for` overrides while exporting for another one.
  """
  return 8192 if pallas_kernels.platform() == "gpu" else 512


def check_prompts(prompts: Sequence[Sequence[int]],
                  instructions: Sequence[Sequence[int]] | None = None, *,
                  cache_len: int | None = None, new_tokens: int | None = None) -> list[int]:
  """Every check of a batch of prompts (and their instructions, given apart) in one place.
  Returns each row's length, its instruction included; raises GenerationError."""
  if len(prompts) == 0:
    raise GenerationError("batch of zero prompts: pass at least one prompt")
  lengths = [len(p) for p in prompts]
  empty = [i for i, n in enumerate(lengths) if n == 0]
  if empty:
    raise GenerationError(f"empty prompt at batch index {empty[0]}: a prompt needs >= 1 token")
  if new_tokens is not None and new_tokens < 1:
    raise GenerationError(f"max_new_tokens must be >= 1, got {new_tokens}")
  if instructions is not None:
    if len(instructions) != len(prompts):
      raise GenerationError(f"{len(prompts)} prompts but {len(instructions)} instructions")
    ins_lens = [len(i) for i in instructions]
    if 0 in ins_lens:
      raise GenerationError(f"empty instruction at batch index {ins_lens.index(0)}")
    lengths = [n + i for n, i in zip(lengths, ins_lens)]
  longest = max(lengths)
  if cache_len is not None and longest + (new_tokens or 0) > cache_len:
    if new_tokens:
      raise GenerationError(
          f"prompt of {longest} tokens plus {new_tokens} new tokens does not fit the cache "
          f"({cache_len} slots)")
    what = "prompt" if instructions is None else "document plus instruction"
    raise GenerationError(
        f"{what} of {longest} tokens is longer than the cache ({cache_len} slots)")
  return lengths


def layer_method(method: RegisteredMethod) -> Method:
  """The method, if it runs per layer; a mesh method is an error that says where it runs."""
  if not isinstance(method, Method):
    raise MethodError(f"{method.name!r} runs over a device mesh: use "
                      "jax_longctx.distributed.generate_distributed (generate_sharded for "
                      "reattention_mesh), or `jax-longctx eval`, LM.generate")
  return method


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("cache", "last"))
def prefill_step(params, tokens, start, prompt_lengths, cache: Cache, last, *, cfg: LlamaConfig,
                 method: Method):
  """One prompt chunk [B, C] at positions start..start+C-1; keeps each row's last-token logits."""
  b, c = tokens.shape
  positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
  valid = positions < prompt_lengths[:, None]
  idx = jnp.clip(prompt_lengths - 1 - start, 0, c - 1)
  logits, cache = forward(params, tokens, positions, cache, method, cfg, valid=valid,
                          logits_index=idx)
  ends_here = (prompt_lengths - 1 >= start) & (prompt_lengths - 1 < start + c)
  return cache, jnp.where(ends_here[:, None], logits, last)


def padded(rows: Sequence[Sequence[int]], width: int) -> jnp.ndarray:
  """Token rows, left-aligned and zero-padded to [B, width] int32."""
  out = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return jnp.asarray(out)


def prefill_prompts(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]], method: Method,
                    *, cache_len: int, chunk_size: int | None = None,
                    decode_room: int | None = None):
  """The prompts read whole, chunk by chunk. Returns (cache, last-token logits [B, V])."""
  method = layer_method(method)
  lengths = check_prompts(prompts)
  if method.needs_instruction:
    raise GenerationError(
        f"method {method.name!r} needs the instruction apart from the document: pass "
        "instructions= (or --instruction on the command line)")
  lengths = check_prompts(prompts, cache_len=cache_len)
  longest = max(lengths)
  # A short prompt is not padded up to the default chunk: it rounds up to a multiple of 512.
  chunk = method.prefill_chunk or chunk_size or min(default_chunk(), -(-longest // 512) * 512)
  n_chunks = -(-longest // chunk)
  tokens = padded(prompts, n_chunks * chunk)
  cache = new_cache(cfg, method, len(prompts), cache_len, chunk=chunk)
  last = jnp.zeros((len(prompts), cfg.vocab_size), jnp.float32)
  plen = jnp.asarray(lengths, jnp.int32)
  for c in range(n_chunks):
    cache, last = prefill_step(params, tokens[:, c * chunk:(c + 1) * chunk], jnp.int32(c * chunk),
                               plen, cache, last, cfg=cfg, method=method)
  room = cache_len - longest if decode_room is None else decode_room
  return end_prefill(cache, cfg, method, decode_room=room), last


def end_prefill(cache: Cache, cfg: LlamaConfig, method: Method, decode_room: int) -> Cache:
  """The method's end-of-prefill hook on every layer, if it `ends_prefill`.

  The prompt cache is donated leaf by leaf where the result has a buffer of its shape to reuse
  (RefreshKV keeps its full cache as it is: donating it avoids a second copy). Leaves the hook
  turns into something smaller (SnapKV's compression) are not donated: no output could reuse
  them, and XLA would only warn that it cannot.
  """
  if not method.ends_prefill:
    return cache
  leaves, tree = jax.tree.flatten(cache)
  avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
  reuse = _reusable_leaves(tree, avals, cfg, method, decode_room)
  return finish_prefill([x for x, r in zip(leaves, reuse) if r],
                        [x for x, r in zip(leaves, reuse) if not r],
                        tree=tree, reuse=reuse, cfg=cfg, method=method, decode_room=decode_room)


def _end_of_prefill_all(cache: Cache, cfg: LlamaConfig, method: Method, decode_room: int) -> Cache:
  state = tuple(
      method.end_of_prefill(s, PrefillEnd(cfg, i, cache.lengths, decode_room))
      for i, s in enumerate(cache.state))
  return cache.replace(state=state)


@functools.lru_cache(maxsize=64)
def _reusable_leaves(tree, avals, cfg, method, decode_room) -> tuple[bool, ...]:
  """Which input leaves an output of the same shape and dtype can take over (as XLA pairs
  donated buffers with outputs)."""
  out = jax.eval_shape(
      lambda c: _end_of_prefill_all(c, cfg, method, decode_room), jax.tree.unflatten(tree, avals))
  free = collections.Counter((x.shape, x.dtype) for x in jax.tree.leaves(out))
  reuse = []
  for x in avals:
    reuse.append(free[(x.shape, x.dtype)] > 0)
    free[(x.shape, x.dtype)] -= reuse[-1]
  return tuple(reuse)


@functools.partial(jax.jit, static_argnames=("tree", "reuse", "cfg", "method", "decode_room"),
                   donate_argnames=("donated",))
def finish_prefill(donated, kept, *, tree, reuse, cfg: LlamaConfig, method: Method,
                   decode_room: int) -> Cache:
  """Runs the method's end-of-prefill hook on every layer (SnapKV's one-time compression) on the
  cache flattened into donated and kept leaves (`reuse` says which is which)."""
  donated, kept = iter(donated), iter(kept)
  leaves = [next(donated) if r else next(kept) for r in reuse]
  return _end_of_prefill_all(jax.tree.unflatten(tree, leaves), cfg, method, decode_room)
