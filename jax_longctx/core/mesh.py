"""The device mesh of a run, and how one model's weights and heads split over it.

The one place that knows the mesh. A run's mesh has three named axes (any of them 1), and a
training job's a fourth, fsdp:

    data    batch rows: each group of devices along it decodes (or trains on) its own rows
    fsdp    training only (train_cpt): rows too, and every weight and optimizer moment split
            along its model dimension (FSDP: XLA gathers a layer's weights where they are used
            and reduce-scatters their gradients)
    model   tensor parallel: attention heads, MLP hidden units and the vocabulary (Megatron)
    ctx     the context, for the mesh methods (Star, ring, mesh ReAttention)

`make_mesh("data=2,model=4")` builds it; `RunOptions.mesh` carries it to the compiled steps, which
then run per device under `jax.shard_map` (run/sharding.py): every device holds its rows, its
heads and its part of every weight, and the model inserts the few collectives a layer needs
(one all-reduce after the attention output and one after the MLP, the vocabulary's). A run
refuses fsdp > 1: a weight split along its model dimension is not one device's model.

`RULES` maps the logical axes that weights, caches and method states declare (core/axes.py) to
mesh axes, and `spec_of` / `specs` turn declared axes into the PartitionSpecs of a mesh: the one
table of how data splits, for inference and training alike (a rule's axis of size 1 drops out).

`ModelShards` says how a model lies over the `model` axis: each device holds num_heads / model
query heads and the KV heads they read (with fewer KV heads than shards, each shard holds a copy
of its group's KV head, as vLLM does), intermediate_size / model hidden units and a slice of a
vocabulary padded up to a multiple of the axis (the padded logits are cut before anyone sees
them). Heads or hidden units that do not divide are a one-line error.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jax_longctx.core import axes as logical
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.errors import LongctxError

AXES = ("data", "model", "ctx")  # a run's mesh
# Training's axis (train_cpt): only a mesh that asks for it has it, so a run's mesh, its records
# and its messages are what they were before training shared this module.
FSDP = "fsdp"
_ORDER = ("data", FSDP, "model", "ctx")


def _axes_of(names) -> tuple:
  """The axes of a mesh naming `names`: the run's three, and fsdp where named."""
  return tuple(a for a in _ORDER if a in AXES or a in names)


# Logical axis -> the mesh axes it splits over (core/axes.py names them). A run's mesh has no
# fsdp and a training mesh model = ctx = 1, so each kind sees its own column: rows over data
# (and fsdp); heads, hidden units and the vocabulary over model (tensor parallel); in training
# each weight over fsdp (FSDP) along one dimension: the MLP's hidden units, the vocabulary, and
# for the attention projections and norms their model dimension (EMBED), which inference leaves
# whole. (The MLP and embeddings split along their model dimension instead ran the 8B step on 2
# H100s out of memory: benchmarks/results/cpt_step_8b_fsdp2_embedsplit_oom_2xh100.json.)
RULES = {logical.ROWS: ("data", FSDP), logical.HEADS: ("model",), logical.KV_HEADS: ("model",),
         logical.VOCAB: ("model", FSDP), logical.HIDDEN: ("model", FSDP),
         logical.EMBED: (FSDP,), logical.TOKENS: ("ctx",)}


class MeshError(LongctxError, ValueError):
  """A mesh the devices or the model cannot take."""


def make_mesh(spec, devices=None):
  """A `jax.sharding.Mesh` with axes (data, model, ctx) from "data=2,model=4" (axes left out are
  1; the first data * model * ctx devices; "data=2,fsdp=4" adds fsdp after data), or from a
  given Mesh (its missing axes added with size 1); None stays None."""
  import jax
  from jax.sharding import AbstractMesh, Mesh

  if spec is None:
    return None
  if isinstance(spec, (Mesh, AbstractMesh)):
    names = list(spec.axis_names)
    unknown = [a for a in names if a not in _ORDER]
    if unknown:
      raise MeshError(f"mesh axis {unknown[0]!r} is not one of {', '.join(_ORDER)}")
    axes = _axes_of(names)
    if tuple(names) == axes:
      return spec
    # The missing axes of size 1 (a Mesh over ("ctx",) is data=1, model=1, ctx=N).
    sizes = [axis_size(spec, a) for a in axes]
    if isinstance(spec, AbstractMesh):  # shapes only (exports for another platform)
      return AbstractMesh(tuple(sizes), axes)
    grid = np.transpose(spec.devices, [names.index(a) for a in axes if a in names])
    return Mesh(grid.reshape(sizes), axes)
  sizes = parse(spec)
  devices = list(jax.devices() if devices is None else devices)
  n = int(np.prod(list(sizes.values())))
  if n > len(devices):
    shape = " x ".join(f"{a}={s}" for a, s in sizes.items())
    raise MeshError(f"mesh {shape} needs {n} devices, but {len(devices)} are visible")
  grid = np.array(devices[:n], dtype=object).reshape(list(sizes.values()))
  return Mesh(grid, tuple(sizes))


def parse(spec: str) -> dict[str, int]:
  """'data=2,model=4' -> {'data': 2, 'model': 4, 'ctx': 1} (and 'fsdp' where named)."""
  sizes = dict.fromkeys(AXES, 1)
  seen = set()
  for part in filter(None, (p.strip() for p in str(spec).split(","))):
    m = re.fullmatch(r"([a-z_]+)\s*=\s*(-?\d+)", part)
    if not m:
      raise MeshError(f"mesh part {part!r} is not axis=size (e.g. data=2,model=4)")
    axis, size = m.group(1), int(m.group(2))
    if axis not in _ORDER:
      raise MeshError(f"unknown mesh axis {axis!r}: the axes are {', '.join(AXES)} ({FSDP}: a "
                      "training job's)")
    if axis in seen:
      raise MeshError(f"mesh axis {axis!r} given twice")
    if size < 1:
      raise MeshError(f"mesh axis {axis}={size}: a size is >= 1")
    seen.add(axis)
    sizes[axis] = size
  return {a: sizes[a] for a in _axes_of(sizes)}


def axis_size(mesh, axis: str) -> int:
  """The size of `axis` on `mesh` (1 when the mesh is None or has no such axis)."""
  if mesh is None or axis not in mesh.axis_names:
    return 1
  return int(mesh.shape[axis])


def without_ctx(spec):
  """The mesh's data x model devices of its first context shard (ctx=1; None stays None): where
  a step that does not split the context runs on a mesh that does (the key smoothing's
  calibration pass, full attention over 1K tokens, on a run's mesh for mesh ReAttention)."""
  from jax.sharding import Mesh

  mesh = make_mesh(spec)
  if axis_size(mesh, "ctx") == 1:
    return mesh
  return Mesh(np.take(mesh.devices, [0], axis=mesh.axis_names.index("ctx")), mesh.axis_names)


def one_device(mesh) -> bool:
  """Whether `mesh` splits nothing: None, or a mesh of one device."""
  return mesh is None or mesh.size == 1


@dataclasses.dataclass(frozen=True)
class ModelShards:
  """How a model splits over the `model` axis (`shards` devices; 1 = nothing split)."""

  shards: int = 1
  kv_heads: int = 0  # KV heads as placed: the model's, or `shards` copies when it has fewer
  kv_copies: int = 1  # shards that hold each of the model's KV heads
  vocab: int = 0  # vocabulary as placed: padded up to a multiple of `shards`

  @classmethod
  def of(cls, cfg: LlamaConfig, mesh) -> "ModelShards":
    if axis_size(mesh, "fsdp") > 1:
      raise MeshError(f"fsdp={axis_size(mesh, 'fsdp')} is the training axis (train_cpt): a run "
                      "splits over data, model and ctx")
    m = axis_size(mesh, "model")
    h, kv, f = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % m:
      raise MeshError(f"num_heads={h} does not divide over model={m}: use a model axis that "
                      f"divides {h}")
    if kv % m and m % kv:
      raise MeshError(f"num_kv_heads={kv} and model={m}: one must divide the other (each "
                      "shard holds whole KV heads, or a copy of one)")
    if f % m:
      raise MeshError(f"intermediate_size={f} does not divide over model={m}")
    placed_kv = max(kv, m)
    return cls(m, placed_kv, placed_kv // kv, -(-cfg.vocab_size // m) * m)

  def placed(self, cfg: LlamaConfig) -> LlamaConfig:
    """The model as laid out over the whole mesh: KV heads copied up to `shards`, the
    vocabulary padded. It computes what `cfg` does (a copied head answers as its original)."""
    return cfg.replace(num_kv_heads=self.kv_heads, vocab_size=self.vocab)

  def local(self, cfg: LlamaConfig) -> LlamaConfig:
    """The part of the model one device of the `model` axis holds."""
    m = self.shards
    return cfg.replace(num_heads=cfg.num_heads // m, num_kv_heads=self.kv_heads // m,
                       intermediate_size=cfg.intermediate_size // m, vocab_size=self.vocab // m)


def spec_of(names, mesh, shape=None):
  """The PartitionSpec of an array whose dimensions are the logical `names` (an `Axes` or a
  tuple) on `mesh`: each over its RULES axes that are larger than 1 there; with `shape`, a
  dimension those axes do not divide stays whole. Spelled as a step's outputs come (size-1 axes
  and trailing Nones left out): an input whose sharding is spelled otherwise would compile a step
  again. With no mesh, every RULES axis of a run's mesh spelled (valid on any of them). Two
  logical axes of one array on one mesh axis are an error (one axis cannot split two dimensions;
  jax-llm-examples' `logical_to_physical` checks the same)."""
  from jax.sharding import PartitionSpec as P
  names = names.names if isinstance(names, logical.Axes) else tuple(names)
  _check_collisions(names)
  dims = []
  for d, n in enumerate(names):
    on = () if n is None else tuple(a for a in RULES[n]
                                     if (a in AXES if mesh is None else axis_size(mesh, a) > 1))
    if shape is not None and shape[d] % int(np.prod([axis_size(mesh, a) for a in on])):
      on = ()
    dims.append(None if not on else on[0] if len(on) == 1 else on)
  while mesh is not None and dims and dims[-1] is None:
    dims.pop()
  return P(*dims)


def _check_collisions(names: tuple) -> None:
  seen = {}
  for n in filter(None, names):
    for a in RULES[n]:
      if a in seen and seen[a] != n:
        raise MeshError(f"logical axes {seen[a]!r} and {n!r} of one array both land on mesh "
                        f"axis {a!r} (core/mesh.py RULES)")
      seen[a] = n


def specs(tree, mesh, where: str = "state"):
  """The PartitionSpecs of a tree of declared arrays (a Cache, a method's state) on `mesh`."""
  import jax
  return jax.tree.map(lambda a: spec_of(a, mesh), logical.logical_axes(tree, where),
                      is_leaf=logical.is_axes)
