"""Method hyper-parameters: typed checks, budgets, and `key=value` parsing for the command line.

A method is a frozen dataclass; its field annotations are the contract. Every construction
(`methods.get`, a dataclass call, `dataclasses.replace`) checks each value against its field's
type, so a wrong value fails at once with one line naming the method, the parameter and what it
takes, never later inside a trace.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import numbers
import os
import sys
import types
import typing
from typing import Annotated, Any, Literal

from jax_longctx.core.errors import LongctxError


class MethodError(LongctxError, ValueError):
  """Unknown method, unknown hyper-parameter or an invalid hyper-parameter value."""


class _BudgetMarker:
  """Marks a field as a cache budget (see `resolve_budget`)."""


# A cache budget: an int is a number of tokens (>= 1), a float a fraction of the cache in
# (0, 1] (1.0 = all of it). Every budget-like field is annotated with it.
Budget = Annotated[float, _BudgetMarker]
BUDGET_RULE = "a number of tokens (int >= 1) or a fraction of the cache (float in (0, 1])"


def budget_error(value) -> str | None:
  """Why `value` is not a budget, or None."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return f"takes {BUDGET_RULE}"
  if isinstance(value, numbers.Integral):
    return None if value >= 1 else f"takes {BUDGET_RULE}; {value} tokens is not >= 1"
  if value > 1:
    return f"takes {BUDGET_RULE}; a float above 1 is neither (write tokens as an int)"
  return None if value > 0 else f"takes {BUDGET_RULE}"


# (method, budget) pairs already told that their budget keeps the whole cache: once a process.
_WHOLE_CACHE_NOTED: set[tuple[str, Any]] = set()


def resolve_budget(budget, max_len: int, name: str = "budget", method: str = "") -> int:
  """Slots a budget keeps in a cache of `max_len`: int tokens, or a float fraction (ceil).

  A token budget at least the cache keeps all of it (every token, as full attention): a
  default budget (1024) on a shorter prompt runs instead of failing. A budget above the cache
  says so once per process per (method, budget), on stderr (silenced by JAX_LONGCTX_QUIET=1).
  `max_len` is a static int (a shape), so this runs at trace time, never on traced values.
  """
  why = budget_error(budget)
  if why:
    raise MethodError(f"{name}={budget!r} {why}")
  if isinstance(budget, numbers.Integral):
    if budget > max_len:
      _note_whole_cache(method, name, int(budget), max_len)
    return min(int(budget), max_len)
  return max(1, min(max_len, int(-(-budget * max_len // 1))))


def _note_whole_cache(method: str, name: str, budget: int, max_len: int) -> None:
  if (method, name, budget) in _WHOLE_CACHE_NOTED:
    return
  _WHOLE_CACHE_NOTED.add((method, name, budget))
  if not os.environ.get("JAX_LONGCTX_QUIET"):
    print(f"jax-longctx: note: {method + ' ' if method else ''}{name}={budget} is larger than the "
          f"cache ({max_len} slots): it keeps every token (full attention, no compression)",
          file=sys.stderr)


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
  """{hyper-parameter: resolved annotation (extras kept)} of a method class: its constructor's
  fields (a field computed at construction, init=False, is none; RESA's `inner`)."""
  try:
    hints = typing.get_type_hints(cls, include_extras=True)
  except NameError:  # an annotation only a type checker resolves: the method checks it itself
    hints = {}
  return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _is_budget(tp) -> bool:
  return typing.get_origin(tp) is Annotated and _BudgetMarker in typing.get_args(tp)[1:]


def _takes(tp) -> str:
  if typing.get_origin(tp) is Literal:
    return "takes one of " + ", ".join(map(repr, typing.get_args(tp)))
  named = {bool: "a bool (True or False)", int: "an int", float: "a number", str: "a string",
           tuple: "a tuple, e.g. (('page_size', 16),)"}
  return "takes " + named.get(tp, f"a {tp.__name__} object")


def _check_union(args, value) -> tuple[str | None, Any]:
  """A value for `X | Y | ...` (None among them: "derive it"): the first member it fits."""
  if value is None and type(None) in args:
    return None, value
  whys = []
  for member in args:
    if member is not type(None):
      why, converted = check_value(member, value)
      if why is None:
        return None, converted
      whys.append(why)
  why = " or ".join([whys[0]] + [w.removeprefix("takes ") for w in whys[1:]])
  if type(None) in args:  # before a reason the member's check gave ("; -5 tokens is not >= 1")
    head, sep, reason = why.partition("; ")
    why = f"{head} or None{sep}{reason}"
  return why, value


def check_value(tp, value) -> tuple[str | None, Any]:
  """(why `value` does not fit annotation `tp` or None, the value converted: an int given for
  a float field becomes a float)."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    return _check_union(typing.get_args(tp), value)
  if _is_budget(tp):
    return budget_error(value), value
  if typing.get_origin(tp) is Literal:
    ok = isinstance(value, str) and value in typing.get_args(tp)
  elif tp is float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    value = float(value) if ok else value
  elif tp is int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
  elif isinstance(tp, type):  # bool, str, tuple, or a class (RESA's base: a Method)
    ok = isinstance(value, tp)
  else:
    return None, value  # an annotation this checker does not know: the method checks it itself
  return (None if ok else _takes(tp)), value


def check_fields(entry) -> None:
  """Checks (and converts) every hyper-parameter of a method object (its dataclass fields, read
  by name); raises MethodError on the first bad one."""
  for name, tp in field_types(type(entry)).items():
    value = getattr(entry, name)
    why, converted = check_value(tp, value)
    if why:
      raise MethodError(f"method {entry.name!r}: {name}={value!r} is not valid; {name} {why}")
    if converted is not value:
      object.__setattr__(entry, name, converted)


def _literal(raw: str):
  if raw.strip().lower() in ("true", "false"):
    return raw.strip().lower() == "true"
  try:
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    return raw


def parse_method_args(pairs: list[str] | None) -> dict[str, Any]:
  """['budget=256', 'lam=0.5'] -> {'budget': 256, 'lam': 0.5} (Python literals, else strings)."""
  out: dict[str, Any] = {}
  for pair in pairs or []:
    key, sep, raw = pair.partition("=")
    if not sep or not key.strip():
      raise MethodError(f"--method-arg expects key=value or method.key=value, got {pair!r}")
    out[key.strip()] = _literal(raw)
  return out


def args_per_method(pairs: list[str] | None, methods: dict[str, str],
                    option: str = "--methods") -> dict[str, list[str]]:
  """Routes --method-arg pairs to the methods being run ({label: registry name}):
  `method.key=value` to that label only, `key=value` to every one but `full` (which takes none;
  unless it runs alone). Returns {label: ['key=value', ...]}."""
  labels = list(methods)
  out: dict[str, list[str]] = {label: [] for label in labels}
  for pair in pairs or []:
    key, sep, raw = pair.partition("=")
    target, dot, field = key.strip().rpartition(".")
    if not sep or not field:
      raise MethodError(f"--method-arg expects key=value or method.key=value, got {pair!r}")
    if dot and target not in out:
      raise MethodError(f"--method-arg {pair!r} names method {target!r}, which is not in "
                        f"{option} ({', '.join(labels)})")
    undotted = [x for x in labels if methods[x] != "full" or len(labels) == 1]
    for label in [target] if dot else undotted:
      out[label].append(f"{field}={raw}")
  return out
