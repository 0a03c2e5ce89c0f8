"""`python -m checkpoints_convert SRC DST [--overwrite]`: the same as `jax-longctx convert`."""

import sys

from jax_longctx.app.cli import main

if __name__ == "__main__":
  sys.exit(main(["convert", *sys.argv[1:]]))
