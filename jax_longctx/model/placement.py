"""How the weights lie in memory: the fused serving layout, and their placement over a mesh.

Placement (tensor parallel, the mesh's `model` axis; Megatron's split) follows each weight's
declared logical axes (decoder.py WEIGHT_AXES, core/mesh.py RULES): q/k/v and their biases along
the heads, gate/up along the hidden units, o and down along their input, the embedding and
lm_head along the vocabulary; norms replicated. The placed tree is the model as
`ModelShards.placed` describes it: KV heads copied up to the number of shards when there are
fewer (each shard then holds the copy its query heads read) and the vocabulary padded with zero
rows to a multiple of the shards. Every leaf goes to the devices on its own, straight into its
shards (`jax.make_array_from_callback` from host arrays, a jitted transform with sharded output
from device arrays), so no device and no host holds a whole model beyond one leaf. The `data`
and `ctx` axes hold copies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_longctx.core.axes import KV_HEADS, VOCAB
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import MeshError, ModelShards, axis_size, make_mesh, spec_of
from jax_longctx.model.decoder import WEIGHT_AXES, abstract_model, is_fused, random_params


def _name(path) -> str:
  key = path[-1]
  return str(getattr(key, "key", key))


def weight_axes(name: str) -> tuple:
  """A weight's logical axes (core/axes.py), by its name in the parameter tree."""
  if name not in WEIGHT_AXES:
    raise MeshError(f"weight {name!r} declares no logical axes (model/decoder.py WEIGHT_AXES)")
  return WEIGHT_AXES[name]


def weight_spec(name: str, mesh=None, shape=None) -> P:
  """A weight's PartitionSpec: its declared axes over the mesh (`spec_of`; with `shape`, a
  dimension the mesh does not divide stays whole; with no mesh, every axis that splits, as a
  placed tree is spelled on any run's mesh)."""
  return spec_of(weight_axes(name), mesh, shape)


def param_specs(params, mesh=None):
  """The PartitionSpec of every weight, from its declared logical axes."""
  return jax.tree_util.tree_map_with_path(lambda p, x: weight_spec(_name(p), mesh), params)


def _placed_leaf(name: str, x, shards: ModelShards):
  """A weight as `ModelShards.placed` lays it out (x: numpy or jax array): its KV-head axis
  copied up to the shards, its vocabulary axis padded with zero rows."""
  xp = np if isinstance(x, np.ndarray) else jnp
  names = weight_axes(name)
  if KV_HEADS in names and shards.kv_copies > 1:
    return xp.repeat(x, shards.kv_copies, axis=names.index(KV_HEADS))
  if VOCAB in names and x.shape[names.index(VOCAB)] < shards.vocab:
    pad = [(0, 0)] * x.ndim
    pad[names.index(VOCAB)] = (0, shards.vocab - x.shape[names.index(VOCAB)])
    return xp.pad(x, pad)
  return x


@functools.lru_cache(maxsize=None)
def _placer(name: str, shards: ModelShards, sharding: NamedSharding):
  return jax.jit(functools.partial(_placed_leaf, name, shards=shards), out_shardings=sharding)


def place(params, cfg: LlamaConfig, mesh):
  """The weights (standard layout, on any device or in host memory) placed over `mesh`, leaf by
  leaf. The input tree is left as it is; drop it to free it."""
  mesh = make_mesh(mesh)
  fused = is_fused(params)
  if fused and axis_size(mesh, "model") > 1:  # fusing interleaves each shard's parts
    raise MeshError("place the weights before fusing them on a mesh that splits the model "
                    "(model.serving_params after place)")
  # With one model shard a fused tree is what fusing after placing makes (the data and ctx axes
  # hold copies): e.g. each process of a one-process-per-GPU run fuses on its own GPU, and Star
  # then spreads the weights over the processes' ctx mesh.
  shards = ModelShards.of(cfg, mesh)
  standard = abstract_model(cfg, fused)[1]

  def one(path, x, want):
    name = _name(path)
    if tuple(x.shape) != tuple(want.shape):  # placed already, or another model's
      raise MeshError(f"weight {jax.tree_util.keystr(path)} is {tuple(x.shape)}, not the "
                      f"{tuple(want.shape)} this config has: place takes the weights as loaded")
    sharding = NamedSharding(mesh, weight_spec(name, mesh))
    if jax.process_count() > 1 and isinstance(x, jax.Array) and x.is_fully_addressable:
      x = np.asarray(x)  # this process's copy: every process holds the same weights
    if isinstance(x, np.ndarray):
      return _from_host(name, x, shards, sharding)
    if (jax.eval_shape(lambda y: _placed_leaf(name, y, shards), x).shape == x.shape
        and x.sharding.is_equivalent_to(sharding, x.ndim)):
      return x  # read or drawn into its shards already: no copy (a 70B model has no room)
    return _placer(name, shards, sharding)(x)

  return jax.tree_util.tree_map_with_path(one, params, standard)


def _from_host(name: str, x: np.ndarray, shards: ModelShards, sharding: NamedSharding):
  placed = _placed_leaf(name, x, shards)
  return jax.make_array_from_callback(placed.shape, sharding, lambda idx: placed[idx])


def place_leaf(name: str, x, cfg: LlamaConfig, mesh):
  """One weight (standard layout, a host array) placed over `mesh` as `place` places it."""
  mesh = make_mesh(mesh)
  return _from_host(name, np.asarray(x), ModelShards.of(cfg, mesh),
                    NamedSharding(mesh, weight_spec(name, mesh)))


def restore_shardings(cfg: LlamaConfig, mesh):
  """Shardings to read a checkpoint (standard layout) with straight onto the mesh: each weight
  split as `place` splits it where its dimension divides (the padding and KV copies `place`
  adds come after), else whole along it."""
  mesh = make_mesh(mesh)
  ModelShards.of(cfg, mesh)  # the mesh checked against the model
  _, shapes = abstract_model(cfg)
  return jax.tree_util.tree_map_with_path(
      lambda path, s: NamedSharding(mesh, weight_spec(_name(path), mesh, s.shape)), shapes)


def random_on_mesh(cfg: LlamaConfig, mesh, seed: int = 0):
  """`random_params` created on the mesh and placed there (benchmarks' weights at shapes no
  device holds whole): each leaf is drawn straight into its shards."""
  return place(random_params(cfg, seed, shardings=restore_shardings(cfg, mesh)), cfg, mesh)


def _fuse_heads(parts, shards: int):
  """[D, n_i, hd] weights -> [D, sum n_i, hd] with each shard's heads of every part together."""
  if shards == 1:  # eagerly, each reshape below would be a copy of its weight
    return jnp.concatenate(parts, axis=1)
  d, hd = parts[0].shape[0], parts[0].shape[2]
  split = [x.reshape(d, shards, x.shape[1] // shards, hd) for x in parts]
  return jnp.concatenate(split, axis=2).reshape(d, -1, hd)


def _fuse_units(parts, shards: int):
  """[D, F] weights -> [D, 2F] with each shard's hidden units of every part together."""
  if shards == 1:
    return jnp.concatenate(parts, axis=1)
  d = parts[0].shape[0]
  split = [x.reshape(d, shards, x.shape[1] // shards) for x in parts]
  return jnp.concatenate(split, axis=2).reshape(d, -1)


# The weights fusing replaces, by block.
_FUSED_PARTS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj")}

# Each fused weight: (its block, its parts, how it is made of them over `shards` model shards),
# in the order `fuse_placed` makes them (its doc says why this order).
_FUSED = {
    "o_proj_t": ("attn", ("o_proj",),  # [H, hd, D] -> [D, H, hd]
                 lambda p, shards: jnp.transpose(p["o_proj"], (2, 0, 1))),
    "qkv_proj": ("attn", ("q_proj", "k_proj", "v_proj"),
                 lambda p, shards: _fuse_heads([p["q_proj"], p["k_proj"], p["v_proj"]], shards)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj"),
                     lambda p, shards: _fuse_units([p["gate_proj"], p["up_proj"]], shards)),
}


def fuse_projections(params, shards: int = 1):
  """The serving layout: per layer q/k/v concatenated over heads into `qkv_proj` [D, H+2KV, hd],
  gate/up over outputs into `gate_up_proj` [D, 2F], and the output projection transposed into
  `o_proj_t` [D, H, hd]; everything else shared, not copied. Over `shards` devices of the
  `model` axis each shard's part of q, k and v (gate and up) sits together, so a placed fused
  weight splits into per-device fused weights (a transposed one splits along its heads as
  before).

  Why `o_proj_t`: at batch 1, XLA's GPU simplifier turns a matrix-vector dot whose operands
  hold under 10M elements into a multiply and a reduction (the 8B's [2048 x 4096] a device on
  `model=2`, the 3B's [3072 x 3072] on one GPU). Stored [H, hd, D] that reduction runs across
  rows; stored [D, H, hd] along them: 28.9 -> 12.4 us a call (8B, `model=2`), 37.8 -> 14.7
  (3B), and 39.6 -> 37.1 where the dot stays a GEMM (8B, one GPU), on an H200
  (benchmarks/matvec_forms.py, BENCHMARKS.md).

  A new tree (the input is left as it is; drop it to free the unfused weights). Why: a batch-1
  decode step is one matrix-vector product per weight, and each small one (k, v: 8 MB at the 8B
  shape) pays a kernel launch and a ramp-up for little data; one launch per fused weight reads
  the same bytes. Only for generation: checkpoints, training and HF export take unfused params.
  """
  if is_fused(params):
    return params
  layers = {}
  for i, layer in params["layers"].items():
    new = {block: {k: v for k, v in layer[block].items() if k not in names}
           for block, names in _FUSED_PARTS.items()}
    for name, (block, names, make) in _FUSED.items():
      new[block][name] = make({k: layer[block][k] for k in names}, shards)
    layers[i] = {**layer, **new}
  return {**params, "layers": layers}


def serving_params(params, mesh=None):
  """The layout generation runs fastest on: fused projections on NVIDIA GPUs (H200, 8B shape,
  batch-1 decode at 32K: 5.88 -> 5.70 ms, benchmarks/decode_profile.py), as given elsewhere
  (unmeasured on TPU; on CPU the tests compare both layouts). With a mesh: params already
  `place`d. On a GPU the input is consumed: each layer's q/k/v, o and gate/up buffers are freed
  once their fused weights are made, so fusing holds one layer twice, not every projection
  (the 8B shape, input kept: a 25.2 GB peak for 16.1 GB of weights, before any step)."""
  if jax.default_backend() != "gpu":
    return params
  return fuse_placed(params, mesh, consume=True)


def fuse_placed(params, mesh=None, *, consume: bool = False):
  """`fuse_projections` of weights `place`d over `mesh` (None: on one device), per shard, layer
  by layer, each fused weight split as its parts were. Only the fused weights are new buffers:
  every other weight is the input's own (a jitted copy of whole layers once held two models:
  30.0 GB against 25.2 at the 8B shape on one H200 with `mesh="model=1"`). consume: the parts
  are deleted from the input tree as each fused weight is made.

  One fused weight at a time, its parts freed before the next is made, in the order of `_FUSED`
  (o_proj_t, then q/k/v, then gate/up): then each new weight fits exactly in what its like freed
  in the layer before (o_proj_t in part of the block the previous k, o, q, v left, the fused
  q/k/v in the rest, gate/up in its predecessors' block). Why: XLA's GPU allocator (BFC) hands
  out a free block whole when it is under twice the request and the excess under 128 MiB, and
  counts it whole as in use. All three made in one call a layer, the 70B on `model=2` had 75.86
  GB in use a GPU for 70.56 GB of live weights (about 67 MB a layer: what a fused q/k/v of 84 MB
  leaves of the 151 MB block a layer's k, o, q, v free; inferred, not traced) and ran out of
  memory on 2 H100s at 32K; made this way, 70.56 GB in use, peak 71.02
  (benchmarks/results/tp70b_fuse_memory_2xh100.jsonl)."""
  if is_fused(params):
    return params
  mesh = mesh if mesh is None else make_mesh(mesh)
  shards = 1 if mesh is None else axis_size(mesh, "model")
  layers = {}
  for i, layer in params["layers"].items():
    new = {block: {k: v for k, v in layer[block].items() if k not in names}
           for block, names in _FUSED_PARTS.items()}
    for name, (block, names, _) in _FUSED.items():
      parts = {k: layer[block][k] for k in names}
      where = None if mesh is None else NamedSharding(mesh, weight_spec(name, mesh))
      fused = _fuser(name, shards, where)(parts)
      if consume:  # (donating them warns: no output can reuse a part's buffer)
        jax.block_until_ready(fused)  # freed before the next weight is allocated
        for x in parts.values():
          x.delete()
      new[block][name] = fused
    layers[i] = {**layer, **new}
  return {**params, "layers": layers}


@functools.lru_cache(maxsize=None)
def _fuser(name: str, shards: int, sharding):
  make = functools.partial(_FUSED[name][2], shards=shards)
  return jax.jit(make) if sharding is None else jax.jit(make, out_shardings=sharding)
