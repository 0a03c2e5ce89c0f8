"""Generation: prefill (whole prompts, or documents and instructions apart) and an on-device
decode loop; `generate` is both, exported as `jax_longctx.generate`.

Decoding is one jitted `lax.while_loop` that samples, runs the model one token at a time and
stops when every sequence has hit a stop token or the budget: no host round-trip per token, the
cache donated. (This module was `jax_longctx.generate` before issue 25; the package exports a
function of that name, which hid the module.)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.cache import Cache
from jax_longctx.chunked_prefill import (GenerationError, check_prompts, end_prefill,
                                         layer_method, prefill_prompts, prefill_step)
from jax_longctx.config import LlamaConfig
from jax_longctx.instructed import prefill_instructed
from jax_longctx.methods.base import Method
from jax_longctx.model import forward

__all__ = ["DECODE_TRACES", "GenerationError", "GenerationResult", "Sampling", "decode",
           "decode_loop", "decode_while", "end_prefill", "generate", "prefill", "prefill_step",
           "sample", "teacher_forced_nll", "trim_at_stops"]


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
  prefill_s: float = 0.0  # wall time of the prefill (until its logits were ready)
  decode_s: float = 0.0  # wall time of the decode loop


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


def trim_at_stops(rows, stop_tokens) -> list[list[int]]:
  """Each row of generated tokens up to (not including) its first stop token."""
  stops = set(int(t) for t in stop_tokens)
  return [row[:next((i for i, t in enumerate(row) if t in stops), len(row))]
          for row in np.asarray(rows).tolist()]


def prefill(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]], method: Method, *,
            cache_len: int, chunk_size: int | None = None, decode_room: int | None = None,
            instructions: Sequence[Sequence[int]] | None = None, encode_instruction: bool = True):
  """Runs the prompts through the model chunk by chunk. Returns (cache, last-token logits [B, V]).

  instructions: each prompt's instruction, given apart from it (the prompt is then the
  document); methods that `needs_instruction` (CItruS) need it, the others read both as one
  (`instructed.prefill_instructed`; encode_instruction=False stops before the instruction).
  decode_room: tokens decoding will append (default: what the cache has left).
  """
  method = layer_method(method)
  if instructions is None:
    return prefill_prompts(params, cfg, prompts, method, cache_len=cache_len,
                           chunk_size=chunk_size, decode_room=decode_room)
  check_prompts(prompts, instructions)
  room = cache_len - max(map(len, prompts)) - max(map(len, instructions)) \
      if decode_room is None else decode_room
  return prefill_instructed(params, cfg, prompts, instructions, method, cache_len=cache_len,
                            decode_room=max(room, 0), chunk_size=chunk_size,
                            encode_instruction=encode_instruction)


def decode(params, cfg: LlamaConfig, cache: Cache, last_logits, method: Method, *,
           max_new_tokens: int, sampling: Sampling = Sampling(), stop_tokens=()):
  """The decode loop after a prefill. Returns (new tokens per row, stop token excluded; cache)."""
  stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
  out, steps, cache = decode_loop(params, cache, last_logits, stops,
                                  jax.random.key(sampling.seed), cfg=cfg, method=method,
                                  max_new_tokens=max_new_tokens, sampling=sampling)
  return trim_at_stops(np.asarray(out)[:, :int(steps)], stop_tokens), cache


def generate(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]], method: Method, *,
             max_new_tokens: int, sampling: Sampling = Sampling(), stop_tokens=(),
             chunk_size: int | None = None, cache_len: int | None = None,
             instructions: Sequence[Sequence[int]] | None = None) -> GenerationResult:
  """Generates up to max_new_tokens for each prompt (token id lists of any lengths).

  instructions: each prompt's instruction apart from it (see `prefill`). cache_len: None sizes
  the cache to the longest prompt plus max_new_tokens, rounded up to a multiple of 128.
  """
  lengths = check_prompts(prompts, instructions, cache_len=cache_len, new_tokens=max_new_tokens)
  if cache_len is None:
    cache_len = -(-(max(lengths) + max_new_tokens) // 128) * 128  # nearby lengths share a compile
  t0 = time.perf_counter()
  cache, last = prefill(params, cfg, prompts, method, cache_len=cache_len, chunk_size=chunk_size,
                        decode_room=max_new_tokens, instructions=instructions)
  jax.block_until_ready(last)
  t1 = time.perf_counter()
  rows, cache = decode(params, cfg, cache, last, method, max_new_tokens=max_new_tokens,
                       sampling=sampling, stop_tokens=stop_tokens)
  return GenerationResult(rows, cache, lengths, t1 - t0, time.perf_counter() - t1)
