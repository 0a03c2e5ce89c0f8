"""benchmarks/decode.py's --kernel-option / --run-option / --decode-tiling parsing
(benchmarks/common.py): each value becomes its field's type, and a field the dataclass lacks is a
one-line exit naming it."""

import pytest

from benchmarks.common import kernel_options, option_fields
from jax_longctx.app.bench_measure import run_options
from jax_longctx.core.options import RunOptions
from pallas_kernels import KernelOptions, Route
from pallas_kernels.gpu import Tiling


def test_values_take_their_fields_types():
  assert option_fields(Route, ["add_norm_backend=none", "decode_kernel=true",
                               "cache_write_backend=gpu"],
                       "--run-option") == {"add_norm_backend": None, "decode_kernel": True,
                                           "cache_write_backend": "gpu"}
  assert option_fields(RunOptions, ["prefill_chunk=2048"], "--run-option") == {
      "prefill_chunk": 2048}
  assert Tiling(**option_fields(Tiling, "block_keys=64,num_stages=3,prefetch=false".split(","),
                                "--decode-tiling")) == Tiling(block_keys=64, num_stages=3,
                                                              prefetch=False)
  opts = kernel_options(["decode_merge_kernel=false", "prefill_dequantize_bytes=0"])
  assert not opts.decode_merge_kernel and opts.prefill_dequantize_bytes == 0


def test_run_options_route_the_kernel_fields():
  """A --run-option naming a field of the route goes to RunOptions.route; the rest to RunOptions."""
  opts = run_options(run_option=["add_norm_backend=none", "prefill_chunk=2048",
                                 "decode_kernel=true", "cache_write_backend=gpu"],
                     kernel_option=["decode_merge_kernel=false"], decode_tiling="block_keys=64")
  assert opts.prefill_chunk == 2048
  assert opts.route == Route(add_norm_backend=None, decode_kernel=True, cache_write_backend="gpu",
                             kernels=KernelOptions(decode_merge_kernel=False),
                             decode_tiling=Tiling(block_keys=64))


def test_an_unknown_field_is_one_line():
  with pytest.raises(SystemExit, match="--run-option add_norm=auto: RunOptions has no field "
                                       "'add_norm'"):
    option_fields(RunOptions, ["add_norm=auto"], "--run-option")


def test_a_value_of_the_wrong_type_is_one_line():
  from pallas_kernels import KernelOptions
  assert option_fields(KernelOptions, ["topk_key_splits=4"], "--kernel-option") == {
      "topk_key_splits": 4}
  with pytest.raises(SystemExit, match="--kernel-option topk_key_splits=four: topk_key_splits "
                                       "takes an integer"):
    option_fields(KernelOptions, ["topk_key_splits=four"], "--kernel-option")
