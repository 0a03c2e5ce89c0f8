"""Per-family spellings of a model config: Hugging Face config.json and GGUF metadata, both ways.

Llama and Mistral share one decoder layout; Qwen2/Qwen2.5 add q/k/v biases; Qwen3 a per-head
RMSNorm on q and k. What a family has that this library does not run (sliding-window attention,
an o or MLP bias, another activation) is refused with a ConfigError naming it, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from jax_longctx.core.config_types import _DTYPES, ConfigError, RopeScaling
from jax_longctx.core.rope import RopeSpec, _base_inv_freq, _llama3_inv_freq

# A family reads a spelling into the config's fields (a dict: `config.LlamaConfig` builds on this
# module and makes the object) and writes a config (anything with its fields) back out.
Fields = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Family:
  architecture: str  # LlamaConfig.architecture and HF model_type
  hf_class: str  # HF `architectures[0]`
  attention_bias: bool = False
  qk_norm: bool = False


FAMILIES = {f.architecture: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM"),
    Family("qwen2", "Qwen2ForCausalLM", attention_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
)}
_BY_CLASS = {f.hf_class: f for f in FAMILIES.values()}
# GGUF `general.architecture` values read here (llama.cpp converts Mistral as "llama").
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _family_of(hf: Mapping[str, Any]) -> Family:
  arch = hf.get("architectures") or []
  model_type = hf.get("model_type")
  by_type = FAMILIES.get(model_type or "llama")
  by_class = _BY_CLASS.get(arch[0]) if arch else by_type
  if by_type is None or by_class is None or by_type is not by_class:
    raise ConfigError(
        f"unsupported architecture {arch or model_type!r} in config.json; supported model types: "
        f"{', '.join(FAMILIES)} ({', '.join(_BY_CLASS)})")
  return by_type


def _check_supported(family: Family, hf: Mapping[str, Any]) -> None:
  """Refuses features of a family this decoder does not implement."""
  name = family.architecture
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ConfigError(f"config.json sets hidden_act={act!r}; only 'silu' is implemented")
  if hf.get("mlp_bias"):
    raise ConfigError("config.json sets mlp_bias=true, which this implementation lacks")
  if hf.get("attention_bias") and name != "qwen2":
    # Llama's and Qwen3's flag adds an o_proj bias too, which the model does not have.
    raise ConfigError(f"config.json sets attention_bias=true, which this {name} implementation lacks")
  window = hf.get("sliding_window")
  uses_window = hf.get("use_sliding_window", True) if name == "mistral" else hf.get(
      "use_sliding_window", False)
  max_pos = int(hf.get("max_position_embeddings", 8192))
  if name in ("mistral", "qwen2", "qwen3") and uses_window and window and int(window) < max_pos:
    raise ConfigError(
        f"config.json sets sliding_window={window}, shorter than max_position_embeddings="
        f"{max_pos}: sliding-window attention is not implemented (every layer would attend to "
        "the whole context)")


def _yarn_attention_factor(rope: Mapping[str, Any], factor: float) -> float:
  """transformers' default for a YaRN config without `attention_factor`."""
  if rope.get("attention_factor") is not None:
    return float(rope["attention_factor"])

  def get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

  mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
  if mscale and mscale_all:
    return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all))
  return get_mscale(factor)


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling]:
  rope = dict(hf.get("rope_parameters") or {})  # transformers v5
  rope.update(hf.get("rope_scaling") or {})  # v4
  theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  rtype = rope.get("rope_type", rope.get("type", "default"))
  max_pos = int(hf.get("max_position_embeddings", 8192))
  original = int(rope.get("original_max_position_embeddings") or max_pos)
  factor = rope.get("factor")
  factor = float(max_pos / original if factor is None and rtype == "yarn" else factor or 1.0)
  kw = {}
  if rtype == "yarn":
    kw = dict(beta_fast=float(rope.get("beta_fast") or 32.0),
              beta_slow=float(rope.get("beta_slow") or 1.0),
              attention_factor=_yarn_attention_factor(rope, factor),
              truncate=bool(rope.get("truncate", True)))
  return theta, RopeScaling(
      type=rtype, factor=factor, low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
      high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
      original_max_position_embeddings=original, **kw)


def from_hf(hf: Mapping[str, Any]) -> Fields:
  family = _family_of(hf)
  _check_supported(family, hf)
  heads = hf["num_attention_heads"]
  theta, scaling = _rope_from_hf(hf)
  eos = hf.get("eos_token_id")
  eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
  return dict(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      intermediate_size=hf["intermediate_size"],
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
      dtype=dtype if dtype in _DTYPES else "float32",
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=eos,
      architecture=family.architecture,
      attention_bias=family.attention_bias,
      qk_norm=family.qk_norm,
  )


def _rope_to_hf(cfg) -> dict[str, Any]:
  s = cfg.rope_scaling
  rope: dict[str, Any] = {"rope_type": s.type, "rope_theta": cfg.rope_theta}
  if s.type != "default":
    rope.update(factor=s.factor)
  if s.type == "llama3":
    rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings)
  if s.type == "yarn":
    rope.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, attention_factor=s.attention_factor,
                truncate=s.truncate,
                original_max_position_embeddings=s.original_max_position_embeddings)
  return rope


def to_hf(cfg) -> dict[str, Any]:
  """A config (a LlamaConfig: read for its fields) as its family's HF config.json dict."""
  family = FAMILIES[cfg.architecture]
  rope = _rope_to_hf(cfg)
  v4_rope = None if cfg.rope_scaling.type == "default" else {
      k: v for k, v in rope.items() if k != "rope_theta"}
  eos = list(cfg.eos_token_ids)
  out = {
      "architectures": [family.hf_class],
      "model_type": family.architecture,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "intermediate_size": cfg.intermediate_size,
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_word_embeddings,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": v4_rope,
      "rope_parameters": rope,
      "max_position_embeddings": cfg.max_position_embeddings,
      "hidden_act": "silu",
      "torch_dtype": cfg.dtype,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
  }
  if cfg.architecture in ("llama", "qwen3"):
    out.update(attention_bias=False)
  if cfg.architecture == "llama":
    out.update(mlp_bias=False)
  if cfg.architecture != "llama":
    out.update(sliding_window=None, use_sliding_window=False)
  return out


# ---- GGUF ---------------------------------------------------------------------------------------
# llama.cpp writes Llama 3.x rope scaling as a `rope_freqs.weight` tensor (per-frequency divisors),
# not as metadata. These are the llama3 settings it is matched against (all Llama 3.1-3.3).
_LLAMA3_CANDIDATES = tuple(RopeScaling("llama3", f, 1.0, 4.0, 8192) for f in (8.0, 32.0, 16.0, 4.0))


def _llama3_from_freqs(freqs, head_dim: int, theta: float) -> RopeScaling:
  freqs = np.asarray(freqs, np.float64)
  base = _base_inv_freq(head_dim, theta).astype(np.float64)
  for scaling in _LLAMA3_CANDIDATES:
    probe = RopeSpec(head_dim, theta, scaling)
    if freqs.shape == base.shape and np.allclose(base / _llama3_inv_freq(probe), freqs, rtol=1e-4):
      return scaling
  raise ConfigError(
      "GGUF tensor rope_freqs.weight matches no llama3 rope scaling (factor 4/8/16/32, "
      "low/high 1/4, original 8192); convert the Hugging Face checkpoint instead")


def _gguf_rope(meta: Mapping[str, Any], p: str, head_dim: int,
               theta: float) -> RopeScaling:
  kind = meta.get(p + "rope.scaling.type", "none")
  original = int(meta.get(p + "rope.scaling.original_context_length", meta[p + "context_length"]))
  if meta.get("_rope_freqs") is not None:
    if kind not in ("none", None):
      raise ConfigError(f"GGUF has both rope_freqs.weight and rope.scaling.type={kind!r}")
    return _llama3_from_freqs(meta["_rope_freqs"], head_dim, theta)
  if kind in ("none", None):
    return RopeScaling()
  factor = float(meta.get(p + "rope.scaling.factor", 1.0))
  if kind == "yarn":
    return RopeScaling(
        "yarn", factor, original_max_position_embeddings=original,
        beta_fast=float(meta.get(p + "rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(meta.get(p + "rope.scaling.yarn_beta_slow", 1.0)),
        attention_factor=_yarn_attention_factor({}, factor))
  return RopeScaling(type=str(kind), factor=factor, original_max_position_embeddings=original)


def from_gguf(meta: Mapping[str, Any]) -> Fields:
  arch = meta.get("general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise ConfigError(
        f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
  family = FAMILIES[arch]
  p = arch + "."
  heads = int(meta[p + "attention.head_count"])
  hidden = int(meta[p + "embedding_length"])
  head_dim = int(meta.get(p + "attention.key_length")
                 or meta.get(p + "rope.dimension_count") or hidden // heads)
  theta = float(meta.get(p + "rope.freq_base", 10000.0))
  vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
  eos = meta.get("tokenizer.ggml.eos_token_id")
  return dict(
      vocab_size=int(vocab),
      hidden_size=hidden,
      num_layers=int(meta[p + "block_count"]),
      num_heads=heads,
      num_kv_heads=int(meta.get(p + "attention.head_count_kv", heads)),
      head_dim=head_dim,
      intermediate_size=int(meta[p + "feed_forward_length"]),
      rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings=not meta.get("_has_output_weight", False),
      rope_theta=theta,
      rope_scaling=_gguf_rope(meta, p, head_dim, theta),
      max_position_embeddings=int(meta[p + "context_length"]),
      dtype="float32",
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (int(eos),),
      architecture=family.architecture,
      attention_bias=family.attention_bias,
      qk_norm=family.qk_norm,
  )
