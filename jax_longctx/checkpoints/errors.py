"""The one error type conversion raises for bad checkpoints."""

from jax_longctx.core.errors import LongctxError


class CheckpointError(LongctxError, ValueError):
  """A missing, unreadable, corrupt or inconsistent checkpoint."""
