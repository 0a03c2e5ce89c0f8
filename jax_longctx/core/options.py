"""RunOptions: how a run's compiled steps are built, as opposed to what they compute.

One frozen (hashable) value handed to every jitted step as a static argument and to each layer's
method through `AttnContext.options`: the kernel route (pallas_kernels.Route: the kernels'
variant and choices, decode tiling, the cache-write and add+norm kernels, full attention's
kernel switches; every kernel call takes it as `route=`), the prefill chunk, remat, the mesh,
the KV dtype. Two
option sets compile apart, so a benchmark that compares variants builds one option set each and
nothing it changes can leave an already compiled step stale (module globals read at trace time
could). The device mesh is one of them: steps built for a mesh run per device
(run/sharding.py). Every default is today's measured choice; the opt-in kernels stay off until
a device measurement says otherwise (benchmarks/decode_profile.py times them as variants).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pallas_kernels import quant
from pallas_kernels.route import Route
from jax_longctx.core.config_types import ConfigError
from jax_longctx.core.mesh import make_mesh


# What a rematerialized layer keeps for the backward pass (RunOptions.remat).
REMAT_POLICIES = {"layer": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@dataclasses.dataclass(frozen=True)
class RunOptions:
  # Every kernel call's route (pallas_kernels/route.py says each field): the variant ("auto":
  # the platform's; "gpu": the GPU kernels, interpreted off a GPU, as benchmarks/decode_profile.py
  # --smoke runs them on CPU), the KernelOptions, the decode tiling, the cache-write and add+norm
  # kernels, full attention's prefill / decode kernel switches. `replace_route` makes a variant.
  route: Route = Route()
  # Prefill chunk (tokens a step); None: the method's own, else `default_chunk()`.
  prefill_chunk: int | None = None
  # Rematerialization of each decoder layer in a backward pass (training; forward-only steps
  # are unaffected): None keeps every activation; "layer" keeps only each layer's input and
  # recomputes the rest; "dots" also keeps the outputs of the weight matmuls (no batch
  # dimensions: the projections and the MLP, not attention's scores), recomputing less.
  remat: str | None = None
  # The device mesh the steps run on (`core.mesh`: axes data, model, ctx), or None: one device.
  # A string such as "data=2,model=4" is made into a Mesh over the first devices.
  mesh: Any = None
  # How the KV cache is stored: None, the model's dtype; "int8" or "float8_e4m3fn", 8 bits with a
  # scale per (token, KV head) (pallas_kernels.quant: every method and kernel reads it so).
  kv_dtype: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "mesh", make_mesh(self.mesh))
    if self.kv_dtype is not None:
      try:
        object.__setattr__(self, "kv_dtype", quant.check_kv_dtype(self.kv_dtype))
      except ValueError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(self.route, Route):
      raise ConfigError(f"route={self.route!r} must be a pallas_kernels.Route")
    if self.prefill_chunk is not None and self.prefill_chunk < 1:
      raise ConfigError(f"prefill_chunk={self.prefill_chunk} must be >= 1 (or None)")
    if self.remat is not None and self.remat not in REMAT_POLICIES:
      raise ConfigError(f"remat={self.remat!r} must be one of {tuple(REMAT_POLICIES)} (or None)")

  def cache_dtype(self, model_dtype):
    """The dtype the KV cache is stored in for a model computing in `model_dtype`."""
    return model_dtype if self.kv_dtype is None else self.kv_dtype

  def remat_policy(self):
    """The `jax.checkpoint` policy of `remat` (only when it is set)."""
    return REMAT_POLICIES[self.remat]

  def replace(self, **kw) -> "RunOptions":
    return dataclasses.replace(self, **kw)

  def replace_route(self, **kw) -> "RunOptions":
    """These options with the route's fields `kw` replaced (Route's fields)."""
    try:
      return dataclasses.replace(self, route=self.route.replace(**kw))
    except ValueError as e:
      raise ConfigError(str(e)) from None


DEFAULT = RunOptions()
