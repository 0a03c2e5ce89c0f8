"""Prefill of a document and an instruction given apart: the outer loop of CItruS.

    cache, last = prefill_instructed(params, cfg, documents, instructions, method, cache_len=...)

For a method that `needs_instruction` (the CItruS family) the document goes in `chunk`-sized
steps with eviction inside each layer; before each step, if the method scores with the
instruction, an instruction pass (a forward of the instruction over the cache that leaves it
unchanged) records every layer's scores. After the document one more instruction pass and the
final eviction, then the instruction itself is encoded over the k-sized cache and decoding
continues from its last token. Every other method gets document + instruction as one prompt.

A prompt given as one string is split by `split_prompt`: the instruction is its last paragraph.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jax_longctx.cache import Cache
from jax_longctx.chunked_prefill import (check_prompts, layer_method, padded, prefill_prompts,
                                         prefill_step)
from jax_longctx.config import LlamaConfig
from jax_longctx.methods.base import Method
from jax_longctx.model import forward, new_cache

_INSTRUCTION_ROUND = 16  # instruction lengths rounded up so nearby ones share a compile


def split_prompt(text: str) -> tuple[str, str]:
  """(document, instruction): the instruction is the text after the last blank line.

  Without a blank line, the last line; a prompt of one line cannot be split (pass the
  instruction separately).
  """
  for sep in ("\n\n", "\n"):
    head, found, tail = text.rstrip().rpartition(sep)
    if found and head.strip() and tail.strip():
      return head + found, text[len(head) + len(found):]
  raise ValueError("cannot split a one-line prompt into document and instruction: pass the "
                   "instruction separately (--instruction, or instruction= in the API)")


@dataclasses.dataclass(frozen=True)
class InstructionPass(Method):
  """Runs a CItruS method's instruction scoring as one model forward."""

  inner: Method | None = None

  def prefill(self, state, q, k, v, ctx):
    return self.inner.score_instruction(state, q, k, v, ctx)


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("cache",))
def instruction_pass(params, tokens, lengths, cache: Cache, *, cfg: LlamaConfig, method: Method):
  """Every layer's scores of its cache by the instruction [B, I]; the cache is not extended."""
  b, n = tokens.shape
  valid = jnp.arange(n)[None, :] < lengths[:, None]
  positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  _, scored = forward(params, tokens, positions, cache, InstructionPass(inner=method), cfg,
                      valid=valid, logits_index=jnp.zeros((b,), jnp.int32))
  return scored.replace(lengths=cache.lengths)


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("cache",))
def final_eviction(cache: Cache, *, cfg: LlamaConfig, method: Method) -> Cache:
  return cache.replace(state=tuple(method.evict_by_instruction(s) for s in cache.state))


@functools.partial(jax.jit, static_argnames=("cfg", "method"), donate_argnames=("cache",))
def encode_appended(params, tokens, lengths, cache: Cache, *, cfg: LlamaConfig, method: Method):
  """Tokens [B, I] appended without eviction; logits of each row's last valid token."""
  n = tokens.shape[1]
  valid = jnp.arange(n)[None, :] < lengths[:, None]
  positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  logits, cache = forward(params, tokens, positions, cache, method, cfg, valid=valid, decode=True,
                          logits_index=jnp.maximum(lengths - 1, 0))
  return cache, logits


def prefill_instructed(params, cfg: LlamaConfig, documents: Sequence[Sequence[int]],
                       instructions: Sequence[Sequence[int]], method: Method, *, cache_len: int,
                       decode_room: int, chunk_size: int, encode_instruction: bool = True):
  """Returns (cache, last logits [B, V]) after the document and (if asked) the instruction.

  decode_room: tokens decoding will append. encode_instruction=False stops after the final
  eviction (perplexity of a continuation, where the instruction only steers the eviction).
  """
  method = layer_method(method)
  check_prompts(documents, instructions, cache_len=cache_len)
  if not method.needs_instruction:
    prompts = [list(d) + (list(i) if encode_instruction else [])
               for d, i in zip(documents, instructions)]
    return prefill_prompts(params, cfg, prompts, method, cache_len=cache_len,
                           chunk_size=chunk_size, decode_room=decode_room)
  doc_lens, ins_lens = [len(d) for d in documents], [len(i) for i in instructions]
  chunk = method.prefill_chunk
  width = -(-max(ins_lens) // _INSTRUCTION_ROUND) * _INSTRUCTION_ROUND
  tail = (width if encode_instruction else 0) + decode_room
  b = len(documents)
  cache = new_cache(cfg, method, b, cache_len, chunk=max(chunk, tail))
  n_chunks = -(-max(doc_lens) // chunk)
  doc = padded(documents, n_chunks * chunk)
  ins, ins_len = padded(instructions, width), jnp.asarray(ins_lens, jnp.int32)
  last = jnp.zeros((b, cfg.vocab_size), jnp.float32)
  plen = jnp.asarray(doc_lens, jnp.int32)
  for c in range(n_chunks):
    if method.scores_with_instruction:
      cache = instruction_pass(params, ins, ins_len, cache, cfg=cfg, method=method)
    cache, last = prefill_step(params, doc[:, c * chunk:(c + 1) * chunk], jnp.int32(c * chunk),
                                plen, cache, last, cfg=cfg, method=method)
  cache = instruction_pass(params, ins, ins_len, cache, cfg=cfg, method=method)
  cache = final_eviction(cache, cfg=cfg, method=method)
  if encode_instruction:
    cache, last = encode_appended(params, ins, ins_len, cache, cfg=cfg, method=method)
  return cache, last
