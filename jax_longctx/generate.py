"""Chunked prefill and an on-device decode loop.

Prompts are left-aligned (every sequence starts at position 0) and consumed in fixed-size chunks;
one jitted chunk step serves all chunks (its start is traced). Decoding is one jitted
`lax.while_loop` that samples, runs the model one token at a time and stops when every sequence
has hit a stop token or the budget: no host round-trip per token, the cache donated.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.cache import Cache
from jax_longctx.config import LlamaConfig
from jax_longctx.methods.base import Method, PrefillEnd
from jax_longctx.model import forward, new_cache



def default_chunk() -> int:
  """Prefill chunk when neither the caller nor the method names one.

  8192 on GPUs: measured on an H200 (8B shape, batch 1, BENCHMARKS.md), prefill at 32K / 128K ran
  1.10x / 1.04x transformers' speed at 4096, 1.11x / 1.05x at 8192 and 1.12x / 1.05x at 16384,
  with the same peak memory (the cache and weights dominate it); 8192 keeps most of the gain at
  half of 16384's activations. 512 elsewhere: on CPU the jnp attention holds chunk x cache score
  blocks, and TPU chunk sizes are not measured.
  """
  return 8192 if jax.default_backend() == "gpu" else 512


class GenerationError(ValueError):
  """Bad generation input: empty batch or prompt, a prompt that does not fit the cache, ..."""


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0  # 0 means greedy
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class GenerationResult:
  tokens: list[list[int]]  # new tokens per prompt, stop token excluded
  cache: Cache
  prompt_lengths: list[int]


def sample(logits: jnp.ndarray, key, sampling: Sampling) -> jnp.ndarray:
  """logits [B, V] fp32 -> token ids [B] int32."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  if sampling.top_p < 1:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop = (jnp.cumsum(probs, axis=-1) - probs) >= sampling.top_p
    sorted_logits = jnp.where(drop, -jnp.inf, sorted_logits)
    logits = jnp.full_like(logits, -jnp.inf).at[
        jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("cache", "last"))
def prefill_chunk(params, tokens, start, prompt_lengths, cache: Cache, last, *, cfg: LlamaConfig,
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


def decode_while(method: Method, keep_going, step, carry, cache_of):
  """`lax.while_loop(keep_going, step, carry)` for decode steps `step(carry, gate_open)`.

  With a method's `decode_gate`, the steps it closes run `gate_open=False` in an inner loop of
  their own and the others `gate_open=True`: the gate is a loop condition, not a `lax.cond` around
  the model, which XLA would pass the cache through by copying it (a loop updates it in place).
  """

  def gate(c):
    cache = cache_of(c)
    return method.decode_gate(cache, cache.lengths[:, None])

  if gate(carry) is None:
    return jax.lax.while_loop(keep_going, functools.partial(step, gate_open=True), carry)

  def group(c):  # the closed steps up to the next open one, then the open ones
    c = jax.lax.while_loop(lambda c: keep_going(c) & ~gate(c),
                           functools.partial(step, gate_open=False), c)
    return jax.lax.while_loop(lambda c: keep_going(c) & gate(c),
                              functools.partial(step, gate_open=True), c)

  return jax.lax.while_loop(keep_going, group, carry)


# Counts how often the decode loop is traced (= compiled); tests read it.
DECODE_TRACES = [0]


@functools.partial(jax.jit, static_argnames=("cfg", "method", "max_new_tokens", "sampling"),
                   donate_argnames=("cache",))
def decode_loop(params, cache: Cache, last_logits, stop_tokens, key, *, cfg: LlamaConfig,
                method: Method, max_new_tokens: int, sampling: Sampling):
  """Samples up to max_new_tokens per row on device. Returns (tokens [B, N], steps, cache)."""
  DECODE_TRACES[0] += 1
  b = last_logits.shape[0]
  key, sub = jax.random.split(key)
  tok = sample(last_logits, sub, sampling)
  out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok)
  done = jnp.isin(tok, stop_tokens)

  def keep_going(carry):
    step, _, _, _, done, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(carry, gate_open: bool):
    step, cache, tok, out, done, key = carry
    positions = cache.lengths[:, None]
    logits, cache = forward(params, tok[:, None], positions, cache, method, cfg, decode=True,
                            logits_index=jnp.zeros((b,), jnp.int32), gate_open=gate_open)
    key, sub = jax.random.split(key)
    nxt = jnp.where(done, tok, sample(logits, sub, sampling))
    out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], step, axis=1)
    return step + 1, cache, nxt, out, done | jnp.isin(nxt, stop_tokens), key

  step, cache, _, out, _, _ = decode_while(
      method, keep_going, body, (jnp.int32(1), cache, tok, out, done, key), lambda c: c[1])
  return out, step, cache


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("cache",))
def teacher_forced_nll(params, cache: Cache, last_logits, targets, *, cfg: LlamaConfig,
                       method: Method):
  """NLL [B, N] of `targets` fed one token per decode step after a prefill (teacher forcing)."""

  def nll(logits, tok):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=1)[:, 0]

  def body(carry, gate_open: bool):
    i, cache, out = carry  # feeds targets[:, i - 1], scores targets[:, i]
    tok, nxt = jax.lax.dynamic_slice_in_dim(targets, i - 1, 2, axis=1).T
    logits, cache = forward(params, tok[:, None], cache.lengths[:, None], cache, method, cfg,
                            decode=True, logits_index=jnp.zeros(tok.shape, jnp.int32),
                            gate_open=gate_open)
    return i + 1, cache, jax.lax.dynamic_update_slice_in_dim(out, nll(logits, nxt)[:, None], i, 1)

  n = targets.shape[1]
  out = jnp.zeros(targets.shape, jnp.float32).at[:, 0].set(nll(last_logits, targets[:, 0]))
  _, cache, out = decode_while(method, lambda c: c[0] < n, body, (jnp.int32(1), cache, out),
                               lambda c: c[1])
  return out, cache


def _check_prompts(prompts: Sequence[Sequence[int]]) -> list[int]:
  if len(prompts) == 0:
    raise GenerationError("batch of zero prompts: pass at least one prompt")
  lengths = [len(p) for p in prompts]
  empty = [i for i, n in enumerate(lengths) if n == 0]
  if empty:
    raise GenerationError(f"empty prompt at batch index {empty[0]}: a prompt needs >= 1 token")
  return lengths


def prefill(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]], method: Method, *,
            cache_len: int, chunk_size: int | None = None, decode_room: int | None = None,
            instructions: Sequence[Sequence[int]] | None = None):
  """Runs the prompts through the model chunk by chunk. Returns (cache, last-token logits [B, V]).

  instructions: each prompt's instruction, given apart from it (the prompt is then the
  document); methods guided by the instruction (CItruS) need it, the others read both as one.
  decode_room: tokens decoding will append (default: what the cache has left).
  """
  lengths = _check_prompts(prompts)
  if instructions is not None:
    from jax_longctx.instructed import prefill_instructed
    room = cache_len - max(lengths) - max(map(len, instructions)) if decode_room is None \
        else decode_room
    return prefill_instructed(params, cfg, prompts, instructions, method, cache_len=cache_len,
                              decode_room=max(room, 0), chunk_size=chunk_size)
  if getattr(method, "needs_instruction", False):
    raise GenerationError(
        f"method {method.name!r} needs the instruction apart from the document: pass "
        "instructions= (or --instruction on the command line)")
  longest = max(lengths)
  if longest > cache_len:
    raise GenerationError(
        f"prompt of {longest} tokens is longer than the cache ({cache_len} slots)")
  # A short prompt is not padded up to the default chunk: it rounds up to a multiple of 512.
  chunk = method.prefill_chunk or chunk_size or min(default_chunk(), -(-longest // 512) * 512)
  n_chunks = -(-longest // chunk)
  tokens = np.zeros((len(prompts), n_chunks * chunk), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  cache = new_cache(cfg, method, len(prompts), cache_len, chunk=chunk)
  last = jnp.zeros((len(prompts), cfg.vocab_size), jnp.float32)
  plen = jnp.asarray(lengths, jnp.int32)
  for c in range(n_chunks):
    cache, last = prefill_chunk(params, jnp.asarray(tokens[:, c * chunk:(c + 1) * chunk]),
                                jnp.int32(c * chunk), plen, cache, last, cfg=cfg, method=method)
  room = cache_len - longest if decode_room is None else decode_room
  return end_prefill(cache, cfg, method, decode_room=room), last


def end_prefill(cache: Cache, cfg: LlamaConfig, method: Method, decode_room: int) -> Cache:
  """The method's end-of-prefill hook on every layer, if the method has one.

  The prompt cache is donated leaf by leaf where the result has a buffer of its shape to reuse
  (RefreshKV keeps its full cache as it is: donating it avoids a second copy). Leaves the hook
  turns into something smaller (SnapKV's compression) are not donated: no output could reuse
  them, and XLA would only warn that it cannot.
  """
  if type(method).end_of_prefill is Method.end_of_prefill:
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


def generate(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]], method: Method, *,
             max_new_tokens: int, sampling: Sampling = Sampling(), stop_tokens=(),
             chunk_size: int | None = None, cache_len: int | None = None,
             instructions: Sequence[Sequence[int]] | None = None) -> GenerationResult:
  """Generates up to max_new_tokens for each prompt (token id lists of any lengths).

  instructions: each prompt's instruction apart from it (see `prefill`).
  """
  lengths = _check_prompts(prompts)
  if max_new_tokens < 1:
    raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if instructions is not None:
    if len(instructions) != len(prompts):
      raise GenerationError(f"{len(prompts)} prompts but {len(instructions)} instructions")
    lengths = [n + len(i) for n, i in zip(lengths, instructions)]
  needed = max(lengths) + max_new_tokens
  if cache_len is None:
    cache_len = -(-needed // 128) * 128  # round up so nearby lengths share a compile
  elif needed > cache_len:
    raise GenerationError(
        f"prompt of {max(lengths)} tokens plus {max_new_tokens} new tokens does not fit the cache "
        f"({cache_len} slots)")
  cache, last = prefill(params, cfg, prompts, method, cache_len=cache_len, chunk_size=chunk_size,
                        decode_room=max_new_tokens, instructions=instructions)
  stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
  out, steps, cache = decode_loop(params, cache, last, stops, jax.random.key(sampling.seed),
                                  cfg=cfg, method=method, max_new_tokens=max_new_tokens,
                                  sampling=sampling)
  out = np.asarray(out)[:, :int(steps)]
  stop_set = set(int(s) for s in stop_tokens)
  result = []
  for row in out.tolist():
    cut = next((i for i, t in enumerate(row) if t in stop_set), len(row))
    result.append(row[:cut])
  return GenerationResult(result, cache, lengths)
