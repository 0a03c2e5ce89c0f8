"""RunOptions: how a run's compiled steps are built, as opposed to what they compute.

One frozen (hashable) value handed to every jitted step as a static argument and to each layer's
method through `AttnContext.options`: kernel choices, decode variants, the prefill chunk. Two
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

import pallas_kernels
from pallas_kernels import quant
from jax_longctx.core.config_types import ConfigError
from jax_longctx.core.mesh import make_mesh


# What a rematerialized layer keeps for the backward pass (RunOptions.remat).
REMAT_POLICIES = {"layer": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@dataclasses.dataclass(frozen=True)
class RunOptions:
  # Which kernel a call runs where several compute the same thing (pallas_kernels.KernelOptions).
  kernels: pallas_kernels.KernelOptions = pallas_kernels.KernelOptions()
  # Tiling of one-token decode attention on GPU (None: the kernel's own split plan,
  # gpu.split_plan: about 2 programs per core, ~32 splits of 1024 keys at 32K, batch 1, 8 kv heads).
  decode_tiling: pallas_kernels.Tiling | None = None
  # One-token cache writes through pallas_kernels.decode.cache_write's in-place kernel on this kernel
  # backend ("auto": the kernel on GPU, the scatter elsewhere; "gpu": also interpreted on CPU),
  # or None: XLA's scatter for every write. This switch, the next and KernelOptions'
  # decode_merge_kernel / decode_q_in_kernel together: the 8B's decode on `model=2` 5.37 -> 5.16
  # ms (2 H100s; one GPU ~0.5% each, within spread), so on by default (BENCHMARKS.md).
  cache_write_backend: str | None = "auto"
  # One-token steps run each residual add and the norm after it as one kernel
  # (pallas_kernels.decode.add_rmsnorm) on this backend, or None: jnp's add and norm (above).
  add_norm_backend: str | None = "auto"
  # Prefill chunk (tokens a step); None: the method's own, else `default_chunk()`.
  prefill_chunk: int | None = None
  # The kernel backend of full attention's kernel calls ("auto": the platform's; "gpu": the GPU
  # kernels, interpreted off a GPU, as benchmarks/decode_profile.py --smoke runs them on CPU).
  kernel_backend: str = "auto"
  # Full attention through the flash-attention kernels, for prefill chunks and for one-token
  # steps; None: where measured faster (prefill on GPU and TPU, decode on NVIDIA GPUs).
  prefill_kernel: bool | None = None
  decode_kernel: bool | None = None
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
    for field in ("cache_write_backend", "add_norm_backend", "kernel_backend"):
      value = getattr(self, field)
      if value is not None and value not in pallas_kernels.BACKENDS:
        raise ConfigError(f"{field}={value!r} must be one of {pallas_kernels.BACKENDS}")
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


DEFAULT = RunOptions()
