"""KV-cache pytrees: preallocated, static shapes, per-sequence int32 lengths.

`Cache` is what the model takes and returns: the number of tokens each sequence has consumed
(`lengths`, [batch] int32) and the attention method's own state, one pytree per layer (separate
buffers, so each layer's update happens in place and its reads need no slicing). `KVCache` is the
plain preallocated key/value store most methods build on.

How keys and values are stored is one concern of this layer: in a float dtype (the model's, by
default) or in 8 bits with a scale per (token, KV head) (`pallas_kernels.quant.Quantized`,
`RunOptions.kv_dtype`). `zeros` makes either; `stored` writes new rows as the buffer stores them
and `per_row` moves rows with their scales; `load` gives the values back in a compute dtype
where a jnp path needs them (the kernels read the 8-bit rows and scales themselves).
"""

from __future__ import annotations


import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, TOKENS, axes

from jax_longctx.core.config import LlamaConfig
from pallas_kernels.decode import cache_write
from pallas_kernels.quant import Quantized, dequantize, per_row, store_like, zeros_like_storage
from pallas_kernels.route import Route

__all__ = ["Cache", "KVCache", "Quantized", "load", "per_row", "stored", "stored_as",
           "float_dtype", "weighted_sum", "with_key_offset", "zeros"]


def zeros(shape, dtype):
  """An empty K or V buffer [..., d] stored as `dtype` (a float dtype or an 8-bit one)."""
  return zeros_like_storage(shape, dtype)


def stored(x, like):
  """New rows x [..., d] as the buffer `like` stores them (quantized, or cast)."""
  return store_like(x, like)


def stored_as(x, dtype):
  """Fresh rows x [..., d] stored as `dtype` (a float dtype or an 8-bit one)."""
  return store_like(x, zeros((0,) + x.shape[1:], dtype))


def weighted_sum(x, w):
  """sum_t w[b, h, t] x[b, h, t, :] -> [B, H, d] fp32 of a stored buffer [B, H, T, d], the
  product in the buffer's dtype (no fp32 copy of a cache). An 8-bit buffer's scales fold into
  the weights, rounded to bf16 (its values are exact there): a relative 2^-9 per term."""
  if isinstance(x, Quantized):
    w, x = w * x.scale[..., 0], x.values.astype(jnp.bfloat16)
  return jnp.einsum("bhtd,bht->bhd", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def float_dtype(x, fallback):
  """The dtype a jnp path computes in over a stored buffer: a float buffer's own, `fallback`
  for an 8-bit one (which `load` dequantizes into it)."""
  return fallback if isinstance(x, Quantized) else x.dtype


def load(x, dtype):
  """A stored buffer's values: 8-bit rows times their scales, in `dtype`; a float buffer as it
  is (its own dtype: what the jnp paths always read)."""
  return dequantize(x, dtype) if isinstance(x, Quantized) else x

def with_key_offset(k, offset, heads_axis: int = 1):
  """Pre-RoPE keys k [..., KV, ..., d] (their KV-head axis `heads_axis`) plus the constant
  offset [KV, d] they were stored less (`AttnContext.key_offset`, model/decoder.py), in k's
  dtype, before a method rotates them; offset None: k as it is."""
  if offset is None:
    return k
  shape = [1] * k.ndim
  shape[heads_axis], shape[-1] = offset.shape
  return k + offset.reshape(shape).astype(k.dtype)


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
    """dtype: how keys and values are stored (a float dtype, or "int8" / "float8_e4m3fn")."""
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return cls(zeros(shape, dtype), zeros(shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(self, positions: jnp.ndarray, k_new: jnp.ndarray, v_new: jnp.ndarray, *,
            route: Route) -> "KVCache":
    """Stores k/v_new [B, S, KV, d] at slots `positions` [B, S] (out of range: dropped).

    route: the run's kernel route; with a `cache_write_backend`, one-token writes go through
    pallas_kernels.decode.cache_write's in-place kernel on it, else the scatter below."""
    if positions.shape[1] == 1 and route.cache_write_backend is not None:
      return KVCache(*cache_write.write_one_token(self.k, self.v, positions[:, 0], k_new[:, 0],
                                                  v_new[:, 0], route=route))
    b_idx = jnp.arange(positions.shape[0])[:, None]

    def put(cache, new):
      return per_row(lambda c, n: c.at[b_idx, :, positions].set(n, mode="drop"), cache,
                     stored(new, cache))

    return KVCache(put(self.k, k_new), put(self.v, v_new))
