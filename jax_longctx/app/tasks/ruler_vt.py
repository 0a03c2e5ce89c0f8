"""RULER's variable tracking, vt (NVIDIA/RULER scripts/data/synthetic/variable_tracking.py, read,
not copied).

A chain "VAR A = 12345", "VAR B = VAR A ", ... of `num_hops` + 1 five-letter variables, its lines
at random places among noise lines (RULER's five filler sentences, one copy a line); the question
asks for every variable holding the value, all `num_hops` + 1 of them expected. Before it, as in
RULER, one solved example: a chain of three-letter variables in a haystack sized to 500 tokens,
the task's template and answer prefix without the chat template, then its answer.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import string

from jax_longctx.app.tasks.base import largest_fitting, render
from jax_longctx.app.tasks.ruler import RulerTask
from jax_longctx.app.tasks.ruler_niah import NOISE

ICL_TOKENS = 500  # RULER's few-shot example: a haystack that fits in 500 tokens


def _chains(rng: random.Random, num_chains: int, num_hops: int, letters: int
            ) -> tuple[list[list[str]], list[list[str]], str]:
  """(variables per chain, the chains' lines, the first chain's value)."""
  names: list[str] = []
  while len(names) < num_chains * (num_hops + 1):
    name = "".join(rng.choices(string.ascii_uppercase, k=letters))
    if name not in names:
      names.append(name)
  variables, lines = [], []
  for c in range(num_chains):
    vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
    value = str(rng.randint(10000, 99998))  # numpy's randint(10000, 99999): the top excluded
    variables.append(vs)
    lines.append([f"VAR {vs[0]} = {value}"] +
                 [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)])
  return variables, lines, lines[0][0].split("=")[-1].strip()


def _noise(rng: random.Random, n: int, chains: list[list[str]]) -> str:
  lines = [NOISE] * n
  for chain in chains:
    at = sorted(rng.sample(range(len(lines)), len(chain)))
    for j, (pos, line) in enumerate(zip(at, chain)):
      lines.insert(pos + j, line)
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class RulerVT(RulerTask):
  num_chains: int = 1
  num_hops: int = 4
  kind = "variable_tracking"

  def min_units(self, length: int) -> int:
    return self.num_hops + 1

  def _filled(self, rng, n: int, letters: int) -> tuple[str, str, list[str]]:
    """(template with a fresh chain in n noise lines, answer prefix, the asked variables)."""
    variables, chains, value = _chains(rng, self.num_chains, self.num_hops, letters)
    fill = dict(context=_noise(rng, n, chains), query=value, num_v=self.num_hops + 1)
    return (self.template.format(**fill), self.answer_prefix.format(**fill), variables[0])

  def example(self, rng: random.Random, n: int) -> str:
    """The solved example: template and answer prefix, then the variables, then a new line."""
    body, prefix, variables = self._filled(rng, n, letters=3)
    return body + prefix + " " + " ".join(variables) + "\n"

  def build(self, tok, length, seed, n, chat):
    rng = random.Random(f"{self.name}/{seed}")
    shot = self.example(rng, _example_units(self, tok))
    body, prefix, variables = self._filled(rng, n, letters=5)
    question = body[body.rindex("\n") + 1:]
    return render(tok, shot + "\n" + body, prefix, chat), tuple(variables), question


@functools.lru_cache(maxsize=16)
def _example_units(task: RulerVT, tok) -> int:
  """Noise lines of the solved example: the most whose template and answer prefix (without the
  answer) fit in ICL_TOKENS tokens, for a reference draw; every sample's example has as many."""
  def fits(n):
    body, prefix, _ = task._filled(random.Random(f"{task.name}/example"), n, letters=3)
    return len(tok.encode(body + prefix)) <= ICL_TOKENS
  return largest_fitting(fits, task.num_hops + 1, 10)
