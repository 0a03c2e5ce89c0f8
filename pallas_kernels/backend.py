"""Which variant of a kernel runs: the jnp reference, the GPU Pallas kernel or the TPU one.

"auto" picks by the platform of the default device: GPU kernels on CUDA, TPU kernels on TPU, the
reference elsewhere. Asking for "gpu" or "tpu" on a machine without that accelerator runs the
variant in Pallas interpret mode (on CPU), which is how the tests check both variants.
"""

from __future__ import annotations

import dataclasses

import jax

BACKENDS = ("auto", "reference", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Variant:
  kind: str  # "reference" | "gpu" | "tpu"
  interpret: bool  # run the Pallas kernel in interpret mode (no matching accelerator)

  def interpret_arg(self):
    """The `interpret=` value for pallas_call."""
    if not self.interpret:
      return False
    if self.kind == "tpu":
      from jax.experimental.pallas import tpu as pltpu
      return pltpu.InterpretParams()
    return True


def platform() -> str:
  return jax.devices()[0].platform


def resolve(backend: str) -> Variant:
  if backend not in BACKENDS:
    raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
  here = platform()
  if backend == "auto":
    if here == "gpu":
      return Variant("gpu", False)
    if here == "tpu":
      return Variant("tpu", False)
    return Variant("reference", False)
  if backend == "reference":
    return Variant("reference", False)
  return Variant(backend, here != backend)


def num_cores() -> int:
  """Streaming multiprocessors on a GPU (what key-axis splits must fill); 1 elsewhere."""
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 1


def is_hopper() -> bool:
  """Whether the default device is an sm_90 GPU (H100/H200), where Mosaic GPU's WGMMA runs."""
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")) == "9.0"
