"""Attention across devices: ring attention and the exact cross-device merge of Star Attention."""

from jax_longctx.distributed.attention import merge_across, ring_attention

__all__ = ["merge_across", "ring_attention"]
