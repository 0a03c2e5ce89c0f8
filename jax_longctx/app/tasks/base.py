"""Tasks: seeded generators of long prompts with known answers, and their scorers.

A generator fills a prompt to a requested length in tokens of the model's own tokenizer (never
past it, within 0.5% below), optionally wrapped in the model's chat template; a scorer turns a
prediction into [0, 1].
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jax_longctx.core.errors import LongctxError
from jax_longctx.app.tokenizer import Tokenizer


class TaskError(LongctxError, ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Sample:
  task: str
  prompt: str  # the full prompt text (template applied)
  expected: tuple[str, ...]
  length: int  # requested prompt tokens
  depth: float | None
  seed: int
  n_tokens: int  # actual prompt tokens
  # The instruction: a suffix of `prompt` (the question and what follows it), what methods
  # guided by the instruction (CItruS) read apart from the document before it.
  instruction: str = ""

  @property
  def document(self) -> str:
    return self.prompt[:len(self.prompt) - len(self.instruction)]


def from_question(prompt: str, question: str) -> str:
  """The instruction of a rendered prompt: from the last occurrence of `question` to the end."""
  return prompt[prompt.rindex(question):]


def render(tok: Tokenizer, body: str, answer_prefix: str, chat: bool) -> str:
  """The prompt as the model sees it: plain text, or the chat template around the user turn."""
  if not chat:
    return body + answer_prefix
  return tok.apply_chat_template([{"role": "user", "content": body}]) + answer_prefix


def fit_length(tok: Tokenizer, length: int, build: Callable[[int], str], n0: int,
               tolerance: float = 0.005, name: str = "this task") -> tuple[str, int]:
  """The prompt of the largest filler count n whose build(n) is at most `length` tokens, chat
  template included (as RULER sizes its haystacks): a prompt never runs past the length asked,
  so a "32K" prompt fits a 32,768-token window. The search stops early at a prompt within
  `tolerance` below the length. `build` must grow with n; build(0) is the prompt without filler.
  Returns (prompt, its token count)."""
  counts = _Counts(tok, build)
  if counts.exact(0) > length:
    raise TaskError(f"{name} needs a length of at least {counts.exact(0)} tokens (its prompt "
                    f"without filler), got {length}")
  full = (1 - tolerance) * length
  guess = max(1, n0)
  counts.bracket(guess, [full, length + 1])
  n = largest_fitting(lambda n: not counts.reaches(n, length + 1), 0, guess,
                      done=lambda n: counts.reaches(n, full))
  counts.exact(n)
  return counts.texts[n]


class _Counts:
  """Token counts of build(n), taken only where the search cannot do without them.

  The search asks only whether count(n) reaches a threshold. Counts are monotone in n up to a
  few tokens (a needle moved to another piece boundary can merge differently there), so a count
  already taken at m < n (or m > n) settles the question for n when it clears the threshold by
  `_MARGIN`. The answers, and so the prompt found, are those of counting every n the search
  visits; a 2M-token passkey prompt took 44 encodes of ~2M tokens that way (140 s on a
  2-core CPU)."""

  def __init__(self, tok: Tokenizer, build: Callable[[int], str]):
    self.tok, self.build = tok, build
    self.texts: dict[int, tuple[str, int]] = {}

  def exact(self, n: int) -> int:
    if n not in self.texts:
      text = self.build(n)
      self.texts[n] = (text, len(self.tok.encode(text)))
    return self.texts[n][1]

  def reaches(self, n: int, threshold: float) -> bool:
    """count(n) >= threshold."""
    if n not in self.texts:
      below = max((m for m in self.texts if m < n), default=None)
      above = min((m for m in self.texts if m > n), default=None)
      if below is not None and self.texts[below][1] >= threshold + _MARGIN:
        return True
      if above is not None and self.texts[above][1] < threshold - _MARGIN:
        return False
    return self.exact(n) >= threshold

  def bracket(self, guess: int, thresholds: list[float]) -> None:
    """Counts a little below and above each threshold, placed on the line through the counts
    at 0 and `guess` (filler is near-linear in tokens), so the search's far steps are settled
    without encoding."""
    c0, cg = self.exact(0), self.exact(guess)
    if cg <= c0:
      return
    per_n = (cg - c0) / guess
    for t in thresholds:
      for side in (-1, 1):
        target = t + side * max(2 * _MARGIN, 0.001 * t)
        self.exact(max(0, round((target - c0) / per_n)))


# Well above the few tokens a count can step back by as n grows (where a needle's boundary moves).
_MARGIN = 64


def largest_fitting(fits: Callable[[int], bool], lo: int, guess: int,
                    done: Callable[[int], bool] = lambda n: False) -> int:
  """The largest n >= lo for which fits(n) holds, searched outward from `guess` (fits(lo) holds,
  and fits is monotone: a longer haystack never makes a shorter prompt). `done(n)`, asked of a
  fitting n, ends the search there (close enough below the limit)."""
  g = max(lo, guess)
  step = 1
  if fits(g):
    lo = g
    if done(lo):
      return lo
    while fits(lo + step):
      lo += step
      if done(lo):
        return lo
      step *= 2
      if step > 1 << 26:
        raise TaskError("haystack sizing did not converge")
    hi = lo + step
  else:
    hi = g
    while hi - step > lo and not fits(hi - step):
      hi -= step
      step *= 2
    lo = max(lo, hi - step)
    if done(lo):
      return lo
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if fits(mid):
      lo = mid
      if done(lo):
        return lo
    else:
      hi = mid
  return lo


def token_counter(tok: Tokenizer) -> Callable[[str], int]:
  """len(tok.encode(text)), remembered per text: `insert_at_depths` measures every filler
  piece, the pieces repeat (cycled sentences) and `fit_length` builds the prompt several times,
  which made a 1M-token sample's build mostly repeated tokenizer calls."""
  counts: dict[str, int] = {}

  def count(text: str) -> int:
    if text not in counts:
      counts[text] = len(tok.encode(text))
    return counts[text]
  return count


def take_words(sentences: Sequence[str], n_words: int) -> list[str]:
  """Sentences cycled until exactly n_words words (the last one cut), each ending in a space."""
  out, count, i = [], 0, 0
  while count < n_words and sentences:
    words = sentences[i % len(sentences)].split()
    i += 1
    keep = words[:n_words - count]
    out.append(" ".join(keep) + " ")
    count += len(keep)
  return out


def insert_at_depths(pieces: Sequence[str], needles: Sequence[tuple[float, str]],
                     measure: Callable[[str], int] = len) -> str:
  """Joins the pieces with each needle at the piece boundary nearest to `depth` of the text.

  Depth is measured with `measure` (pass the tokenizer's length for token depth; characters
  misplace needles in prose, where names in capitals cost more tokens per character).
  """
  ends = np.cumsum([measure(p) for p in pieces]) if pieces else np.zeros(0)
  total = ends[-1] if len(ends) else 0
  out = list(pieces)
  for depth, needle in sorted(needles, key=lambda d: -d[0]):  # back to front keeps indices valid
    out.insert(int(np.searchsorted(ends, depth * total, side="left")) + (depth > 0), needle)
  return "".join(out)


def parse_length(text: str) -> int:
  """'4k' -> 4096, '8K' -> 8192, '1500' -> 1500; a length below one token is an error (0 ran the
  task's shortest prompt and reported it as "0K"; a negative one wrote nothing)."""
  t = text.strip().lower()
  try:
    if t.endswith("k"):
      n = int(float(t[:-1]) * 1024)
    elif t.endswith("m"):
      n = int(float(t[:-1]) * 1024 * 1024)
    else:
      n = int(t)
  except ValueError as e:
    raise TaskError(f"bad length {text!r}: use a number of tokens like 4096 or 4k") from e
  if n < 1:
    raise TaskError(f"bad length {text!r}: a prompt length is at least 1 token, like 4096 or 4k")
  return n
