"""RULER-style needles in a haystack (Hsieh et al. 2024, arXiv:2404.06654).

Variants: `single` (one needle), `multikey` (the needle among needles for distractor keys),
`multivalue` (several values for one key), `multiquery` (several keys asked at once). Haystack:
`noise` (repeated filler sentences) or `text` (public-domain prose). Values: 7-digit `number`s
or `uuid`-like strings. Score: the fraction of expected values found in the prediction.
"""

from __future__ import annotations

import dataclasses
import random

from jax_longctx.app.tasks import text_sources
from jax_longctx.app.tasks.base import (Sample, TaskError, fit_length, from_question,
                                    insert_at_depths, render, take_words, token_counter)

VARIANTS = ("single", "multikey", "multivalue", "multiquery")


def _value(rng: random.Random, kind: str) -> str:
  if kind == "number":
    return str(rng.randint(1_000_000, 9_999_999))
  h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
  return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclasses.dataclass(frozen=True)
class Niah:
  variant: str = "single"
  haystack: str = "noise"
  value_type: str = "number"
  n_distractors: int = 3  # multikey
  n_values: int = 4  # multivalue
  n_queries: int = 2  # multiquery
  max_new_tokens: int = 64
  needle_task = True

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise TaskError(f"niah variant {self.variant!r} not in {VARIANTS}")
    if self.haystack not in ("noise", "text"):
      raise TaskError(f"niah haystack {self.haystack!r} must be 'noise' or 'text'")
    if self.value_type not in ("number", "uuid"):
      raise TaskError(f"niah value_type {self.value_type!r} must be 'number' or 'uuid'")

  @property
  def name(self) -> str:
    return f"niah_{self.variant}"

  def make(self, tok, length: int, depth: float, seed: int, chat: bool = False) -> Sample:
    rng = random.Random(seed)
    adjectives, nouns = text_sources.words("adjective"), text_sources.words("noun")
    n_keys = {"multikey": 1 + self.n_distractors, "multiquery": self.n_queries}.get(self.variant, 1)
    keys = []
    while len(keys) < n_keys:
      k = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
      if k not in keys:
        keys.append(k)
    per_key = self.n_values if self.variant == "multivalue" else 1
    values = {k: [_value(rng, self.value_type) for _ in range(per_key)] for k in keys}
    asked = keys if self.variant == "multiquery" else keys[:1]
    kind = "numbers" if self.value_type == "number" else "uuids"
    needles = [f" One of the special magic {kind} for {k} is: {v}. " for k in keys for v in values[k]]
    # The asked needles sit at `depth`; distractors spread over the haystack.
    spots = [depth if any(k in n for k in asked) else rng.random() for n in needles]
    if self.haystack == "noise":
      unit = list(text_sources.FILLER_SENTENCES)
    else:
      unit = text_sources.prose_sentences(rng.randint(0, 10**6))
    query = ", ".join(asked)
    head = (f"Some special magic {kind} are hidden within the following text. Make sure to "
            f"memorize it. I will quiz you about the {kind} afterwards.\n")
    question = (f"\nWhat are all the special magic {kind} for {query} mentioned in the provided "
                f"text?")
    answer = f" The special magic {kind} for {query} mentioned in the provided text are"

    measure = token_counter(tok)

    def build(n_words):
      pieces = take_words(unit, n_words)
      body = head + insert_at_depths(pieces, list(zip(spots, needles)), measure) + question
      return render(tok, body, answer, chat)

    prompt, n_tok = fit_length(tok, length, build, length // 2, name=self.name)
    expected = tuple(v for k in asked for v in values[k])
    return Sample(self.name, prompt, expected, length, depth, seed, n_tok,
                  from_question(prompt, question))

  def score(self, prediction: str, sample: Sample) -> float:
    return sum(v in prediction for v in sample.expected) / len(sample.expected)
