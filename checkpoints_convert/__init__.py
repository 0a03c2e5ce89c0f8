"""The conversion tool: `python -m checkpoints_convert SRC DST` (as `jax-longctx convert`), and
its names for scripts (`from checkpoints_convert import convert`).

The formats themselves live in `jax_longctx.checkpoints`, below the library's `load()`, which
reads them: a package above jax_longctx keeps the imports between the two one way.
"""

from jax_longctx.checkpoints import (FORMAT, CheckpointError, atomic_dir, convert, convert_once,
                                     export_hf, load_source, restore)

__all__ = ["FORMAT", "CheckpointError", "atomic_dir", "convert", "convert_once", "export_hf",
           "load_source", "restore"]
