"""The device mesh of a training job: ("data", "fsdp"), batch over both, parameters over fsdp.

Every device gets distinct rows (data parallel over the whole mesh); each parameter and its
optimizer moments are split along their largest dimension that the fsdp axis divides (FSDP-style:
XLA gathers a layer's weights where they are used and reduce-scatters its gradients), the rest
replicated. fsdp = 1 is plain data parallelism.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


def make_mesh(fsdp: int) -> Mesh:
  """fsdp devices along "fsdp" (0: every device), the rest along "data"."""
  devices = jax.devices()
  fsdp = fsdp or len(devices)
  if len(devices) % fsdp:
    raise ValueError(f"fsdp={fsdp} does not divide the {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(len(devices) // fsdp, fsdp), BATCH_AXES)


def param_sharding(mesh: Mesh, shape) -> NamedSharding:
  n = mesh.shape["fsdp"]
  dims = [i for i in np.argsort(shape)[::-1] if shape[i] % n == 0 and shape[i] >= n] \
      if n > 1 else []
  spec = [None] * len(shape)
  if dims:
    spec[int(dims[0])] = "fsdp"
  return NamedSharding(mesh, P(*spec))


def shard_like_params(mesh: Mesh, tree):
  """Shardings for a tree of arrays (params, optimizer state) by each leaf's shape."""
  return jax.tree.map(lambda x: param_sharding(mesh, tuple(x.shape)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """[accumulation, micro_batch, tokens]: micro-batch rows spread over every device."""
  return NamedSharding(mesh, P(None, BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
