"""RULER's needle-in-a-haystack tasks (NVIDIA/RULER scripts/data/synthetic/niah.py, read, not
copied).

Needles "One of the special magic {numbers|uuids} for {key} is: {value}." with keys drawn from
RULER's words (an adjective and a noun of wonderwords' lists, joined by "-"), 7-digit numbers or
uuid4s; `num_k` keys with `num_v` values each, `num_q` of the keys asked (so at least `num_q`
keys). Haystacks: `noise` (RULER's five filler sentences repeated, one copy a line), `needle`
(distractor needles with random keys and values, one a line) and `essay` (prose cut into
sentences, the needles placed at RULER's 40 depths, sampled without replacement). With one key
asked and one value the template speaks in the singular, as RULER's does.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import uuid

import numpy as np

from jax_longctx.app.tasks import text_sources
from jax_longctx.app.tasks.base import render
from jax_longctx.app.tasks.ruler import RulerTask

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again.")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# RULER's depths (percent of the essay's sentences), 40 from 0 to 100.
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))


@functools.lru_cache(maxsize=None)
def key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(adjectives, nouns), distinct and sorted: a uniform pair is RULER's uniform f"{adj}-{noun}"
  over its sorted set of all pairs, without building its 6M strings."""
  return (tuple(sorted(set(text_sources.word_list("adjective")))),
          tuple(sorted(set(text_sources.word_list("noun")))))


@functools.lru_cache(maxsize=None)
def essay_words() -> tuple[str, ...]:
  return tuple(text_sources.prose().split())


def split_sentences(text: str) -> list[str]:
  """Sentences at '.', '!' or '?' before whitespace (RULER's nltk Punkt is not installed here)."""
  return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def draw(rng: random.Random, kind: str) -> str:
  if kind == "numbers":
    return str(rng.randint(10**6, 10**7 - 1))
  if kind == "uuids":
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  adjectives, nouns = key_words()
  return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"


@dataclasses.dataclass(frozen=True)
class RulerNiah(RulerTask):
  haystack: str = "noise"  # noise | essay | needle
  type_k: str = "words"
  type_v: str = "numbers"
  num_k: int = 1
  num_v: int = 1
  num_q: int = 1
  kind = "niah"

  @property
  def n_needles(self) -> int:
    return max(self.num_k, self.num_q) * self.num_v

  def min_units(self, length: int) -> int:
    return 1 if self.haystack == "essay" else self.n_needles

  def build(self, tok, length, seed, n, chat):
    rng = random.Random(f"{self.name}/{seed}")
    num_k = max(self.num_k, self.num_q)
    keys = [draw(rng, self.type_k) for _ in range(num_k)]
    values = [[draw(rng, self.type_v) for _ in range(self.num_v)] for _ in keys]
    needles = [NEEDLE.format(type_needle_v=self.type_v, key=k, value=v)
               for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), self.num_q)
    queries = [keys[i] for i in asked]
    expected = tuple(v for i in asked for v in values[i])
    query = (", ".join(queries[:-1]) + ", and " + queries[-1]) if len(queries) > 1 else queries[0]
    # Draws that depend on the haystack's size come last, so keys and values do not.
    context = self._context(rng, n, needles)
    template, prefix, type_v = self.template, self.answer_prefix, self.type_v
    if self.num_q * self.num_v == 1:  # RULER's singular wording
      template, prefix = (_singular(t) for t in (template, prefix))
      type_v = type_v[:-1]
    body = template.format(type_needle_v=type_v, context=context, query=query)
    question = body[body.rindex("\n") + 1:]
    return (render(tok, body, prefix.format(type_needle_v=type_v, query=query), chat), expected,
            question)

  def _context(self, rng: random.Random, n: int, needles: list[str]) -> str:
    if self.haystack == "essay":
      words = essay_words()
      # RULER repeats the essay when it runs out; the prose holds ~900K words.
      text = " ".join(words[:n] if n <= len(words) else (words * (n // len(words) + 1))[:n])
      sents = split_sentences(text.strip())
      cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
      cuts.append(len(sents))
      parts = []
      for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(needles):
          parts.append(needles[i - 1])
      return " ".join(parts)
    if self.haystack == "noise":
      lines = [NOISE] * n
    else:
      lines = [NEEDLE.format(type_needle_v=self.type_v, key=draw(rng, self.type_k),
                             value=draw(rng, self.type_v)) for _ in range(n)]
    for at, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
      lines.insert(at, needle)
    return "\n".join(lines)


def _singular(text: str) -> str:
  for plural, one in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
    text = text.replace(plural, one)
  return text


# scripts/synthetic.yaml's niah entries.
TASKS = {
    "niah_single_1": dict(haystack="noise"),
    "niah_single_2": dict(haystack="essay"),
    "niah_single_3": dict(haystack="essay", type_v="uuids"),
    "niah_multikey_1": dict(haystack="essay", num_k=4),
    "niah_multikey_2": dict(haystack="needle"),
    "niah_multikey_3": dict(haystack="needle", type_k="uuids", type_v="uuids"),
    "niah_multivalue": dict(haystack="essay", num_v=4),
    "niah_multiquery": dict(haystack="essay", num_q=4),
}

