"""Streaming safetensors reading and writing with numpy (bf16 through ml_dtypes), no torch.

Reading memory-maps the file and hands out one tensor at a time; writing lays out the header from
shapes known in advance and then streams tensor bytes, so neither holds a whole model in memory.
"""

from __future__ import annotations

import json
import math
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


_MAX_HEADER = 100 << 20  # bytes; the safetensors library's own limit


def _counts(v, n: int | None = None) -> bool:
  """Whether v is a list (of n) non-negative integers."""
  return isinstance(v, list) and (n is None or len(v) == n) and all(
      isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _check_entry(path: str, name: str, info, base: int, size: int) -> None:
  """One tensor's header entry, refused unless its bytes lie in the data section and hold
  exactly its shape: a header is data from the file, and a wrong offset would read other bytes
  as weights."""
  if not isinstance(info, dict):
    raise SafetensorsError(f"{path}: tensor {name} has no header entry")
  dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
  if not isinstance(dtype, str) or dtype not in _DTYPES:
    raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {dtype}")
  if not _counts(shape) or not _counts(offsets, 2) or offsets[0] > offsets[1]:
    raise SafetensorsError(f"{path}: tensor {name} has a malformed shape or data_offsets")
  if base + offsets[1] > size:
    raise SafetensorsError(f"{path}: tensor {name} runs past the end of the file (corrupt?)")
  if offsets[1] - offsets[0] != math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize:
    raise SafetensorsError(f"{path}: tensor {name}'s {offsets[1] - offsets[0]} bytes do not hold "
                           f"its shape {shape} of {dtype}")


def read_header(path: str) -> tuple[dict, int]:
  """(tensor table, byte offset of the data section), every entry checked against the file."""
  try:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      raw = f.read(8)
      if len(raw) != 8:
        raise SafetensorsError(f"{path}: truncated safetensors file")
      (n,) = struct.unpack("<Q", raw)
      if n > min(_MAX_HEADER, size - 8):  # read before anything allocates n bytes
        raise SafetensorsError(f"{path}: header of {n} bytes does not fit the file (corrupt?)")
      header = json.loads(f.read(n))
  except SafetensorsError:
    raise
  except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or UTF-8
    raise SafetensorsError(f"{path}: not a readable safetensors file ({e})") from e
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path}: not a readable safetensors file (header is not an object)")
  header.pop("__metadata__", None)
  for name, info in header.items():
    _check_entry(path, name, info, 8 + n, size)
  return header, 8 + n


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, read-only array view into the memory-mapped file)."""
  header, base = read_header(path)
  data = np.memmap(path, dtype=np.uint8, mode="r")
  for name, info in header.items():
    start, end = info["data_offsets"]
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
