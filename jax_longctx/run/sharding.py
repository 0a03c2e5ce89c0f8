"""The mesh as a wrapper: one decorator makes a one-device step a step on a device mesh, and one
host-side adapter prepares a run for it.

`@mesh_step(inputs=..., outputs=...)` jits a step whose body is written for one device. Without
a mesh (`RunOptions.mesh` None, or a mesh of one device) the body is jitted as it is and nothing
here runs. On a mesh the body runs on every device under `jax.shard_map`, over that device's
part of each argument, which the decorator lays out from what the data declares:

    "params"  the weights, as `model.place` lays them out (their heads, hidden units, vocabulary
              over `model`);
    "cache"   a Cache or a method's state: every leaf as its class declares it (core/axes.py;
              rows over `data`, heads over `model`, tokens over `ctx`);
    a tuple   logical axes for every leaf of the argument, e.g. (ROWS,) for per-row arrays;
    ()        replicated (scalars, stop tokens, the sampling key).

Outputs take the same kinds, and two more: "same" (the input cache's layout: a step that
updates a cache in place), and "gathered" (per-row results all-gathered over `data`, so every
device and every process of a multi-host run holds all rows: what a step hands the host). The
body never spells a PartitionSpec and never asks which device it is on: the model adds the
tensor-parallel collectives, a method's `Heads` those of its decisions, and a method that
splits its cache along the tokens the `ctx` ones (core/mesh.py and methods/base.py).

`HostBatch` is what the driver does on the host for a mesh before and after the steps: the
weights placed once, the batch padded to a multiple of `data` with copies of its last row, and
the padding rows dropped from the results.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_longctx.core.axes import take_rows
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import (MeshError, ModelShards, axis_size, make_mesh, one_device,
                                   spec_of, specs)
from jax_longctx.core.options import RunOptions
from jax_longctx.methods.base import Method
from jax_longctx.model import abstract_model, is_fused, new_cache, param_specs, place
from jax_longctx.ops.cache import Cache

_STATIC = ("cfg", "method", "options")


def on_one_device(options: RunOptions) -> bool:
  """Whether steps run as they are: no mesh, or a mesh of one device (nothing to split)."""
  return one_device(options.mesh)


def mesh_step(*, inputs, outputs, donate: Sequence[str] = (), static: Sequence[str] = _STATIC):
  """A decorator: `body(*arrays, **static)` jitted (static keywords `static`, donated
  arguments `donate`), run per device under shard_map when `options` (a static keyword, its
  default the body's) has a mesh that splits anything. inputs: the kind of each array argument
  by its name, e.g. `{"params": "params", "tokens": (ROWS,), "cache": "cache"}`; outputs: one
  kind, or a tuple of kinds for a tuple of outputs (the module's doc). Both are checked against
  the body's signature when it is decorated. Every input but the weights is put on the mesh as
  its kind says (`_placed_arg`), so a step fed its own outputs compiles once. The step's
  `compile_ahead(*args, **kw)` compiles it on a host thread for such arguments (`Ahead`)."""

  def wrap(body: Callable):
    signature = inspect.signature(body)
    default = signature.parameters["options"].default
    kinds = _kinds_by_argument(body, signature, inputs, static)

    @functools.wraps(body)
    def step(*args, **kw):
      options = kw.get("options", default)
      if on_one_device(options):
        return body(*args, **kw)
      return _per_device(functools.partial(body, **kw), args, kinds, outputs, options.mesh)

    names = list(signature.parameters)
    jitted = jax.jit(step, static_argnames=tuple(static),
                     donate_argnums=tuple(names.index(n) for n in donate))

    @functools.wraps(body)
    def call(*args, **kw):
      mesh = kw.get("options", default).mesh
      if isinstance(mesh, Mesh) and not one_device(mesh):  # (an AbstractMesh: nothing to put)
        args = tuple(_placed_arg(a, kind, mesh) for a, kind in zip(args, kinds, strict=True))
      return jitted(*args, **kw)

    def compile_ahead(*args, **kw) -> Ahead:
      """Compiles the step on a host thread for arguments like `args` (jit's programs are keyed
      by shapes, types and layouts, not values), so a later call with such arrays runs at once.
      The abstract values are taken before this returns: `args` may be donated after it."""
      mesh = kw.get("options", default).mesh
      on_mesh = isinstance(mesh, Mesh) and not one_device(mesh)
      abstract = tuple(_abstract_arg(a, kind, mesh if on_mesh else None)
                       for a, kind in zip(args, kinds, strict=True))
      return Ahead(lambda: jitted.lower(*abstract, **kw).compile())

    call.lower, call.trace, call._cache_size = jitted.lower, jitted.trace, jitted._cache_size
    call.compile_ahead = compile_ahead
    return call

  return wrap


class Ahead(threading.Thread):
  """A compile running on a host thread (`mesh_step`'s compile_ahead); `wait` before the call
  it prepares, or that call compiles the program again alongside it. A failure is kept in
  `error`: the call itself raises it where it is made."""

  def __init__(self, compile_fn: Callable):
    super().__init__(daemon=True, name="compile-ahead")
    self._compile, self.error = compile_fn, None
    self.start()

  def run(self):
    try:
      self._compile()
    except Exception as e:  # noqa: BLE001 (raised again by the call, in its own thread)
      self.error = e

  def wait(self) -> None:
    self.join()


def _abstract_arg(arg, kind, mesh):
  """What jit keys a call by for `arg`: each leaf's shape, type and layout as the call will
  pass it (on a mesh, laid out as its kind says; else its own layout if committed)."""
  if mesh is not None and kind != "params":
    return jax.tree.map(lambda x, s: _abstract(x, NamedSharding(mesh, s)), arg,
                        _in_spec(kind, arg, mesh), is_leaf=lambda x: isinstance(x, P))
  return jax.tree.map(lambda x: _abstract(x, x.sharding if getattr(x, "committed", False)
                                          else None), arg)


def _abstract(x, sharding):
  if not isinstance(x, jax.Array):  # host values are passed as they are
    return x
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                              weak_type=getattr(x, "weak_type", False))


def _kinds_by_argument(body, signature, inputs, static) -> tuple:
  """The kinds of `body`'s array arguments in order, every one named once in `inputs`."""
  arrays = [n for n in signature.parameters if n not in static]
  if not isinstance(inputs, dict) or list(inputs) != arrays:
    named = list(inputs) if isinstance(inputs, dict) else "no argument (kinds by name: a dict)"
    raise TypeError(f"mesh_step of {body.__name__}: inputs name {named}, its array "
                    f"arguments are {arrays}")
  return tuple(inputs.values())


def _placed_arg(arg, kind, mesh):
  """arg laid out as `kind` says, spelled as the steps spell their outputs' shardings. Weights
  come placed (HostBatch.enter). A cache comes from empty_cache or a step, but XLA may spell an
  output's sharding otherwise over an axis of size 1 (P('model', None) for P() on model=1),
  which would compile the next step again: put, it is the same buffers under the same name."""
  if kind == "params":
    return arg
  return jax.tree.map(lambda x, s: _put(x, NamedSharding(mesh, s)), arg,
                      _in_spec(kind, arg, mesh), is_leaf=lambda x: isinstance(x, P))


def _put(x, sharding: NamedSharding):
  """x laid out as `sharding`: an array of an equivalent layout renamed (its buffers kept; a
  multi-host array too), any other value put there (one process's local array as host data,
  the same on every process of a multi-host run)."""
  if isinstance(x, jax.core.Tracer):
    return x
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
    if x.sharding == sharding:
      return x
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [s.data for s in x.addressable_shards])
  if isinstance(x, jax.Array) and not sharding.is_fully_addressable:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # keys travel as their data
      return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding),
                                      impl=jax.random.key_impl(x))
    x = np.asarray(x)
  return jax.device_put(x, sharding)


def _per_device(fn, args, inputs, outputs, mesh):
  in_specs = tuple(_in_spec(kind, a, mesh) for kind, a in zip(inputs, args, strict=True))
  several = isinstance(outputs, tuple)
  kinds = outputs if several else (outputs,)
  cache_spec = next((s for kind, s in zip(inputs, in_specs) if kind == "cache"), None)
  gather = axis_size(mesh, "data") > 1

  def body(*local):
    out = fn(*local)
    out = out if several else (out,)
    return tuple(jax.tree.map(lambda x: jax.lax.all_gather(x, "data", axis=0, tiled=True), o)
                 if kind == "gathered" and gather else o for kind, o in zip(kinds, out))

  # check_vma stays off: the bodies' collectives are not typed for it (decoder.py gathers the
  # logits over `model` with all_gather, not all_gather_invariant, so with the check on the
  # prefill step's per-row logits, P('data'), are refused as "possibly varying over model").
  shapes = None
  if "cache" in kinds:  # a state of a new structure: laid out as its classes declare
    shapes = jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(),
                                          check_vma=False), *args)
  out_specs = tuple(_out_spec(kind, shapes[i] if shapes else None, cache_spec, mesh)
                    for i, kind in enumerate(kinds))
  out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      check_vma=False)(*args)
  return out if several else out[0]


def _in_spec(kind, arg, mesh):
  if kind == "params":
    return param_specs(arg, mesh)
  if kind == "cache":
    return specs(arg, mesh, "cache")
  return jax.tree.map(lambda _: spec_of(kind, mesh), arg)


def _out_spec(kind, shape, cache_spec, mesh):
  if kind == "same":
    return cache_spec
  if kind == "cache":
    return specs(shape, mesh, "cache")
  if kind == "gathered":
    return P()
  return spec_of(kind, mesh) if kind else P()


def empty_cache(cfg: LlamaConfig, method: Method, batch: int, max_len: int, chunk: int,
                options: RunOptions) -> Cache:
  """`model.new_cache`, made on the mesh as its classes declare it: each device allocates only
  its part (KV heads as `ModelShards.placed` copies them). On a mesh of one device it lies on
  that mesh as the placed weights do, so the first step's output cache has the layout of its
  donated input. (The 4.8 GB more peak once seen with `mesh="model=1"` was not this but the
  weights' fusing: `model.fuse_placed`.)"""
  dtype = options.cache_dtype(cfg.jnp_dtype)
  if options.mesh is None:
    return new_cache(cfg, method, batch, max_len, dtype, chunk=chunk)
  mesh = options.mesh
  for axis, n, what in (("data", batch, "batch of {} rows"), ("ctx", max_len, "cache of {} slots")):
    if n % axis_size(mesh, axis):
      raise MeshError(f"a {what.format(n)} does not divide over {axis}={axis_size(mesh, axis)}")
  return _empty_cache(ModelShards.of(cfg, mesh).placed(cfg), method, batch, max_len, dtype,
                      chunk, mesh)()


@functools.lru_cache(maxsize=32)
def _empty_cache(cfg, method, batch, max_len, dtype, chunk, mesh):
  def build():
    return new_cache(cfg, method, batch, max_len, dtype, chunk=chunk)
  laid = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(jax.eval_shape(build), mesh),
                      is_leaf=lambda x: isinstance(x, P))
  return jax.jit(build, out_shardings=laid)


@dataclasses.dataclass(frozen=True)
class HostBatch:
  """The host side of a run on a mesh (`enter`): weights placed, rows padded over `data`; then
  `rows` / `cache` drop the padding from what the steps return."""

  n: int  # the caller's rows
  padded: int  # rows the steps run

  @classmethod
  def enter(cls, params, cfg: LlamaConfig, options: RunOptions, *row_lists):
    """(adapter, params, *row_lists padded): each list of per-row items (None stays None)."""
    n = len(next(r for r in row_lists if r is not None))
    if options.mesh is None or n == 0:
      return (cls(n, n), params, *row_lists)
    params = placed(params, cfg, options.mesh)
    extra = -n % axis_size(options.mesh, "data")
    padded = [None if r is None else list(r) + [r[-1]] * extra for r in row_lists]
    return (cls(n, n + extra), params, *padded)

  def rows(self, x):
    return x if self.padded == self.n else x[:self.n]

  def cache(self, cache: Cache) -> Cache:
    """The cache of the caller's rows (for reports and results)."""
    return cache if self.padded == self.n else take_rows(cache, 0, self.n, "cache")


def placed(params, cfg: LlamaConfig, mesh):
  """The weights as `model.place` lays them on `mesh`: as they are if they lie so already (a
  placed tree is passed from call to call), else placed now (once, leaf by leaf)."""
  mesh = make_mesh(mesh)
  shapes = _placed_shapes(cfg, mesh, is_fused(params))

  def ready(x, spec, shape):
    return (isinstance(x, jax.Array) and x.shape == shape.shape
            and x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim))

  if all(jax.tree.leaves(jax.tree.map(ready, params, param_specs(params, mesh), shapes,
                                      is_leaf=lambda x: isinstance(x, P)))):
    return params
  return place(params, cfg, mesh)


def restrict(tree, part: Mesh):
  """A tree of arrays placed on a mesh, as arrays of `part`, a part of it whose devices hold
  whole copies (core.mesh.without_ctx; the arrays split along none of the axes cut): the
  shards its devices hold, as they lie, nothing copied."""
  devices = set(part.devices.flat)

  def one(x):
    shards = [s.data for s in x.addressable_shards if s.device in devices]
    return jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(part, x.sharding.spec), shards)

  return jax.tree.map(one, tree)


@functools.lru_cache(maxsize=8)
def _placed_shapes(cfg: LlamaConfig, mesh, fused: bool):
  return abstract_model(ModelShards.of(cfg, mesh).placed(cfg), fused)[1]


def check_layer_mesh(method: Method, options: RunOptions) -> None:
  """ctx splits a cache along the tokens: only for methods that do (`Method.splits_tokens`)."""
  ctx = axis_size(options.mesh, "ctx")
  if ctx > 1 and not method.splits_tokens:
    raise MeshError(f"method {method.name!r} runs on the data and model axes; ctx={ctx} is for "
                    "the methods that split the context (names('mesh'))")


__all__ = ["HostBatch", "check_layer_mesh", "empty_cache", "mesh_step", "on_one_device",
           "placed", "restrict"]
