"""Pallas kernels for long-context attention, each with a GPU variant, a TPU variant and a jnp
reference behind one `backend=` switch ("auto" | "reference" | "gpu" | "tpu").

- topk_scores: fused q.k + exact top-k over a long key axis (no score matrix in HBM; on Hopper,
  prefill chunks can run a Mosaic GPU kernel, mgpu_topk, when asked: GPU_TOPK_IMPL / Tiling).
- flash_attention: online-softmax attention returning its log-sum-exp (prefill and decode; on
  Hopper, prefill runs a Mosaic GPU kernel, mgpu_attention).
- chunk_attention: a prefill chunk over the cache before it and itself (two cuDNN calls merged
  by LSE on NVIDIA GPUs, flash_attention elsewhere).
- gathered_attention: attention over keys at given indices per KV group (sparse decoding).
- merge_attention: exact merge of partial (out, lse) pairs.

`lowering_for("tpu")` traces the TPU kernels for real (not interpreted) on any machine, for
`jax.export` with `platforms=["tpu"]`: how CI checks their Mosaic lowering without a TPU.

docs/KERNELS.md says which lowering each variant uses, how it is tested and what was measured.
"""

from pallas_kernels.backend import BACKENDS, lowering_for, platform, resolve
from pallas_kernels.chunk_prefill import chunk_attention
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.gathered_attention import gathered_attention
from pallas_kernels.gpu import Tiling
from pallas_kernels.merge_attention import merge_attention
from pallas_kernels.topk_scores import topk_scores

__all__ = ["BACKENDS", "lowering_for", "platform", "resolve", "chunk_attention", "flash_attention",
           "gathered_attention", "merge_attention", "topk_scores", "Tiling"]
