"""The decoder (decoder.py): a Flax NNX Llama-family model whose KV cache is a pytree passed in
and out, and whose attention layers hand pre-RoPE q, k, v to a method; kv_offsets.py: the
calibrated K/V offsets a layer takes out of what its cache stores; placement.py: the fused serving
layout and the weights' placement over a device mesh (tensor parallel)."""

from jax_longctx.model.decoder import (Llama, abstract_model, device_view, forward,
                                       hidden_states, is_fused,
                                       new_cache, random_params, unembed)
from jax_longctx.model.placement import (fuse_placed, fuse_projections, param_specs, place,
                                         random_on_mesh, restore_shardings, serving_params,
                                         weight_spec)

__all__ = ["Llama", "abstract_model", "device_view", "forward", "fuse_placed", "fuse_projections",
           "hidden_states", "is_fused", "new_cache", "param_specs", "place", "random_on_mesh",
           "random_params", "restore_shardings", "serving_params", "unembed", "weight_spec"]
