"""Pallas kernels for long-context attention, each with a GPU variant, a TPU variant and a jnp
reference, chosen by the run's route (`Route`, route.py): every public kernel takes it as a
required keyword, `route=`, so a call that forgets the run's choice is a TypeError.

One folder per op; a folder says what runs where:

- attention/: flash.py, flash_attention (online-softmax attention returning its log-sum-exp,
  prefill and decode; the Triton and TPU kernels, and on Hopper the Mosaic GPU prefill kernel,
  mgpu_flash.py); chunk.py, chunk_attention (a prefill chunk over the cache before it and
  itself: two cuDNN calls merged by LSE on NVIDIA GPUs, flash_attention elsewhere); gathered.py,
  gathered_attention (attention over keys at given indices per KV group, sparse decoding).
- topk/: topk.py, topk_scores (fused q.k + exact top-k over a long key axis, no score matrix in
  HBM; on Hopper, prefill chunks on the Mosaic GPU kernel, mgpu_topk.py, selecting by segments,
  topk_segments.py); topk_blocks.py, top_k_by_blocks (`lax.top_k` through block maxima:
  ReAttention's vote count, and decode's GPU pick in a small kernel); topk_tile.py (a tile's
  running top-k).
- decode/: split_merge.py (the merge of a decode call's key splits in one kernel),
  add_rmsnorm.py, add_rms_norm (residual add + RMSNorm), cache_write.py, write_one_token (a
  one-token K/V write in place).

Shared at the top, imported by the folders and importing none of them: backend (which variant
a route resolves to, `lowering_for`), route (Route), options (KernelOptions), quant (8-bit
storage), read (how a call reads an 8-bit cache), layout (shapes and layouts), gpu (Triton helpers, Tiling), mgpu_common (Mosaic GPU
helpers), tpu (TPU helpers), online_softmax (the per-tile softmax and tile reads of attention
and top-k), reference (the jnp references of every op, and `merge_attention`). attention/ also
imports decode/ (its decode calls merge key splits with split_merge); tests/test_import_layers.py
holds the rule.

Modules are named for their kernel and export a function named for what it returns, so no module
hides behind a function of its name (`from pallas_kernels.attention import flash` is the module,
`pallas_kernels.flash_attention` the function); the Mosaic GPU variants carry `mgpu_`.

`lowering_for("tpu")` traces the TPU kernels for real (not interpreted) on any machine, for
`jax.export` with `platforms=["tpu"]`: how CI checks their Mosaic lowering without a TPU.

docs/KERNELS.md says which lowering each variant uses, how it is tested and what was measured.
"""

from pallas_kernels.backend import BACKENDS, lowering_for, platform, resolve
from pallas_kernels.attention import chunk_attention, flash_attention, gathered_attention
from pallas_kernels.decode import add_rms_norm, write_one_token
from pallas_kernels.gpu import Tiling
from pallas_kernels.options import KernelOptions
from pallas_kernels.route import Route
from pallas_kernels.topk import top_k_by_blocks, topk_scores

__all__ = ["BACKENDS", "lowering_for", "platform", "resolve", "chunk_attention", "flash_attention",
           "gathered_attention", "topk_scores", "top_k_by_blocks", "add_rms_norm",
           "write_one_token", "KernelOptions", "Route", "Tiling"]
