"""Checkpoints: Hugging Face safetensors directories and GGUF files read into Flax params
(sources, layout, gguf_tokenizer, safetensors_io), stored with orbax and exported back to
Hugging Face safetensors (pipeline), one writer per destination (destination).

The exports load on first use (PEP 562), so a reader does not load the model the pipeline needs.
"""

import importlib

_EXPORTS = {"FORMAT": "pipeline", "atomic_dir": "pipeline", "convert": "pipeline",
            "convert_once": "pipeline", "export_hf": "pipeline", "load_source": "pipeline",
            "restore": "pipeline", "CheckpointError": "sources"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jax_longctx.checkpoints' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"jax_longctx.checkpoints.{_EXPORTS[name]}"), name)
  globals()[name] = value
  return value
