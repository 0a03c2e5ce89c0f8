"""Attention across devices: ring attention, the exact cross-device merge, and Star Attention's
two phases as a model driver (`generate_distributed` = `encode_context` then `answer`, method
"star" or "ring")."""

from jax_longctx.run.distributed.attention import merge_across, ring_attention
from jax_longctx.run.distributed.reattention_mesh import (cache_unit, decode_sharded,
                                                      generate_sharded, prefill_sharded, sharded)
from jax_longctx.run.distributed.star import answer, encode_context, generate_distributed

__all__ = ["answer", "cache_unit", "decode_sharded", "encode_context", "generate_distributed",
           "generate_sharded", "merge_across", "prefill_sharded", "ring_attention", "sharded"]
