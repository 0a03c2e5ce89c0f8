"""Model configuration (Llama, Mistral, Qwen2/2.5, Qwen3), read from HF config.json or GGUF metadata.

The families differ only in small switches of one decoder (q/k/v biases, per-head q/k RMSNorm),
so one frozen config describes them all; jax_longctx/core/families.py reads each family's spellings.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from typing import Any, Mapping

from jax_longctx.core import families
from jax_longctx.core.config_types import (  # noqa: F401  (re-exported: their public home)
    _DTYPES, ARCHITECTURES, ROPE_TYPES, ConfigError, RopeScaling, check_count, check_real)

# Upper bounds of a config's sizes: far above any released model (vocabularies reach 262K,
# hidden sizes 16K, 126 layers, 128 heads, contexts 10M), far below what would exhaust memory on
# its own, so that a model file's absurd value is refused, not allocated.
LIMITS = {"vocab_size": 1 << 24, "hidden_size": 1 << 17, "num_layers": 1 << 12,
          "num_heads": 1 << 12, "num_kv_heads": 1 << 12, "head_dim": 1 << 12,
          "intermediate_size": 1 << 20, "max_position_embeddings": 1 << 30}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  max_position_embeddings: int = 8192
  dtype: str = "float32"  # storage and compute dtype of the weights
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  architecture: str = "llama"  # one of ARCHITECTURES (HF names, export, GGUF q/k permutation)
  attention_bias: bool = False  # q/k/v projection biases (Qwen2); no bias on o
  qk_norm: bool = False  # RMSNorm over head_dim on each q and k head before RoPE (Qwen3)
  # Per-(KV head, channel) key scales in the weights (`k_smooth`; run/key_smoothing.py): set by
  # calibration for an 8-bit cache, not a checkpoint's own fact.
  key_smoothing: bool = False
  # Per-(KV head, channel) key and value offsets in the weights (`k_offset`, `v_offset`,
  # `k_offset_before_rope`; run/key_smoothing.py): taken out of what the cache stores, exactly
  # restored (decoder.py; the key offsets where the cache is 8-bit).
  kv_offsets: bool = False

  def __post_init__(self):
    for name, limit in LIMITS.items():
      check_count(name, getattr(self, name), limit)
    check_real("rms_norm_eps", self.rms_norm_eps, at_least=True)
    check_real("rope_theta", self.rope_theta, above=1.0)  # RoPE's base (its log divides)
    if not isinstance(self.rope_scaling, RopeScaling):
      raise ConfigError(f"rope_scaling={self.rope_scaling!r} is not a RopeScaling")
    ids = ([] if self.bos_token_id is None else [self.bos_token_id]) + list(self.eos_token_ids)
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids):
      raise ConfigError(f"token ids bos={self.bos_token_id!r} eos={self.eos_token_ids!r} are not "
                        "non-negative integers")
    if self.architecture not in ARCHITECTURES:
      raise ConfigError(f"architecture {self.architecture!r} not in {ARCHITECTURES}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.dtype not in _DTYPES:
      raise ConfigError(f"dtype {self.dtype!r} not in {tuple(_DTYPES)}")

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def replace(self, **kw) -> "LlamaConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
    attn += hd * (self.num_heads + 2 * self.num_kv_heads) * self.attention_bias
    attn += 2 * hd * self.qk_norm
    per_layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.num_layers * per_layer + self.vocab_size * d + head + d

  # ---- serialization --------------------------------------------------------------------------
  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["eos_token_ids"] = list(self.eos_token_ids)
    return out

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
    d = dict(d)
    d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    return cls(**d)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
    """From a Hugging Face config.json dict (transformers v4 or v5 spelling), any supported family."""
    # Read before the config exists: the head size may be hidden_size divided by it.
    check_count("num_attention_heads", hf.get("num_attention_heads"), LIMITS["num_heads"])
    return cls(**families.from_hf(hf))

  @classmethod
  def from_hf_json(cls, path: str) -> "LlamaConfig":
    try:
      with open(path) as f:
        hf = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8
      raise ConfigError(f"cannot read {path}: {e}") from e
    return _from_file(path, lambda: cls.from_hf(hf))

  def to_hf(self) -> dict[str, Any]:
    return families.to_hf(self)

  @classmethod
  def from_gguf_fields(cls, meta: Mapping[str, Any]) -> "LlamaConfig":
    """From GGUF key/value metadata (already decoded to Python values)."""
    return cls(**families.from_gguf(meta))


_L31 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
_L32 = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
PRESETS: dict[str, LlamaConfig] = {
    "smollm2-135m": LlamaConfig(49152, 576, 30, 9, 3, 64, 1536, 1e-5, True, 100000.0,
                                RopeScaling(), 8192, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.2-1b": LlamaConfig(128256, 2048, 16, 32, 8, 64, 8192, 1e-5, True, 500000.0, _L32,
                                131072, "bfloat16", 128000, (128001, 128008, 128009)),
    "llama-3.2-3b": LlamaConfig(128256, 3072, 28, 24, 8, 128, 8192, 1e-5, True, 500000.0, _L32,
                                131072, "bfloat16", 128000, (128001, 128008, 128009)),
    "llama-3.1-8b": LlamaConfig(128256, 4096, 32, 32, 8, 128, 14336, 1e-5, False, 500000.0, _L31,
                                131072, "bfloat16", 128000, (128001, 128008, 128009)),
    "llama-3.1-70b": LlamaConfig(128256, 8192, 80, 64, 8, 128, 28672, 1e-5, False, 500000.0, _L31,
                                 131072, "bfloat16", 128000, (128001, 128008, 128009)),
    # Qwen2.5-Coder-1.5B's shape (its HF config.json): q/k/v biases, tied embeddings.
    "qwen2.5-coder-1.5b": LlamaConfig(151936, 1536, 28, 12, 2, 128, 8960, 1e-6, True, 1000000.0,
                                      RopeScaling(), 32768, "bfloat16", None, (151643,),
                                      architecture="qwen2", attention_bias=True),
}


def preset(name: str, **overrides) -> LlamaConfig:
  """A named model shape (for benchmarks with random weights)."""
  key = name.lower()
  if key not in PRESETS:
    raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(PRESETS)}")
  return PRESETS[key].replace(**overrides)


def _from_file(path: str, build) -> LlamaConfig:
  """build()'s config; a value of the file that it cannot take (missing, of the wrong type,
  refused by the checks) is one ConfigError naming the file."""
  try:
    return build()
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from e
  except KeyError as e:
    raise ConfigError(f"{path}: lacks {e}") from e
  except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
    raise ConfigError(f"{path}: not a model configuration this library reads ({e})") from e


def load_config_file(path: str) -> LlamaConfig:
  """Our own config.json (written by conversion) or an HF one."""
  with open(path) as f:
    d = json.load(f)
  if isinstance(d, dict) and "num_layers" in d:
    return _from_file(path, lambda: LlamaConfig.from_dict(d))
  return _from_file(path, lambda: LlamaConfig.from_hf(d))


def save_config_file(cfg: LlamaConfig, directory: str) -> None:
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=1)
