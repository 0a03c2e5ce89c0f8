"""Exports a function for TPU on this (CPU) machine: the real Pallas-to-Mosaic lowering of every
TPU kernel it calls, without a TPU (pallas_kernels.lowering_for; docs/KERNELS.md says what this
does and does not prove). Shared by tests/kernels/test_tpu_export.py and
tests/test_tpu_export_methods.py."""

import jax

import pallas_kernels

# The custom call each Mosaic kernel lowers to; interpret mode and the jnp references have none.
MOSAIC_CALL = "tpu_custom_call"


def export_for_tpu(fn, *args) -> jax.export.Exported:
  """jax.export of jit(fn) for TPU; args may be arrays or jax.ShapeDtypeStructs (pytrees)."""
  with pallas_kernels.lowering_for("tpu"):
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
  assert exported.platforms == ("tpu",)
  return exported


def mosaic_calls(exported: jax.export.Exported) -> int:
  """How many Mosaic TPU kernel calls the exported module holds."""
  return exported.mlir_module().count(f"@{MOSAIC_CALL}")
