"""Key smoothing for an 8-bit KV cache: per-channel powers of two moved from keys to queries.

Why: an 8-bit cache row (one token of one KV head) has one scale, set by its largest value
(pallas_kernels/quant.py). Qwen2.5's keys carry a few channels two orders of magnitude above the
rest (Qwen2.5-Coder-1.5B, layer 0: a RoPE pair's RMS up to 323 against a median of 1.5; its
k_proj bias), so the other channels keep a level or two of int8. Dividing key channel c by s_c
and multiplying the query's channel c by s_c leaves every q.k as it was (SmoothQuant's migration,
arXiv:2211.10438, here between keys and queries) and evens the key channels out before they are
quantized. s is one per (layer, KV head, RoPE pair), so RoPE commutes with it (it rotates within
a pair), and a power of two, so scaling is exact: scores, softmax and every method's choices
are bit for bit those of the unsmoothed model, only the quantization sees it.

s_c = 2^round(strength * log2 rms_c), rms_c the RMS of the pair's keys over calibration tokens
(a pair's norm does not depend on the position, so post-RoPE cache keys give it). Measured on
Qwen2.5-Coder-1.5B (CPU, fp32, all 1,023 predictions of a 1K text, calibrated on another text;
int8 cache against fp32; experiments/key_smoothing_proxy.py): NLL +0.28% unsmoothed, +0.016%
at strength 1, +0.009% at 0.5; calibrated on random token ids +0.10% / +0.017%. 0.5 is the
default: a key channel's quantization error reaches the score times the query's s_c, so full
equalization (1) buys the keys' grid at the queries' cost. E4M3 is not helped (+8.0% / +8.0% /
+65%): its error is relative to each value, not set by the row's largest, so evening the
channels out does not reduce it. What helps E4M3 is taking the keys' and values' common offset
out of what the cache stores (`key_offset`, model/kv_offsets.py), calibrated in the
same pass: Qwen's E4M3 NLL +8.0% -> +0.09% on that text (docs/CLAIMS.md). Caches of pre-RoPE
keys (ReAttention, StreamingLLM, CItruS: `Method.keys_before_rope`) are stored less the pre-RoPE
keys' mean instead, which their 8-bit key buffers hold and add back on every read
(`Quantized.offset`, ops/cache.py).
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from jax_longctx.core.config import LlamaConfig
from jax_longctx.core.errors import LongctxError
from jax_longctx.core.mesh import ModelShards, make_mesh, without_ctx
from jax_longctx.core.options import DEFAULT, RunOptions
from jax_longctx.core.rope import inv_freq, rotate
from jax_longctx.methods.base import get
from jax_longctx.model.placement import place_leaf
from jax_longctx.run.generation import prefill
from jax_longctx.run.sharding import HostBatch, placed, restrict

STRENGTH = 0.5  # SmoothQuant's alpha between keys (1: keys evened out) and queries (0: nothing)
_MAX_EXPONENT = 24  # |log2 s|: a channel of zeros (RMS 0) gets 2^-24, not 0


def cache_stats(params, cfg: LlamaConfig, ids, options: RunOptions = DEFAULT) -> dict:
  """What one prompt `ids` (full attention, the cache in the model's dtype) stores, per layer and
  KV head in the standard head layout, fp32: `pair_rms` [L, KV, hd / 2] each RoPE pair's key RMS,
  `key_mean` and `value_mean` [L, KV, hd] the cached (post-RoPE) keys' and the values' means,
  `pre_rope_key_mean` [L, KV, hd] the keys' mean before RoPE (each cached key rotated back)."""
  if cfg.key_smoothing:
    raise LongctxError("these weights are smoothed already (cfg.key_smoothing)")
  ids = [int(i) for i in ids]
  options = options.replace(kv_dtype=None)
  _, weights, rows = HostBatch.enter(params, cfg, options, [ids])
  cache, _ = prefill(weights, cfg, rows, get("full"), cache_len=len(ids), options=options)
  half = cfg.head_dim // 2
  freqs = inv_freq(cfg, len(ids))  # what the prefill rotated the cached keys with

  @jax.jit
  def stats(k, v):  # [B, KV, T, hd] over the first row (the others are its copies)
    k, v = k[0].astype(jnp.float32), v[0].astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(k[..., :half] ** 2 + k[..., half:] ** 2, axis=1) / 2)
    before_rope = rotate(k, -jnp.arange(k.shape[1])[None, :], freqs)  # slot t holds position t
    return rms, jnp.mean(k, axis=1), jnp.mean(v, axis=1), jnp.mean(before_rope, axis=1)

  out = [[np.asarray(x) for x in stats(layer.k, layer.v)] for layer in cache.state]
  copies = 1 if options.mesh is None else ModelShards.of(cfg, make_mesh(options.mesh)).kv_copies
  # a placed cache copies each KV head `copies` times, side by side
  return {name: np.stack([o[i] for o in out])[:, ::copies]
          for i, name in enumerate(("pair_rms", "key_mean", "value_mean", "pre_rope_key_mean"))}


def key_offset(key_mean: np.ndarray, s: np.ndarray) -> np.ndarray:
  """[..., hd] the post-RoPE constant c a cache's keys (divided by `s`) are stored less: their
  mean over the calibration prompt's positions (0..1K). RoPE turns a pre-RoPE bias b to R(p) b,
  so a constant matches it only where a pair turns slowly; Qwen2.5's k_proj bias sits in such
  pairs. Which constant, measured on Qwen2.5-Coder-1.5B (experiments/key_offset_proxy.py: a 1K
  text placed at positions 0, 16K and 30K, every K/V row rounded through E4M3 less the offsets,
  NLL against fp32; b averaged over the rotations of positions [0, T)): T = 1K, about this mean,
  -0.16% / +0.06% / +0.05%; T = 1 (b itself) at 16K / 30K -0.03% / +0.17%; T = 4K +0.11% at 16K;
  T = 32K (Qwen's window) -0.06% / +0.21% / +0.24%; nothing taken out +8.0% / +5.9% / +6.5%."""
  return (np.asarray(key_mean, np.float64) / s).astype(np.float32)


def smoothing_from_rms(rms: np.ndarray, strength: float = STRENGTH) -> np.ndarray:
  """[..., hd / 2] pair RMS -> [..., hd] the powers of two keys are divided by (a pair's two
  channels, c and c + hd / 2 in the HF rotate-half layout, share one)."""
  e = np.round(strength * np.log2(np.maximum(np.asarray(rms, np.float64), 2.0 ** -100)))
  s = np.exp2(np.clip(e, -_MAX_EXPONENT, _MAX_EXPONENT)).astype(np.float32)
  return np.concatenate([s, s], axis=-1)


def smooth_keys(params, cfg: LlamaConfig, ids, options: RunOptions = DEFAULT,
                strength: float = STRENGTH, offsets: bool = True):
  """(params, cfg) with per-layer key smoothing calibrated on the tokens `ids` (1K tokens of
  text, the model's own kind of input, serve; random ids nearly as well): each layer's
  `attn.k_smooth` [KV, hd] and cfg.key_smoothing, and with `offsets` the keys' and values'
  offsets (`attn.k_offset`, `attn.v_offset`, `attn.k_offset_before_rope`, cfg.kv_offsets). On a
  mesh (options.mesh) the weights come back placed there. The input tree is left as it is."""
  if not 0 <= strength <= 1:
    raise LongctxError(f"key smoothing strength must lie in [0, 1], got {strength}")
  if options.mesh is not None:
    params = placed(params, cfg, options.mesh)  # once: the calibration runs on these
  # Full attention does not split the context: on a mesh with a ctx axis (mesh ReAttention's)
  # the pass runs on the first context shard's devices, on the weights they already hold.
  part = without_ctx(options.mesh)
  stats = cache_stats(params if part is options.mesh else restrict(params, part), cfg, ids,
                      options.replace(mesh=part))
  s = smoothing_from_rms(stats["pair_rms"], strength)
  kv = ((key_offset(stats["key_mean"], s), stats["value_mean"],
         key_offset(stats["pre_rope_key_mean"], s)) if offsets else None)
  return with_smoothing(params, cfg, s, options.mesh, kv)


def with_smoothing(params, cfg: LlamaConfig, s, mesh=None, offsets=None):
  """(params, cfg) with `s` [layers, KV, hd] (standard head layout) as each layer's
  `attn.k_smooth`, and `offsets` (key after RoPE, value, key before RoPE: each [layers, KV, hd];
  None: none) as its `attn.k_offset`, `attn.v_offset` and `attn.k_offset_before_rope`, placed
  over `mesh` as the weights are (given: already placed there)."""
  def leaf(name, x):
    x = np.asarray(x).astype(cfg.jnp_dtype)  # powers of two are exact in every float dtype
    return jnp.asarray(x) if mesh is None else place_leaf(name, x, cfg, mesh)

  def attn(i, a):
    a = {**a, "k_smooth": leaf("k_smooth", s[i])}
    if offsets is not None:
      names = ("k_offset", "v_offset", "k_offset_before_rope")
      a.update({name: leaf(name, x[i]) for name, x in zip(names, offsets, strict=True)})
    return a

  layers = {i: {**layer, "attn": attn(i, layer["attn"])} for i, layer in params["layers"].items()}
  return ({**params, "layers": layers},
          cfg.replace(key_smoothing=True, kv_offsets=offsets is not None))
