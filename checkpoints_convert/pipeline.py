"""HF directory / GGUF file -> Flax params -> orbax checkpoint, and back to HF safetensors.

A converted checkpoint is a directory:
    config.json      this library's LlamaConfig (format "jax-longctx")
    params/          orbax (StandardCheckpointer), the parameter tree
    tokenizer.json   and the other tokenizer files of the source
Every writer builds the result in a temporary sibling directory and renames it into place, so an
interrupted conversion leaves no destination behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from typing import Callable, Iterator

import numpy as np

from checkpoints_convert import layout, safetensors_io
from checkpoints_convert.sources import CheckpointError, Source, open_source
from jax_longctx.config import LlamaConfig, load_config_file, save_config_file
from jax_longctx.model import abstract_model  # the parameter tree's shapes
from jax_longctx.progress import progress

FORMAT = "jax-longctx"
_SHARD_BYTES = 4 << 30  # export shard size, as transformers' default 5GB-ish shards


def _dtype_name(dtype) -> str:
  return {"bfloat16": "bfloat16", "float16": "float16"}.get(np.dtype(dtype).name, "float32")


def _first_dtype(source: Source):
  for _, w in source.tensors():
    return w.dtype
  raise CheckpointError("the checkpoint holds no tensors")


def assemble(source: Source, allocate: Callable[[tuple, tuple, np.dtype], np.ndarray],
             desc: str = "converting") -> tuple[LlamaConfig, dict]:
  """Fills the parameter tree tensor by tensor. allocate(path, shape, dtype) -> array."""
  dtype = np.dtype(_first_dtype(source))
  if dtype.kind != "f" and dtype.name != "bfloat16":
    raise CheckpointError(f"unsupported weight dtype {dtype}")
  cfg = source.cfg.replace(dtype=_dtype_name(dtype))
  _, shapes = abstract_model(cfg)
  params: dict = {}
  expected = {rule.full_path(i) for _, rule, i in layout.hf_names(cfg)}
  for path in expected:
    layout.set_path(params, path, allocate(path, layout.get_path(shapes, path).shape, dtype))
  unknown = [n for n in source.names if layout.match(n, cfg) is None and not layout.ignored(n, cfg)]
  if unknown:
    # Loading without them would run another model (e.g. Qwen2 without its q/k/v biases).
    raise CheckpointError(
        f"checkpoint has {len(unknown)} tensors this {cfg.architecture} config does not use: "
        f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
  seen = set()
  for name, w in progress(source.tensors(), total=source.num_tensors, desc=desc):
    found = layout.match(name, cfg)
    if found is None:
      continue  # layout.ignored (checked above): a tied lm_head copy, rotary buffers
    rule, i = found
    target = layout.get_path(params, rule.full_path(i))
    value = rule.to_flax(np.asarray(w), cfg)
    if value.shape != target.shape:
      raise CheckpointError(f"{name}: shape {w.shape} does not fit the config ({target.shape})")
    target[...] = value.astype(dtype)
    seen.add(rule.full_path(i))
  missing = expected - seen
  if missing:
    names = sorted(n for n, r, i in layout.hf_names(cfg) if r.full_path(i) in missing)
    raise CheckpointError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:3]}")
  return cfg, params


def load_source(src: str) -> tuple[LlamaConfig, dict, Source]:
  """Reads an HF directory or GGUF file into numpy params in memory."""
  source = open_source(src)
  cfg, params = assemble(source, lambda path, shape, dtype: np.empty(shape, dtype),
                         desc=f"loading {os.path.basename(src.rstrip('/'))}")
  return cfg, params, source


@contextlib.contextmanager
def atomic_dir(dst: str, overwrite: bool = False) -> Iterator[str]:
  """Yields a temporary directory that becomes `dst` only if the block finishes."""
  dst = os.path.abspath(dst)
  if os.path.exists(dst) and not overwrite:
    raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
  parent = os.path.dirname(dst)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=parent)
  try:
    yield tmp
    if os.path.exists(dst):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=parent)
      os.rename(dst, os.path.join(old, "x"))
      os.rename(tmp, dst)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(tmp, dst)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def save_orbax(params: dict, directory: str) -> None:
  import orbax.checkpoint as ocp
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(os.path.abspath(directory), "params"), params)
  ckptr.wait_until_finished()


def convert(src: str, dst: str, overwrite: bool = False) -> LlamaConfig:
  """Converts an HF directory or GGUF file into an orbax checkpoint directory at `dst`.

  Tensors stream through memory-mapped scratch files, so peak memory stays about one tensor.
  """
  source = open_source(src)
  with atomic_dir(dst, overwrite) as tmp:
    scratch = os.path.join(tmp, ".scratch")
    os.makedirs(scratch)

    def allocate(path, shape, dtype):
      fname = os.path.join(scratch, "_".join(map(str, path)) + ".npy")
      return np.lib.format.open_memmap(fname, mode="w+", dtype=dtype, shape=shape)

    cfg, params = assemble(source, allocate, desc=f"converting {os.path.basename(src)}")
    save_orbax(params, tmp)
    del params
    shutil.rmtree(scratch)
    save_config_file(cfg, tmp)
    source.write_tokenizer(tmp)
  return cfg


def convert_once(src: str, dst: str) -> str:
  """`dst`, converted from `src` first unless a finished checkpoint (its config.json) is there.

  Processes that start at once (several eval jobs sharing a GPU and a fresh cache) take turns on
  a lock file beside `dst`: one converts, the others wait and then find it finished. Without the
  lock, four such jobs on an H200 all converted and one failed reading the checkpoint
  ("Truncated Zstd-compressed stream")."""
  done = os.path.join(dst, "config.json")
  if os.path.exists(done):
    return dst
  os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
  lock_path = os.path.abspath(dst) + ".lock"
  with open(lock_path, "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not os.path.exists(done):
      try:
        convert(src, dst)
      finally:
        # No leftovers in the cache. Safe while others wait on this file: they hold it open and
        # find config.json once they get the lock; a later arrival finds it without locking.
        os.remove(lock_path)
  return dst


def restore(directory: str, dtype=None, sharding=None) -> tuple[LlamaConfig, dict]:
  """Loads a converted checkpoint's params (optionally cast to `dtype`, placed with `sharding`)."""
  import jax
  import orbax.checkpoint as ocp

  cfg_path = os.path.join(directory, "config.json")
  params_dir = os.path.join(os.path.abspath(directory), "params")
  if not (os.path.exists(cfg_path) and os.path.isdir(params_dir)):
    raise CheckpointError(f"{directory}: not a converted checkpoint (needs config.json and params/)")
  try:
    cfg = load_config_file(cfg_path)
  except (json.JSONDecodeError, TypeError, KeyError) as e:
    raise CheckpointError(f"{cfg_path}: corrupt config ({e})") from e
  if dtype is not None:
    cfg = cfg.replace(dtype=_dtype_name(dtype))
  _, shapes = abstract_model(cfg)
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
  try:
    params = ocp.StandardCheckpointer().restore(params_dir, target)
  except Exception as e:  # orbax/tensorstore raise many types for damaged checkpoints
    raise CheckpointError(f"{params_dir}: cannot restore params ({type(e).__name__}: {e})") from e
  return cfg, jax.tree.map(jax.numpy.asarray, params)


def export_hf(params: dict, cfg: LlamaConfig, dst: str, tokenizer_dir: str | None = None,
              overwrite: bool = False) -> None:
  """Writes an HF Llama directory (config.json + safetensors, sharded with an index if large)."""
  import jax

  entries = layout.hf_names(cfg)
  specs, shards, size = {}, [[]], 0
  for name, rule, i in entries:
    leaf = layout.get_path(params, rule.full_path(i))
    one = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    shape = tuple(jax.eval_shape(lambda w, rule=rule: rule.to_hf(w, cfg), one).shape)
    nbytes = int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    if size and size + nbytes > _SHARD_BYTES:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
    specs[name] = (shape, np.dtype(leaf.dtype), rule, i)

  def produce(name):
    _, _, rule, i = specs[name]
    return rule.to_hf(np.asarray(layout.get_path(params, rule.full_path(i))), cfg)

  with atomic_dir(dst, overwrite) as tmp:
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for fname, names in progress(list(zip(files, shards)), desc="exporting"):
      safetensors_io.write(os.path.join(tmp, fname),
                           {n: specs[n][:2] for n in names}, produce)
    if len(shards) > 1:
      weight_map = {n: f for f, names in zip(files, shards) for n in names}
      with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(cfg.to_hf(), f, indent=1)
    if tokenizer_dir:
      for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json",
                                                    "generation_config.json"):
          shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
