"""Pallas kernels for long-context attention, each with a GPU variant, a TPU variant and a jnp
reference behind one `backend=` switch ("auto" | "reference" | "gpu" | "tpu").

Modules are named for their kernel and export a function named for what it returns, so no module
hides behind a function of its name (`from pallas_kernels import flash` is the module,
`pallas_kernels.flash_attention` the function); the Mosaic GPU variants carry `mgpu_`:

- topk.py, topk_scores: fused q.k + exact top-k over a long key axis (no score matrix in HBM; on
  Hopper, prefill chunks can run a Mosaic GPU kernel, mgpu_topk.mgpu_topk_scores, when asked:
  KernelOptions / Tiling).
- flash.py, flash_attention: online-softmax attention returning its log-sum-exp (prefill and
  decode; on Hopper, prefill runs a Mosaic GPU kernel, mgpu_flash.mgpu_flash_attention).
- chunk.py, chunk_attention: a prefill chunk over the cache before it and itself (two cuDNN calls
  merged by LSE on NVIDIA GPUs, flash_attention elsewhere).
- gathered.py, gathered_attention: attention over keys at given indices per KV group (sparse
  decoding).
- topk_blocks.py, top_k_by_blocks: `lax.top_k` through block maxima (jnp; ReAttention's vote
  count uses it; decode's top-k takes its GPU pick after the maxima in a small kernel).

`lowering_for("tpu")` traces the TPU kernels for real (not interpreted) on any machine, for
`jax.export` with `platforms=["tpu"]`: how CI checks their Mosaic lowering without a TPU.

docs/KERNELS.md says which lowering each variant uses, how it is tested and what was measured.
"""

from pallas_kernels.backend import BACKENDS, lowering_for, platform, resolve
from pallas_kernels.attention import chunk_attention, flash_attention, gathered_attention
from pallas_kernels.decode import add_rms_norm, write_one_token
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from pallas_kernels.topk import top_k_by_blocks, topk_scores

__all__ = ["BACKENDS", "lowering_for", "platform", "resolve", "chunk_attention", "flash_attention",
           "gathered_attention", "topk_scores", "top_k_by_blocks", "KernelOptions", "Tiling"]
