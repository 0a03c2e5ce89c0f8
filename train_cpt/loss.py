"""The training loss: mean next-token NLL of rows [B, L + S], its cross-entropy in chunks.

At Llama-3's vocabulary the logits of one 8K row are 8,142 x 128,256 fp32 = 4.2 GB, and a
log-softmax copy beside them as much again. With `loss_chunk` > 0 the positions go through the
unembedding `loss_chunk` at a time (`lax.map`), each chunk's logits reduced to its summed NLL at
once and recomputed in the backward pass (`jax.checkpoint`), so no [tokens, vocab] array exists
whole: the largest is [B, loss_chunk, V]. The result is the same quantity (tests: loss and
gradients within 1e-5 relative of the unchunked loss, fp32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_longctx.core.options import RunOptions
from jax_longctx.model import hidden_states, unembed
from jax_longctx.ops.cache import Cache


def _nll_sum(params, h, targets, mask, cfg):
  """Summed NLL of targets [B, C] under the logits of normed h [B, C, D]; mask [C] drops
  padding."""
  logits = unembed(params, h, cfg)  # fp32 [B, C, V]
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked) * mask)


def chunked_nll_sum(params, h, targets, cfg, chunk: int):
  """`_nll_sum` over the positions of h [B, T, D] `chunk` at a time (the last chunk padded)."""
  b, t, d = h.shape
  n = -(-t // chunk)
  pad = n * chunk - t
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)
  targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
  mask = (jnp.arange(n * chunk) < t).astype(jnp.float32).reshape(n, chunk)
  # Checkpointed: the backward pass recomputes a chunk's logits instead of keeping them all.
  piece = jax.checkpoint(lambda h, y, m: _nll_sum(params, h, y, m, cfg))
  return jnp.sum(jax.lax.map(lambda a: piece(*a), (h, targets, mask)))


def sequence_loss(params, tokens, *, model_cfg, method, compute_dtype, remat: str | None = None,
                  loss_chunk: int = 0):
  """Mean next-token NLL over every position of rows tokens [B, L + S].

  remat: `RunOptions.remat` of the forward (None, "layer" or "dots"); loss_chunk: positions per
  cross-entropy chunk (0: all at once).
  """
  p = jax.tree.map(lambda x: x.astype(compute_dtype), params)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  cache = Cache(jnp.zeros((b,), jnp.int32), (None,) * model_cfg.num_layers, t)
  h, _ = hidden_states(p, tokens, positions, cache, method, model_cfg,
                       options=RunOptions(remat=remat))
  h, targets = h[:, :-1], tokens[:, 1:]
  if loss_chunk:
    total = chunked_nll_sum(p, h, targets, model_cfg, loss_chunk)
  else:
    total = _nll_sum(p, h, targets, jnp.float32(1), model_cfg)
  return total / targets.size
