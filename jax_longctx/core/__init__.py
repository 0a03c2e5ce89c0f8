"""What every layer stands on: the model config and its families, RoPE, the run options, the
library's errors, progress bars. Imports nothing of jax_longctx above it."""
