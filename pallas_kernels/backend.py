"""Which variant of a kernel runs: the jnp reference, the GPU Pallas kernel or the TPU one.

"auto" picks by the platform of the default device: GPU kernels on CUDA, TPU kernels on TPU, the
reference elsewhere. Asking for "gpu" or "tpu" on a machine without that accelerator runs the
variant in Pallas interpret mode (on CPU), which is how the tests check both variants.

`lowering_for("tpu")` makes the trace inside it see a TPU instead of the machine's device:
"auto" picks the TPU kernels and "tpu" stops interpreting, so `jax.export.export(jax.jit(f),
platforms=["tpu"])` on a CPU runs the real Pallas-to-Mosaic lowering (tests/kernels/
test_tpu_export.py, docs/KERNELS.md).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

BACKENDS = ("auto", "reference", "gpu", "tpu")
# Platforms `lowering_for` can stand in for. Only TPU: a GPU export on CPU would also need the
# cuDNN route, whose jax entry reads the local cuDNN version and GPU compute capability.
LOWERING_PLATFORMS = ("tpu",)

# The platform `lowering_for` names, or None. A jax user context, not a plain contextvar: its
# value is part of jit's trace and compile cache keys, so a function traced for CPU outside the
# block is traced again inside it (and the Mosaic-lowered trace is never reused outside), and
# like jax's own config contexts it is thread-local.
_LOWERING_FOR = jax.make_user_context(None)


@contextlib.contextmanager
def lowering_for(target: str):
  """Within the block, trace as if the default device were a `target` ("tpu").

  Trace-time only: it changes which variant kernels pick and every other platform branch taken
  while tracing (cuDNN routing, `num_cores`, jax_longctx's default prefill chunk), not where
  anything runs. Use it around `jax.export.export(jax.jit(f), platforms=[target])`; a function
  run on the CPU inside it would fail on the first TPU kernel.
  """
  if target not in LOWERING_PLATFORMS:
    raise ValueError(f"lowering_for({target!r}): expected one of {LOWERING_PLATFORMS}")
  with _LOWERING_FOR(target):
    yield


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
  """The default device's platform, or the one `lowering_for` stands in for."""
  return _LOWERING_FOR.value or jax.devices()[0].platform


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
  if platform() != "gpu":
    return 1
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def is_hopper() -> bool:
  """Whether the default device is an sm_90 GPU (H100/H200), where Mosaic GPU's WGMMA runs."""
  dev = jax.devices()[0]
  return platform() == "gpu" and str(getattr(dev, "compute_capability", "")) == "9.0"
