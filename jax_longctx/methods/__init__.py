"""Attention methods, all reachable through the registry.

One file per paper, named after it, holding every registry entry of that paper: its method,
its variants, a baseline the paper defines on its own machinery, and the method over a device
mesh. citrus.py: citrus_standard, citrus_shared, citrus_individual and h2o_shared (the CItruS
paper's "H2O + shared cache", run on CItruS' chunked cache and outer loop); star.py: star and
ring (the Star paper's baseline: ring prefill, then Star's phase 2); reattention.py:
reattention, reattention_mesh; resa.py: resa, resa_mesh; full, streaming_llm, h2o, tova,
snapkv, quest, topk, refreshkv one each. The other modules (base, hparams, slot_cache,
selection, chunk_cache, reattention_scope, token_layout) hold no entry: what several methods
stand on.

Every method class is exported here, spelled as its paper spells the method; importing a class's
module registers it under its registry name (the string the CLI and `get` take)."""

from jax_longctx.methods.base import (AttnContext, Budget, Method, MethodError, PrefillEnd,
                                      RegisteredMethod, TokenShards, args_per_method, get, names,
                                      parse_method_args, register, resolve_budget)
from jax_longctx.methods.citrus import (CItruSIndividual, CItruSShared, CItruSStandard,
                                        H2OShared)
from jax_longctx.methods.full import Full
from jax_longctx.methods.h2o import H2O
from jax_longctx.methods.quest import Quest
from jax_longctx.methods.reattention import MeshReAttention, ReAttention
from jax_longctx.methods.refreshkv import RefreshKV
from jax_longctx.methods.resa import MeshRESA, RESA
from jax_longctx.methods.snapkv import SnapKV
from jax_longctx.methods.star import RingAttention, StarAttention
from jax_longctx.methods.streaming_llm import StreamingLLM
from jax_longctx.methods.topk import TopK
from jax_longctx.methods.tova import TOVA

__all__ = [
    # the interface and the registry
    "AttnContext", "Budget", "Method", "MethodError", "PrefillEnd", "RegisteredMethod",
    "TokenShards", "args_per_method", "get", "names", "parse_method_args", "register",
    "resolve_budget",
    # the methods
    "CItruSIndividual", "CItruSShared", "CItruSStandard", "Full", "H2O", "H2OShared",
    "MeshRESA", "MeshReAttention", "Quest", "RESA", "ReAttention", "RefreshKV", "RingAttention",
    "SnapKV", "StarAttention", "StreamingLLM", "TOVA", "TopK",
]
