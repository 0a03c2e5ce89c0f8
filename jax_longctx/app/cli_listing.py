"""`jax-longctx methods` and `jax-longctx tasks`: what a user can pass to --method(s),
--method-arg, --task and --task-arg, read from the registries, so the listing never lags them."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
import types
import typing
from typing import Literal

from jax_longctx import methods as methods_lib
from jax_longctx.methods.hparams import field_types

_ARXIV = re.compile(r"arXiv:\s*(\d{4}\.\d{4,5})")
_TITLE = re.compile(r'"([^"]+)"')
_SHORT = 160  # characters of a class's sentence worth a line of the listing
_WIDTH = 100
BUDGET_NOTE = ("A budget is kept tokens as an int (budget=512) or the share of the cache KEPT as a "
               "float (budget=0.25 keeps a quarter): the complement of kvpress's compression_ratio "
               "and of eval's --compression-ratios.")


def _first_line(doc: str | None) -> str:
  return (doc or "").strip().split("\n", 1)[0].strip()


def paper(cls) -> str:
  """The paper a method's module cites: its first quoted title and first arXiv id ("" if it
  cites none). The module docstrings are the one place each method names its paper."""
  doc = " ".join((sys.modules[cls.__module__].__doc__ or "").split())
  title, arxiv = _TITLE.search(doc), _ARXIV.search(doc)
  parts = ([f'"{title.group(1)}"'] if title else []) + ([f"arXiv:{arxiv.group(1)}"] if arxiv else [])
  return ", ".join(parts)


def _summary(cls, siblings: int) -> str:
  """The module's first line; where the module registers several entries (CItruS' four), the
  class's own first sentence too, when short enough to tell them apart at a glance."""
  line = _first_line(sys.modules[cls.__module__].__doc__)
  own = " ".join((cls.__doc__ or "").split())
  sentence = re.split(r"(?<=\.)\s", own, maxsplit=1)[0]
  if siblings > 1 and own and len(sentence) <= _SHORT:
    line += f" {sentence}"
  return line


def type_name(tp) -> str:
  """An annotation of a hyper-parameter in the words of --method-arg."""
  origin = typing.get_origin(tp)
  if origin is typing.Annotated:  # the one annotated kind is a budget
    return "kept tokens (int) or share of the cache kept (float)"
  if origin is Literal:
    return " or ".join(map(repr, typing.get_args(tp)))
  if origin in (typing.Union, types.UnionType):
    return " or ".join("None" if a is type(None) else type_name(a) for a in typing.get_args(tp))
  return getattr(tp, "__name__", str(tp))


def _tags(entry) -> list[str]:
  tags = []
  if entry.needs_instruction:
    tags.append("reads the instruction apart (--instruction, else the prompt's last paragraph)")
  if getattr(entry, "splits_tokens", False):
    tags.append("splits the context over the mesh's ctx axis (--mesh ctx=N)")
  if getattr(entry, "int4_refusal", None) == "":
    tags.append("stores a 4-bit cache (--kv-dtype int4)")
  return tags


def _wrap(text: str, indent: str = "", hang: str = "    ") -> list[str]:
  return textwrap.wrap(text, _WIDTH, initial_indent=indent, subsequent_indent=indent + hang)


def methods_text(names: list[str] | None = None) -> str:
  """Every registered method (or those named): what it does, its paper, and each
  hyper-parameter with its default and type."""
  everyone = {name: methods_lib.get(name) for name in methods_lib.names()}
  entries = [methods_lib.get(name) for name in names] if names else list(everyone.values())
  modules = [type(e).__module__ for e in everyone.values()]
  out = _wrap(BUDGET_NOTE, hang="") + [""]
  for entry in entries:
    cls = type(entry)
    out += _wrap(f"{entry.name}: {_summary(cls, modules.count(cls.__module__))}")
    out += _wrap(f"paper: {paper(cls) or 'none (a baseline of this library)'}", "  ")
    out += [line for tag in _tags(entry) for line in _wrap(tag, "  ")]
    fields = field_types(cls)
    settings = [f"{field}={getattr(entry, field)!r}" for field in fields]
    width = max(map(len, settings), default=0)
    out += [f"  {s.ljust(width)}  {type_name(tp)}" for s, tp in zip(settings, fields.values())]
    out += ["  hyper-parameters: none"] if not fields else []
    out.append("")
  return "\n".join(out).rstrip() + "\n"


def _task_options(name: str, task) -> tuple[dict, dict]:
  """({option: default} a --task-arg may set, {setting: value} the task's name fixes): a field
  the registry passes itself (niah_single's variant) cannot be given again."""
  from jax_longctx.app import tasks as tasks_lib

  settable, fixed = {}, {}
  for field in dataclasses.fields(task):
    value = getattr(task, field.name)
    try:
      tasks_lib.get(name, **{field.name: value})
      settable[field.name] = value
    except (tasks_lib.TaskError, TypeError):
      fixed[field.name] = value
  return settable, fixed


def _pairs(values: dict) -> str:
  return ", ".join(f"{k}={v!r}" for k, v in values.items())


def tasks_text() -> str:
  """Every task --task takes: what it measures, its --task-arg options with their defaults,
  and for RULER's suite its tasks with the settings RULER defines."""
  from jax_longctx.app import tasks as tasks_lib

  out = ["Options go to eval as --task-arg KEY=VALUE (repeat for several).", ""]
  for name in tasks_lib.names():
    task = tasks_lib.get(name)
    settable, fixed = _task_options(name, task)
    out += _wrap(f"{name}: {_first_line(sys.modules[type(task).__module__].__doc__)}")
    out += _wrap(f"options: {_pairs(settable) or 'none'}", "  ")
    out += _wrap(f"set by the name: {_pairs(fixed)}", "  ") if fixed else []
    out.append("")
  ruler = tasks_lib.expand("ruler")
  out += _wrap("ruler: RULER's synthetic tasks, all of them (--task ruler) or some (--task "
                "ruler:vt,cwe); each takes only the options shown, the rest is RULER's definition")
  for name in ruler:
    settable, fixed = _task_options(name, tasks_lib.get(name))
    fixed.pop("ruler_name", None)
    out += _wrap(f"{name}: options: {_pairs(settable) or 'none'}; RULER's settings: "
                 f"{_pairs(fixed)}", "  ")
  return "\n".join(out) + "\n"
