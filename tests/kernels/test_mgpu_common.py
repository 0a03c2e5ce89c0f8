"""What the Mosaic GPU kernels share (pallas_kernels/mgpu_common.py) that runs apart from them."""

import pytest

from pallas_kernels import mgpu_common


def test_a_jax_without_the_interpreter_fails_clearly(monkeypatch):
  """jax's Mosaic GPU interpreter is a private module: without it, asking to interpret says why
  (one line naming the way out) instead of an ImportError from inside a kernel call."""
  monkeypatch.setattr(mgpu_common, "_interpreter_params_class", lambda: (None, "gone"))
  assert mgpu_common.interpreter_available() == "gone"
  assert mgpu_common.interpret_params(False) is None
  with pytest.raises(NotImplementedError, match="off a GPU: gone; run them on a Hopper GPU"):
    mgpu_common.interpret_params(True)


def test_the_interpreter_of_this_jax_is_found_or_said_missing():
  params, why = mgpu_common._interpreter_params_class()
  assert (params is None) == (why is not None)
  if params is not None:
    assert isinstance(mgpu_common.interpret_params(True), params)
