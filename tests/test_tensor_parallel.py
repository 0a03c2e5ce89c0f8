"""Tensor- and data-parallel inference (`RunOptions.mesh`, `load(mesh=...)`) on 8 fake CPU
devices, the 16-head / 2-KV-head model's half of tests/helpers/tensor_parallel_checks.py (its
module doc says which methods run on which meshes, and why that choice), in one process: every
per-layer method, the mesh methods with heads over `model`, no cache-sized all-gather, bad meshes,
fused projections and the TPU exports. The other head layouts (MHA, Qwen2, the default model's 9
heads and the command line) are tests/test_tensor_parallel_layouts.py: two files, so that
`pytest --dist loadfile` runs the halves on two workers (one file's checks took 678 s of CI's
3,000 s budget on one worker, at the run's end). The halves were split by the checks' measured
times in one process (2 cores): 215 s here, 155 s + 63 s of command line there."""

import pytest

from tests.conftest import run_on_eight_devices


@pytest.mark.parametrize("name", ["all_methods", "meshes_gqa", "mesh_methods",
                                  "hlo_no_cache_gather", "errors", "fused", "tpu_export"])
def test_on_eight_devices(name, request):
  run_on_eight_devices("tests.helpers.tensor_parallel_checks", name, request)
