"""How a training job lies on its mesh (core/mesh.py's, `state.training_mesh`: data and fsdp):
batch over both, parameters over fsdp.

Every device gets distinct rows (data parallel over the whole mesh); each parameter and its
optimizer moments are split as core/mesh.py RULES split the weight's declared logical axes
(model/placement.py `weight_spec`): on this mesh (model = ctx = 1) that is its model dimension
over fsdp (FSDP: XLA gathers a layer's weights where they are used and reduce-scatters its
gradients), whole where fsdp does not divide it. fsdp = 1 is plain data parallelism.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_longctx.core.axes import ROWS
from jax_longctx.core.mesh import spec_of
from jax_longctx.model import weight_spec


def shard_like_params(mesh: Mesh, tree):
  """Shardings for a tree of arrays (params, optimizer state): a leaf under a weight's name (a
  parameter, AdamW's moments of it) as its declared axes split on `mesh`; a scalar (the step
  count) replicated."""
  def one(path, x):
    if not x.shape:
      return replicated(mesh)
    key = path[-1]
    return NamedSharding(mesh, weight_spec(str(getattr(key, "key", key)), mesh, x.shape))

  return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[accumulation, micro_batch, tokens]: micro-batch rows spread over every device."""
  return NamedSharding(mesh, spec_of((None, ROWS, None), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
