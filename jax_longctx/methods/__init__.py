"""Attention methods: one file each, all reachable through the registry."""

from jax_longctx.methods.base import (AttnContext, Method, MethodError, get, names,
                                      parse_method_args, register)
from jax_longctx.methods.full import Full

__all__ = ["AttnContext", "Full", "Method", "MethodError", "get", "names", "parse_method_args",
           "register"]
