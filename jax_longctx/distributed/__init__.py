"""Attention across devices: ring attention, the exact cross-device merge, and Star Attention's
two phases as a model driver (`generate_distributed`, method "star" or "ring")."""

from jax_longctx.distributed.attention import merge_across, ring_attention
from jax_longctx.distributed.star import encode_context, generate_distributed

__all__ = ["encode_context", "generate_distributed", "merge_across", "ring_attention"]
