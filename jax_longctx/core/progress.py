"""Progress bars for long work (conversion, sweeps, training), on stderr."""

from __future__ import annotations

import os
import sys


def progress(iterable, total=None, desc=None, **kw):
  """tqdm when installed and not silenced (JAX_LONGCTX_QUIET=1), else the iterable itself."""
  if os.environ.get("JAX_LONGCTX_QUIET"):
    return iterable
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return iterable
  return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True,
              mininterval=1.0, **kw)
