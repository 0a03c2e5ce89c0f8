"""The configuration's leaf types: dtype names, ConfigError, RopeScaling (no package imports but
the error base, so jax_longctx.core.families, which reads each family's spellings, and
jax_longctx.core.config, which uses it, both stand on them without importing each other in a
circle)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_longctx.core.errors import LongctxError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# What the decoder looks like per family: "llama" and "mistral" share one layout, "qwen2" adds
# q/k/v biases, "qwen3" a per-head RMSNorm on q and k before RoPE.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(LongctxError, ValueError):
  """A checkpoint's configuration this library cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`)."""

  type: str = "default"
  factor: float = 1.0
  # llama3 (Llama-3.1 style) only.
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  # yarn only (transformers' defaults). attention_factor multiplies cos and sin in transformers,
  # so every q.k score by its square.
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 1.0
  truncate: bool = True

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ConfigError(f"unsupported rope scaling type {self.type!r}; supported: {ROPE_TYPES}")
