"""RULER's synthetic tasks as RULER defines them (Hsieh et al. 2024, arXiv:2404.06654).

The 11 tasks of NVIDIA/RULER's `scripts/synthetic.yaml` with its templates and answer prefixes
(`scripts/data/synthetic/constants.py`), its needles, counts and tokens to generate, its haystack
sizing (the largest haystack whose prompt, chat template and answer prefix included, leaves room
for the tokens to generate within the length, counted in the model's tokens) and its score
(`string_match_all`). Two deviations, both because RULER downloads the data: the "essay" haystack
(Paul Graham's essays) is public-domain prose (Shakespeare, `text_sources.prose`), and qa_1 /
qa_2 (SQuAD, HotpotQA) are not offered. `--task ruler` runs all 11, `--task ruler:vt,cwe` some;
each task's name in records is `ruler:<RULER's name>`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar

from jax_longctx.app.tasks.base import Sample, TaskError, largest_fitting

PREFIX = "ruler:"

# scripts/data/synthetic/constants.py, word for word: (template, answer prefix, tokens to generate).
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
        "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are "
        "all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        128),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following "
        "text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in "
        "the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
        "variables are assigned the value {query}, they are: ",
        30),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most "
        "common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        120),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the "
        "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently appeared "
        "words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words "
        "are:",
        50),
}

# RULER's task list minus what needs downloaded data (scripts/synthetic.yaml's order).
LEFT_OUT = {"qa_1": "SQuAD", "qa_2": "HotpotQA"}
LEFT_OUT_NOTE = ("RULER here: 11 of RULER's 13 tasks; qa_1 (SQuAD) and qa_2 (HotpotQA) are left "
                 "out (RULER downloads them; nothing here downloads at run time), and the "
                 "\"essay\" haystack (Paul Graham's essays, downloaded) is public-domain prose "
                 "(Shakespeare's plays, the `shakespeare` package).")


def match_share(prediction: str, refs) -> float:
  """The share of `refs` found in `prediction`, case-insensitively (one sample's score)."""
  return sum(r.lower() in prediction.lower() for r in refs) / len(refs)


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
  """RULER's metric (scripts/eval/synthetic/constants.py): `match_share` per prediction, the mean
  over predictions in %, to 2 decimals."""
  return round(sum(match_share(p, ref) for p, ref in zip(preds, refs)) / len(preds) * 100, 2)


@dataclasses.dataclass(frozen=True)
class RulerTask:
  """One RULER task. Subclasses define `build`: the whole prompt (chat template and answer prefix
  included), its expected strings and its question, for a seed and a haystack of n units (noise
  lines, prose words, distractor needles, distinct words, coded words)."""
  ruler_name: str
  # Tokens generated when evaluating; None: RULER's tokens to generate. The haystack is sized for
  # RULER's count whatever this is (a short run with few new tokens sees RULER's prompt).
  max_new_tokens: int | None = None
  kind: ClassVar[str]
  needle_task: ClassVar[bool] = False  # needles sit at RULER's own random depths

  def __post_init__(self):
    if self.max_new_tokens is None:
      object.__setattr__(self, "max_new_tokens", self.tokens_to_generate)
    if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
      raise TaskError(f"{self.name}: max_new_tokens must be an int >= 1, got "
                      f"{self.max_new_tokens!r}")

  @property
  def name(self) -> str:
    return PREFIX + self.ruler_name

  @property
  def template(self) -> str:
    return TEMPLATES[self.kind][0]

  @property
  def answer_prefix(self) -> str:
    return TEMPLATES[self.kind][1]

  @property
  def tokens_to_generate(self) -> int:
    return TEMPLATES[self.kind][2]

  def build(self, tok, length: int, seed: int, n: int, chat: bool
            ) -> tuple[str, tuple[str, ...], str]:
    raise NotImplementedError

  def min_units(self, length: int) -> int:
    """The smallest haystack the generator can place its needles in."""
    return 1

  def max_units(self, length: int) -> int | None:
    """The largest haystack the data allows (None: no limit)."""
    return None

  def _count(self, tok, length: int, seed: int, chat: bool) -> Callable[[int], int]:
    """n -> prompt tokens of build(n), each n encoded once."""
    memo: dict[int, int] = {}

    def count(n: int) -> int:
      if n not in memo:
        memo[n] = len(tok.encode(self.build(tok, length, seed, n, chat)[0]))
      return memo[n]
    return count

  def min_length(self, tok, length: int, chat: bool = False) -> int:
    """The shortest length this task fits in: its smallest prompt plus the tokens to generate."""
    return self._count(tok, length, -1, chat)(self.min_units(length)) + self.tokens_to_generate

  def check_length(self, tok, length: int, chat: bool = False) -> None:
    need = self.min_length(tok, length, chat)
    if need > length:
      raise TaskError(f"{self.name} needs a length of at least {need} tokens (its template, answer "
                      f"prefix and {self.tokens_to_generate} tokens to generate), got {length}")

  def units(self, tok, length: int, seed: int, chat: bool) -> int:
    """RULER's sizing: the largest haystack whose prompt plus the tokens to generate fits in
    `length`. RULER searches once and steps each sample down by a fixed increment until it fits
    (up to 500 prose words); here each sample gets its own largest, never a shorter prompt."""
    count = self._count(tok, length, seed, chat)
    lo = self.min_units(length)
    if count(lo) + self.tokens_to_generate > length:
      self.check_length(tok, length, chat)
    n = self._largest(count, length, _reference_units(self, tok, length, chat), secants=1)
    cap = self.max_units(length)
    if cap is not None and n == cap:
      raise TaskError(f"{self.name} at {length} tokens needs more than the {cap} distinct words "
                      f"of its word lists (RULER's own list is not offered); use a shorter length")
    return n

  def _largest(self, count: Callable[[int], int], length: int, start: int, secants: int) -> int:
    """The largest n whose count(n) leaves room for the tokens to generate, searched from where
    secant steps through (min_units, start) land: each count is a whole prompt's encoding."""
    limit = length - self.tokens_to_generate
    lo, cap = self.min_units(length), self.max_units(length)
    a, b = lo, max(start, lo + 1)
    for _ in range(secants):
      ca, cb = count(a), count(b)
      if cb == ca or abs(limit - cb) < 4:
        break
      a, b = b, max(lo + 1, b + int((limit - cb) * (b - a) / (cb - ca)))
      if cap is not None:
        b = min(b, cap)
    return largest_fitting(lambda n: (cap is None or n <= cap) and count(n) <= limit, lo, b)

  def make(self, tok, length: int, depth: float | None, seed: int, chat: bool = False) -> Sample:
    n = self.units(tok, length, seed, chat)
    prompt, expected, question = self.build(tok, length, seed, n, chat)
    return Sample(self.name, prompt, expected, length, None, seed, len(tok.encode(prompt)),
                  prompt[prompt.rindex(question):])

  def score(self, prediction: str, sample: Sample) -> float:
    """RULER's string_match_all of one prediction as a fraction (its mean over samples, in %, is
    RULER's score)."""
    return match_share(prediction, sample.expected)


@functools.lru_cache(maxsize=256)
def _reference_units(task: RulerTask, tok, length: int, chat: bool) -> int:
  """The largest haystack for a reference draw (seed -1, which no sample has): where each
  sample's search starts, one secant step and a few encodes from its own largest."""
  count = task._count(tok, length, -1, chat)
  lo = task.min_units(length)
  if count(lo) + task.tokens_to_generate > length:
    return lo
  return task._largest(count, length, lo + 64, secants=4)
