"""KV-cache pytrees: preallocated, static shapes, per-sequence int32 lengths.

`Cache` is what the model takes and returns: the number of tokens each sequence has consumed
(`lengths`, [batch] int32) and the attention method's own state, one pytree per layer (separate
buffers, so each layer's update happens in place and its reads need no slicing). `KVCache` is the
plain preallocated key/value store most methods build on.
"""

from __future__ import annotations


import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, TOKENS, axes

from jax_longctx.core.config import LlamaConfig
from pallas_kernels import cache_write

@struct.dataclass
class Cache:
  lengths: jnp.ndarray = axes(ROWS)  # [B] int32, tokens consumed per sequence (next to write)
  state: tuple  # the method's state, one pytree per layer
  max_len: int = struct.field(pytree_node=False, default=0)


@struct.dataclass
class KVCache:
  """One layer's keys and values: [batch, kv_heads, max_len, head_dim].

  Slot j of a sequence holds its token at position j; slots at or past the sequence's length hold
  stale data that the causal rule (slot position <= query position) never lets a query see.
  """

  k: jnp.ndarray = axes(ROWS, HEADS, TOKENS, None)
  v: jnp.ndarray = axes(ROWS, HEADS, TOKENS, None)

  @classmethod
  def zeros(cls, cfg: LlamaConfig, batch: int, max_len: int, dtype) -> "KVCache":
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(self, positions: jnp.ndarray, k_new: jnp.ndarray, v_new: jnp.ndarray,
            one_token_backend: str | None = None) -> "KVCache":
    """Stores k/v_new [B, S, KV, d] at slots `positions` [B, S] (out of range: dropped).

    one_token_backend: one-token writes through pallas_kernels.cache_write's in-place kernel on
    that backend (`RunOptions.cache_write_backend`); None: the scatter below."""
    if positions.shape[1] == 1 and one_token_backend is not None:
      return KVCache(*cache_write.write_one_token(self.k, self.v, positions[:, 0], k_new[:, 0],
                                                  v_new[:, 0], backend=one_token_backend))
    b_idx = jnp.arange(positions.shape[0])[:, None]
    k = self.k.at[b_idx, :, positions].set(k_new.astype(self.k.dtype), mode="drop")
    v = self.v.at[b_idx, :, positions].set(v_new.astype(self.v.dtype), mode="drop")
    return KVCache(k, v)
