"""Attention kernels: softmax attention returning its log-sum-exp, on every platform.

- flash.py, flash_attention: online-softmax attention (prefill and decode): the Triton GPU kernel,
  the TPU (Mosaic) kernel and, on Hopper, the Mosaic GPU prefill kernel (mgpu_flash.py).
- chunk.py, chunk_attention: a prefill chunk over the cache before it and itself (two cuDNN calls
  merged by LSE on NVIDIA GPUs, flash_attention elsewhere).
- gathered.py, gathered_attention: attention over keys at given indices per KV group (sparse
  decoding), Triton GPU and TPU kernels.

The jnp references are pallas_kernels/reference.py (shared with topk/); the per-tile softmax is
pallas_kernels/online_softmax.py. Decode calls merge their key splits with decode/split_merge.py.
"""

from pallas_kernels.attention.chunk import chunk_attention
from pallas_kernels.attention.flash import flash_attention
from pallas_kernels.attention.gathered import gathered_attention

__all__ = ["chunk_attention", "flash_attention", "gathered_attention"]
