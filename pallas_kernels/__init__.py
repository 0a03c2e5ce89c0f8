"""Pallas kernels (fused score+top-k, attention with log-sum-exp) for GPU and TPU.

Empty until the kernels land; jax_longctx.attention holds the jnp paths they will replace.
"""
