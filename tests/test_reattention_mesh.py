"""Mesh ReAttention (jax_longctx/methods/reattention.py MeshReAttention) equals one-device ReAttention
on 8 fake CPU devices; the checks run in one process of their own (the device count is fixed when
JAX starts): tests/helpers/reattention_mesh_checks.py says what each one checks."""

import numpy as np
import pytest

from tests.conftest import run_on_eight_devices


@pytest.mark.parametrize("name", ["layer", "layer_tied", "layer_gpu_kernels", "model",
                                  "stride_model", "resa_model", "errors", "cyclic_layer_tied",
                                  "cyclic_layer_gpu_kernels", "cyclic_model",
                                  "cyclic_resa_model", "int4_layer", "int4_cyclic_layer_gpu_kernels",
                                  "int4_model", "int4_resa_model"])
def test_on_eight_devices(name, request):
  run_on_eight_devices("tests.helpers.reattention_mesh_checks", name, request)


@pytest.mark.parametrize("name", ["reattention_mesh", "resa_mesh"])
def test_on_one_device_the_driver_matches_the_one_device_method(tiny, name):
  """The one road for a method that splits the tokens (this process: a mesh of one device, the
  shard the whole cache): the same greedy tokens as the one-device method."""
  from jax_longctx.run.driver import generate
  from jax_longctx.methods import get
  from tests.helpers.reattention_mesh_checks import HP
  cfg, params = tiny
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (41, 26)]
  if name == "resa_mesh":
    entry = get(name, base_args=tuple(HP.items()))
    one = get("resa", base="reattention", base_args=tuple(HP.items()))
  else:
    entry, one = get(name, **HP), get("reattention", **HP)
  want = generate(params, cfg, prompts, one, max_new_tokens=4, cache_len=64)
  got = generate(params, cfg, prompts, entry, max_new_tokens=4, cache_len=64)
  assert got.tokens == want.tokens and got.report == {"devices": 1}
