"""ReAttention over a device mesh as registry entries: `reattention_mesh` (its settings) and
`resa_mesh` (RESA's prior over it).

The pre-RoPE cache is split along the tokens into contiguous equal shards, one per device of the
mesh's context axis, so a context N times longer than one device holds fits N devices. Every
step selects exactly the scope one device would (each device scores its shard, the candidates
are merged) and each device attends to the part of the scope it holds; the parts merge by their
log-sum-exp. The per-device steps and the driver are in `jax_longctx.distributed.
reattention_mesh`; `jax_longctx.driver` routes these entries there (`MeshMethod.layer_method`).
"""

from __future__ import annotations

import dataclasses

from jax_longctx.methods.base import MeshMethod, register
from jax_longctx.methods.reattention import ReAttention, ReAttentionSettings
from jax_longctx.methods.resa import Prior, Resa


@register
@dataclasses.dataclass(frozen=True)
class MeshReAttention(ReAttentionSettings, MeshMethod):
  """ReAttention's hyper-parameters (the paper's defaults); the prompt is read whole.
  shard_block: how the tokens lie on the devices (no paper has it): 0, contiguous shards; > 0
  (a multiple of `chunk`), blocks of that many tokens dealt to the devices in turn, which
  balances the causal prefill's scoring (distributed/shard_layout.py)."""

  name = "reattention_mesh"
  needs_instruction = False

  shard_block: int = 0

  def layer_method(self) -> ReAttention:
    fields = dataclasses.fields(ReAttentionSettings)
    return ReAttention(**{f.name: getattr(self, f.name) for f in fields})


@register
@dataclasses.dataclass(frozen=True)
class MeshResa(MeshMethod):
  """RESA over mesh ReAttention (its prior pre-RoPE: methods/resa.py says why). `base_args`:
  ReAttention's hyper-parameters, e.g. (("n_local", 2048),); the defaults are RESA's."""

  name = "resa_mesh"
  needs_instruction = False

  lam: float = Resa.lam
  prior: Prior = Resa.prior
  base_args: tuple = Resa.base_args
  prior_distance: int | None = Resa.prior_distance
  shard_block: int = 0  # as MeshReAttention's

  def __post_init__(self):
    super().__post_init__()
    self.layer_method()  # a wrong base_args fails at construction

  def layer_method(self) -> Resa:
    return Resa(base=ReAttention.name, lam=self.lam, prior=self.prior, base_args=self.base_args,
                prior_distance=self.prior_distance)
