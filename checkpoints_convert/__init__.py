"""Checkpoint conversion: Hugging Face safetensors directories and GGUF files to Flax params
stored with orbax, and back to Hugging Face safetensors.

The exports load on first use (PEP 562): the readers and name rules (`sources`, `layout`) stand
on the config alone, so importing them does not load the model that `pipeline` builds on.
"""

import importlib

_EXPORTS = {"FORMAT": "pipeline", "atomic_dir": "pipeline", "convert": "pipeline", "convert_once": "pipeline",
            "export_hf": "pipeline", "load_source": "pipeline", "restore": "pipeline",
            "CheckpointError": "sources"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'checkpoints_convert' has no attribute {name!r}")
  return getattr(importlib.import_module(f"checkpoints_convert.{_EXPORTS[name]}"), name)
