"""Tensor operations the methods build on: attention with its log-sum-exp over a cache, the
cache pytrees, the n largest entries of a row."""
