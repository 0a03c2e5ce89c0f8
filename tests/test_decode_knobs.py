"""Switches of the decode step that benchmarks/decode_profile.py's variants set (issue 21,
point 3): each reaches the code it is meant to change, and changes no result."""

import jax.numpy as jnp

from jax_longctx.methods import full
from pallas_kernels import Tiling


def test_full_passes_decode_tiling(monkeypatch):
  """Full.attend_cache hands DECODE_TILING to the kernel on one-token steps."""
  seen = []
  monkeypatch.setattr(full, "decode_uses_kernel", lambda: True)
  monkeypatch.setattr(full.pallas_kernels, "flash_attention",
                      lambda *a, tiling=None, **kw: seen.append(tiling) or (None, None))
  monkeypatch.setattr(full, "DECODE_TILING", Tiling(key_splits=64))
  state = full.KVCache(jnp.ones((1, 2, 8, 4)), jnp.ones((1, 2, 8, 4)))
  ctx = type("Ctx", (), {"q_pos": jnp.asarray([[3]])})()
  full.Full().attend_cache(state, jnp.ones((1, 1, 4, 4)), ctx)
  assert seen == [Tiling(key_splits=64)]
