"""Tiny GGUF files written with the gguf package's GGUFWriter, as llama.cpp lays them out."""

import numpy as np

from jax_longctx.checkpoints import layout

_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf: str) -> str:
  if hf in _TO_GGUF:
    return _TO_GGUF[hf]
  _, _, i, rest = hf.split(".", 3)
  module, kind = rest.rsplit(".", 1)
  return f"blk.{i}.{_TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w, n_head):
  """convert_hf_to_gguf.py's LlamaModel.permute (HF's rotate-half rows -> GGML's pairs)."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens(n: int) -> list[str]:
  """n distinct tokens spelled in the GPT-2 byte alphabet."""
  from jax_longctx.checkpoints.gguf_tokenizer import _byte_alphabet
  chars = list(_byte_alphabet().values())
  return (chars + [a + b for a in chars for b in chars])[:n]


def write_gguf(path, cfg, params, arch: str, *, quantize=(), extra=None, rope_freqs=None,
               tokens=None, merges=(), pre="qwen2", token_types=None, chat_template=None,
               kv=None):
  """Writes cfg/params as llama.cpp would for `arch`; `quantize` lists GGUF tensor-name suffixes
  stored as Q8_0; `extra` maps more GGUF names to arrays; `kv` more metadata keys to
  (value, gguf.GGUFValueType)."""
  import gguf

  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  tokens = tokens or byte_tokens(cfg.vocab_size)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(token_types or [1] * len(tokens))
  w.add_token_merges(list(merges))
  w.add_eos_token_id(len(tokens) - 1)
  if chat_template is not None:
    w.add_chat_template(chat_template)
  for key, (value, vtype) in (kv or {}).items():
    w.add_key_value(key, value, vtype)
  for name, rule, i in layout.hf_names(cfg):
    arr = np.ascontiguousarray(rule.to_hf(np.asarray(layout.get_path(params, rule.full_path(i))), cfg),
                               dtype=np.float32)
    if arch == "llama" and name.endswith("q_proj.weight"):
      arr = llama_cpp_permute(arr, cfg.num_heads)
    elif arch == "llama" and name.endswith("k_proj.weight"):
      arr = llama_cpp_permute(arr, cfg.num_kv_heads)
    g = gguf_name(name)
    if any(g.endswith(q) for q in quantize):
      q8 = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(g, q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(g, arr)
  if rope_freqs is not None:
    w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
  for g, arr in (extra or {}).items():
    w.add_tensor(g, np.asarray(arr, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
