"""HF directory / GGUF file -> Flax params -> orbax checkpoint, and back to HF safetensors.

A converted checkpoint is a directory:
    config.json      this library's LlamaConfig (format "jax-longctx")
    params/          orbax (StandardCheckpointer), the parameter tree
    tokenizer.json   and the other tokenizer files of the source
Every writer builds the result in a temporary sibling directory and renames it into place, so an
interrupted conversion leaves no destination behind; one writer at a time per destination, and
the scratch of a writer that died is removed by the next (`destination`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Callable, Iterator

import numpy as np

from jax_longctx.checkpoints import destination, layout, safetensors_io
from jax_longctx.checkpoints.sources import CheckpointError, Source, open_source
from jax_longctx.core.config import LlamaConfig, load_config_file, save_config_file
from jax_longctx.model import abstract_model  # the parameter tree's shapes
from jax_longctx.core.progress import progress

FORMAT = "jax-longctx"
_SHARD_BYTES = 4 << 30  # export shard size, as transformers' default 5GB-ish shards


def _dtype_name(dtype) -> str:
  return {"bfloat16": "bfloat16", "float16": "float16"}.get(np.dtype(dtype).name, "float32")


def _first_dtype(source: Source):
  for _, w in source.tensors():
    return w.dtype
  raise CheckpointError("the checkpoint holds no tensors")


def target_config(source: Source) -> tuple[LlamaConfig, np.dtype]:
  """The converted model's config and weight dtype (the first tensor's), checked against the
  file's tensor table."""
  dtype = np.dtype(_first_dtype(source))
  if dtype.kind != "f" and dtype.name != "bfloat16":
    raise CheckpointError(f"unsupported weight dtype {dtype}")
  cfg = source.cfg.replace(dtype=_dtype_name(dtype))
  _check_tensors(source, cfg)
  return cfg, dtype


def hf_shape(rule: layout.Rule, cfg: LlamaConfig, shape: tuple, dtype=np.float32) -> tuple:
  """The HF-layout shape of a parameter of `shape` (traced: nothing is allocated)."""
  import jax
  one = jax.ShapeDtypeStruct(tuple(shape), dtype)
  return tuple(jax.eval_shape(lambda w: rule.to_hf(w, cfg), one).shape)


def _lacks(source: Source, cfg: LlamaConfig, missing: set) -> CheckpointError:
  names = sorted(n for n, r, i in layout.hf_names(cfg) if r.full_path(i) in missing)
  return CheckpointError(f"{source.path}: checkpoint lacks {len(names)} tensors, e.g. {names[:3]}")


def _check_tensors(source: Source, cfg: LlamaConfig) -> None:
  """Refuses a config that the file's own tensor table (read from its headers, before any
  weight) does not bear out, before anything is allocated: the sizes come from the model file,
  and a declared vocabulary or layer count far beyond its tensors must not reserve memory or
  disk."""
  unknown = [n for n in source.names if layout.match(n, cfg) is None and not layout.ignored(n, cfg)]
  if unknown:
    # Loading without them would run another model (e.g. Qwen2 without its q/k/v biases).
    raise CheckpointError(
        f"{source.path}: checkpoint has {len(unknown)} tensors this {cfg.architecture} config "
        f"does not use: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
  # Names first: a declared layer count far beyond the file's is refused before the model's
  # shapes are traced (thousands of layers take minutes).
  expected = {name: (rule, i) for name, rule, i in layout.hf_names(cfg)}
  missing = {rule.full_path(i) for name, (rule, i) in expected.items() if name not in source.shapes}
  if missing:
    raise _lacks(source, cfg, missing)
  _, shapes = abstract_model(cfg)
  known = {}  # (rule, parameter shape) -> HF shape: the layers share a few
  for name, (rule, i) in expected.items():
    key = (rule, layout.get_path(shapes, rule.full_path(i)).shape)
    if key not in known:
      known[key] = hf_shape(rule, cfg, key[1])
    if tuple(source.shapes[name]) != known[key]:
      raise CheckpointError(
          f"{source.path}: tensor {name} has shape {tuple(source.shapes[name])}; the config "
          f"makes it {known[key]}")


def assemble(source: Source, allocate: Callable[[tuple, tuple, np.dtype], np.ndarray],
             desc: str = "converting", planned: tuple[LlamaConfig, np.dtype] | None = None
             ) -> tuple[LlamaConfig, dict]:
  """Fills the parameter tree tensor by tensor. allocate(path, shape, dtype) -> array.
  planned: `target_config(source)` when the caller has it already (it reads a tensor)."""
  cfg, dtype = planned or target_config(source)
  _, shapes = abstract_model(cfg)
  params: dict = {}
  expected = {rule.full_path(i) for _, rule, i in layout.hf_names(cfg)}
  for path in expected:
    layout.set_path(params, path, allocate(path, layout.get_path(shapes, path).shape, dtype))
  seen = set()
  for name, w in progress(source.tensors(), total=source.num_tensors, desc=desc):
    found = layout.match(name, cfg)
    if found is None:
      continue  # layout.ignored (_check_tensors): a tied lm_head copy, rotary buffers
    rule, i = found
    target = layout.get_path(params, rule.full_path(i))
    value = rule.to_flax(np.asarray(w), cfg)
    if value.shape != target.shape:
      raise CheckpointError(f"{name}: shape {w.shape} does not fit the config ({target.shape})")
    target[...] = value.astype(dtype)
    seen.add(rule.full_path(i))
  if expected - seen:  # the tensor table promised them (_check_tensors)
    raise _lacks(source, cfg, expected - seen)
  return cfg, params


def load_source(src: str) -> tuple[LlamaConfig, dict, Source]:
  """Reads an HF directory or GGUF file into numpy params in memory."""
  source = open_source(src)
  cfg, params = assemble(source, lambda path, shape, dtype: np.empty(shape, dtype),
                         desc=f"loading {os.path.basename(src.rstrip('/'))}")
  return cfg, params, source


@contextlib.contextmanager
def atomic_dir(dst: str, overwrite: bool = False, need: int | None = None,
               at_least: int | None = None) -> Iterator[str]:
  """Yields a temporary directory that becomes `dst` only if the block finishes.

  Under dst's writer lock (`destination`): a second writer waits for the first, and scratch left
  by a writer that died is removed first. need, at_least: about the peak bytes the block writes,
  and what it writes for sure (`destination.writing`); a full disk is one CheckpointError line
  naming dst, with nothing left behind.
  """
  dst = os.path.abspath(dst)
  with destination.writer_lock(dst) as waited:
    if os.path.exists(dst) and not overwrite:
      by = " (written by the process this one waited for)" if waited else ""
      raise FileExistsError(f"{dst} exists{by}; pass overwrite=True (--overwrite) to replace it")
    with destination.writing(dst, need, at_least=at_least) as tmp:
      yield tmp
      if overwrite and os.path.exists(dst):
        old = destination.new_scratch(dst, kind="old")
        os.rename(dst, os.path.join(old, "x"))
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
      else:
        _rename_new(tmp, dst)


def _rename_new(tmp: str, dst: str) -> None:
  # rename(2) would silently replace an empty directory at dst. Under the lock dst was absent at
  # the start; only a writer that bypasses it (on another host, see `destination`) adds one.
  if os.path.lexists(dst):
    raise FileExistsError(f"{dst} was written by another writer meanwhile; not replacing it")
  os.rename(tmp, dst)


def save_orbax(params: dict, directory: str) -> None:
  import orbax.checkpoint as ocp
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(os.path.abspath(directory), "params"), params)
  ckptr.wait_until_finished()


def _memmap(fname: str, shape: tuple, dtype) -> np.ndarray:
  out = np.lib.format.open_memmap(fname, mode="w+", dtype=dtype, shape=shape)
  if hasattr(os, "posix_fallocate"):
    # A store into a memory map that the disk cannot back kills the process (SIGBUS) instead of
    # raising; reserving the blocks now turns a full disk into an OSError (ENOSPC) here.
    with open(fname, "r+b") as f:
      os.posix_fallocate(f.fileno(), 0, os.path.getsize(fname))
  return out


def convert(src: str, dst: str, overwrite: bool = False) -> LlamaConfig:
  """Converts an HF directory or GGUF file into an orbax checkpoint directory at `dst`.

  Tensors stream through memory-mapped scratch files, so peak memory stays about one tensor.
  """
  source = open_source(src)
  cfg, dtype = planned = target_config(source)
  # Peak disk use: the memory-mapped scratch and the orbax copy of every weight at once. Orbax
  # compresses (the default model's 538 MB of fp32 weights took 337 MB), so only the scratch is
  # sure: less free space than that refuses at once, and 2x is what the error names.
  weights = cfg.num_params() * dtype.itemsize
  with atomic_dir(dst, overwrite, need=2 * weights, at_least=weights) as tmp:
    scratch = os.path.join(tmp, ".scratch")
    os.makedirs(scratch)

    def allocate(path, shape, dtype):
      return _memmap(os.path.join(scratch, "_".join(map(str, path)) + ".npy"), shape, dtype)

    cfg, params = assemble(source, allocate, desc=f"converting {os.path.basename(src)}",
                           planned=planned)
    save_orbax(params, tmp)
    del params
    shutil.rmtree(scratch)
    save_config_file(cfg, tmp)
    source.write_tokenizer(tmp)
  return cfg


def convert_once(src: str, dst: str) -> str:
  """`dst`, converted from `src` first unless a finished checkpoint (its config.json) is there.

  Processes that start at once (several eval jobs sharing a GPU and a fresh cache) take turns on
  dst's writer lock: one converts, the others wait and then find it finished. Without the lock,
  four such jobs on an H200 all converted and one failed reading the checkpoint ("Truncated
  Zstd-compressed stream")."""
  return destination.once(dst, lambda: os.path.exists(os.path.join(dst, "config.json")),
                          lambda: convert(src, dst))


def restore(directory: str, dtype=None, sharding=None) -> tuple[LlamaConfig, dict]:
  """Loads a converted checkpoint's params (optionally cast to `dtype`, placed with `sharding`:
  one for every leaf, or a function of the config giving a tree of them, with which each
  process reads only its devices' shards)."""
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
  if callable(sharding):
    target = jax.tree.map(lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w),
                          shapes, sharding(cfg))
  else:
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                          shapes)
  try:
    params = ocp.StandardCheckpointer().restore(params_dir, target)
  except Exception as e:  # orbax/tensorstore raise many types for damaged checkpoints
    raise CheckpointError(f"{params_dir}: cannot restore params ({type(e).__name__}: {e})") from e
  # Orbax restores the shapes stored, whatever the target says: a config.json edited after
  # conversion would otherwise describe other weights than those loaded.
  stored = jax.tree_util.tree_leaves_with_path(params)
  for (key, leaf), want in zip(stored, jax.tree.leaves(shapes)):
    if tuple(leaf.shape) != tuple(want.shape):
      raise CheckpointError(f"{cfg_path}: does not fit the params stored beside it (params"
                            f"{jax.tree_util.keystr(key)} is {tuple(leaf.shape)}, the config "
                            f"makes it {tuple(want.shape)})")
  return cfg, jax.tree.map(jax.numpy.asarray, params)


def export_hf(params: dict, cfg: LlamaConfig, dst: str, tokenizer_dir: str | None = None,
              overwrite: bool = False) -> None:
  """Writes an HF Llama directory (config.json + safetensors, sharded with an index if large)."""
  import jax

  if cfg.key_smoothing:  # HF has no such weights; q/k would export scaled by them
    raise CheckpointError("export_hf takes the weights as loaded, not smoothed for an 8-bit "
                          "cache (load without kv_dtype, or with smooth_keys=False)")
  entries = layout.hf_names(cfg)
  specs, shards, size = {}, [[]], 0
  for name, rule, i in entries:
    leaf = layout.get_path(params, rule.full_path(i))
    shape = hf_shape(rule, cfg, leaf.shape, leaf.dtype)
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

  need = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype, _, _ in specs.values())
  with atomic_dir(dst, overwrite, need) as tmp:
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
        wanted = name.startswith("tokenizer") or name in ("special_tokens_map.json",
                                                          "generation_config.json")
        # isfile: a regular file (or a link to one), never a device or pipe that copies forever.
        if wanted and os.path.isfile(os.path.join(tokenizer_dir, name)):
          shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
