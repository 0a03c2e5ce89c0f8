"""Attention methods: one file each, all reachable through the registry."""

from jax_longctx.methods.base import (AttnContext, Budget, MeshMethod, Method, MethodError,
                                      PrefillEnd, RegisteredMethod, args_per_method, get, names,
                                      parse_method_args, register, resolve_budget)
from jax_longctx.methods.full import Full

__all__ = ["AttnContext", "Budget", "Full", "MeshMethod", "Method", "MethodError", "PrefillEnd",
           "RegisteredMethod", "args_per_method", "get", "names", "parse_method_args", "register", "resolve_budget"]

# Importing a method module registers it.
from jax_longctx.methods import (citrus, h2o, quest, reattention,  # noqa: E402,F401
                                 reattention_mesh, refreshkv, resa, snapkv, star,
                                 streaming_llm, topk, tova)
