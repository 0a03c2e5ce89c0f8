"""Prefill of a document and an instruction given apart: the outer loop of CItruS, a branch of the
one prefill road (`generation.prefill` routes a method that `needs_instruction` here).

The document goes in the method's chunk-sized steps with eviction inside each layer; before each
step, if the method scores with the instruction, an instruction pass (a forward of the
instruction over the cache that leaves it unchanged) records every layer's scores. After the
document one more instruction pass and the final eviction, then the instruction itself is
encoded over the k-sized cache and decoding continues from its last token. Every other method
gets document + instruction as one prompt (the router joins them).

A prompt given as one string is split by `split_prompt`: the instruction is its last paragraph.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp

from jax_longctx.core.axes import ROWS
from jax_longctx.ops.cache import Cache
from jax_longctx.run.chunked_prefill import padded, read_chunks
from jax_longctx.core.config import LlamaConfig
from jax_longctx.methods.base import Method
from jax_longctx.model import forward
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.run import sharding
from jax_longctx.run.sharding import mesh_step

INSTRUCTION_ROUND = 16  # instruction lengths rounded up so nearby ones share a compile


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


@mesh_step(inputs={"params": "params", "tokens": (ROWS,), "lengths": (ROWS,), "cache": "cache"},
           outputs="same", donate=("cache",))
def instruction_pass(params, tokens, lengths, cache: Cache, *, cfg: LlamaConfig, method: Method,
                     options: RunOptions = DEFAULT):
  """Every layer's scores of its cache by the instruction [B, I]; the cache is not extended."""
  b, n = tokens.shape
  valid = jnp.arange(n)[None, :] < lengths[:, None]
  positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  _, scored = forward(params, tokens, positions, cache, InstructionPass(inner=method), cfg,
                      valid=valid, logits_index=jnp.zeros((b,), jnp.int32), options=options)
  return scored.replace(lengths=cache.lengths)


@mesh_step(inputs={"cache": "cache"}, outputs="same", donate=("cache",))
def final_eviction(cache: Cache, *, cfg: LlamaConfig, method: Method,
                   options: RunOptions = DEFAULT) -> Cache:
  return cache.replace(state=tuple(method.evict_by_instruction(s) for s in cache.state))


@mesh_step(inputs={"params": "params", "tokens": (ROWS,), "lengths": (ROWS,), "cache": "cache"},
           outputs=("same", (ROWS,)), donate=("cache",))
def encode_appended(params, tokens, lengths, cache: Cache, *, cfg: LlamaConfig, method: Method,
                    options: RunOptions = DEFAULT):
  """Tokens [B, I] appended without eviction; logits of each row's last valid token."""
  n = tokens.shape[1]
  valid = jnp.arange(n)[None, :] < lengths[:, None]
  positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
  logits, cache = forward(params, tokens, positions, cache, method, cfg, valid=valid,
                          decode=True, logits_index=jnp.maximum(lengths - 1, 0), options=options)
  return cache, logits


def prefill_instructed(params, cfg: LlamaConfig, documents: Sequence[Sequence[int]],
                       instructions: Sequence[Sequence[int]], method: Method, *, cache_len: int,
                       decode_room: int, encode_instruction: bool = True,
                       options: RunOptions = DEFAULT):
  """Returns (cache, last logits [B, V]) after the document and (if asked) the instruction, for a
  method that `needs_instruction`; `generation.prefill` checked the rows and routed here.

  decode_room: tokens decoding will append. encode_instruction=False stops after the final
  eviction (perplexity of a continuation, where the instruction only steers the eviction).
  """
  doc_lens, ins_lens = [len(d) for d in documents], [len(i) for i in instructions]
  chunk = method.prefill_chunk
  width = -(-max(ins_lens) // INSTRUCTION_ROUND) * INSTRUCTION_ROUND
  tail = (width if encode_instruction else 0) + decode_room
  cache = sharding.empty_cache(cfg, method, len(documents), cache_len, max(chunk, tail), options)
  ins, ins_len = padded(instructions, width), jnp.asarray(ins_lens, jnp.int32)

  def scored(cache):  # an instruction pass: every layer's scores of its cache by the instruction
    return instruction_pass(params, ins, ins_len, cache, cfg=cfg, method=method, options=options)

  cache, last = read_chunks(params, cfg, method, cache, documents, doc_lens, chunk, options,
                            before_chunk=scored if method.scores_with_instruction else None)
  cache = final_eviction(scored(cache), cfg=cfg, method=method, options=options)
  if encode_instruction:
    cache, last = encode_appended(params, ins, ins_len, cache, cfg=cfg, method=method,
                                  options=options)
  return cache, last
