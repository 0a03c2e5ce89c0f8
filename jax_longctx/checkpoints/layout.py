"""Where each Hugging Face Llama / Mistral / Qwen2 / Qwen3 tensor lives in this library's parameter tree, and how it turns.

HF stores nn.Linear weights as [out, in]; the Flax model keeps einsum-ready kernels
([in, heads, head_dim] for q/k/v, [heads, head_dim, out] for o, [in, out] for the MLP), one set
per layer under params["layers"][i]. Each rule is exact (a transpose and a reshape), so
conversion round-trips bit for bit.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import numpy as np

from jax_longctx.core.config import LlamaConfig

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Rule:
  hf: str  # name with {i} for the layer index
  path: Path  # location in the params tree (inside params["layers"][i] for per-layer rules)
  to_flax: Callable[[np.ndarray, LlamaConfig], np.ndarray]
  to_hf: Callable[[np.ndarray, LlamaConfig], np.ndarray]
  when: Callable[[LlamaConfig], bool] = lambda cfg: True  # whether a config has this tensor

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf

  def full_path(self, i: int | None) -> Path:
    return ("layers", i) + self.path if self.per_layer else self.path


def _same(w, cfg):
  return w


def _t(w, cfg):
  return w.T


def _in_heads(heads_of: Callable[[LlamaConfig], int]):

  def to_flax(w, cfg):  # [heads*hd, D] -> [D, heads, hd]
    return w.T.reshape(cfg.hidden_size, heads_of(cfg), cfg.head_dim)

  def to_hf(w, cfg):
    return w.reshape(cfg.hidden_size, -1).T

  return to_flax, to_hf


def _o_to_flax(w, cfg):  # [D, H*hd] -> [H, hd, D]
  return w.T.reshape(cfg.num_heads, cfg.head_dim, cfg.hidden_size)


def _o_to_hf(w, cfg):
  return w.reshape(-1, cfg.hidden_size).T


def _bias(heads_of: Callable[[LlamaConfig], int]):

  def to_flax(w, cfg):  # [heads*hd] -> [heads, hd]
    return w.reshape(heads_of(cfg), cfg.head_dim)

  def to_hf(w, cfg):
    return w.reshape(-1)

  return to_flax, to_hf


_Q = _in_heads(lambda c: c.num_heads)
_KV = _in_heads(lambda c: c.num_kv_heads)
_QB = _bias(lambda c: c.num_heads)
_KVB = _bias(lambda c: c.num_kv_heads)
_L = "model.layers.{i}."


def _biased(cfg):
  return cfg.attention_bias


def _qk_normed(cfg):
  return cfg.qk_norm


RULES: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", ("embed",), _same, _same),
    Rule("model.norm.weight", ("final_norm", "scale"), _same, _same),
    Rule("lm_head.weight", ("lm_head",), _t, _t, lambda cfg: not cfg.tie_word_embeddings),
    Rule(_L + "input_layernorm.weight", ("attn_norm", "scale"), _same, _same),
    Rule(_L + "post_attention_layernorm.weight", ("mlp_norm", "scale"), _same, _same),
    Rule(_L + "self_attn.q_proj.weight", ("attn", "q_proj"), *_Q),
    Rule(_L + "self_attn.k_proj.weight", ("attn", "k_proj"), *_KV),
    Rule(_L + "self_attn.v_proj.weight", ("attn", "v_proj"), *_KV),
    Rule(_L + "self_attn.o_proj.weight", ("attn", "o_proj"), _o_to_flax, _o_to_hf),
    Rule(_L + "self_attn.q_proj.bias", ("attn", "q_bias"), *_QB, _biased),
    Rule(_L + "self_attn.k_proj.bias", ("attn", "k_bias"), *_KVB, _biased),
    Rule(_L + "self_attn.v_proj.bias", ("attn", "v_bias"), *_KVB, _biased),
    Rule(_L + "self_attn.q_norm.weight", ("attn", "q_norm", "scale"), _same, _same, _qk_normed),
    Rule(_L + "self_attn.k_norm.weight", ("attn", "k_norm", "scale"), _same, _same, _qk_normed),
    Rule(_L + "mlp.gate_proj.weight", ("mlp", "gate_proj"), _t, _t),
    Rule(_L + "mlp.up_proj.weight", ("mlp", "up_proj"), _t, _t),
    Rule(_L + "mlp.down_proj.weight", ("mlp", "down_proj"), _t, _t),
)


# Tensors a checkpoint may hold that the model rightly does not read: rotary buffers some old
# exports saved, and the lm_head copy of a tied checkpoint (the config says it equals the embedding).
IGNORED = (re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),)


def ignored(name: str, cfg: LlamaConfig) -> bool:
  if name == "lm_head.weight" and cfg.tie_word_embeddings:
    return True
  return any(p.match(name) for p in IGNORED)


def rules_for(cfg: LlamaConfig) -> tuple[Rule, ...]:
  return tuple(r for r in RULES if r.when(cfg))


def match(name: str, cfg: LlamaConfig) -> tuple[Rule, int | None] | None:
  """The rule for an HF tensor name and its layer index; None for a name this config lacks."""
  for rule in rules_for(cfg):
    pattern = "^" + re.escape(rule.hf).replace(r"\{i\}", r"(\d+)") + "$"
    m = re.match(pattern, name)
    if m:
      i = int(m.group(1)) if rule.per_layer else None
      return None if i is not None and i >= cfg.num_layers else (rule, i)
  return None


def hf_names(cfg: LlamaConfig) -> list[tuple[str, Rule, int | None]]:
  """Every HF tensor name of a checkpoint of this config, in a stable order."""
  out = []
  for rule in rules_for(cfg):
    if rule.per_layer:
      out += [(rule.hf.format(i=i), rule, i) for i in range(cfg.num_layers)]
    else:
      out.append((rule.hf, rule, None))
  return out


def get_path(tree: dict, path: Path):
  for key in path:
    tree = tree[key]
  return tree


def set_path(tree: dict, path: Path, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
