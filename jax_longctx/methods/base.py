"""The attention-method interface and the registry of methods.

The model never knows which method runs: every attention layer hands the method its pre-RoPE
q, k, v and the token positions, and the method owns that layer's cache state and returns the
attention output. A method is a frozen dataclass of hyper-parameters (hashable, so it can be a
static argument of a jitted step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from jax_longctx.config import LlamaConfig
from jax_longctx.methods.hparams import (Budget, MethodError, args_per_method, check_fields,
                                         parse_method_args, resolve_budget)

__all__ = ["AttnContext", "Budget", "Method", "MethodError", "PrefillEnd", "args_per_method",
           "get", "names", "parse_method_args", "register", "resolve_budget"]

_REGISTRY: dict[str, type["Method"]] = {}


@dataclasses.dataclass(frozen=True)
class AttnContext:
  """What one attention layer knows about the tokens it processes (built inside the trace)."""

  layer: int  # which layer (a Python int: the layer loop is unrolled)
  q_pos: jnp.ndarray  # [B, S] int32 position of each new token
  valid: jnp.ndarray  # [B, S] bool, False for padding
  freqs: jnp.ndarray  # [head_dim // 2] RoPE inverse frequencies for this step
  cfg: LlamaConfig
  # False when the method's `decode_gate` ruled out its occasional costly branch for this step
  # in every layer (a Python bool: the model compiles the step once for each value).
  gate_open: bool = True

  def replace(self, **kw) -> "AttnContext":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class Method:
  """Base class. Subclasses set `name` and implement the three methods below.

  Hyper-parameters are the dataclass fields; their annotations are checked at construction
  (`hparams.check_fields`): a budget-like field is annotated `Budget`, a field with a few
  allowed strings `Literal[...]`.

  State is one layer's pytree of fixed-shape arrays: `init_state` builds it, the model keeps one
  per layer, and `prefill` / `decode` get that layer's state and return its successor (donated
  through the step, so XLA updates it in place). `ctx.layer` says which layer it is.
  """

  name: ClassVar[str] = ""
  keys_before_rope: ClassVar[bool] = False
  # Prefill chunk this method needs (None: the caller's choice).
  prefill_chunk: ClassVar[int | None] = None

  def __post_init__(self):
    check_fields(self)

  def init_state(self, cfg: LlamaConfig, batch: int, max_len: int, dtype, chunk: int) -> Any:
    """One layer's state for `batch` sequences of up to `max_len` tokens, fed `chunk` at a time."""
    raise NotImplementedError

  def end_of_prefill(self, state, info: "PrefillEnd"):
    """Called once per layer after the whole prompt is in (SnapKV compresses here)."""
    return state

  def prefill(self, state, q, k, v, ctx: AttnContext):
    """One prompt chunk. q [B,S,H,d], k/v [B,S,KV,d] before RoPE -> (out [B,S,H,d], state)."""
    raise NotImplementedError

  def decode(self, state, q, k, v, ctx: AttnContext):
    """One generated token (S = 1, or a few). Same shapes as `prefill`."""
    return self.prefill(state, q, k, v, ctx)

  def decode_gate(self, cache, q_pos) -> jnp.ndarray | None:
    """None, or a scalar bool computed once per decode step (q_pos [B, S]: the step's token
    positions) before any layer runs: False says no layer can take the method's occasional
    costly branch this step. The decode loops (`generate.decode_while`) then run that step
    compiled with `ctx.gate_open=False`, so it carries no per-layer conditional (on GPU each
    waits for its predicate on the host)."""
    del cache, q_pos
    return None

  def hparams(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PrefillEnd:
  """What `Method.end_of_prefill` knows: the prompt lengths and the room decoding needs."""

  cfg: LlamaConfig
  layer: int
  prompt_lengths: jnp.ndarray  # [B] int32
  decode_room: int  # slots the decode phase will append at most


def register(cls: type[Method]) -> type[Method]:
  if not cls.name:
    raise TypeError(f"{cls.__name__} has no registry name")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def get(name: str | Method, **overrides) -> Method:
  """A method by registry name with hyper-parameter overrides (or a method object, returned)."""
  if isinstance(name, Method):
    return dataclasses.replace(name, **overrides) if overrides else name
  if name not in _REGISTRY:
    raise MethodError(f"unknown method {name!r}; known methods: {', '.join(names())}")
  cls = _REGISTRY[name]
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    known = ", ".join(sorted(fields)) or "none"
    raise MethodError(f"method {name!r} has no hyper-parameter "
                      f"{', '.join(map(repr, unknown))}; it takes: {known}")
  return cls(**overrides)
