"""A `tokenizers` tokenizer.json built from a GGUF file's BPE vocabulary and merges.

Only GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`), which the Llama-3, Qwen2/3 and
SmolLM families use. The text is split before BPE by the regex of the vocabulary's pre-tokenizer
(`tokenizer.ggml.pre`, llama.cpp's name for it): merges learned on one split give other tokens on
another, so an unknown name is an error, not a silent GPT-2 split. Special tokens follow
llama.cpp's token types, as transformers' GGUF loader reads them.
"""

from __future__ import annotations

import functools
import json
import os

from jax_longctx.core.config import ConfigError

# tokenizer_config.json key naming the GGUF the tokenizer files were built from, so that errors
# of its chat template name that file (app/tokenizer.py), not the directory they were written to.
SOURCE_KEY = "jax_longctx_source"
_CONTROL = 3  # llama.cpp token type of special tokens (<|im_start|>, <|endoftext|>, ...)
_USER_DEFINED = 4  # added tokens matched whole but not special (<tool_call>, <think>)

# Split regexes of llama.cpp's pre-tokenizer names (the ones in the models' own tokenizer.json).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's differs from Llama 3's in one place: digits one by one (\p{N}, not \p{N}{1,3}).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_REGEXES = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Names that mean the GPT-2 split itself; "smollm" adds single digits in front of it.
_GPT2_PRE = ("default", "gpt2", "smollm")


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character map (what byte-level BPE vocabularies are spelled in)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _pre_tokenizer(pre, where: str = "GGUF"):
  from tokenizers import Regex, pre_tokenizers

  if isinstance(pre, str) and pre in SPLIT_REGEXES:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEXES[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  if not isinstance(pre, str) or pre not in _GPT2_PRE:
    raise ConfigError(
        f"{where}: GGUF pre-tokenizer {pre!r} is not supported (known: "
        f"{', '.join(sorted(set(SPLIT_REGEXES) | set(_GPT2_PRE)))}); convert the Hugging Face "
        "checkpoint instead")
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  return byte_level


def _strings(meta: dict, key: str, where: str, required: bool = True) -> list[str]:
  value = meta.get(key)
  if value is None and not required:
    return []
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise ConfigError(f"{where}: GGUF {key} is not a list of strings")
  return value


def _token_index(meta: dict, key: str, n: int, where: str) -> int | None:
  idx = meta.get(key)
  if idx is None:
    return None
  # A negative id would silently index from the end of the vocabulary.
  if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
    raise ConfigError(f"{where}: GGUF {key}={idx!r} is not a token id of its {n} tokens")
  return idx


def build_tokenizer(meta: dict, where: str = "GGUF"):
  """where: the GGUF file, named in errors."""
  from tokenizers import AddedToken, Tokenizer, decoders, models

  if meta.get("tokenizer.ggml.model") != "gpt2":
    raise ConfigError(
        f"{where}: GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported "
        "(only byte-level BPE, 'gpt2'); convert the Hugging Face checkpoint instead")
  raw = _strings(meta, "tokenizer.ggml.tokens", where)
  merges = _strings(meta, "tokenizer.ggml.merges", where, required=False)
  bad = next((m for m in merges if " " not in m), None)
  if bad is not None:
    raise ConfigError(f"{where}: GGUF merge {bad[:40]!r} is not two tokens split by a space")
  types = list(meta.get("tokenizer.ggml.token_type") or [])
  if types and (len(types) != len(raw) or not all(isinstance(t, int) for t in types)):
    raise ConfigError(f"{where}: GGUF tokenizer.ggml.token_type is not one integer per token "
                      f"({len(types)} for {len(raw)} tokens)")
  alphabet = _byte_alphabet()
  spelled = set(alphabet.values())
  # A token written outside the byte alphabet (some converters store raw text) is respelled.
  tokens = [t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))
            for t in raw]
  tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                            merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
  tk.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), where)
  tk.decoder = decoders.ByteLevel()
  # A control token outside the byte alphabet is a llama.cpp mislabel (transformers skips it too).
  tk.add_special_tokens([AddedToken(raw[i], special=True, normalized=False)
                         for i, t in enumerate(types) if t == _CONTROL and set(raw[i]) <= spelled])
  tk.add_tokens([AddedToken(raw[i], special=False, normalized=False)
                 for i, t in enumerate(types) if t == _USER_DEFINED])
  return tk


def write_tokenizer_files(meta: dict, dst: str, source: str | None = None) -> None:
  """tokenizer.json and tokenizer_config.json of a GGUF's metadata, into `dst`; source: the GGUF
  file, named in errors (also those of its chat template, later)."""
  where = source or "GGUF"
  tk = build_tokenizer(meta, where)
  tk.save(os.path.join(dst, "tokenizer.json"))
  tokens = meta["tokenizer.ggml.tokens"]

  def tok(key):
    idx = _token_index(meta, key, len(tokens), where)
    return None if idx is None else tokens[idx]

  template = meta.get("tokenizer.chat_template")
  if template is not None and not isinstance(template, str):
    raise ConfigError(f"{where}: GGUF tokenizer.chat_template is not a string")
  config = {
      "bos_token": tok("tokenizer.ggml.bos_token_id"),
      "eos_token": tok("tokenizer.ggml.eos_token_id"),
      "pad_token": tok("tokenizer.ggml.padding_token_id"),
      "unk_token": tok("tokenizer.ggml.unknown_token_id"),
      "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
      "chat_template": template,
  }
  if source:
    config[SOURCE_KEY] = os.path.abspath(source)
  with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=1)
