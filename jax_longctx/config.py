"""Llama-family model configuration, read from HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import jax.numpy as jnp

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(ValueError):
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

  def __post_init__(self):
    if self.type not in ROPE_TYPES:
      raise ConfigError(f"unsupported rope scaling type {self.type!r}; supported: {ROPE_TYPES}")


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

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.dtype not in _DTYPES:
      raise ConfigError(f"dtype {self.dtype!r} not in {tuple(_DTYPES)}")

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def replace(self, **kw) -> "LlamaConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
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
    """From a Hugging Face config.json dict (transformers v4 or v5 spelling)."""
    arch = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type not in (None, "llama") or (arch and arch[0] != "LlamaForCausalLM"):
      raise ConfigError(
          f"unsupported architecture {arch or model_type!r} in config.json: only Llama-family "
          "models (model_type 'llama', LlamaForCausalLM) are supported")
    for flag in ("attention_bias", "mlp_bias"):
      if hf.get(flag):
        raise ConfigError(f"config.json sets {flag}=true, which this Llama implementation lacks")
    heads = hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or {})  # transformers v5
    rope.update(hf.get("rope_scaling") or {})  # v4
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rtype = rope.get("rope_type", rope.get("type", "default"))
    scaling = RopeScaling(
        type=rtype,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))),
    )
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        dtype=dtype if dtype in _DTYPES else "float32",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
    )

  @classmethod
  def from_hf_json(cls, path: str) -> "LlamaConfig":
    try:
      with open(path) as f:
        hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ConfigError(f"cannot read {path}: {e}") from e
    return cls.from_hf(hf)

  def to_hf(self) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": self.rope_scaling.type, "rope_theta": self.rope_theta}
    if self.rope_scaling.type != "default":
      rope.update(factor=self.rope_scaling.factor)
    if self.rope_scaling.type == "llama3":
      rope.update(
          low_freq_factor=self.rope_scaling.low_freq_factor,
          high_freq_factor=self.rope_scaling.high_freq_factor,
          original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings)
    v4_rope = None if self.rope_scaling.type == "default" else {
        k: v for k, v in rope.items() if k != "rope_theta"}
    eos = list(self.eos_token_ids)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "intermediate_size": self.intermediate_size,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "rope_theta": self.rope_theta,
        "rope_scaling": v4_rope,
        "rope_parameters": rope,
        "max_position_embeddings": self.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": self.dtype,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
    }

  @classmethod
  def from_gguf_fields(cls, meta: Mapping[str, Any]) -> "LlamaConfig":
    """From GGUF key/value metadata (already decoded to Python values)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
      raise ConfigError(f"unsupported GGUF architecture {arch!r}: only 'llama' is supported")
    p = "llama."
    heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    scaling_type = meta.get(p + "rope.scaling.type", "none")
    scaling = RopeScaling() if scaling_type in ("none", None) else RopeScaling(
        type=str(scaling_type), factor=float(meta.get(p + "rope.scaling.factor", 1.0)),
        original_max_position_embeddings=int(
            meta.get(p + "rope.scaling.original_context_length", meta[p + "context_length"])))
    vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return cls(
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(meta[p + "block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get(p + "attention.head_count_kv", heads)),
        head_dim=int(meta.get(p + "rope.dimension_count", hidden // heads)),
        intermediate_size=int(meta[p + "feed_forward_length"]),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=not meta.get("_has_output_weight", False),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(meta[p + "context_length"]),
        dtype="float32",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


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
}


def preset(name: str, **overrides) -> LlamaConfig:
  """A named model shape (for benchmarks with random weights)."""
  key = name.lower()
  if key not in PRESETS:
    raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(PRESETS)}")
  return PRESETS[key].replace(**overrides)


def load_config_file(path: str) -> LlamaConfig:
  """Our own config.json (written by conversion) or an HF one."""
  with open(path) as f:
    d = json.load(f)
  if "num_layers" in d:
    return LlamaConfig.from_dict(d)
  return LlamaConfig.from_hf(d)


def save_config_file(cfg: LlamaConfig, directory: str) -> None:
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(cfg.to_dict(), f, indent=1)
