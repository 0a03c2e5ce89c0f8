"""Flax NNX Llama whose KV cache is data passed in and out, never module state.

    logits, cache = forward(params, tokens, positions, cache, method, cfg)

Each layer owns separate weight and cache buffers and the layer loop is unrolled at trace time.
A step still compiles once per shape, with compile time growing with depth. Measured on an H200
(8B shape, batch 1, 32K context): stacking layers on a leading axis under `lax.scan` made XLA copy
each layer's weights and cache slice out of the stacked buffers every step (3x the HBM traffic;
15.3 ms/token against a 4.5 ms bound); separate buffers let every matmul read them in place.

Serving params may be fused (placement.py, `fuse_projections`): q/k/v as one weight and gate/up
as one, so a decode step runs one matrix-vector product where it ran three (two), and the output
projection stored [D, H, hd] (`o_proj_t`) so its reduction runs along contiguous rows. `forward`
tells the two layouts apart by the params' structure. Under tensor parallelism
(`RunOptions.mesh` with a `model` axis) `forward` is one device's step: this device's heads,
hidden units and vocabulary slice, with an all-reduce after the attention output and the MLP
(Megatron).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_longctx.core.axes import EMBED, HEADS, HIDDEN, KV_HEADS, VOCAB
from jax_longctx.ops.cache import Cache
from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.mesh import ModelShards, axis_size
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.methods.base import (AttnContext, Heads, Method, TokenShards,
                                      check_cache_dtype)
from jax_longctx.core.rope import inv_freq, query_scale
from jax_longctx.model.kv_offsets import less_offsets
from pallas_kernels.decode import add_rmsnorm
from pallas_kernels.route import Route

_INIT_STD = 0.02

# Each weight's logical axes (core/axes.py), declared here where the weights are built, by their
# name in the parameter tree; core/mesh.py RULES maps them to the mesh (tensor parallel: heads,
# KV heads, hidden units and the vocabulary over `model`; model/placement.py). A fused weight
# (placement.fuse_projections) splits as its parts do. EMBED names the model dimension
# (hidden_size) of the attention projections and the norms: inference leaves it whole, training
# splits it over fsdp. The MLP and the embeddings split over fsdp along their hidden units and
# vocabulary instead (RULES says why), so their model dimension stays unnamed: one array cannot
# split two dimensions over one mesh axis. A norm's `scale` is its one dimension: the model
# dimension, or a q/k norm's head dimension.
WEIGHT_AXES = {
    "embed": (VOCAB, None), "lm_head": (None, VOCAB),
    "q_proj": (EMBED, HEADS, None), "k_proj": (EMBED, KV_HEADS, None),
    "v_proj": (EMBED, KV_HEADS, None), "qkv_proj": (EMBED, HEADS, None),
    "o_proj": (HEADS, None, EMBED), "o_proj_t": (EMBED, HEADS, None),
    "q_bias": (HEADS, None), "k_bias": (KV_HEADS, None), "v_bias": (KV_HEADS, None),
    "k_smooth": (KV_HEADS, None), "k_offset": (KV_HEADS, None), "v_offset": (KV_HEADS, None),
    "k_offset_before_rope": (KV_HEADS, None),
    "gate_proj": (None, HIDDEN), "up_proj": (None, HIDDEN), "gate_up_proj": (None, HIDDEN),
    "down_proj": (HIDDEN, None), "scale": (EMBED,),
}


def _param(rngs: nnx.Rngs, name: str, shape, dtype):
  assert len(WEIGHT_AXES[name]) == len(shape), (name, shape)
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * _INIT_STD)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.scale[...] * xf.astype(x.dtype)

  def add_and_norm(self, x, h, *, route: Route):
    """(x + h, the norm of it); h None: nothing to add. With an add+norm backend in the run's
    route (`Route.add_norm_backend`), a one-token step's add and norm are one kernel."""
    if h is None:
      return x, self(x)
    b, s, d = x.shape
    if route.add_norm_backend is None or s != 1:
      x = x + h
      return x, self(x)
    total, y = add_rmsnorm.add_rms_norm(x.reshape(b, d), h.reshape(b, d), self.scale[...],
                                        eps=self.eps, route=route)
    return total.reshape(x.shape), y.reshape(x.shape)


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, fused: bool = False):
    d, h, kv, hd, dt = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype
    if fused:  # heads [q..., k..., v...]; in memory the same bytes as [D, (H + 2 KV) * hd]
      self.qkv_proj = _param(rngs, "qkv_proj", (d, h + 2 * kv, hd), dt)
    else:
      self.q_proj = _param(rngs, "q_proj", (d, h, hd), dt)
      self.k_proj = _param(rngs, "k_proj", (d, kv, hd), dt)
      self.v_proj = _param(rngs, "v_proj", (d, kv, hd), dt)
    if fused:  # the output projection transposed: placement.fuse_projections says why
      self.o_proj_t = _param(rngs, "o_proj_t", (d, h, hd), dt)
    else:
      self.o_proj = _param(rngs, "o_proj", (h, hd, d), dt)
    if cfg.attention_bias:  # Qwen2
      self.q_bias = _param(rngs, "q_bias", (h, hd), dt)
      self.k_bias = _param(rngs, "k_bias", (kv, hd), dt)
      self.v_bias = _param(rngs, "v_bias", (kv, hd), dt)
    if cfg.qk_norm:  # Qwen3
      self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dt)
      self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dt)
    if cfg.key_smoothing:  # powers of two, one per (KV head, channel): run.key_smoothing
      self.k_smooth = nnx.Param(jnp.ones((kv, hd), dt))
    if cfg.kv_offsets:  # what the cache stores less, one per (KV head, channel): run.key_smoothing
      self.k_offset = nnx.Param(jnp.zeros((kv, hd), dt))  # after RoPE (keys rotated in place)
      self.k_offset_before_rope = nnx.Param(jnp.zeros((kv, hd), dt))  # caches of pre-RoPE keys
      self.v_offset = nnx.Param(jnp.zeros((kv, hd), dt))
    self.q_scale = query_scale(cfg)
    self.num_heads, self.num_kv_heads = h, kv
    # The layout, said once (the weights above follow it): fused projections, Qwen2's biases,
    # Qwen3's q/k norms, key smoothing, the calibrated K/V offsets.
    self.fused, self.biased, self.qk_normed = fused, bool(cfg.attention_bias), bool(cfg.qk_norm)
    self.smoothed, self.offsets = bool(cfg.key_smoothing), bool(cfg.kv_offsets)

  def _qkv(self, x):
    if self.fused:
      h, kv = self.num_heads, self.num_kv_heads
      qkv = jnp.einsum("bsd,dhk->bshk", x, self.qkv_proj[...])
      return qkv[:, :, :h], qkv[:, :, h:h + kv], qkv[:, :, h + kv:]
    q = jnp.einsum("bsd,dhk->bshk", x, self.q_proj[...])  # [B, S, H, hd]
    k = jnp.einsum("bsd,dhk->bshk", x, self.k_proj[...])  # [B, S, KV, hd]
    v = jnp.einsum("bsd,dhk->bshk", x, self.v_proj[...])
    return q, k, v

  def __call__(self, x, state, ctx: AttnContext, method: Method, decode: bool):
    q, k, v = self._qkv(x)
    if self.biased:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    if self.qk_normed:
      q, k = self.q_norm(q), self.k_norm(k)
    if self.smoothed:
      # Keys divided and queries multiplied by the same power of two per channel: every q.k is
      # unchanged bit for bit (and RoPE commutes: a RoPE pair shares its factor), while an
      # 8-bit cache's per-token scale is no longer set by a few large key channels.
      s = jnp.repeat(self.k_smooth[...], self.num_heads // self.num_kv_heads, axis=0)  # [H, hd]
      q, k = q * s.astype(q.dtype), k / self.k_smooth[...].astype(k.dtype)
      ctx = ctx.replace(query_smoothing=s)
    if self.q_scale != 1.0:
      # Methods get keys and queries before RoPE; a constant on q scales every score as
      # YaRN's factor on both rotated q and k does, and leaves the cached keys untouched.
      q = q * jnp.asarray(self.q_scale, q.dtype)
    if self.offsets:
      k, v, state = less_offsets(k, v, ctx, state, method, k_offset=self.k_offset[...],
                                 k_offset_before_rope=self.k_offset_before_rope[...],
                                 v_offset=self.v_offset[...])
    step = method.decode if decode else method.prefill
    out, state = step(state, q, k, v, ctx)  # [B, S, H, hd]
    if self.offsets:  # each value's offset back: out is a convex sum of values
      out = out + self._per_query_head(self.v_offset[...]).astype(out.dtype)
    return _all_reduce(self._out(out.astype(x.dtype)), ctx.heads.axis), state

  def _per_query_head(self, x):  # [KV, hd] -> [H, hd]
    return jnp.repeat(x, self.num_heads // self.num_kv_heads, axis=0)

  def _out(self, out):  # [B, S, H, hd] -> [B, S, D]
    if self.fused:
      return jnp.einsum("bshk,dhk->bsd", out, self.o_proj_t[...])
    return jnp.einsum("bshk,hkd->bsd", out, self.o_proj[...])


class MLP(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, fused: bool = False):
    d, f, dt = cfg.hidden_size, cfg.intermediate_size, cfg.jnp_dtype
    if fused:  # [gate | up] along the output axis
      self.gate_up_proj = _param(rngs, "gate_up_proj", (d, 2 * f), dt)
    else:
      self.gate_proj = _param(rngs, "gate_proj", (d, f), dt)
      self.up_proj = _param(rngs, "up_proj", (d, f), dt)
    self.down_proj = _param(rngs, "down_proj", (f, d), dt)
    self.intermediate_size, self.fused = f, fused

  def __call__(self, x, axis: str | None = None):
    """axis: the tensor-parallel mesh axis this device's hidden units are a part of."""
    if self.fused:
      f = self.intermediate_size
      gate_up = jnp.einsum("bsd,df->bsf", x, self.gate_up_proj[...])
      gate, up = gate_up[..., :f], gate_up[..., f:]
    else:
      gate = jnp.einsum("bsd,df->bsf", x, self.gate_proj[...])
      up = jnp.einsum("bsd,df->bsf", x, self.up_proj[...])
    return _all_reduce(jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, self.down_proj[...]),
                       axis)


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, fused: bool = False):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    self.attn = Attention(cfg, rngs, fused)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    self.mlp = MLP(cfg, rngs, fused)

  def __call__(self, x, pending, state, ctx, method, decode):
    """x: the residual stream without `pending`, the previous layer's MLP output (None in the
    first layer), which is added here together with this layer's first norm (so that the two
    can be one kernel). Returns (x, this layer's MLP output, not yet added, state)."""
    route = ctx.options.route
    x, normed = self.attn_norm.add_and_norm(x, pending, route=route)
    h, state = self.attn(normed, state, ctx, method, decode)
    x, normed = self.mlp_norm.add_and_norm(x, h, route=route)
    return x, self.mlp(normed, ctx.heads.axis), state


class Llama(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, fused: bool = False):
    """fused: the serving layout of `fuse_projections` (one q/k/v and one gate/up weight)."""
    self.cfg = cfg
    self.embed = _param(rngs, "embed", (cfg.vocab_size, cfg.hidden_size), cfg.jnp_dtype)
    self.layers = nnx.List([DecoderLayer(cfg, rngs, fused) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, "lm_head", (cfg.hidden_size, cfg.vocab_size), cfg.jnp_dtype)

  def unembed(self, h, axis: str | None = None, vocab: int | None = None):
    """h [..., D] (already normed) -> fp32 logits [..., V]. Under tensor parallelism (`axis`)
    this device holds a slice of the vocabulary: the slices are gathered (every device gets the
    whole row, so sampling needs no further collective) and the padding past `vocab` cut."""
    if self.cfg.tie_word_embeddings:
      logits = jnp.einsum("...d,vd->...v", h, self.embed[...], preferred_element_type=jnp.float32)
    else:
      logits = jnp.einsum("...d,dv->...v", h, self.lm_head[...],
                          preferred_element_type=jnp.float32)
    if axis is not None:
      logits = jax.lax.all_gather(logits, axis, axis=logits.ndim - 1, tiled=True)
    return logits if vocab is None else logits[..., :vocab]

  def embed_tokens(self, tokens, axis: str | None = None):
    """Token ids [B, S] -> embeddings [B, S, D]; under tensor parallelism each device looks up
    the ids in its vocabulary slice and the slices' rows are summed (one holds each id)."""
    table = self.embed[...]
    if axis is None:
      return jnp.take(table, tokens, axis=0)
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
    return jax.lax.psum(jnp.where(mine[..., None], x, jnp.zeros((), x.dtype)), axis)

  def __call__(self, tokens, positions, cache: Cache, method: Method, valid=None,
               decode: bool = False, gate_open: bool = True, options: RunOptions = DEFAULT,
               heads: Heads = Heads(), token_shards: TokenShards = TokenShards()):
    """tokens, positions [B, S] -> (normed hidden states [B, S, D], new cache). heads,
    token_shards: the part of every layer's heads, and of a cache split along the tokens, this
    device holds (`forward` derives them: `device_view`)."""
    cfg = self.cfg
    if valid is None:
      valid = jnp.ones(tokens.shape, bool)
    x = self.embed_tokens(tokens, heads.axis)
    ctx = AttnContext(layer=-1, q_pos=positions.astype(jnp.int32), valid=valid,
                      freqs=inv_freq(cfg, jnp.max(positions) + 1), cfg=cfg,
                      gate_open=gate_open, options=options, heads=heads, tokens=token_shards)
    state, pending = list(cache.state), None
    for i, layer in enumerate(self.layers):
      run = functools.partial(layer, ctx=ctx.replace(layer=i), method=method, decode=decode)
      if options.remat is not None:  # a backward pass recomputes the layer from its inputs
        run = jax.checkpoint(run, policy=options.remat_policy())
      x, pending, state[i] = run(x, pending, state[i])
    lengths = cache.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32)
    normed = self.final_norm.add_and_norm(x, pending, route=options.route)[1]
    return normed, cache.replace(lengths=lengths, state=tuple(state))


def abstract_model(cfg: LlamaConfig, fused: bool = False):
  """(graphdef, params shape tree) without allocating weights (fused: `fuse_projections`' tree)."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0), fused)))
  return graphdef, nnx.to_pure_dict(state)


def is_fused(params) -> bool:
  """Whether params are in `fuse_projections`' serving layout (checked on the first layer)."""
  return "qkv_proj" in next(iter(params["layers"].values()))["attn"]


@functools.lru_cache(maxsize=None)
def _draw(shape: tuple, dtype, sharding, ones: bool):
  """A jitted draw of one leaf (normal * std, or ones), straight into `sharding`'s shards."""
  def draw(key):
    if ones:
      return jnp.ones(shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * _INIT_STD).astype(dtype)
  return jax.jit(draw) if sharding is None else jax.jit(draw, out_shardings=sharding)


def random_params(cfg: LlamaConfig, seed: int = 0, shardings=None):
  """Random weights (std 0.02, norm scales and key smoothing 1) for tests and benchmarks, on the
  default device or, leaf by leaf, straight into `shardings` (a tree of them: no device holds a
  whole leaf its sharding splits; the values do not depend on it).

  Leaf by leaf, so compile time stays small at any depth (one compile per distinct shape).
  """
  _, shapes = abstract_model(cfg)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  where = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  ones = ("'scale']", "'k_smooth']")  # norm scales and key smoothing start at 1
  out = [_draw(tuple(s.shape), jnp.dtype(s.dtype), w, str(path[-1]).endswith(ones))(k)
         for (path, s), k, w in zip(leaves, keys, where)]
  return jax.tree_util.tree_unflatten(treedef, out)


@functools.lru_cache(maxsize=None)
def graphdef_for(cfg: LlamaConfig, fused: bool = False):
  return abstract_model(cfg, fused)[0]


def forward(params, tokens, positions, cache: Cache, method: Method, cfg: LlamaConfig, *,
            valid=None, decode: bool = False, logits_index=None, gate_open: bool = True,
            options: RunOptions = DEFAULT):
  """Pure forward. Returns (logits fp32, cache).

  gate_open=False: a decode step the method's `decode_gate` closed (see
  `generation.decode_while`). options: how the step is built (`RunOptions`); with a mesh this is
  one device's step under `jax.shard_map` (run/sharding.py): params, cache and rows are this
  device's parts, and the logits the whole (gathered) vocabulary.
  logits_index: None -> logits for every token [B, S, V]; an int32 array [B] -> only at that index
  of each row [B, V] (what generation needs, without a [B, S, V] buffer).
  """
  h, cache = hidden_states(params, tokens, positions, cache, method, cfg, valid=valid,
                           decode=decode, gate_open=gate_open, options=options)
  if logits_index is not None:
    h = jnp.take_along_axis(h, logits_index[:, None, None], axis=1)[:, 0]
  return unembed(params, h, cfg, options), cache


def hidden_states(params, tokens, positions, cache: Cache, method: Method, cfg: LlamaConfig, *,
                  valid=None, decode: bool = False, gate_open: bool = True,
                  options: RunOptions = DEFAULT):
  """`forward` without the unembedding: (final normed hidden states [B, S, D], cache). For a
  loss that unembeds a few positions at a time (train_cpt's chunked cross-entropy)."""
  model, heads, shards = _on_this_device(params, cfg, options)
  return model(tokens, positions, cache, method, valid=valid, decode=decode,
               gate_open=gate_open, options=options, heads=heads, token_shards=shards)


def unembed(params, h, cfg: LlamaConfig, options: RunOptions = DEFAULT):
  """`Llama.unembed` of params: normed h [..., D] -> fp32 logits [..., V] (the whole vocabulary
  also under tensor parallelism)."""
  model, heads, _ = _on_this_device(params, cfg, options)
  return model.unembed(h, heads.axis, cfg.vocab_size)


def _on_this_device(params, cfg: LlamaConfig, options: RunOptions):
  """(the model as this device holds it, with its params; the heads and tokens it holds)."""
  local, heads, tokens = device_view(cfg, options)
  return nnx.merge(graphdef_for(local, is_fused(params)), params), heads, tokens


def device_view(cfg: LlamaConfig, options: RunOptions) -> tuple[LlamaConfig, Heads, TokenShards]:
  """What one device holds inside a step on `options.mesh`: (the model's config as it holds it,
  its heads, its part of a cache split along the tokens). The whole model without a mesh, or on
  a mesh of one device (the steps then run as they are: run/sharding.py)."""
  mesh = None if options.mesh is None or options.mesh.size == 1 else options.mesh
  shards = ModelShards.of(cfg, mesh)
  heads = local_heads(shards)
  ctx = axis_size(mesh, "ctx")
  tokens = TokenShards("ctx", ctx) if ctx > 1 else TokenShards()
  return (shards.local(cfg) if heads.axis else cfg), heads, tokens


def local_heads(shards: ModelShards) -> Heads:
  """The `Heads` of a device of the `model` axis (`Heads()`: nothing split)."""
  if shards.shards == 1:
    return Heads()
  return Heads("model", shards.shards, shards.kv_copies)


def _all_reduce(x, axis: str | None):
  """The sum over the `model` axis of a product whose contraction dimension (heads, hidden
  units) is split over it: Megatron's one all-reduce after the attention output and the MLP."""
  return x if axis is None else jax.lax.psum(x, axis)


def new_cache(cfg: LlamaConfig, method: Method, batch: int, max_len: int, dtype=None,
              chunk: int | None = None) -> Cache:
  """An empty cache; `chunk` is the longest step that will be fed (default: max_len). dtype: how
  its keys and values are stored (default the model's; "int8" / "float8_e4m3fn": 8 bits with a
  scale per token and KV head; "int4" (or another of quant4.FORMATS): KIVI's 4-bit
  layout, for a method with no `int4_refusal`; ops/cache.py)."""
  dtype = cfg.jnp_dtype if dtype is None else dtype
  check_cache_dtype(method, dtype)
  chunk = max_len if chunk is None else chunk
  state = tuple(method.init_state(cfg, batch, max_len, dtype, chunk)
                for _ in range(cfg.num_layers))
  return Cache(lengths=jnp.zeros((batch,), jnp.int32), state=state, max_len=max_len)
