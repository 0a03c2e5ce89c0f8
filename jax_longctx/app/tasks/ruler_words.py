"""RULER's aggregation tasks, cwe and fwe (NVIDIA/RULER scripts/data/synthetic/
common_words_extraction.py and freq_words_extraction.py, read, not copied).

cwe: a numbered list "1. word 2. word ..." of distinct words from wonderwords' noun, adjective and
verb lists, `num_cw` of them `freq_cw` times each, the others `freq_ucw` times, shuffled; the 10
frequent ones expected. One solved example comes first: the whole prompt (chat template and
answer prefix) of a 40-word list (10 x 10, 30 x 3), its answer, a new line. Below 4096 tokens RULER
shrinks both: a 20-word example (10 x 3, 10 x 1) and 6 / 1 repeats.

fwe: coded words (6 random letters) from a vocabulary of (length - 50) // 50, the k-th most
frequent repeated int(n * k^-alpha / zeta(alpha)) times, shuffled; the first is '...' (noise) and
the next three are expected.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import string

import numpy as np
from scipy.special import zeta

from jax_longctx.app.tasks import text_sources
from jax_longctx.app.tasks.base import render
from jax_longctx.app.tasks.ruler import RulerTask


@functools.lru_cache(maxsize=None)
def cwe_words() -> tuple[str, ...]:
  """RULER's cwe words: wonderwords' nouns, adjectives and verbs, distinct, sorted."""
  return tuple(sorted(set(text_sources.word_list("noun") + text_sources.word_list("adjective")
                          + text_sources.word_list("verb"))))


def numbered(words) -> str:
  return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


@dataclasses.dataclass(frozen=True)
class RulerCWE(RulerTask):
  freq_cw: int = 30
  freq_ucw: int = 3
  num_cw: int = 10
  kind = "common_words_extraction"

  def min_units(self, length: int) -> int:
    return self.num_cw

  def max_units(self, length: int) -> int:
    return len(cwe_words())

  def _example(self, rng: random.Random, n: int, repeats: int, uncommon_repeats: int):
    chosen = rng.sample(cwe_words(), n)
    common, uncommon = chosen[:self.num_cw], chosen[self.num_cw:]
    listed = common * repeats + uncommon * uncommon_repeats
    rng.shuffle(listed)
    return numbered(listed), common

  def build(self, tok, length, seed, n, chat):
    rng = random.Random(f"{self.name}/{seed}")
    if length < 4096:  # RULER's short-length setting
      shot = self._example(rng, 20, 3, 1)
      context, common = self._example(rng, n, 6, 1)
    else:
      shot = self._example(rng, 40, 10, 3)
      context, common = self._example(rng, n, self.freq_cw, self.freq_ucw)
    shown = render(tok, self.template.format(context=shot[0]), self.answer_prefix, chat)
    body = self.template.format(context=context)
    prompt = (shown + " " + numbered(shot[1]) + "\n"
              + render(tok, body, self.answer_prefix, chat))
    return prompt, tuple(common), body[body.rindex("\n") + 1:]


@dataclasses.dataclass(frozen=True)
class RulerFWE(RulerTask):
  alpha: float = 2.0
  coded_wordlen: int = 6
  kind = "freq_words_extraction"

  def min_units(self, length: int) -> int:
    # The 4th most frequent word (the last expected) appears at least once.
    return math.ceil(4 ** self.alpha * zeta(self.alpha))

  def vocabulary(self, rng: random.Random, length: int) -> list[str]:
    size = (length - self.tokens_to_generate) // 50
    vocab: set[str] = set()
    while len(vocab) < size:
      vocab.add("".join(rng.choices(string.ascii_lowercase, k=self.coded_wordlen)))
    out = sorted(vocab)
    rng.shuffle(out)
    out[0] = "..."  # the most frequent is noise
    return out

  def build(self, tok, length, seed, n, chat):
    rng = random.Random(f"{self.name}/{seed}")
    vocab = self.vocabulary(rng, length)
    counts = (n * np.arange(1, len(vocab) + 1, dtype=np.float64) ** -self.alpha
              / zeta(self.alpha)).astype(int)
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(words)
    body = self.template.format(context=" ".join(words))
    return (render(tok, body, self.answer_prefix, chat), tuple(vocab[1:4]),
            body[body.rindex("\n") + 1:])

