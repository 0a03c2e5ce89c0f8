"""Top-k scoring kernels: fused q.k and an exact top-k over a long key axis (no score matrix in
HBM).

- topk.py, topk_scores: the entry point; the Triton GPU kernel and the TPU kernel, and on
  Hopper the Mosaic GPU kernel for prefill chunks (mgpu_topk.py) with its selection by segments
  (topk_segments.py).
- topk_blocks.py, top_k_by_blocks: `lax.top_k` through block maxima (decode rows' GPU pick in a
  small kernel after XLA's block maxima; ReAttention's vote count).
- topk_tile.py: the running top-k of one score tile, shared by the kernels above.

The jnp reference is pallas_kernels/reference.py (shared with attention/).
"""

from pallas_kernels.topk.topk import topk_scores
from pallas_kernels.topk.topk_blocks import top_k_by_blocks

__all__ = ["topk_scores", "top_k_by_blocks"]
