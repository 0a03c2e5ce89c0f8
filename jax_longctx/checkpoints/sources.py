"""Checkpoint sources: a Hugging Face directory or a GGUF file, read one tensor at a time.

Each source gives the config, an iterator of (HF tensor name, numpy array) and the tokenizer
files; everything downstream (stacking, orbax, export) is shared.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Iterator

import numpy as np

from jax_longctx.checkpoints import safetensors_io
from jax_longctx.checkpoints.errors import CheckpointError
from jax_longctx.core.config import ConfigError, LlamaConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


@dataclasses.dataclass
class Source:
  cfg: LlamaConfig
  # HF name -> HF-layout shape of every tensor `tensors()` yields, known before reading any (from
  # the files' headers), so a config that does not fit them is refused before anything allocates.
  shapes: dict[str, tuple[int, ...]]
  tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]
  write_tokenizer: Callable[[str], None]  # writes tokenizer files into a directory
  path: str = ""  # the directory or file, named in errors

  @property
  def names(self) -> list[str]:
    return list(self.shapes)

  @property
  def num_tensors(self) -> int:
    return len(self.shapes)


def open_source(src: str) -> Source:
  if not os.path.exists(src):
    raise CheckpointError(f"checkpoint not found: {src}")
  if os.path.isfile(src):
    if src.endswith(".gguf"):
      return _gguf_source(src)
    raise CheckpointError(f"{src}: expected a .gguf file or a checkpoint directory")
  if not os.path.exists(os.path.join(src, "config.json")):
    raise CheckpointError(f"{src}: no config.json, so not a Hugging Face model directory")
  return _hf_source(src)


# ---- Hugging Face directories -------------------------------------------------------------------
def _shard_name(index: str, name) -> str:
  """A file name from the shard index, refused unless it names a file in the index's own
  directory: the index is data from the model's publisher, not a path to follow anywhere."""
  if (not isinstance(name, str) or not name or os.path.isabs(name) or "\0" in name
      or ".." in name.replace("\\", "/").split("/")):
    raise CheckpointError(f"{index}: shard {name!r} is not a file name inside the checkpoint "
                          "directory")
  return os.path.normpath(name)


def _safetensors_files(src: str) -> list[str]:
  index = os.path.join(src, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted({_shard_name(index, v) for v in weight_map.values()})
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
      raise CheckpointError(f"{index}: unreadable shard index ({e})") from e
  else:
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
  if not files:
    raise CheckpointError(f"{src}: no .safetensors weights (only safetensors checkpoints load)")
  missing = [f for f in files if not os.path.isfile(os.path.join(src, f))]
  if missing:
    raise CheckpointError(f"{src}: missing weight shards {missing}")
  return [os.path.join(src, f) for f in files]


def _hf_source(src: str) -> Source:
  cfg = LlamaConfig.from_hf_json(os.path.join(src, "config.json"))
  files = _safetensors_files(src)
  shapes = {n: tuple(info["shape"]) for f in files
            for n, info in safetensors_io.read_header(f)[0].items()}

  def tensors():
    for f in files:
      yield from safetensors_io.iter_tensors(f)

  def write_tokenizer(dst: str):
    import shutil
    for name in TOKENIZER_FILES:
      # isfile: a regular file (or a link to one), never a device or pipe that copies forever.
      if os.path.isfile(os.path.join(src, name)):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))

  return Source(cfg, shapes, tensors, write_tokenizer, src)


# ---- GGUF ---------------------------------------------------------------------------------------
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Read into the config (llama3 rope scaling as per-frequency divisors), not into the parameters.
_GGUF_CONFIG_TENSORS = ("rope_freqs.weight",)


def _gguf_to_hf_name(name: str) -> str:
  """The HF name of a GGUF tensor; a name with no HF counterpart keeps its GGUF spelling, so
  conversion reports it as unknown instead of dropping it."""
  if name in _GGUF_NAMES:
    return _GGUF_NAMES[name]
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER:
    return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[3]}"
  return name


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation (GGML's rope pairs adjacent dims, HF's halves)."""
  half = w.shape[0] // n_head // 2
  return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_reader(path: str):
  try:
    import gguf
  except ImportError as e:
    raise CheckpointError(
        "reading GGUF needs the gguf package: pip install 'jax-longctx[convert]' (or pip install "
        "gguf)") from e
  try:
    return gguf, gguf.GGUFReader(path)
  except Exception as e:  # the reader raises bare ValueError/struct errors on bad files
    raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from e


def gguf_metadata(reader) -> dict:
  meta = {}
  for key, field in reader.fields.items():
    try:
      meta[key] = field.contents()
    except Exception:  # a few exotic field types; none that a config needs
      continue
  return meta


def _dequantize(gguf, t) -> np.ndarray:
  """One tensor as fp32 in HF's [out, in] layout (gguf.quants: F32/F16/BF16, Q4_0...Q8_0,
  the K-quants and more, in numpy)."""
  try:
    w = gguf.quants.dequantize(t.data, t.tensor_type)
  except NotImplementedError as e:
    raise CheckpointError(f"GGUF tensor {t.name}: {e}") from e
  return w.astype(np.float32, copy=False).reshape([int(x) for x in reversed(t.shape)])


def _gguf_source(path: str) -> Source:
  gguf, reader = _gguf_reader(path)
  meta = gguf_metadata(reader)
  by_name = {t.name: t for t in reader.tensors}
  meta["_has_output_weight"] = "output.weight" in by_name
  if "rope_freqs.weight" in by_name:
    meta["_rope_freqs"] = tuple(_dequantize(gguf, by_name["rope_freqs.weight"]).ravel().tolist())
  try:
    cfg = LlamaConfig.from_gguf_fields(meta)
  except KeyError as e:
    raise ConfigError(f"{path}: GGUF metadata lacks {e}") from e
  except ConfigError as e:
    raise ConfigError(f"{path}: {e}") from e
  except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
    # A metadata value of the wrong type (a string or list where a count belongs).
    raise ConfigError(f"{path}: GGUF metadata does not describe a model ({e})") from e
  # llama.cpp permutes q/k rows only when converting to its "llama" architecture (Llama, Mistral).
  permuted = meta.get("general.architecture") == "llama"
  weights = [t for t in reader.tensors if t.name not in _GGUF_CONFIG_TENSORS]

  def tensors():
    for t in weights:
      name = _gguf_to_hf_name(t.name)
      w = _dequantize(gguf, t)
      if permuted and name.endswith("q_proj.weight"):
        w = _unpermute(w, cfg.num_heads)
      elif permuted and name.endswith("k_proj.weight"):
        w = _unpermute(w, cfg.num_kv_heads)
      yield name, w

  def write_tokenizer(dst: str):
    from jax_longctx.checkpoints.gguf_tokenizer import write_tokenizer_files
    write_tokenizer_files(meta, dst, source=path)

  shapes = {_gguf_to_hf_name(t.name): tuple(int(x) for x in reversed(t.shape)) for t in weights}
  return Source(cfg, shapes, tensors, write_tokenizer, path)
