"""The one error type conversion raises for bad checkpoints."""


class CheckpointError(ValueError):
  """A missing, unreadable, corrupt or inconsistent checkpoint."""
