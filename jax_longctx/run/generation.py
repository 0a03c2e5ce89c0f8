"""The one prefill road and the on-device decode loop under `driver.generate`.

`prefill` is the only router of a prompt batch: it resolves the layer method and checks the
prompts once, then reads them whole in chunks (`chunked_prefill`) or, for a method that
`needs_instruction` (CItruS), takes the instruction-pass branch (`instructed`). Decoding is one
jitted `lax.while_loop` that samples, runs the model one token at a time and stops when every
sequence has hit a stop token or the budget: no host round-trip per token, the cache donated.
Every jitted step takes the run's `RunOptions` as a static argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.core.axes import ROWS
from jax_longctx.ops.cache import Cache
from jax_longctx.run.chunked_prefill import chunk_for, end_prefill, read_chunks
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import axis_size
from jax_longctx.core.errors import LongctxError
from jax_longctx.run.context_encoding import prefill_context
from jax_longctx.run.instructed import prefill_instructed
from jax_longctx.methods.base import Method
from jax_longctx.model import forward
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.run import sharding
from jax_longctx.run.sharding import mesh_step

__all__ = ["DECODE_TRACES", "GenerationError", "GenerationResult", "Sampling", "check_prompts",
           "decode", "decode_loop", "decode_while", "prefill",
           "row_keys", "sample", "teacher_forced_nll", "trim_at_stops"]


class GenerationError(LongctxError, ValueError):
  """Bad generation input: empty batch or prompt, a prompt that does not fit the cache, ..."""


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
  cache: Cache | None  # the cache after decoding
  prompt_lengths: list[int]
  prefill_s: float = 0.0  # wall time of the prefill (until its logits were ready)
  decode_s: float = 0.0
  report: dict[str, Any] = dataclasses.field(default_factory=dict)  # Method.report; devices
  logits: Any = None  # [B, V] fp32: each prompt's last-token logits after the prefill


def sample(logits: jnp.ndarray, keys, sampling: Sampling) -> jnp.ndarray:
  """logits [B, V] fp32 -> token ids [B] int32; keys [B]: each row's own key (`row_keys`), so
  what a row samples does not depend on which device holds it."""
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
  return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def row_keys(seed: int, batch: int):
  """One sampling key per row [B]: row i's is the seed's key folded with i."""
  return jax.vmap(lambda r: jax.random.fold_in(jax.random.key(seed), r))(jnp.arange(batch))


def _split_rows(keys, sampling: Sampling):
  """Each row's key -> (its next key, a key to draw with); greedy decoding draws nothing, so
  its keys pass through (a split per step is a kernel a step: ~1% of an 8B decode step)."""
  if sampling.temperature == 0:
    return keys, keys
  pairs = jax.vmap(jax.random.split)(keys)  # [B, 2]
  return pairs[:, 0], pairs[:, 1]


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


@mesh_step(inputs={"params": "params", "cache": "cache", "last_logits": (ROWS,),
                   "stop_tokens": (), "keys": (ROWS,)},
           outputs=("gathered", "gathered", "same"), donate=("cache",),
           static=("cfg", "method", "max_new_tokens", "sampling", "options"))
def decode_loop(params, cache: Cache, last_logits, stop_tokens, keys, *, cfg: LlamaConfig,
                method: Method, max_new_tokens: int, sampling: Sampling,
                options: RunOptions = DEFAULT):
  """Samples up to max_new_tokens per row on device (keys [B]: `row_keys`). Returns (tokens
  [B, N], steps [B]: the most steps a row of its `data` group ran, cache). On a mesh each group
  of devices runs its own loop, which stops when its rows are done."""
  DECODE_TRACES[0] += 1
  b = last_logits.shape[0]
  keys, sub = _split_rows(keys, sampling)
  tok = sample(last_logits, sub, sampling)
  out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(tok)
  done = jnp.isin(tok, stop_tokens)

  def keep_going(carry):
    step, _, _, _, done, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def one_token(carry, gate_open: bool):
    step, cache, tok, out, done, keys = carry
    positions = cache.lengths[:, None]
    logits, cache = forward(params, tok[:, None], positions, cache, method, cfg, decode=True,
                            logits_index=jnp.zeros((b,), jnp.int32), gate_open=gate_open,
                            options=options)
    keys, sub = _split_rows(keys, sampling)
    nxt = jnp.where(done, tok, sample(logits, sub, sampling))
    out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], step, axis=1)
    return step + 1, cache, nxt, out, done | jnp.isin(nxt, stop_tokens), keys

  step, cache, _, out, _, _ = decode_while(
      method, keep_going, one_token, (jnp.int32(1), cache, tok, out, done, keys), lambda c: c[1])
  return out, jnp.full((b,), step), cache


@mesh_step(inputs={"params": "params", "cache": "cache", "last_logits": (ROWS,),
                   "targets": (ROWS,)}, outputs=("gathered", "same"), donate=("cache",))
def teacher_forced_nll(params, cache: Cache, last_logits, targets, *, cfg: LlamaConfig,
                       method: Method, options: RunOptions = DEFAULT):
  """NLL [B, N] of `targets` fed one token per decode step after a prefill (teacher forcing);
  on a mesh every device (and process) holds all of it, as the decode loop's tokens."""

  def nll(logits, tok):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok[:, None], axis=1)[:, 0]

  def one_token(carry, gate_open: bool):
    i, cache, out = carry  # feeds targets[:, i - 1], scores targets[:, i]
    tok, nxt = jax.lax.dynamic_slice_in_dim(targets, i - 1, 2, axis=1).T
    logits, cache = forward(params, tok[:, None], cache.lengths[:, None], cache, method, cfg,
                            decode=True, logits_index=jnp.zeros(tok.shape, jnp.int32),
                            gate_open=gate_open, options=options)
    out = jax.lax.dynamic_update_slice_in_dim(out, nll(logits, nxt)[:, None], i, 1)
    return i + 1, cache, out

  n = targets.shape[1]
  out = jnp.zeros(targets.shape, jnp.float32).at[:, 0].set(nll(last_logits, targets[:, 0]))
  _, cache, out = decode_while(method, lambda c: c[0] < n, one_token,
                               (jnp.int32(1), cache, out), lambda c: c[1])
  return out, cache


def trim_at_stops(rows, stop_tokens) -> list[list[int]]:
  """Each row of generated tokens up to (not including) its first stop token."""
  stops = set(int(t) for t in stop_tokens)
  return [row[:next((i for i, t in enumerate(row) if t in stops), len(row))]
          for row in np.asarray(rows).tolist()]


def prefill(params, cfg: LlamaConfig, prompts: Sequence[Sequence[int]], method: Method, *,
            cache_len: int, decode_room: int | None = None,
            instructions: Sequence[Sequence[int]] | None = None, encode_instruction: bool = True,
            options: RunOptions = DEFAULT, on_chunk=None):
  """Runs the prompts through the model. Returns (cache, last-token logits [B, V]).

  The one router: the prompts are checked here, once, and the method's declarations pick the
  road: chunks (`chunked_prefill`), the instruction-pass branch for a method that
  `needs_instruction` and scores with it (CItruS: `instructed`), or the context encoded in
  blocks for one that `encodes_context` (Star, ring: `context_encoding`). instructions: each
  prompt's instruction (a query), given apart from it; the methods that need it take it apart,
  the others read document + instruction as one prompt (encode_instruction=False: the document
  alone, where the instruction only steers a CItruS eviction). decode_room: tokens decoding will
  append (default: what the cache has left). on_chunk(i, n, last, cache): after chunk i of n of
  the chunked road is dispatched (benchmarks time the chunks through it; `DecodeAhead` compiles the
  decode loop); the cache is donated to the next chunk, so it is not to be kept.
  """
  sharding.check_layer_mesh(method, options)
  unit = method.cache_unit(axis_size(options.mesh, "ctx"), options.kv_dtype)
  if cache_len % unit:
    raise GenerationError(f"cache_len={cache_len} is not a multiple of {unit}, the unit "
                          f"{method.name!r} splits over the mesh's ctx axis")
  # Decoding's room is checked where the instruction is encoded (a CItruS perplexity run leaves
  # it out: the continuation then follows the document directly).
  lengths = check_prompts(prompts, instructions, cache_len=cache_len,
                          new_tokens=decode_room if encode_instruction else None)
  room = cache_len - max(lengths) if decode_room is None else decode_room
  if method.needs_instruction:
    if instructions is None:
      raise GenerationError(
          f"method {method.name!r} needs the instruction apart from the document: pass "
          "instructions= (or --instruction on the command line)")
    if method.encodes_context:
      return prefill_context(params, cfg, prompts, instructions, method,
                             decode_room=max(room, 0), options=options)
    return prefill_instructed(params, cfg, prompts, instructions, method, cache_len=cache_len,
                              decode_room=max(room, 0), encode_instruction=encode_instruction,
                              options=options)
  if instructions is not None:
    prompts = [list(p) + (list(i) if encode_instruction else [])
               for p, i in zip(prompts, instructions)]
    lengths = [len(p) for p in prompts]
  chunk = chunk_for(method, options, max(lengths))
  cache = sharding.empty_cache(cfg, method, len(prompts), cache_len, chunk, options)
  cache, last = read_chunks(params, cfg, method, cache, prompts, lengths, chunk, options,
                            on_chunk=on_chunk)
  return end_prefill(cache, cfg, method, decode_room=room, options=options), last


def decode(params, cfg: LlamaConfig, cache: Cache, last_logits, method: Method, *,
           max_new_tokens: int, sampling: Sampling = Sampling(), stop_tokens=(),
           options: RunOptions = DEFAULT):
  """The decode loop after a prefill. Returns (new tokens per row, stop token excluded; cache)."""
  out, steps, cache = decode_loop(params, *loop_inputs(cache, last_logits, sampling, stop_tokens),
                                  cfg=cfg, method=method, max_new_tokens=max_new_tokens,
                                  sampling=sampling, options=options)
  return trim_at_stops(np.asarray(out)[:, :int(np.max(steps))], stop_tokens), cache


def loop_inputs(cache, last_logits, sampling: Sampling, stop_tokens) -> tuple:
  """decode_loop's array arguments after the weights."""
  stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
  return cache, last_logits, stops, row_keys(sampling.seed, last_logits.shape[0])


class DecodeAhead:
  """An `on_chunk` for `prefill`: after the first of several chunks, the decode loop (as
  `decode` calls it) compiles on a host thread while the device runs the other chunks, so
  decoding starts without compiling (a 28-layer model's loop: ~16 s on an H200). Only for a
  method without an end-of-prefill hook, whose cache keeps the first chunk's shapes and layouts
  to the end. `wait()` before decoding. then: another on_chunk, called after."""

  def __init__(self, params, cfg: LlamaConfig, method: Method, *, max_new_tokens: int,
               sampling: Sampling = Sampling(), stop_tokens=(), options: RunOptions = DEFAULT,
               then=None):
    self._params, self._sampling, self._stops, self._then = params, sampling, stop_tokens, then
    self._kw = dict(cfg=cfg, method=method, max_new_tokens=max_new_tokens, sampling=sampling,
                    options=options)
    self.compile = None  # the Ahead thread, once started

  def __call__(self, i: int, n: int, last, cache) -> None:
    if i == 0 and n > 1 and not self._kw["method"].ends_prefill:
      self.compile = decode_loop.compile_ahead(
          self._params, *loop_inputs(cache, last, self._sampling, self._stops), **self._kw)
    if self._then is not None:
      self._then(i, n, last, cache)

  def wait(self) -> None:
    if self.compile is not None:
      self.compile.wait()
