"""The 8-bit KV cache on 8 fake CPU devices (tests/helpers/tensor_parallel_checks.py `quantized`,
`hlo_no_cache_gather_int8`, `smoothed`): every per-layer method with an int8 cache and two
with fp8 on (data 2, model 2) against one device with the same cache, mesh ReAttention's on
(ctx 2, model 2), no all-gather of a cache's size with an int8 cache, and key smoothing
calibrated on a mesh that copies KV heads as on one device. A file of its own (and the 4-bit
cache's tests/test_kv_int4_mesh.py another) so that `pytest -n 2 --dist loadfile` can run it
on another worker than test_tensor_parallel*.py."""

import pytest

from tests.conftest import run_on_eight_devices


@pytest.mark.parametrize("name", ["quantized", "hlo_no_cache_gather_int8", "smoothed"])
def test_on_eight_devices(name, request):
  run_on_eight_devices("tests.helpers.tensor_parallel_checks", name, request)
