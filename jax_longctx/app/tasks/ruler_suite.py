"""The RULER suite: its 11 tasks by name (scripts/synthetic.yaml's settings), and `--task` specs
("ruler", "ruler:vt,cwe") expanded into task names."""

from __future__ import annotations

from jax_longctx.app.tasks.base import TaskError
from jax_longctx.app.tasks.ruler import LEFT_OUT, PREFIX, RulerTask
from jax_longctx.app.tasks.ruler_niah import TASKS as NIAH, RulerNiah
from jax_longctx.app.tasks.ruler_vt import RulerVT
from jax_longctx.app.tasks.ruler_words import RulerCWE, RulerFWE

# RULER's names in scripts/synthetic.yaml's order, with the generator and settings of each.
SUITE = {
    **{name: (RulerNiah, args) for name, args in NIAH.items()},
    "vt": (RulerVT, dict(num_chains=1, num_hops=4)),
    "cwe": (RulerCWE, dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": (RulerFWE, dict(alpha=2.0)),
}
NAMES = tuple(SUITE)
OPTIONS = ("max_new_tokens",)  # all a user sets: the rest is RULER's definition


def _unknown(name: str) -> TaskError:
  if name in LEFT_OUT:
    return TaskError(f"RULER's {name} ({LEFT_OUT[name]}) is not offered: RULER downloads its "
                     f"data and nothing here downloads at run time; RULER's tasks here are "
                     f"{', '.join(NAMES)}.")
  return TaskError(f"unknown RULER task {name!r}; RULER's tasks here: {', '.join(NAMES)}")


def get(ruler_name: str, **options) -> RulerTask:
  """The RULER task `ruler_name` (RULER's name, e.g. niah_multikey_3)."""
  if ruler_name not in SUITE:
    raise _unknown(ruler_name)
  extra = sorted(set(options) - set(OPTIONS))
  if extra:
    raise TaskError(f"task {PREFIX + ruler_name!r} has no option {', '.join(extra)}; RULER's "
                    f"tasks take only {', '.join(OPTIONS)} (the rest is RULER's definition)")
  cls, args = SUITE[ruler_name]
  return cls(ruler_name=ruler_name, **args, **options)


def expand(spec: str) -> list[str]:
  """'ruler' -> the 11 task names (ruler:niah_single_1, ...); 'ruler:vt,cwe' -> those two."""
  if spec == "ruler" or spec == PREFIX:
    return [PREFIX + n for n in NAMES]
  picked = [n.strip() for n in spec[len(PREFIX):].split(",") if n.strip()]
  for n in picked:
    if n not in SUITE:
      raise _unknown(n)
  if not picked:
    raise TaskError(f"{spec!r} names no RULER task; RULER's tasks here: {', '.join(NAMES)}")
  return [PREFIX + n for n in dict.fromkeys(picked)]
