"""The 4-bit KV cache on 8 fake CPU devices (tests/helpers/tensor_parallel_checks.py
`quantized_int4`): every method that stores 4 bits on (data 2, model 2) against one device with
the same cache, its scales and zero points split with their rows and heads; `mesh_methods_int4`:
Star, ring, mesh ReAttention and RESA over 4 bits on ctx x model against ctx alone. Apart from the
8-bit caches' tests/test_kv_quant_mesh.py, whose one process took 260 s with it (the 4-bit pass
60-70 s of that, 2 cores), so that `pytest --dist loadfile` can run the two on two workers: the
8-bit file is scheduled near the end of a run (xdist orders files by their number of tests),
where a long file runs on one worker while the other has nothing left."""

import pytest

from tests.conftest import run_on_eight_devices


@pytest.mark.parametrize("name", ["quantized_int4", "mesh_methods_int4"])
def test_on_eight_devices(name, request):
  run_on_eight_devices("tests.helpers.tensor_parallel_checks", name, request)
