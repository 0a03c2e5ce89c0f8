"""Random kernel inputs (never zeros) shared by the kernel tests."""

import jax.numpy as jnp


def small_ints(rng, shape, dtype=jnp.bfloat16):
  """Nonzero integers in [-3, 3]: dot products are exact in fp32, so top-k indices can be compared
  exactly with the reference, and equal scores (ties) are frequent."""
  x = rng.integers(1, 4, shape) * rng.choice([-1, 1], shape)
  return jnp.asarray(x, dtype)


def normal(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def keys_shape(b, t, kvh, d, kv_layout):
  return (b, t, kvh, d) if kv_layout == "BTHD" else (b, kvh, t, d)
