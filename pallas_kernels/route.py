"""A run's kernel route: which variant every kernel call runs and with which choices, as one value.

Every public kernel (flash_attention, chunk_attention, gathered_attention, topk_scores,
add_rms_norm, write_one_token) takes it as a required keyword, `route=`, so a call that forgets
the run's choice is a TypeError, not a silent default. It is frozen (hashable): a run holds one
(`jax_longctx.core.options.RunOptions.route`), which is a static argument of its jitted steps, so
two routes compile apart and none can leave a compiled step stale. Methods ask it what they need
(`fused_prefill`, `fused_decode`, `is_reference`, `on_gpu`), never a resolved backend kind.

"auto" is resolved when a kernel is traced (`backend.resolve`: the platform of the default
device, or the one `lowering_for` stands in for), never when the route is built.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels import backend as backend_lib
from pallas_kernels.backend import BACKENDS, Variant
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions


@dataclasses.dataclass(frozen=True)
class Route:
  # The variant of every attention and top-k call: "auto" (the platform's kernels, the jnp
  # reference off GPU/TPU), "reference", "gpu" or "tpu" (interpreted off that device).
  backend: str = "auto"
  # Which kernel a call runs where several compute the same thing (KernelOptions).
  kernels: KernelOptions = KernelOptions()
  # Tiling of one-token decode attention on GPU (None: the kernel's own split plan,
  # gpu.split_plan: at most 2 programs per core: 32 splits at batch 1 of 8 kv heads on 132 cores).
  decode_tiling: Tiling | None = None
  # One-token cache writes through decode/cache_write's in-place kernel on this backend ("auto":
  # the kernel on GPU, the scatter elsewhere; "gpu": also interpreted on CPU), or None: XLA's
  # scatter for every write. This switch, the next and KernelOptions' decode_merge_kernel /
  # decode_q_in_kernel together: the 8B's decode on `model=2` 5.37 -> 5.16 ms (2 H100s; one GPU
  # ~0.5% each, within spread), so on by default (BENCHMARKS.md).
  cache_write_backend: str | None = "auto"
  # One-token steps run each residual add and the norm after it as one kernel
  # (decode/add_rmsnorm) on this backend, or None: jnp's add and norm.
  add_norm_backend: str | None = "auto"
  # Full attention through the flash-attention kernels, for prefill chunks and for one-token
  # steps; None: where measured faster (prefill on GPU and TPU, decode on NVIDIA GPUs).
  prefill_kernel: bool | None = None
  decode_kernel: bool | None = None

  def __post_init__(self):
    for field in ("backend", "cache_write_backend", "add_norm_backend"):
      value = getattr(self, field)
      if (value is not None or field == "backend") and value not in BACKENDS:
        raise ValueError(f"unknown kernel backend {value!r} for Route.{field}; expected one of "
                         f"{BACKENDS}")
    if not isinstance(self.kernels, KernelOptions):
      raise ValueError(f"kernels={self.kernels!r} must be a KernelOptions")
    if self.decode_tiling is not None and not isinstance(self.decode_tiling, Tiling):
      raise ValueError(f"decode_tiling={self.decode_tiling!r} must be a Tiling (or None)")

  def variant(self) -> Variant:
    """The attention and top-k kernels' variant where this is traced."""
    return backend_lib.resolve(self.backend)

  @property
  def is_reference(self) -> bool:
    """Whether the kernel calls run the jnp references (no Pallas kernel)."""
    return self.variant().kind == "reference"

  @property
  def on_gpu(self) -> bool:
    """Whether the kernel calls run the GPU kernels (on a GPU, or interpreted)."""
    return self.variant().kind == "gpu"

  @property
  def fused_prefill(self) -> bool:
    """Whether full attention's prefill chunks run the flash-attention kernels."""
    return self.prefill_kernel if self.prefill_kernel is not None else not self.is_reference

  @property
  def fused_decode(self) -> bool:
    """Whether full attention's one-token steps run the flash-attention kernel: by default on
    NVIDIA GPUs, where its split-K decode variant reads only the slots below each sequence's
    length (H200, 8B shape: decode 5.70 -> 5.47 ms at 32K with fused projections,
    BENCHMARKS.md). Not on TPU: unmeasured. Also wherever KernelOptions.decode_int8_products is
    asked (True): its products are flash_attention's (every variant, the reference included),
    which the jnp decode path would drop."""
    if self.decode_kernel is not None:
      return self.decode_kernel
    return self.on_gpu or self.kernels.decode_int8_products is True

  def replace(self, **kw) -> "Route":
    return dataclasses.replace(self, **kw)


DEFAULT = Route()
REFERENCE = Route(backend="reference")
