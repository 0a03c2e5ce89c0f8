"""Long-text perplexity, decoded token by token through the method.

The last `n_scored` tokens of a `length`-token stretch of public-domain prose are fed one at a
time after a prefill of everything before them (teacher forcing), so a method's decode-time
cache behaviour is what is measured. The result keeps every token's negative log-likelihood, so
the ratio to full attention can be followed along the generated positions.
"""

from __future__ import annotations

import dataclasses
import random

from jax_longctx.tasks import text_sources
from jax_longctx.tasks.base import Sample, TaskError


# What steers the eviction of methods guided by an instruction (CItruS's shared cache): the
# paper (Figure 7) samples questions from Qasper and HotpotQA; a generic question stands in.
INSTRUCTION = "\n\nWhat is the main topic of the text above, and who are the people in it?"


@dataclasses.dataclass(frozen=True)
class Perplexity:
  n_scored: int = 256
  name = "ppl"
  needle_task = False
  max_new_tokens = 0

  def make(self, tok, length: int, depth: float | None, seed: int, chat: bool = False) -> Sample:
    if length <= self.n_scored:
      raise TaskError(f"ppl needs more than n_scored={self.n_scored} tokens, got {length}")
    text = text_sources.prose()
    start = random.Random(seed).randint(0, len(text) // 2)
    ids = tok.encode(text[start:start + 8 * length])[1:length + 1]  # skip a partial first token
    if len(ids) < length:
      raise TaskError(f"not enough prose for {length} tokens")
    return Sample(self.name, "", tuple(map(str, ids)), length, None, seed, len(ids), INSTRUCTION)

  def split(self, sample: Sample) -> tuple[list[int], list[int]]:
    ids = [int(i) for i in sample.expected]
    return ids[:-self.n_scored], ids[-self.n_scored:]
