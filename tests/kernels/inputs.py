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


def with_outliers(rng, x, channels=(3, 17), low=20.0, high=50.0):
  """x with a few head-dim channels 20-50x larger, as KIVI reports for keys (quantization's hard
  case: one scale per row must cover them)."""
  big = rng.uniform(low, high, len(channels))
  factor = jnp.ones(x.shape[-1]).at[jnp.asarray(channels)].set(big)
  return (x.astype(jnp.float32) * factor).astype(x.dtype)
