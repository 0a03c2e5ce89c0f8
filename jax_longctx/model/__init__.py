"""The decoder (decoder.py): a Flax NNX Llama-family model whose KV cache is a pytree passed in
and out, and whose attention layers hand pre-RoPE q, k, v to a method."""

from jax_longctx.model.decoder import (Llama, abstract_model, forward, fuse_projections,
                                       hidden_states, is_fused, new_cache, random_params,
                                       serving_params, unembed)

__all__ = ["Llama", "abstract_model", "forward", "fuse_projections", "hidden_states", "is_fused",
           "new_cache", "random_params", "serving_params", "unembed"]
