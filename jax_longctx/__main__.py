"""`python -m jax_longctx ...`: the command line (`jax-longctx`)."""

import sys

from jax_longctx.app.cli import main

if __name__ == "__main__":
  sys.exit(main())
