"""The calibrated K/V offsets an attention layer takes out of what its cache stores
(cfg.kv_offsets; run/key_smoothing.py calibrates them: the keys' and values' means), so an 8-bit
cache rounds what is left of each value, not a large common part of it (E4M3 rounds relative to
each value).

Exact for every method: the value offset comes back on the layer's output (decoder.py
`Attention`: the output is a convex sum of values). Keys, only where the state stores 8 bits (a
float cache keeps them whole):
- buffers of keys cached before RoPE hold the pre-RoPE keys' mean c0 as their offset, set here:
  they store each key less c0 and read it back whole (ops/cache.py), whoever reads them (a
  wrapping method too), so k goes to the method whole;
- any other method rotates each key at its own position p and reads keys nowhere before
  (`Method.keys_before_rope` False), so it is given RoPE_p(k) - c for a post-RoPE constant c
  (taken out here as R(-p) c): every score of a query drops by the same q.c, which softmax, top-k
  and LSE merges do not see.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_longctx.core.rope import rotate
from jax_longctx.methods.base import AttnContext, Method
from jax_longctx.ops.cache import holds_8_bit, set_key_offset


def less_offsets(k, v, ctx: AttnContext, state, method: Method, *, k_offset,
                 k_offset_before_rope, v_offset):
  """(k, v, state): a layer's pre-RoPE k and v [B, S, KV, hd] less its offsets ([KV, hd] each:
  `k_offset` after RoPE, `k_offset_before_rope` for caches of pre-RoPE keys), and its state with
  the pre-RoPE key offset set in the buffers that hold one."""
  v = (v.astype(jnp.float32) - v_offset.astype(jnp.float32)).astype(v.dtype)
  if not holds_8_bit(state):
    return k, v, state
  state, before_rope = set_key_offset(state, k_offset_before_rope)
  if before_rope:
    return k, v, state
  if method.keys_before_rope:
    raise ValueError(f"{method.name} caches keys before RoPE but its 8-bit key buffers hold no "
                     "offset: make them with ops.cache.zeros(..., offset_heads_axis=)")
  c = jnp.broadcast_to(k_offset.astype(jnp.float32), k.shape)
  c = rotate(c, -ctx.q_pos[:, :, None], ctx.freqs)
  return (k.astype(jnp.float32) - c).astype(k.dtype), v, state
