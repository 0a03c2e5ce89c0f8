"""A `tokenizers` tokenizer.json built from a GGUF file's BPE vocabulary and merges.

Only GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`), which the Llama-3 and
SmolLM families use. The pre-tokenizer follows llama.cpp's per-model split rules.
"""

from __future__ import annotations

import json
import os

from jax_longctx.config import ConfigError

_CONTROL = 3  # llama.cpp token type of special tokens (<|im_start|>, <|endoftext|>, ...)
# llama.cpp pre-tokenizer name -> whether digits are split one by one before the GPT-2 regex.
_SPLIT_DIGITS = {"smollm": True, "gpt2": False, "default": False}


def build_tokenizer(meta: dict):
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  if meta.get("tokenizer.ggml.model") != "gpt2":
    raise ConfigError(
        f"GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported (only "
        "byte-level BPE, 'gpt2'); convert the Hugging Face checkpoint instead")
  tokens = list(meta["tokenizer.ggml.tokens"])
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  vocab = {tok: i for i, tok in enumerate(tokens)}
  tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if _SPLIT_DIGITS.get(meta.get("tokenizer.ggml.pre", "default"), False):
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    tk.pre_tokenizer = byte_level
  tk.decoder = decoders.ByteLevel()
  types = list(meta.get("tokenizer.ggml.token_type", []))
  special = [AddedToken(tokens[i], special=True, normalized=False)
             for i, t in enumerate(types) if t == _CONTROL]
  tk.add_special_tokens(special)
  return tk


def write_tokenizer_files(meta: dict, dst: str) -> None:
  tk = build_tokenizer(meta)
  tk.save(os.path.join(dst, "tokenizer.json"))
  tokens = meta["tokenizer.ggml.tokens"]

  def tok(key):
    idx = meta.get(key)
    return None if idx is None else tokens[int(idx)]

  config = {
      "bos_token": tok("tokenizer.ggml.bos_token_id"),
      "eos_token": tok("tokenizer.ggml.eos_token_id"),
      "pad_token": tok("tokenizer.ggml.padding_token_id"),
      "unk_token": tok("tokenizer.ggml.unknown_token_id"),
      "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
      "chat_template": meta.get("tokenizer.chat_template"),
  }
  with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=1)
