"""Long-text perplexity, decoded token by token through the method.

The last `n_scored` tokens of a `length`-token stretch of public-domain prose are fed one at a
time after a prefill of everything before them (teacher forcing), so a method's decode-time
cache behaviour is what is measured. The result keeps every token's negative log-likelihood, so
the ratio to full attention can be followed along the generated positions.
"""

from __future__ import annotations

import dataclasses
import random

from jax_longctx.app.tasks import text_sources
from jax_longctx.app.tasks.base import Sample, TaskError


# What steers the eviction of methods guided by an instruction (CItruS's shared cache): the
# paper (Figure 7) samples questions from Qasper and HotpotQA; a generic question stands in.
INSTRUCTION = "\n\nWhat is the main topic of the text above, and who are the people in it?"


# Evaluation texts start in the first half of the prose and read at most 8 characters a token;
# held-out texts (threshold calibration) start past this fraction, so no evaluation text up to
# (HELDOUT_FROM - 1/2) * len(prose) / 8 tokens (~125K for the 5M-character prose) overlaps one.
HELDOUT_FROM = 0.7


@dataclasses.dataclass(frozen=True)
class Perplexity:
  n_scored: int = 256
  heldout: bool = False  # True: texts from the prose's last 30%, disjoint from evaluation texts
  name = "ppl"
  needle_task = False
  max_new_tokens = 0

  def make(self, tok, length: int, depth: float | None, seed: int, chat: bool = False) -> Sample:
    if length <= self.n_scored:
      raise TaskError(f"ppl needs more than n_scored={self.n_scored} tokens, got {length}")
    text = text_sources.prose()
    lo, hi = 0, len(text) // 2
    if self.heldout:
      lo, hi = int(HELDOUT_FROM * len(text)), len(text) - 8 * length
      if hi < lo:
        raise TaskError(f"not enough held-out prose for {length} tokens")
    start = random.Random(seed).randint(lo, hi)
    ids = tok.encode(text[start:start + 8 * length])[1:length + 1]  # skip a partial first token
    if len(ids) < length:
      raise TaskError(f"not enough prose for {length} tokens")
    return Sample(self.name, "", tuple(map(str, ids)), length, None, seed, len(ids), INSTRUCTION)

  def split(self, sample: Sample) -> tuple[list[int], list[int]]:
    ids = [int(i) for i in sample.expected]
    return ids[:-self.n_scored], ids[-self.n_scored:]
