"""Star Attention and ring attention as registry entries (`MeshMethod`s: their settings).

Acharya et al., "Star Attention: Efficient LLM Inference over Long Sequences", 2024
(arXiv:2411.17116). Not per-layer steps like the other methods: the context is encoded across
the devices of a mesh axis and the query merges every device's attention, so they run through
`jax_longctx.run.distributed.generate_distributed` (`jax_longctx.run.driver` routes them there).

`ring` is here and not in a ring.py of its own because it is the Star paper's baseline as the
paper runs it, not Ring Attention's method: ring prefill over the context, then Star's phase 2
for the query and the answer (both in distributed/star.py); only the prefill differs.
"""

from __future__ import annotations

import dataclasses

from jax_longctx.methods.base import MeshMethod, register


@register
@dataclasses.dataclass(frozen=True)
class StarAttention(MeshMethod):
  """Phase 1: anchor + block rows encoded in parallel; phase 2: exact merged attention."""

  name = "star"

  block_size: int = 0  # 0: a quarter of the context (the paper's setting)
  anchor_size: int = -1  # -1: the block size (the paper's setting)
  # The anchor computed once and its KV sent to every device (same outputs); False runs it in
  # every block's row, as the authors' code does.
  shared_anchor: bool = True

  def settings(self) -> dict:
    return {"block_size": self.block_size or None,
            "anchor_size": None if self.anchor_size < 0 else self.anchor_size,
            "shared_anchor": self.shared_anchor}


@register
@dataclasses.dataclass(frozen=True)
class RingAttention(MeshMethod):
  """Exact prefill with K/V passed around the ring, then Star's phase 2 (the paper's baseline)."""

  name = "ring"
