"""ReAttention that hands every step's scope to the host: the diagnostics' one instrument.

`TracedReAttention` (registered as "reattention_traced") is ReAttention with one more effect:
after each layer selects its scope, a host callback stores the selected cache slots in SCOPES,
keyed by (row, layer, the step's last query position). Decode steps only by default (`steps`
"decode"), or every prefill chunk too ("all"). A host callback per layer and step: for
experiments, never for timing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.methods import register
from jax_longctx.methods.reattention import ReAttention

SCOPES: dict[tuple[int, int, int], np.ndarray] = {}  # (row, layer, last query) -> sorted slots


@register
@dataclasses.dataclass(frozen=True)
class TracedReAttention(ReAttention):
  """ReAttention whose scopes land in SCOPES (diagnostics only)."""

  name = "reattention_traced"
  steps: str = "decode"  # "decode": one-query steps; "all": prefill chunks too
  from_position: int = 0  # only steps whose last query is at or past this are recorded

  def scope(self, state, q, ctx):
    sc = super().scope(state, q, ctx)
    if self.steps == "all" or q.shape[1] == 1:
      last = jnp.max(jnp.where(ctx.valid, ctx.q_pos, -1), axis=1)  # [B]
      jax.debug.callback(functools.partial(_record, self.from_position, ctx.layer), sc.idx,
                         sc.length, last)
    return sc


def _record(from_position: int, layer: int, idx, length, last) -> None:
  idx, length, last = (np.asarray(x) for x in (idx, length, last))
  for row in range(idx.shape[0]):
    if last[row] >= from_position:
      SCOPES[(row, layer, int(last[row]))] = np.sort(idx[row, :length[row]])


def taken() -> dict[tuple[int, int, int], np.ndarray]:
  """The scopes recorded since the last call (every pending callback run first), then clears."""
  jax.effects_barrier()
  out = dict(SCOPES)
  SCOPES.clear()
  return out
