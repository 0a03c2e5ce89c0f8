"""Evaluation tasks: `get(name, **options)` and `names()`."""

from __future__ import annotations

from jax_longctx.app.tasks.base import Sample, TaskError, parse_length
from jax_longctx.app.tasks.chain_of_key import ChainOfKey
from jax_longctx.app.tasks.niah import Niah
from jax_longctx.app.tasks.passkey import Passkey
from jax_longctx.app.tasks.ppl import Perplexity

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
  return sorted(_TASKS)


def get(name: str, **options):
  if name not in _TASKS:
    raise TaskError(f"unknown task {name!r}; known tasks: {', '.join(names())}")
  try:
    return _TASKS[name](**options)
  except TypeError as e:
    raise TaskError(f"task {name!r}: {e}") from e


__all__ = ["Sample", "TaskError", "get", "names", "parse_length"]
