"""Streaming safetensors reading and writing with numpy (bf16 through ml_dtypes), no torch.

Reading memory-maps the file and hands out one tensor at a time; writing lays out the header from
shapes known in advance and then streams tensor bytes, so neither holds a whole model in memory.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

from jax_longctx.checkpoints.errors import CheckpointError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsError(CheckpointError):
  pass


def read_header(path: str) -> tuple[dict, int]:
  """(tensor table, byte offset of the data section)."""
  try:
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise SafetensorsError(f"{path}: truncated safetensors file")
      (n,) = struct.unpack("<Q", raw)
      header = json.loads(f.read(n))
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise SafetensorsError(f"{path}: not a readable safetensors file ({e})") from e
  header.pop("__metadata__", None)
  return header, 8 + n


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, read-only array view into the memory-mapped file)."""
  header, base = read_header(path)
  size = os.path.getsize(path)
  data = np.memmap(path, dtype=np.uint8, mode="r")
  for name, info in header.items():
    start, end = info["data_offsets"]
    if base + end > size:
      raise SafetensorsError(f"{path}: tensor {name} runs past the end of the file (corrupt?)")
    if info["dtype"] not in _DTYPES:
      raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
    arr = data[base + start:base + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    yield name, arr


def write(path: str, specs: dict[str, tuple[tuple[int, ...], np.dtype]],
          produce: Callable[[str], np.ndarray], metadata: dict | None = None) -> None:
  """Writes tensors named in `specs` (name -> (shape, dtype)); `produce(name)` makes each one."""
  header: dict = {"__metadata__": metadata or {"format": "pt"}}
  offset = 0
  for name, (shape, dtype) in specs.items():
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, (shape, dtype) in specs.items():
      arr = np.ascontiguousarray(produce(name))
      if arr.shape != tuple(shape) or arr.dtype != np.dtype(dtype):
        raise SafetensorsError(f"{name}: produced {arr.shape} {arr.dtype}, expected {shape} {dtype}")
      f.write(arr.tobytes())
