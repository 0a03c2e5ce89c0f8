"""Checkpoint conversion: Hugging Face safetensors directories and GGUF files to Flax params
stored with orbax, and back to Hugging Face safetensors."""

from checkpoints_convert.convert import (FORMAT, atomic_dir, convert, export_hf, load_source,
                                         restore)
from checkpoints_convert.sources import CheckpointError

__all__ = ["FORMAT", "CheckpointError", "atomic_dir", "convert", "export_hf", "load_source",
           "restore"]
