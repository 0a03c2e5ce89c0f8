"""Logical axes: what each dimension of a cache or a method's state is, declared where it is built.

A state class declares each array field with the logical names of its dimensions,

    k: jnp.ndarray = axes(ROWS, HEADS, TOKENS, None)   # [B, KV, T, d]

and `logical_axes(tree)` reads the declarations back as a tree of `Axes`, one per array, with
the tree's own structure. `core/mesh.py` maps the names to the device mesh (`spec_of`: rows over
`data`, heads over `model`, tokens over `ctx`), so nothing ever has to guess how a state splits.

- ROWS: batch rows (sequences);
- HEADS: attention heads, query or KV (a cache's KV heads, a state's per-head vectors);
- TOKENS: a cache's token slots, split over `ctx` only by methods that `splits_tokens`;
- EMBED: a weight's model dimension (hidden_size), whole for inference, split over `fsdp` in
  training;
- None: not split (head dim, kept-slot counts, window positions, ...).

A field whose value is a struct of its own (a KVCache inside SnapKV's state) is not declared: the
walk descends into it. A `pallas_kernels.quant.Quantized` under a declared field takes the
declaration for its values and scales: its scales are its values' shape with a last axis of 1,
which a declaration never splits (the head dim, None: `_leaf` checks); its offset, if any (a
buffer of pre-RoPE keys), keeps only the declaration's HEADS. A 4-bit buffer (quant4) takes it
for its codes, scales and zero points alike (their grouped axis is split as its slots would be:
a group never straddles two shards where the slots divide into whole groups a shard); 4-bit keys'
residual (each sequence's newest group, whole) keeps every name but TOKENS, its group index ROWS.
An array reached with no declaration is an error naming its place: a new state class must
declare its fields.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import struct

from pallas_kernels import quant4
from pallas_kernels.quant import Quantized

ROWS, HEADS, TOKENS = "rows", "heads", "tokens"
# Weights (model/decoder.py): query heads, KV heads (copied up to the shards when fewer), the
# vocabulary (padded to a multiple of the shards), the MLP's hidden units and the model dimension.
KV_HEADS, VOCAB, HIDDEN, EMBED = "kv_heads", "vocab", "hidden", "embed"
NAMES = (ROWS, HEADS, TOKENS, KV_HEADS, VOCAB, HIDDEN, EMBED)

_KEY = "logical_axes"


@dataclasses.dataclass(frozen=True)
class Axes:
  """The logical names of one array's dimensions (a leaf of `logical_axes`' tree)."""

  names: tuple

  def __post_init__(self):
    bad = [n for n in self.names if n is not None and n not in NAMES]
    if bad:
      raise ValueError(f"unknown logical axis {bad[0]!r}: one of {', '.join(NAMES)} or None")


def axes(*names, **field_kw):
  """A struct field holding an array whose dimensions are `names` (None: not split)."""
  Axes(names)  # checked now, at class definition
  return struct.field(pytree_node=True, metadata={_KEY: names}, **field_kw)


def declared(cls) -> dict[str, tuple]:
  """{field: names} of a struct class's declared fields."""
  return {f.name: f.metadata[_KEY] for f in dataclasses.fields(cls) if _KEY in f.metadata}


def logical_axes(tree, where: str = "state"):
  """The tree with each array replaced by its `Axes` (None stays None): every array must sit in
  a declared field of a struct, or be given by `with_axes`."""
  if tree is None:
    return None
  if isinstance(tree, Quantized) or quant4.is_int4(tree):
    raise ValueError(f"{where}: quantized storage outside a declared field")
  if isinstance(tree, (tuple, list)):
    return type(tree)(logical_axes(x, f"{where}[{i}]") for i, x in enumerate(tree))
  if isinstance(tree, dict):
    return {k: logical_axes(x, f"{where}[{k!r}]") for k, x in tree.items()}
  if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
    names = declared(type(tree))
    out = {}
    for f in dataclasses.fields(tree):
      if not f.metadata.get("pytree_node", True):
        continue  # static: not an array
      value = getattr(tree, f.name)
      at = f"{type(tree).__name__}.{f.name}"
      out[f.name] = (_leaf(value, names[f.name], at) if f.name in names
                     else logical_axes(value, at))
    return dataclasses.replace(tree, **out)
  raise ValueError(f"{where}: an array with no declared axes (declare the field with "
                   "core.axes.axes(...))")


def _leaf(value, names: tuple, where: str):
  if value is None:
    return None
  if isinstance(value, Quantized):
    if names and names[-1] is not None:
      raise ValueError(f"{where}: quantized storage splits its last axis {names[-1]!r}, which its "
                       "scales hold once (declare it None)")
    # An offset (keys cached before RoPE) is one per KV head and channel: its other axes are 1.
    offset = None if value.offset is None else _leaf(
        value.offset, tuple(n if n == HEADS else None for n in names), where)
    return Quantized(_leaf(value.values, names, where), _leaf(value.scale, names, where), offset)
  if isinstance(value, quant4.GroupedKeys):
    whole = tuple(None if n == TOKENS else n for n in names)
    return quant4.GroupedKeys(_leaf(value.main, names, where), _leaf(value.residual, whole, where),
                              _leaf(value.residual_group, names[:1], where))
  if isinstance(value, quant4.Int4):
    if names and names[-1] is not None:
      raise ValueError(f"{where}: 4-bit storage splits its last axis {names[-1]!r}, whose bytes "
                       "hold two channels (declare it None)")
    parts = (_leaf(getattr(value, f), names, where) for f in ("codes", "scale", "zero"))
    return quant4.Int4(*parts, value.axis, value.group)
  if len(names) != len(value.shape):
    raise ValueError(f"{where}: declared {len(names)} axes {names} for an array of shape "
                     f"{tuple(value.shape)}")
  return Axes(tuple(names))


def is_axes(x) -> bool:
  return isinstance(x, Axes)


def take_rows(tree, start: int, stop: int, where: str = "state"):
  """The tree's rows start..stop: every array sliced along its ROWS dimension, the others kept
  whole (a batch's one sequence, for its report; the caller's rows of a padded batch)."""
  def cut(x, a: Axes):
    return x[tuple(slice(start, stop) if n == ROWS else slice(None) for n in a.names)]
  return jax.tree.map(cut, tree, logical_axes(tree, where))
