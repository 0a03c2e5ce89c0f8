"""The decode step variants `benchmarks/decode_profile.py` measures (its docstring says what each
one changes): XLA flags, the serving layout and the one-token decode options, each a field
(`decode_profile.run_options` turns them into the loop's RunOptions)."""

from __future__ import annotations

from typing import NamedTuple


class Variant(NamedTuple):
  flags: list  # XLA flags
  fused: bool  # params in fuse_projections' serving layout
  flash: bool  # decode attention through pallas_kernels.flash_attention
  decode_tiling: dict | None = None  # Route.decode_tiling, as gpu.Tiling's fields
  merge_kernel: bool = False  # KernelOptions.decode_merge_kernel
  cache_kernel: bool = False  # RunOptions.route.cache_write_backend set
  add_norm: bool = False  # RunOptions.route.add_norm_backend set
  q_in_kernel: bool = False  # KernelOptions.decode_q_in_kernel


PDL = ["--xla_gpu_enable_pdl=true"]


def _on_all(merge_kernel: bool = False, cache_kernel: bool = False, add_norm: bool = False,
            q_in_kernel: bool = False, **tiling) -> Variant:
  """`all` with decode attention's split plan / tiles set (Route.decode_tiling), and/or
  the split merge kernel, the one-token cache write kernel, the residual add + norm kernel, the
  unpadded query rows."""
  return Variant(PDL, True, True, tiling or None, merge_kernel, cache_kernel, add_norm,
                 q_in_kernel)


VARIANTS = {
    "base": Variant([], False, False),
    "fused": Variant([], True, False),
    "pdl": Variant(PDL, False, False),
    "nopdl": Variant(["--xla_gpu_enable_pdl=false"], False, False),
    "cublas": Variant(["--xla_gpu_enable_triton_gemm=false"], False, False),
    "cublaslt": Variant(["--xla_gpu_enable_cublaslt=true"], False, False),
    "flash_decode": Variant([], False, True),
    "fused_pdl": Variant(PDL, True, False),
    "fused_cublas": Variant(["--xla_gpu_enable_triton_gemm=false"], True, False),
    "fused_flash": Variant([], True, True),
    "all": Variant(PDL, True, True),
    "all_op_by_op": Variant(PDL + ["--xla_gpu_enable_command_buffer="], True, True),
    "all_exhaustive": Variant(PDL + ["--xla_gpu_exhaustive_tiling_search=true"], True, True),
    "split16": _on_all(key_splits=16),
    "split64": _on_all(key_splits=64),
    "split128": _on_all(key_splits=128),
    "bk64": _on_all(block_keys=64),
    "bk64_split64": _on_all(block_keys=64, key_splits=64),
    "bk64_s3_split64": _on_all(block_keys=64, num_stages=3, key_splits=64),
    "bk128_s3": _on_all(num_stages=3),
    "bk32_s4_split128": _on_all(block_keys=32, num_stages=4, key_splits=128),
    "bk128_w8": _on_all(num_warps=8),
    "merge_kernel": _on_all(merge_kernel=True),
    "cache_kernel": _on_all(cache_kernel=True),
    "add_norm": _on_all(add_norm=True),
    "q_in_kernel": _on_all(q_in_kernel=True),
    "merge_q": _on_all(merge_kernel=True, q_in_kernel=True),
    "small_kernels": _on_all(merge_kernel=True, cache_kernel=True, add_norm=True,
                             q_in_kernel=True),
}
