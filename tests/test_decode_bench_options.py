"""benchmarks/decode.py's --kernel-option / --run-option / --decode-tiling parsing
(benchmarks/common.py): each value becomes its field's type, and a field the dataclass lacks is a
one-line exit naming it."""

import pytest

from benchmarks.common import kernel_options, option_fields
from jax_longctx.core.options import RunOptions
from pallas_kernels.gpu import Tiling


def test_values_take_their_fields_types():
  assert option_fields(RunOptions, ["add_norm_backend=none", "prefill_chunk=2048",
                                    "decode_kernel=true", "cache_write_backend=gpu"],
                       "--run-option") == {"add_norm_backend": None, "prefill_chunk": 2048,
                                           "decode_kernel": True, "cache_write_backend": "gpu"}
  assert Tiling(**option_fields(Tiling, "block_keys=64,num_stages=3,prefetch=false".split(","),
                                "--decode-tiling")) == Tiling(block_keys=64, num_stages=3,
                                                              prefetch=False)
  opts = kernel_options(["decode_merge_kernel=false", "prefill_dequantize_bytes=0"])
  assert not opts.decode_merge_kernel and opts.prefill_dequantize_bytes == 0


def test_an_unknown_field_is_one_line():
  with pytest.raises(SystemExit, match="--run-option add_norm=auto: RunOptions has no field "
                                       "'add_norm'"):
    option_fields(RunOptions, ["add_norm=auto"], "--run-option")
