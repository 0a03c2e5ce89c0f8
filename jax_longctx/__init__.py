"""jax-longctx: long-context attention methods for Flax Llama models, in JAX and Pallas.

The names below load on first use (PEP 562), so importing a config-level module such as
`jax_longctx.core.config` (checkpoint conversion does) does not load the model, the methods or jax's
compiled steps. `jax_longctx.generate` is the function, defined in `jax_longctx.run.driver`
(`jax_longctx.run.generation` holds the prefill and decode steps it runs). Every error the
library raises derives from `LongctxError`.
"""

import importlib

_EXPORTS = {
    "LM": "jax_longctx.app.api", "load": "jax_longctx.app.api",
    "LlamaConfig": "jax_longctx.core.config", "preset": "jax_longctx.core.config",
    "LongctxError": "jax_longctx.core.errors",
    "GenerationError": "jax_longctx.run.generation", "Sampling": "jax_longctx.run.generation",
    "generate": "jax_longctx.run.driver", "RunOptions": "jax_longctx.core.options",
}
__all__ = sorted([*_EXPORTS, "methods"])
__version__ = "0.1.0"


def __getattr__(name: str):
  if name == "methods":
    return importlib.import_module("jax_longctx.methods")
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
  raise AttributeError(f"module 'jax_longctx' has no attribute {name!r}")


def __dir__():
  return __all__
