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

In 4 bits (`RunOptions.kv_dtype="int4"` or another of quant4.FORMATS, KIVI's layout) values are
stored per token over groups of channels and keys per channel over groups of tokens, each
sequence's newest key group whole until it fills. A key group shares one range, so a 4-bit cache
only appends: `KVCache` alone makes one, for the methods with no `int4_refusal`; new rows of
keys go in through `KVCache.write` (`write_shard` for a device's shard of a cache split along the
tokens; never `stored` / `per_row`'s writes), and a read of some key
rows (`per_row` over one buffer) gives them dequantized. Every kernel takes such a buffer; the
ones that do not read 4-bit tiles yet get a copy in the queries' dtype first
(pallas_kernels/read.py).

An 8-bit buffer of keys cached before RoPE (`zeros(..., offset_heads_axis=)`, made so by a
method that `keys_before_rope`) also holds the layer's key offset (`Quantized.offset`), which
the model fills in every step (`set_key_offset`): `stored` takes it out of new rows and `load`
(and every kernel) adds it back, so a method reads its keys whole and forwards nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jax_longctx.core.axes import HEADS, ROWS, TOKENS, axes

from jax_longctx.core.config import LlamaConfig
from pallas_kernels import quant, quant4
from pallas_kernels.decode import cache_write, int4_write
from pallas_kernels.quant import (Quantized, dequantize, offset_rows, split_offset, store_like,
                                  zeros_like_storage)
from pallas_kernels.route import Route

__all__ = ["Cache", "INT4", "is_int4_dtype", "KVCache", "Quantized", "holds_8_bit", "load",
           "per_row", "stored",
           "stored_as", "float_dtype", "weighted_sum", "set_key_offset", "split_offset", "zeros"]

INT4 = "int4"  # the 4-bit cache's default kv_dtype (quant4.FORMATS names the others)


def is_int4_dtype(dtype) -> bool:
  """Whether a cache dtype is one of the 4-bit cache's formats (a numpy dtype compares equal to
  the string "int4", numpy's name for int32: only the string names it)."""
  return isinstance(dtype, str) and dtype in quant4.FORMATS


def zeros(shape, dtype, *, offset_heads_axis: int | None = None):
  """An empty K or V buffer [..., d] stored as `dtype` (a float dtype or an 8-bit one).
  offset_heads_axis: for keys cached before RoPE, the buffer's KV-head axis (module doc)."""
  if is_int4_dtype(dtype):
    raise ValueError("a 4-bit K/V buffer is made by KVCache.zeros (its keys are grouped along "
                     "tokens), for a method that stores_int4")
  return zeros_like_storage(shape, dtype, offset_heads_axis)


def stored(x, like, heads_axis: int | None = None):
  """New rows x [..., d] as the buffer `like` stores them (quantized, or cast); heads_axis: x's
  KV-head axis, needed where `like` holds a key offset."""
  if isinstance(like, quant4.GroupedKeys):
    raise TypeError("stored: 4-bit keys are written by KVCache.write (groups along tokens)")
  if isinstance(like, quant4.Int4):
    return quant4.quantize(x, like.group, scale_dtype=like.scale.dtype)
  return store_like(x, like, heads_axis)


def per_row(fn, *xs):
  """fn (an indexing op over the leading axes that keeps rows whole: a gather, a scatter, a
  slice) applied to stored buffers alike: arrays, 8-bit rows with their scales, 4-bit values
  with theirs. 4-bit keys (grouped along tokens) are only read here, one buffer: the rows fn
  takes come back dequantized in the model's dtype."""
  if isinstance(xs[0], quant4.GroupedKeys):
    if len(xs) > 1:
      raise TypeError("per_row: 4-bit keys are written by KVCache.write (groups along tokens)")
    return quant4.rows_of_grouped_keys(fn, xs[0])
  if isinstance(xs[0], quant4.Int4):
    return quant4.per_row(fn, *xs)
  return quant.per_row(fn, *xs)


def stored_as(x, dtype):
  """Fresh rows x [..., d] stored as `dtype` (a float dtype or an 8-bit one)."""
  return store_like(x, zeros((0,) + x.shape[1:], dtype))


def weighted_sum(x, w):
  """sum_t w[b, h, t] x[b, h, t, :] -> [B, H, d] fp32 of a stored buffer [B, H, T, d], the
  product in the buffer's dtype (no fp32 copy of a cache). An 8-bit buffer's scales fold into
  the weights, rounded to bf16 (its values are exact there): a relative 2^-9 per term; its key
  offset, if any, comes back as the offset times the weights' sum. A 4-bit buffer is read
  dequantized in fp32 (one layer's copy: RESA's prior, once a prompt)."""
  if quant4.is_int4(x):
    x = quant4.load(x, jnp.float32)
  if not isinstance(x, Quantized):
    return jnp.einsum("bhtd,bht->bhd", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  total = jnp.einsum("bhtd,bht->bhd", x.values.astype(jnp.bfloat16),
                     (w * x.scale[..., 0]).astype(jnp.bfloat16),
                     preferred_element_type=jnp.float32)
  offset = offset_rows(x)
  if offset is None:
    return total
  return total + jnp.sum(w, axis=-1, dtype=jnp.float32)[..., None] * offset


def float_dtype(x, fallback):
  """The dtype a jnp path computes in over a stored buffer: a float buffer's own, `fallback`
  for an 8- or 4-bit one (which `load` dequantizes into it)."""
  return fallback if isinstance(x, Quantized) or quant4.is_int4(x) else x.dtype


def load(x, dtype):
  """A stored buffer's values: 8-bit rows times their scales (plus its key offset), 4-bit
  codes times theirs plus their zero points, in `dtype`; a float buffer as it is (its own
  dtype: what the jnp paths always read)."""
  if quant4.is_int4(x):
    return quant4.load(x, dtype)
  return dequantize(x, dtype) if isinstance(x, Quantized) else x


def _is_quantized(x) -> bool:
  return isinstance(x, Quantized)


def holds_8_bit(state) -> bool:
  """Whether a method's state stores any K/V buffer in 8 bits."""
  return any(map(_is_quantized, jax.tree.leaves(state, is_leaf=_is_quantized)))


def set_key_offset(state, offset):
  """(state with `offset` [KV, d] as the key offset of every buffer that holds one, whether any
  does): the model's step, before the method's (model/kv_offsets.py)."""
  found = []

  def fill(x):
    if not _is_quantized(x) or x.offset is None:
      return x
    found.append(True)
    if offset_rows(x).shape != offset.shape:
      raise ValueError(f"key offset {offset.shape} for a buffer holding {offset_rows(x).shape}")
    return dataclasses.replace(x, offset=offset.astype(jnp.float32).reshape(x.offset.shape))

  return jax.tree.map(fill, state, is_leaf=_is_quantized), bool(found)


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
  def zeros(cls, cfg: LlamaConfig, batch: int, max_len: int, dtype,
            keys_before_rope: bool = False) -> "KVCache":
    """dtype: how keys and values are stored (a float dtype, "int8" / "float8_e4m3fn", or
    a 4-bit format, quant4.FORMATS: slots then rounded up to whole key groups); keys_before_rope: the keys are cached
    before RoPE (an 8-bit buffer then holds their offset: module doc; 4-bit keys need none,
    their groups' zero points take a common part out)."""
    if is_int4_dtype(dtype):
      fmt = quant4.format_of(dtype)
      g = fmt.group
      shape = (batch, cfg.num_kv_heads, -(-max_len // g) * g, cfg.head_dim)
      # values over groups of g channels (KIVI's), or of a head's all where it has fewer
      return cls(quant4.zeros_grouped_keys(shape, cfg.jnp_dtype, g, fmt.scale_dtype),
                 quant4.zeros_values(shape, min(g, cfg.head_dim), fmt.scale_dtype))
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return cls(zeros(shape, dtype, offset_heads_axis=1 if keys_before_rope else None),
               zeros(shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(self, positions: jnp.ndarray, k_new: jnp.ndarray, v_new: jnp.ndarray, *,
            route: Route, valid: jnp.ndarray | None = None) -> "KVCache":
    """Stores k/v_new [B, S, KV, d] at slots `positions` [B, S] (out of range: dropped).

    route: the run's kernel route; with a `cache_write_backend`, one-token writes go through
    pallas_kernels.decode.cache_write's in-place kernel on it (int4_write's for a 4-bit
    cache, where its shapes allow), else the scatter below.
    valid [B, S]: which new tokens are real; the others (a shorter prompt's padding) are not
    written. Required for 4-bit keys, which only append: a padding token written past a
    sequence's end would close a key group that its next real token must join."""
    if valid is not None:
      positions = jnp.where(valid, positions, self.max_len)  # past the end: dropped
    if isinstance(self.k, quant4.GroupedKeys):
      if valid is None:
        raise TypeError("KVCache.write: 4-bit keys need valid= (padding must not be written)")
      if positions.shape[1] == 1 and int4_write.applies(self.k, self.v, route):
        return KVCache(*int4_write.write_one_token(self.k, self.v, positions[:, 0], k_new[:, 0],
                                                   v_new[:, 0], route=route))
      return KVCache(quant4.write_grouped_keys(self.k, positions, k_new),
                     self._put(self.v, positions, v_new))
    if positions.shape[1] == 1 and route.cache_write_backend is not None:
      return KVCache(*cache_write.write_one_token(self.k, self.v, positions[:, 0], k_new[:, 0],
                                                  v_new[:, 0], route=route))
    return KVCache(self._put(self.k, positions, k_new), self._put(self.v, positions, v_new))

  def write_shard(self, positions, slots, k_new, v_new, *, capacity: int, group_here, route: Route,
                  valid: jnp.ndarray | None) -> "KVCache":
    """`write` for one device's shard of a cache split along the tokens: positions [B, S] in the
    whole cache of `capacity` slots, slots [B, S] this shard's (its size where another device
    holds the token: dropped). A 4-bit cache keeps the whole cache's newest key group on every
    device, identical (each sees every new token), and quantizes a group into the shard holding
    it when it fills: group_here(groups [B, n]) -> this shard's group (past its end: another
    shard's; quant4.write_grouped_keys's main_group). Its reads take `shard_view`."""
    if not isinstance(self.k, quant4.GroupedKeys):
      return self.write(slots, k_new, v_new, route=route, valid=valid)
    if valid is None:
      raise TypeError("KVCache.write_shard: 4-bit keys need valid= (padding must not be written)")
    keys = quant4.write_grouped_keys(self.k, jnp.where(valid, positions, capacity), k_new,
                                     capacity=capacity, main_group=group_here)
    return KVCache(keys, self._put(self.v, jnp.where(valid, slots, self.max_len), v_new))

  def shard_view(self, residual_slot) -> "KVCache":
    """This shard as a cache of its own for the kernels: 4-bit keys' residual group placed at
    its slot here (residual_slot [B], the shard's size where another shard holds it: then
    every group here is read from main), other caches as they are."""
    if not isinstance(self.k, quant4.GroupedKeys):
      return self
    here = (residual_slot // self.k.main.group).astype(jnp.int32)
    return KVCache(dataclasses.replace(self.k, residual_group=here), self.v)

  @staticmethod
  def _put(cache, positions, new):
    b_idx = jnp.arange(positions.shape[0])[:, None]
    return per_row(lambda c, n: c.at[b_idx, :, positions].set(n, mode="drop"), cache,
                   stored(new, cache, heads_axis=2))
