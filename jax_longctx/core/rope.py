"""Rotary position embeddings at arbitrary positions (HF's rotate-half layout).

Methods that store keys before RoPE (ReAttention, CItruS, StreamingLLM's position shift) rotate
them at positions of their own choosing, so RoPE is a function of (x, positions), never of a slot.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax.numpy as jnp
import numpy as np

from jax_longctx.core.config_types import RopeScaling


class RopeFields(Protocol):
  """What RoPE reads of a config (LlamaConfig has these fields; this module stays below it, as
  `families`, which config builds on, computes frequencies too)."""

  head_dim: int
  rope_theta: float
  rope_scaling: RopeScaling
  max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class RopeSpec:
  """RopeFields without a whole config (families matches llama3 scalings with it)."""

  head_dim: int
  rope_theta: float
  rope_scaling: RopeScaling
  max_position_embeddings: int = 0


def _exponents(head_dim: int) -> np.ndarray:
  return np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim


def _base_inv_freq(head_dim: int, theta: float) -> np.ndarray:
  return (1.0 / (np.float32(theta) ** _exponents(head_dim))).astype(np.float32)


def _llama3_inv_freq(cfg: RopeFields) -> np.ndarray:
  s = cfg.rope_scaling
  inv = _base_inv_freq(cfg.head_dim, cfg.rope_theta)
  old = s.original_max_position_embeddings
  low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(cfg: RopeFields) -> np.ndarray:
  """YaRN (transformers' _compute_yarn_parameters): high frequencies kept, low ones divided by
  the factor, a linear ramp between; the attention factor is applied by the model to q."""
  s, d, base = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta

  def correction_dim(rotations):
    return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
        2 * math.log(base))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  high = high + 0.001 if low == high else high
  ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = _base_inv_freq(d, base)
  interpolation = extrapolation / np.float32(s.factor)
  keep = 1 - ramp
  return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def query_scale(cfg: RopeFields) -> float:
  """Factor on every q.k score from the RoPE type: YaRN's attention factor squared (transformers
  multiplies both cos and sin by it, so q and k each), else 1."""
  s = cfg.rope_scaling
  return float(s.attention_factor) ** 2 if s.type == "yarn" else 1.0


def inv_freq(cfg: RopeFields, seq_len=None) -> jnp.ndarray:
  """[head_dim // 2] fp32 inverse frequencies.

  `seq_len` matters only for dynamic NTK, which (as in transformers) rescales the base once the
  sequence outgrows the original window; it may be a traced scalar.
  """
  s = cfg.rope_scaling
  if s.type == "default":
    return jnp.asarray(_base_inv_freq(cfg.head_dim, cfg.rope_theta))
  if s.type == "linear":
    return jnp.asarray(_base_inv_freq(cfg.head_dim, cfg.rope_theta) / np.float32(s.factor))
  if s.type == "llama3":
    return jnp.asarray(_llama3_inv_freq(cfg))
  if s.type == "yarn":
    return jnp.asarray(_yarn_inv_freq(cfg))
  # dynamic NTK, measured against max_position_embeddings as transformers does
  orig = cfg.max_position_embeddings
  n = jnp.maximum(jnp.asarray(orig if seq_len is None else seq_len, jnp.float32), orig)
  d = cfg.head_dim
  base = cfg.rope_theta * ((s.factor * n / orig) - (s.factor - 1)) ** (d / (d - 2))
  return 1.0 / (base ** jnp.asarray(_exponents(d)))


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, freqs: jnp.ndarray) -> jnp.ndarray:
  """Rotates x [batch, seq, heads, head_dim] at integer positions [batch, seq]."""
  return rotate(x, positions[:, :, None], freqs)


def rotate(x: jnp.ndarray, positions: jnp.ndarray, freqs: jnp.ndarray) -> jnp.ndarray:
  """Rotates x [..., head_dim] at positions broadcastable to x.shape[:-1]."""
  angles = positions.astype(jnp.float32)[..., None] * freqs
  cos = jnp.cos(angles).astype(x.dtype)
  sin = jnp.sin(angles).astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
