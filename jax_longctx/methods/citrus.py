"""CItruS: chunked state eviction guided by the instruction.

Bai et al., "CItruS: Chunked Instruction-aware State Eviction for Long Sequence Modeling", EMNLP
2024 (arXiv:2406.12018). The document is encoded `chunk` tokens at a time over a cache of
`budget` (k) states: each chunk attends to the cache and to itself, then the cache's old states
are ranked by the attention a scorer gives them (Eq. 1: averaged over heads and the scorer's
queries), the top k kept in token order (Eqs. 2-3) and the chunk appended, so a layer never holds
more than k + chunk states between steps. Keys are cached before RoPE (position shift).

The scorer is what the variants change:
  citrus_standard    the chunk itself (Standard CSE, §4.1);
  citrus_shared      the instruction: a forward of the instruction over the cache that does
                     not change it (§4.2, shared cache);
  citrus_individual  two caches: one scored by the chunk (used to encode the document), one by
                     the instruction (Eqs. 4-5), which answers;
  h2o_shared         H2O's attention accumulated over the document plus the instruction's.
At the end the instruction evicts once more, then is encoded over the k-sized cache and the
answer is generated (its states appended, no further eviction). `jax_longctx.run.instructed` runs
that outer loop; the methods here are one layer's steps.

h2o_shared lives here, not in h2o.py: it is the CItruS paper's "H2O + shared cache" baseline
(Table 1), a variant of citrus_shared that changes only the priority. It runs on this file's
chunked cache and instruction passes; H2O itself (h2o.py) evicts one token at a time from a
SlotCache and never reads an instruction, so the two share an idea and no code.
"""

from __future__ import annotations

import dataclasses
import jax.numpy as jnp
from flax import struct

from jax_longctx.methods.base import (AttnContext, Budget, Method, MethodError, register,
                                      resolve_budget)
from jax_longctx.methods.chunk_cache import ChunkCache


@register
@dataclasses.dataclass(frozen=True)
class CItruSStandard(Method):
  """Standard CSE: each chunk's own attention evicts the cache; the instruction evicts last."""

  name = "citrus_standard"
  int4_refusal = "evicts single cache slots, which a 4-bit key group (one range over 32 tokens) cannot take"
  needs_instruction = True  # instructed.py runs its outer loop
  keys_before_rope = True  # chunk_cache: rotated at their ranks in the cache

  budget: Budget = 768  # k in the paper (§5.3)
  chunk: int = 256  # l in the paper
  # The first tokens kept whatever their score (attention sinks; 0 = the paper's pure top-k).
  n_sink: int = 0

  @property
  def prefill_chunk(self) -> int:  # type: ignore[override]
    return self.chunk

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    """`chunk`: the longest step fed, a document chunk or the instruction plus the answer."""
    k = resolve_budget(self.budget, max_len, method=self.name)
    if self.chunk < 1:
      raise MethodError(f"chunk={self.chunk} must be >= 1")
    return ChunkCache.empty(cfg, batch, k, k + max(chunk, self.chunk), dtype)

  # -- what the variants change -------------------------------------------------------------

  def document_priority(self, cache: ChunkCache, mean_scores, summed_scores, n_queries):
    """(priority of the old slots, cache) after a document chunk [B] of n_queries attended."""
    return mean_scores, cache

  def instruction_priority(self, cache: ChunkCache):
    return cache.score

  def answer_cache(self, state) -> ChunkCache:
    return state

  def with_answer_cache(self, state, cache: ChunkCache):
    return cache

  # -- one layer's steps --------------------------------------------------------------------

  def prefill(self, state, q, k, v, ctx: AttnContext):
    """A document chunk: attend over the cache, evict its old states, append the chunk."""
    out, mean, summed = state.attend_and_score(q, k, v, ctx)
    n_queries = jnp.sum(ctx.valid, axis=1)
    priority, state = self.document_priority(state, mean, summed, n_queries)
    return out, self._evict_append(state, priority, k, v, ctx)

  def _evict(self, cache: ChunkCache, priority, active=None) -> ChunkCache:
    sink = (cache.pos >= 0) & (cache.pos < self.n_sink)
    return cache.evict(jnp.where(sink, jnp.inf, priority), active)

  def _evict_append(self, cache: ChunkCache, priority, k, v, ctx: AttnContext) -> ChunkCache:
    active = jnp.any(ctx.valid, axis=1)  # a row whose document has ended keeps its cache
    return self._evict(cache, priority, active).append(k, v, ctx.valid, ctx.q_pos)

  def score_instruction(self, state, q, k, v, ctx: AttnContext):
    """The instruction over the answering cache; records its scores, changes nothing else."""
    cache = self.answer_cache(state)
    out, mean, _ = cache.attend_and_score(q, k, v, ctx)
    return out, self.with_answer_cache(state, cache.replace(score=mean))

  def evict_by_instruction(self, state):
    """The final eviction, by the scores of the last instruction pass."""
    cache = self.answer_cache(state)
    return self.with_answer_cache(state, self._evict(cache, self.instruction_priority(cache)))

  def decode(self, state, q, k, v, ctx: AttnContext):
    """The instruction and the answer: attend over the answering cache and append, no eviction."""
    cache = self.answer_cache(state)
    out, _, _ = cache.attend_and_score(q, k, v, ctx)
    return out, self.with_answer_cache(state, cache.append(k, v, ctx.valid, ctx.q_pos))


@register
@dataclasses.dataclass(frozen=True)
class CItruSShared(CItruSStandard):
  """One cache, evicted by the instruction's attention after every chunk (§4.2, shared cache)."""

  name = "citrus_shared"
  scores_with_instruction = True

  def document_priority(self, cache, mean_scores, summed_scores, n_queries):
    return cache.score, cache


@register
@dataclasses.dataclass(frozen=True)
class H2OShared(CItruSShared):
  """H2O + shared cache (the paper's Table 1): the instruction's attention added to H2O's.

  The priority of a state is the attention it has accumulated from the document's queries (H2O's
  heavy-hitter score) per query that saw it, plus the instruction's attention averaged over its
  queries. Per query, because a sum over thousands of document queries would drown the
  instruction's few (measured: with sums, passkey 4K on the default model fell to 0%, as
  standard CSE; the paper does not say how its H2O variant weighs the two).
  """

  name = "h2o_shared"

  def document_priority(self, cache, mean_scores, summed_scores, n_queries):
    occupied = cache.slot_positions() >= 0
    seen = cache.seen + jnp.where(occupied, n_queries[:, None].astype(jnp.float32), 0.0)
    cache = cache.replace(history=cache.history + summed_scores, seen=seen)
    return self.instruction_priority(cache), cache

  def instruction_priority(self, cache):
    return cache.history / jnp.maximum(cache.seen, 1.0) + cache.score


@struct.dataclass
class TwinCache:
  document: ChunkCache  # scored by each chunk: what the document is encoded over
  instruction: ChunkCache  # scored by the instruction: what answers


@register
@dataclasses.dataclass(frozen=True)
class CItruSIndividual(CItruSStandard):
  """Two caches (§4.2, individual cache): the chunk's states go into both after each eviction."""

  name = "citrus_individual"
  scores_with_instruction = True

  def init_state(self, cfg, batch, max_len, dtype, chunk):
    def one():
      return super(CItruSIndividual, self).init_state(cfg, batch, max_len, dtype, chunk)
    return TwinCache(one(), one())

  def answer_cache(self, state: TwinCache) -> ChunkCache:
    return state.instruction

  def with_answer_cache(self, state: TwinCache, cache: ChunkCache) -> TwinCache:
    return state.replace(instruction=cache)

  def prefill(self, state: TwinCache, q, k, v, ctx):
    out, mean, _ = state.document.attend_and_score(q, k, v, ctx)
    document = self._evict_append(state.document, mean, k, v, ctx)
    instruction = self._evict_append(state.instruction, state.instruction.score, k, v, ctx)
    return out, TwinCache(document, instruction)
