"""The one base class of every error this library raises on purpose.

Stdlib only, at the bottom of the import layers (tests/test_import_layers.py), so every package
(pallas_kernels, checkpoints_convert's readers, train_cpt's settings) can derive from it; the
package's lazy __init__ makes `import jax_longctx.core.errors` load nothing else.
"""


class LongctxError(Exception):
  """Base of the library's errors: `except jax_longctx.LongctxError` catches them all.

  An Exception, not a ValueError: each error also subclasses the builtin it always had
  (ValueError for bad input, FileNotFoundError for a missing model package), so `except
  ValueError` catches exactly what it caught before."""
