"""Evaluation tasks: `get(name, **options)`, `names()`, and `expand(spec)`: a `--task` value as the
task names it runs (RULER's suite: "ruler", "ruler:vt,cwe")."""

from __future__ import annotations

import dataclasses

from jax_longctx.app.tasks.base import Sample, TaskError, parse_length
from jax_longctx.app.tasks.chain_of_key import ChainOfKey
from jax_longctx.app.tasks.niah import Niah
from jax_longctx.app.tasks.passkey import Passkey
from jax_longctx.app.tasks.ppl import Perplexity
from jax_longctx.app.tasks import ruler_suite
from jax_longctx.app.tasks.ruler import PREFIX as RULER

# name -> (class, the settings the name fixes); a user sets the class's other fields (--task-arg).
_TASKS = {
    "passkey": (Passkey, {}),
    "niah_single": (Niah, {"variant": "single"}),
    "niah_single_text": (Niah, {"variant": "single", "haystack": "text"}),
    "niah_multikey": (Niah, {"variant": "multikey"}),
    "niah_multivalue": (Niah, {"variant": "multivalue"}),
    "niah_multiquery": (Niah, {"variant": "multiquery"}),
    "chain_of_key": (ChainOfKey, {}),
    "ppl": (Perplexity, {}),
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
  cls, fixed = _TASKS[name]
  accepted = options_of(name)
  extra = sorted(set(options) - set(accepted))
  if extra:
    raise TaskError(f"task {name!r} has no option {', '.join(extra)}; its options: "
                    f"{', '.join(accepted) or 'none'}")
  return cls(**fixed, **options)


def options_of(name: str) -> list[str]:
  """The options (--task-arg NAME=VALUE) task `name` of the library's own takes."""
  cls, fixed = _TASKS[name]
  return [f.name for f in dataclasses.fields(cls) if f.name not in fixed]


__all__ = ["Sample", "TaskError", "expand", "get", "names", "parse_length"]
