"""Lowering a GPU (Triton) kernel for CUDA on a machine without a GPU, as the kernel tests do to
catch lowering errors that Pallas interpret mode cannot see."""

import contextlib

import jax


def h200_target():
  """JAX 0.11's Triton lowering asks the device for its compute capability; on a machine without
  a GPU an abstract H200 answers (JAX 0.10 lowers without one)."""
  sharding = jax.sharding
  if not hasattr(sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  dev = sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return sharding.use_abstract_mesh(sharding.AbstractMesh((1,), ("x",), abstract_device=dev))


def cuda_text(fn, *args) -> str:
  """StableHLO of jit(fn)(*args) lowered for CUDA (arguments built before, outside the target)."""
  with h200_target():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
