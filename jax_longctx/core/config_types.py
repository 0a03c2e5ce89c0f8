"""The configuration's leaf types: dtype names, ConfigError, RopeScaling (no package imports but
the error base, so jax_longctx.core.families, which reads each family's spellings, and
jax_longctx.core.config, which uses it, both stand on them without importing each other in a
circle)."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax.numpy as jnp

from jax_longctx.core.errors import LongctxError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# What the decoder looks like per family: "llama" and "mistral" share one layout, "qwen2" adds
# q/k/v biases, "qwen3" a per-head RMSNorm on q and k before RoPE.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(LongctxError, ValueError):
  """A checkpoint's configuration this library cannot run."""


# Config values come from model files: each is checked where the config is built, so that a
# negative, fractional or absurd size is one error before anything allocates or divides by it.
def check_count(name: str, value, limit: int) -> None:
  """A size or count: a whole number from 1 to `limit`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= limit:
    raise ConfigError(f"{name}={value!r} is not a whole number from 1 to {limit}")


def check_real(name: str, value, above: float = 0.0, at_least: bool = False) -> None:
  """A finite number above `above` (or equal to it, with at_least)."""
  ok = (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        and (value >= above if at_least else value > above))
  if not ok:
    raise ConfigError(f"{name}={value!r} is not a finite number "
                      f"{'>=' if at_least else '>'} {above:g}")


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
    # Each divides or takes a logarithm somewhere in core/rope.py: zero or less is NaN or inf.
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "attention_factor"):
      check_real(f"rope_scaling.{name}", getattr(self, name))
    check_count("rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings, 1 << 30)
    if self.type == "llama3" and self.low_freq_factor == self.high_freq_factor:
      raise ConfigError("rope_scaling.low_freq_factor equals high_freq_factor "
                        f"({self.low_freq_factor}): llama3 scaling divides by their difference")
