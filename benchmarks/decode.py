"""Prefill tokens/s and decode ms/token: jax-longctx against transformers, beside the HBM bound and
the GEMM rate measured in the same run. `jax-longctx bench` with this script's defaults (both
impls, records to decode.jsonl); every option of the command works here.

    python -m benchmarks.decode --model llama-3.1-8b --contexts 8192,32768,131072 \
        --batches 1,8 --impls jax,hf --out $OUT/decode.jsonl
    python -m benchmarks.decode --model llama-3.1-70b --meshes model=2 --impls jax ...   # 2 GPUs
    python -m benchmarks.decode --kv-dtypes "none;int8;float8_e4m3fn" ...  # the cache in 8 bits
    python -m benchmarks.decode --contexts 1048576 --fill-cache ...  # decode only, no prefill

`jax-longctx bench --help` says what each option does (jax_longctx/app/bench.py, bench_decode.py
how it is measured). With JAX_LONGCTX_DUMP_HLO=DIR each run also writes its compiled decode loop
to DIR/LABEL_CONTEXT.hlo.txt (where XLA copies buffers shows there).
"""

from __future__ import annotations

import sys

from jax_longctx.app.cli import main as cli_main

DEFAULTS = ["--impls", "jax,hf", "--out", "decode.jsonl"]  # before the user's: theirs win


def main(argv=None) -> int:
  return cli_main(["bench", *DEFAULTS, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
  sys.exit(main())
