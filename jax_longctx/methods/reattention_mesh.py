"""ReAttention over a device mesh as a registry entry (`reattention_mesh`: its settings).

The pre-RoPE cache is split along the tokens into contiguous equal shards, one per device of the
mesh's context axis, so a context N times longer than one device holds fits N devices. Every
step selects exactly the scope one device would (each device scores its shard, the candidates
are merged) and each device attends to the part of the scope it holds; the parts merge by their
log-sum-exp. The per-device steps and the driver are in `jax_longctx.distributed.
reattention_mesh`; `jax_longctx.driver` routes this entry there (`MeshMethod.layer_method`).
"""

from __future__ import annotations

import dataclasses

from jax_longctx.methods.base import MeshMethod, register
from jax_longctx.methods.reattention import ReAttention, ReAttentionSettings


@register
@dataclasses.dataclass(frozen=True)
class MeshReAttention(ReAttentionSettings, MeshMethod):
  """ReAttention's hyper-parameters (the paper's defaults); the prompt is read whole."""

  name = "reattention_mesh"
  needs_instruction = False

  def layer_method(self) -> ReAttention:
    return ReAttention(**self.hparams())
