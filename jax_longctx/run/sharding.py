"""Steps on a device mesh: every compiled step of the run loop, per device under `jax.shard_map`.

With `RunOptions.mesh` set (core/mesh.py: axes data, model, ctx), a jitted step (a prefill chunk,
the end-of-prefill hook, the decode loop, teacher-forced NLL, CItruS' instruction passes) runs
its one-device body on every device over that device's parts: its rows of the batch (`data`),
its heads, hidden units and vocabulary slice (`model`: the weights `model.place`d, the model
inserting its all-reduces) and, for a method over a cache split along the tokens (mesh
ReAttention), its tokens (`ctx`). No array is gathered but the logits' vocabulary slices and
what a method's `Heads` reductions combine, so a cache never leaves its devices. Without a mesh
the bodies run as they are.

How each leaf of a method's state lies is found, not declared: its shape is evaluated
(abstractly) at twice the batch, twice the heads and twice the cache length, and the dimensions
that double are its rows, heads and tokens (`probe_roles`). The roles ride on the cache
(`Cache.roles`), so every later step knows how to split it.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import MeshError, ModelShards, axis_size, make_mesh
from jax_longctx.core.options import RunOptions
from jax_longctx.methods.base import Method, PrefillEnd
from jax_longctx.model import abstract_model, is_fused, new_cache, param_specs, place
from jax_longctx.model.decoder import local_heads
from jax_longctx.ops.cache import Cache

ROLES = {"rows": "data", "heads": "model", "tokens": "ctx"}  # a state dimension -> its mesh axis
_ONE = dict.fromkeys(ROLES, 1)

ALL = P()  # replicated: scalars, stop tokens, the sampling key


def eval_local(fn: Callable, mesh, *args):
  """Shapes `fn(*args)` has on one device of `mesh` (args: that device's shapes), or on the
  one device without a mesh: what a step's body sees, collectives and all."""
  if mesh is None:
    return jax.eval_shape(fn, *args)
  return jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=ALL, out_specs=ALL,
                                      check_vma=False), *args)


def probe_roles(build: Callable[[dict], object], what: str, mesh=None) -> tuple:
  """build(scale) -> one layer's state (as one device of `mesh` holds it) with the batch, the
  heads and the cache length multiplied by scale["rows"], scale["heads"], scale["tokens"].
  Returns, per leaf (tree order), the role of each dimension (a key of ROLES, or None: the same
  on every device)."""
  leaves, tree = jax.tree.flatten(eval_local(lambda: build(_ONE), mesh))
  roles = [[None] * len(x.shape) for x in leaves]
  for role in ROLES:
    grown, grown_tree = jax.tree.flatten(eval_local(lambda: build({**_ONE, role: 2}), mesh))
    if grown_tree != tree:
      raise MeshError(f"{what}: its state changes structure with its {role}; it cannot be split "
                      "over a mesh")
    for i, (a, b) in enumerate(zip(leaves, grown)):
      for d, (x, y) in enumerate(zip(a.shape, b.shape)):
        if x == y:
          continue
        if y != 2 * x or roles[i][d] is not None:
          raise MeshError(f"{what}: a state dimension of {x} grows to {y} with its {role}; it "
                          "cannot be split over a mesh")
        roles[i][d] = role
  return tuple(tuple(r) for r in roles)


def _scaled(cfg: LlamaConfig, scale: dict) -> LlamaConfig:
  h = scale["heads"]
  return cfg.replace(num_heads=cfg.num_heads * h, num_kv_heads=cfg.num_kv_heads * h)


def local_avals(tree, specs, mesh):
  """The abstract arrays of `tree` as one device of `mesh` holds them under `specs`."""
  def one(x, spec):
    shape = list(x.shape)
    for d, axis in enumerate(spec):
      if axis is not None:
        shape[d] //= mesh.shape[axis]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  return jax.tree.map(one, tree, specs, is_leaf=lambda x: isinstance(x, P))


def start_roles(method: Method, cfg: LlamaConfig, batch: int, max_len: int, chunk: int,
                options: RunOptions) -> tuple:
  """The roles of one layer's state as `init_state` builds it (cfg, batch, max_len: one
  device's, inside a step on `options.mesh`)."""
  return probe_roles(lambda s: method.init_state(_scaled(cfg, s), batch * s["rows"],
                                                 max_len * s["tokens"], cfg.jnp_dtype, chunk),
                     method.name, options.mesh)


def end_roles(method: Method, cache: Cache, cfg: LlamaConfig, decode_room: int,
              options: RunOptions) -> tuple:
  """The roles of one layer's state after `end_of_prefill`, from the cache before it (global,
  abstract; cfg: the model's)."""
  mesh = options.mesh
  local_cfg = ModelShards.of(cfg, mesh).local(cfg)
  before = local_avals(cache, cache_specs(cache, mesh), mesh)
  leaves, tree = jax.tree.flatten(before.state[0])
  heads = heads_of(cfg, options)

  def build(s):
    grown = [jnp.zeros([n * (s[r] if r else 1) for n, r in zip(x.shape, roles)], x.dtype)
             for x, roles in zip(leaves, cache.roles)]
    b = before.lengths.shape[0] * s["rows"]
    info = PrefillEnd(_scaled(local_cfg, s), 0, jnp.zeros((b,), jnp.int32), decode_room,
                      options, heads)
    return method.end_of_prefill(jax.tree.unflatten(tree, grown), info)

  return probe_roles(build, method.name, mesh)


def _spec(roles, axes) -> P:
  return P(*[ROLES[r] if r is not None and ROLES[r] in axes else None for r in roles])


def cache_specs(cache: Cache, mesh) -> Cache:
  """The PartitionSpecs of a cache made by `empty_cache` (or a step after it): rows over
  `data`, heads over `model`, tokens over `ctx` (for the methods that split them)."""
  if cache.roles is None:
    raise MeshError("this cache was not made for a mesh (run.sharding.empty_cache)")
  axes = {a for a in mesh.axis_names if mesh.shape[a] > 1}
  specs = [_spec(r, axes) for r in cache.roles]
  state = tuple(jax.tree.unflatten(jax.tree.structure(s), specs) for s in cache.state)
  return cache.replace(lengths=P("data"), state=state)


def rows(tree):
  """Batch-major arrays: their rows over `data`."""
  return jax.tree.map(lambda _: P("data"), tree)


def params(tree):
  """The weights, as `model.place` lays them out."""
  return param_specs(tree)


def per_device(body: Callable, options: RunOptions, in_specs: tuple, out_specs):
  """`body` as every device's part of the step on `options.mesh` (itself without a mesh)."""
  if options.mesh is None:
    return body
  return jax.shard_map(body, mesh=options.mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


def local_config(cfg: LlamaConfig, options: RunOptions) -> LlamaConfig:
  """The model as one device holds it inside a step on `options.mesh`."""
  return ModelShards.of(cfg, options.mesh).local(cfg) if options.mesh is not None else cfg


def check_layer_mesh(method: Method, options: RunOptions) -> None:
  """A per-layer method runs on the data and model axes; ctx is for the methods that split the
  cache along the tokens (`Method.splits_tokens`)."""
  ctx = axis_size(options.mesh, "ctx")
  if ctx > 1 and not method.splits_tokens:
    raise MeshError(f"method {method.name!r} runs per layer on the data and model axes; ctx={ctx} "
                    "is for the mesh methods (star, ring, reattention_mesh, resa_mesh)")


def check_batch(batch: int, options: RunOptions) -> None:
  d = axis_size(options.mesh, "data")
  if batch % d:
    raise MeshError(f"a batch of {batch} rows does not divide over data={d}: pad it "
                    "(jax_longctx.generate does) or use another data axis")


def row_offset(batch: int, options: RunOptions):
  """Inside a step: the batch index of this device's first row (its `batch` rows are a slice)."""
  if axis_size(options.mesh, "data") == 1:
    return 0
  return jax.lax.axis_index("data") * batch


def all_rows(x, options: RunOptions):
  """Inside a step: x [B_local, ...] of every `data` group joined, [B, ...] on every device: what
  a step hands the host (tokens, NLL), readable by every process of a multi-host run."""
  if axis_size(options.mesh, "data") == 1:
    return x
  return jax.lax.all_gather(x, "data", axis=0, tiled=True)


def max_over_rows(x, options: RunOptions):
  """Inside a step: the largest x of every `data` group (one value on every device)."""
  return x if axis_size(options.mesh, "data") == 1 else jax.lax.pmax(x, "data")


def empty_cache(cfg: LlamaConfig, method: Method, batch: int, max_len: int, chunk: int,
                options: RunOptions) -> Cache:
  """`model.new_cache`, made on the mesh: each device allocates only its part."""
  if options.mesh is None:
    return new_cache(cfg, method, batch, max_len, chunk=chunk)
  check_batch(batch, options)
  return _empty_cache(cfg, method, batch, max_len, chunk, options)()


@functools.lru_cache(maxsize=32)
def _empty_cache(cfg, method, batch, max_len, chunk, options):
  mesh = options.mesh
  shards = ModelShards.of(cfg, mesh)
  ctx, data = axis_size(mesh, "ctx"), axis_size(mesh, "data")
  if max_len % ctx:
    raise MeshError(f"a cache of {max_len} slots does not divide over ctx={ctx}")
  local, b, t = shards.local(cfg), batch // data, max_len // ctx
  roles = start_roles(method, local, b, t, chunk, options)

  def body():
    return new_cache(local, method, b, t, chunk=chunk).replace(max_len=max_len, roles=roles)

  shape = jax.eval_shape(body)
  return jax.jit(per_device(body, options, (), cache_specs(shape, mesh)))


def placed(params, cfg: LlamaConfig, mesh):
  """The weights as `model.place` lays them on `mesh`: as they are if they lie so already (a
  placed tree is passed from call to call), else placed now (once, leaf by leaf)."""
  mesh = make_mesh(mesh)
  shapes = _placed_shapes(cfg, mesh, is_fused(params))

  def ready(x, spec, shape):
    return (isinstance(x, jax.Array) and x.shape == shape.shape
            and x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim))

  specs = param_specs(params)
  if all(jax.tree.leaves(jax.tree.map(ready, params, specs, shapes,
                                      is_leaf=lambda x: isinstance(x, P)))):
    return params
  return place(params, cfg, mesh)


@functools.lru_cache(maxsize=8)
def _placed_shapes(cfg: LlamaConfig, mesh, fused: bool):
  return abstract_model(ModelShards.of(cfg, mesh).placed(cfg), fused)[1]


def pad_rows(rows: list, options: RunOptions) -> list:
  """Rows padded with copies of the last to a multiple of the mesh's `data` axis."""
  return list(rows) + [rows[-1]] * (-len(rows) % axis_size(options.mesh, "data"))


def first_rows(cache: Cache, n: int) -> Cache:
  """The cache of its first n sequences (off the mesh's layout: for reports and results)."""
  def cut(x, roles):
    return x[tuple(slice(0, n) if r == "rows" else slice(None) for r in roles)]
  state = tuple(jax.tree.unflatten(jax.tree.structure(s), [cut(x, r) for x, r in
                                                            zip(jax.tree.leaves(s), cache.roles)])
                for s in cache.state)
  return cache.replace(lengths=cache.lengths[:n], state=state, roles=None)


def heads_of(cfg: LlamaConfig, options: RunOptions):
  """The `Heads` a device holds inside a step on `options.mesh`."""
  return local_heads(ModelShards.of(cfg, options.mesh))


def on_mesh(x, mesh, spec):
  """x placed on `mesh` as `spec` says (a no-op for what already lies so), with the spec's axes
  of size 1 and trailing Nones left out, as a step's outputs come: an input whose sharding
  differs, even only in how it is spelled, compiles the step again."""
  axes = [a if a is not None and mesh.shape[a] > 1 else None for a in spec]
  while axes and axes[-1] is None:
    axes.pop()
  return jax.device_put(x, NamedSharding(mesh, P(*axes)))
