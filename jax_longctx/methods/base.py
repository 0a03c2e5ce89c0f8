"""The attention-method interface and the registry of methods.

The model never knows which method runs: every attention layer hands the method its pre-RoPE
q, k, v and the token positions, and the method owns that layer's cache state and returns the
attention output. A method is a frozen dataclass of hyper-parameters (hashable, so it can be a
static argument of a jitted step).

Every entry is a `Method`: per-layer steps the one driver runs (run/driver.py). A method that
`splits_tokens` (mesh ReAttention, RESA over it, Star Attention, ring attention) holds its cache
split along the tokens over the mesh's `ctx` axis, and sees only its part: `ctx.tokens` says
which, and joins the parts (as `ctx.heads` does for the heads of tensor parallelism); on one
device both are plain jnp. Everything a driver may ask of a method is declared here, with its
default; the drivers read these members and nothing else (no `getattr` probing, no type tests).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.options import DEFAULT as DEFAULT_OPTIONS
from jax_longctx.core.options import RunOptions
from jax_longctx.ops.cache import is_int4_dtype
from jax_longctx.ops.mesh_attention import merge_across
from jax_longctx.methods.hparams import (Budget, MethodError, args_per_method, check_fields,
                                         field_types, parse_method_args, resolve_budget)

__all__ = ["AttnContext", "Budget", "Heads", "Method", "MethodError", "PrefillEnd",
           "RegisteredMethod", "TokenShards", "args_per_method", "check_cache_dtype", "get",
           "names", "parse_method_args", "register", "resolve_budget"]

_REGISTRY: dict[str, type["RegisteredMethod"]] = {}

_COMBINE = {"sum": (jnp.sum, jax.lax.psum), "max": (jnp.max, jax.lax.pmax),
            "mean": (jnp.mean, jax.lax.pmean)}


@dataclasses.dataclass(frozen=True)
class Heads:
  """The part of a layer's heads this device holds, and the reductions that combine heads.

  Under tensor parallelism (the mesh's `model` axis) every device runs a method's steps over its
  own query heads and the KV heads they read, so q is [B, S, H / shards, d] and the state holds
  those KV heads. Anything a method decides from several heads at once (a layer's mean query,
  votes pooled over heads, attention summed over a GQA group, scores averaged over heads) goes
  through these reductions, which combine the shards where they exist and are plain jnp
  reductions on one device: the same decision either way, and a method needs no mesh code.
  `ctx.heads` (and `PrefillEnd.heads`) is the run's.
  """

  axis: str | None = None  # the mesh axis heads are split over; None: every head is here
  shards: int = 1
  # Shards holding a copy of each KV head (a model with fewer KV heads than shards): a GQA group's
  # query heads then lie on several shards, which `group` combines.
  kv_copies: int = 1

  def _over(self, op: str, x, axis):
    local, across = _COMBINE[op]
    x = local(x, axis=axis)
    return x if self.axis is None else across(x, self.axis)

  def sum(self, x, axis):
    """Sum over the query heads (or per-group partial sums) along `axis`, on every shard."""
    return self._over("sum", x, axis)

  def mean(self, x, axis):
    """Mean over the query heads along `axis` (every shard holds as many)."""
    return self._over("mean", x, axis)

  def max(self, x, axis):
    return self._over("max", x, axis)

  def concat(self, x, axis: int):
    """Every shard's x joined along `axis` in head order (e.g. votes of every head)."""
    if self.axis is None:
      return x
    return jax.lax.all_gather(x, self.axis, axis=axis, tiled=True)

  def group(self, x, op: str):
    """x [B, KV, ...]: per KV head, a reduction (`op`: "sum", "max" or "mean") over the query
    heads of its group that this device holds -> over the whole group. Only a model with fewer
    KV heads than shards splits a group (then each shard holds one KV head's copy)."""
    if self.axis is None or self.kv_copies == 1:
      return x
    # Each shard puts its partial in its KV head's row; the rows combine over the axis. The
    # group's shards hold equal parts, so its mean is their summed means over kv_copies.
    across, fill = (jax.lax.pmax, -jnp.inf) if op == "max" else (jax.lax.psum, 0.0)
    mine = jax.lax.axis_index(self.axis) // self.kv_copies
    slots = jnp.full((self.shards // self.kv_copies,) + x.shape, fill, x.dtype)
    out = across(slots.at[mine].set(x), self.axis)[mine]
    return out / self.kv_copies if op == "mean" else out


@dataclasses.dataclass(frozen=True)
class TokenShards:
  """The part of a cache split along its tokens that this device holds, and the collectives that
  join the parts (for a method that `splits_tokens`, over the mesh's `ctx` axis): device `index`
  of `shards`. On one device (`axis` None) the whole cache is here and every join is the
  identity, so a method written for shards runs unchanged without a mesh."""

  axis: str | None = None
  shards: int = 1

  def index(self):
    return 0 if self.axis is None else jax.lax.axis_index(self.axis)

  def merge(self, out, lse):
    """Every shard's partial attention (out [..., d], lse [...]) over its keys, merged exactly:
    (out fp32, lse), the same on every shard."""
    if self.axis is None:
      return out.astype(jnp.float32), lse.astype(jnp.float32)
    return merge_across(out, lse, self.axis)

  def sum(self, x):
    return x if self.axis is None else jax.lax.psum(x, self.axis)

  def gather(self, x, axis: int):
    """Every shard's x joined along `axis` in shard order."""
    if self.axis is None:
      return x
    return jax.lax.all_gather(x, self.axis, axis=axis, tiled=True)


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
  # How the step is built (kernel choices, decode variants): every kernel call takes
  # `options.route` as its `route=`.
  options: RunOptions = DEFAULT_OPTIONS
  # The heads this device holds and the reductions that combine them (tensor parallel).
  heads: Heads = Heads()
  # The part of a cache split along the tokens this device holds (methods that splits_tokens).
  tokens: TokenShards = TokenShards()
  # [H, hd] what this layer's queries were multiplied by (and its keys divided by) before the
  # method saw them (model key smoothing; None: nothing). Every q.k is unchanged by it; a method
  # that reads queries or keys otherwise divides it out (RefreshKV's query similarity).
  query_smoothing: jnp.ndarray | None = None

  def replace(self, **kw) -> "AttnContext":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class RegisteredMethod:
  """What every registry entry is: a name, checked hyper-parameters, and whether it reads the
  instruction (or query) apart from the document."""

  name: ClassVar[str] = ""
  # True: the method needs each prompt as (document, instruction) apart. Text prompts are then
  # split (`instructed.split_prompt`) and token prompts need `instructions=`.
  needs_instruction: ClassVar[bool] = False

  def __post_init__(self):
    check_fields(self)

  def hparams(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Method(RegisteredMethod):
  """A per-layer method. Subclasses set `name` and implement `init_state` and `prefill` (and
  `decode` when it differs); every other member below is optional, with the default stated.

  Hyper-parameters are the dataclass fields; their annotations are checked at construction
  (`hparams.check_fields`): a budget-like field is annotated `Budget`, a field with a few
  allowed strings `Literal[...]`.

  State is one layer's pytree of fixed-shape arrays: `init_state` builds it, the model keeps one
  per layer, and `prefill` / `decode` get that layer's state and return its successor (donated
  through the step, so XLA updates it in place). `ctx.layer` says which layer it is.
  """

  # Prefill chunk this method needs (None: the caller's choice). A property may compute it.
  prefill_chunk: ClassVar[int | None] = None
  # True when `end_of_prefill` is overridden: the drivers run (and compile) it only then.
  ends_prefill: ClassVar[bool] = False
  # For `needs_instruction` methods: True runs an instruction pass (`score_instruction` on every
  # layer) before each document chunk, False only once after the document.
  scores_with_instruction: ClassVar[bool] = False
  # True: the cache is split along the tokens over the mesh's `ctx` axis (`ctx.tokens`: mesh
  # ReAttention, RESA over it, Star, ring); without a mesh the driver spreads such a method over
  # every device. The others run with ctx = 1 (`names("mesh")` lists these).
  splits_tokens: ClassVar[bool] = False
  # True: the prompt is not read in chunks but encoded in blocks across the `ctx` axis, the
  # instruction (the query) then appended: Star Attention's phase 1, ring attention
  # (run/context_encoding.py runs it with `context_layout` and `context_encoder`).
  encodes_context: ClassVar[bool] = False
  # True: the method caches keys before RoPE and rotates them elsewhere than at their own
  # positions (ReAttention, StreamingLLM, CItruS). Its init_state then makes its key buffers
  # with `ops.cache.zeros(..., offset_heads_axis=)` (KVCache.zeros(keys_before_rope=)): an 8-bit
  # one holds the layer's pre-RoPE key offset and stores and reads keys through it, so the
  # method sees whole keys and a wrapper of it (RESA, CItruS' instruction pass) inherits that
  # with the state. False: each key is rotated at its own position (`ctx.q_pos`) and read
  # nowhere before, so the model may take a post-RoPE constant out of every new key (the 8-bit
  # cache's calibrated offset, model/kv_offsets.py): every score of a query drops
  # by the same amount, which no softmax, top-k or LSE merge sees.
  keys_before_rope: ClassVar[bool] = False
  # Why this method's cache cannot be stored in 4 bits ("": it can, kv_dtype "int4"). A 4-bit
  # key group shares one range over its 32 tokens (ops/cache.py), so only a cache that appends
  # each token once, at its slot, in order (KVCache.write with the step's `valid`) holds one.
  # `new_cache` refuses "int4" with this reason in one line.
  int4_refusal: ClassVar[str] = ("its cache is not a KVCache that only appends tokens in order, "
                                 "which 4-bit keys grouped along tokens need")

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    # A hook the drivers never call would silently leave the state as prefill left it.
    if cls.end_of_prefill is not Method.end_of_prefill and not cls.ends_prefill:
      raise TypeError(f"{cls.__name__} overrides end_of_prefill but does not set "
                      "ends_prefill = True, so the drivers would never call it")

  def init_state(self, cfg: LlamaConfig, batch: int, max_len: int, dtype, chunk: int) -> Any:
    """One layer's state for `batch` sequences of up to `max_len` tokens, fed `chunk` at a time.
    dtype: how keys and values are stored (ops/cache.py `zeros`: the model's dtype, or 8 bits
    with scales); any other buffer computes in the model's (`cfg.jnp_dtype`)."""
    raise NotImplementedError

  def prefill(self, state, q, k, v, ctx: AttnContext):
    """One prompt chunk. q [B,S,H,d], k/v [B,S,KV,d] before RoPE -> (out [B,S,H,d], state)."""
    raise NotImplementedError

  def decode(self, state, q, k, v, ctx: AttnContext):
    """One generated token (S = 1, or a few). Same shapes as `prefill`."""
    return self.prefill(state, q, k, v, ctx)

  def end_of_prefill(self, state, info: "PrefillEnd"):
    """Called once per layer after the whole prompt is in when `ends_prefill` (SnapKV compresses
    here, changing the state's type for decoding)."""
    return state

  def decode_gate(self, cache, q_pos) -> jnp.ndarray | None:
    """None, or a scalar bool computed once per decode step (q_pos [B, S]: the step's token
    positions) before any layer runs: False says no layer can take the method's occasional
    costly branch this step. The decode loops (`generation.decode_while`) then run that step
    compiled with `ctx.gate_open=False`, so it carries no per-layer conditional (on GPU each
    waits for its predicate on the host)."""
    del cache, q_pos
    return None

  def score_instruction(self, state, q, k, v, ctx: AttnContext):
    """`needs_instruction` methods: the instruction's tokens over this layer's cache; records
    its scores in the state and leaves the cache otherwise unchanged. -> (out, state)."""
    raise NotImplementedError(f"{self.name!r} does not score with an instruction")

  def evict_by_instruction(self, state):
    """`needs_instruction` methods: the final eviction after the document, by the scores of the
    last instruction pass."""
    raise NotImplementedError(f"{self.name!r} does not evict by an instruction")

  def report(self, cache) -> dict[str, Any]:
    """JSON-safe facts about a finished run for evaluation records (RefreshKV: its full steps)."""
    del cache
    return {}

  def cache_unit(self, shards: int, kv_dtype=None) -> int:
    """A cache's length over `shards` devices of the `ctx` axis must be a multiple of this (the
    driver rounds it up; 1 for a method that does not split the tokens). kv_dtype: the cache's
    (RunOptions.kv_dtype: a 4-bit cache's shards hold whole key groups)."""
    del shards, kv_dtype
    return 1

  def context_layout(self, length: int, shards: int):
    """`encodes_context` methods: how a context of `length` tokens is cut into blocks over
    `shards` devices (methods.star.Layout)."""
    raise NotImplementedError(f"{self.name!r} reads its prompt in chunks")

  def context_encoder(self, layout, rows_per_device: int) -> "Method":
    """`encodes_context` methods: the per-layer method phase 1 runs over each device's rows of
    blocks, whose state it returns as that layer's context (methods.star.ContextKV)."""
    raise NotImplementedError(f"{self.name!r} reads its prompt in chunks")


@dataclasses.dataclass(frozen=True)
class PrefillEnd:
  """What `Method.end_of_prefill` knows: the prompt lengths and the room decoding needs."""

  cfg: LlamaConfig
  layer: int
  prompt_lengths: jnp.ndarray  # [B] int32
  decode_room: int  # slots the decode phase will append at most
  options: RunOptions = DEFAULT_OPTIONS  # the run's, as in AttnContext
  heads: Heads = Heads()  # as in AttnContext
  tokens: TokenShards = TokenShards()  # as in AttnContext


def register(cls: type[RegisteredMethod]) -> type[RegisteredMethod]:
  if not cls.name:
    raise TypeError(f"{cls.__name__} has no registry name")
  _REGISTRY[cls.name] = cls
  return cls


_KINDS = {"all": lambda cls: True, "layer": lambda cls: not cls.splits_tokens,
          "mesh": lambda cls: cls.splits_tokens}


def check_cache_dtype(method: Method, dtype) -> None:
  """Refuses, in one line, a cache dtype the method cannot store (kv_dtype "int4" where it
  states an `int4_refusal`); every road that makes a method's cache asks this first."""
  if is_int4_dtype(dtype) and method.int4_refusal:
    raise MethodError(f"{method.name} cannot store a 4-bit cache (kv_dtype {dtype}): "
                      f"{method.int4_refusal}")


def names(kind: str = "all") -> list[str]:
  """Registered names: "all", "layer" (methods on the data and model axes) or "mesh" (those
  that split the context over `ctx`: `Method.splits_tokens`)."""
  return sorted(n for n, cls in _REGISTRY.items() if _KINDS[kind](cls))


def get(name: str | RegisteredMethod, **overrides) -> RegisteredMethod:
  """A method by registry name with hyper-parameter overrides (or a method object, returned
  with the overrides applied)."""
  if isinstance(name, RegisteredMethod):
    cls = type(name)
  elif name in _REGISTRY:
    cls = _REGISTRY[name]
  else:
    raise MethodError(f"unknown method {name!r}; known methods: {', '.join(names())}")
  fields = set(field_types(cls))
  unknown = sorted(set(overrides) - fields)
  if unknown:
    known = ", ".join(sorted(fields)) or "none"
    raise MethodError(f"method {cls.name!r} has no hyper-parameter "
                      f"{', '.join(map(repr, unknown))}; it takes: {known}")
  if isinstance(name, RegisteredMethod):
    return dataclasses.replace(name, **overrides) if overrides else name
  return cls(**overrides)
