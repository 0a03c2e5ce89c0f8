"""Evaluation tasks: `get(name, **options)`, `names()`, and `expand(spec)`: a `--task` value as the
task names it runs (RULER's suite: "ruler", "ruler:vt,cwe")."""

from __future__ import annotations

from jax_longctx.app.tasks.base import Sample, TaskError, parse_length
from jax_longctx.app.tasks.chain_of_key import ChainOfKey
from jax_longctx.app.tasks.niah import Niah
from jax_longctx.app.tasks.passkey import Passkey
from jax_longctx.app.tasks.ppl import Perplexity
from jax_longctx.app.tasks import ruler_suite
from jax_longctx.app.tasks.ruler import PREFIX as RULER

_TASKS = {
    "passkey": Passkey,
    "niah_single": lambda **kw: Niah(variant="single", **kw),
    "niah_single_text": lambda **kw: Niah(variant="single", haystack="text", **kw),
    "niah_multikey": lambda **kw: Niah(variant="multikey", **kw),
    "niah_multivalue": lambda **kw: Niah(variant="multivalue", **kw),
    "niah_multiquery": lambda **kw: Niah(variant="multiquery", **kw),
    "chain_of_key": ChainOfKey,
    "ppl": Perplexity,
}


def names() -> list[str]:
  """The library's own tasks (RULER's are `expand("ruler")`)."""
  return sorted(_TASKS)


def expand(spec: str) -> list[str]:
  """The tasks a `--task` value runs: RULER's suite or some of it, else the one task named."""
  if spec == "ruler" or spec.startswith(RULER):
    return ruler_suite.expand(spec)
  if spec not in _TASKS:
    raise _unknown(spec)
  return [spec]


def _unknown(name: str) -> TaskError:
  return TaskError(f"unknown task {name!r}; known tasks: {', '.join(names())}, ruler (RULER's "
                   f"11 tasks) or ruler:TASK,TASK...")


def get(name: str, **options):
  if name.startswith(RULER):
    return ruler_suite.get(name[len(RULER):], **options)
  if name not in _TASKS:
    raise _unknown(name)
  try:
    return _TASKS[name](**options)
  except TypeError as e:
    raise TaskError(f"task {name!r}: {e}") from e


__all__ = ["Sample", "TaskError", "expand", "get", "names", "parse_length"]
