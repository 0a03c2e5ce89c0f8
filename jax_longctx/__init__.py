"""jax-longctx: long-context attention methods for Flax Llama models, in JAX and Pallas."""

from jax_longctx import methods
from jax_longctx.api import LM, load
from jax_longctx.config import LlamaConfig, ModelConfig, preset
from jax_longctx.generate import GenerationError, Sampling, generate

__all__ = ["LM", "GenerationError", "LlamaConfig", "ModelConfig", "Sampling", "generate", "load",
           "methods", "preset"]
__version__ = "0.1.0"
