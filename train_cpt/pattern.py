"""RefreshKV's attention pattern for continued pretraining (paper §6, Appendix A.1).

A training sequence has L + S tokens. The first L attend causally to each other (prefill). Each of
the last S attends to the top K of the first L plus, causally, the tokens from L onward: what a
RefreshKV partial step sees. The top K are chosen as at inference (RefreshKV's C_p after prefill,
i.e. SnapKV with an observation window of one): the last prefix token's attention over the
prefix, max over a GQA group, max-pooled (kernel 7), that token always kept; the choice carries
no gradient (stop_gradient), the gathered keys and values do.

No L x L mask exists: the prefix goes to `jax.nn.dot_product_attention` with `is_causal` (cuDNN's
flash attention on GPU in bf16, forward and backward; XLA elsewhere, which forms the prefix's
score matrix: fine for the CPU tests, not for long sequences on TPU) and the suffix attends to a
gathered [K + S] key set. With `prefix_block` > 0 the prefix's queries go `prefix_block` rows at
a time, each block's scores recomputed in the backward pass: O(block x L) memory on any backend
(what benchmarks/cpt_memory.py compiles on CPU in place of cuDNN's flash attention).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels
from jax_longctx.ops.attention import attention
from jax_longctx.core.config import LlamaConfig
from jax_longctx.methods.base import AttnContext, Method
from jax_longctx.core.rope import apply_rope


def _prefix_implementation(dtype) -> str | None:
  on_gpu = pallas_kernels.platform() == "gpu"  # as the kernels see it (lowering_for overrides)
  return "cudnn" if on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else None


def blocked_causal_attention(q, k, v, block: int):
  """Causal attention of q [B, L, H, d] over k, v [B, L, KV, d] (same positions), `block` query
  rows at a time (the last block padded); a block's [B, H, block, L] scores are formed in its
  turn and again in the backward pass, never all blocks' at once."""
  b, length, h, d = q.shape
  n = -(-length // block)
  qb = jnp.pad(q, ((0, 0), (0, n * block - length), (0, 0), (0, 0)))
  qb = qb.reshape(b, n, block, h, d).swapaxes(0, 1)
  rows = jnp.arange(n * block).reshape(n, block)

  @jax.checkpoint
  def one(q_block, row):
    visible = row[:, None] >= jnp.arange(length)[None, :]  # [block, L]
    return jax.nn.dot_product_attention(q_block, k, v, mask=visible[None, None])

  out = jax.lax.map(lambda a: one(*a), (qb, rows))
  return out.swapaxes(0, 1).reshape(b, n * block, h, d)[:, :length]


def select_prefix(q_last, k_prefix, top_k: int, pool_kernel: int):
  """[B, KV, top_k] indices into the prefix: the last prefix query's pooled attention.

  q_last [B, H, d] and k_prefix [B, L, KV, d], both after RoPE.
  """
  b, h, d = q_last.shape
  kvh, length = k_prefix.shape[2], k_prefix.shape[1]
  qg = q_last.reshape(b, kvh, h // kvh, d)
  logits = jnp.einsum("bkgd,blkd->bkgl", qg, k_prefix,
                      preferred_element_type=jnp.float32) * d ** -0.5
  score = jnp.max(jax.nn.softmax(logits, axis=-1), axis=2)  # [B, KV, L]
  score = jax.lax.reduce_window(score, -jnp.inf, jax.lax.max, (1, 1, pool_kernel), (1, 1, 1),
                                "SAME")
  score = score.at[:, :, length - 1].set(jnp.inf)
  return jax.lax.top_k(jax.lax.stop_gradient(score), top_k)[1]


@dataclasses.dataclass(frozen=True)
class CptAttention(Method):
  """The training pattern as a method the model's forward runs (no cache: state is None)."""

  name = "refreshkv_cpt"

  prefix_len: int = 4096  # L
  top_k: int = 512  # K
  pool_kernel: int = 7
  prefix_block: int = 0  # query rows per block of the prefix's attention; 0: one call

  def init_state(self, cfg: LlamaConfig, batch, max_len, dtype, chunk):
    return None

  def prefill(self, state, q, k, v, ctx: AttnContext):
    n_pre = self.prefix_len
    q = apply_rope(q, ctx.q_pos, ctx.freqs)
    k = apply_rope(k, ctx.q_pos, ctx.freqs)
    if self.prefix_block:
      out_pre = blocked_causal_attention(q[:, :n_pre], k[:, :n_pre], v[:, :n_pre],
                                         self.prefix_block)
    else:
      out_pre = jax.nn.dot_product_attention(
          q[:, :n_pre], k[:, :n_pre], v[:, :n_pre], is_causal=True,
          implementation=_prefix_implementation(q.dtype))
    idx = select_prefix(q[:, n_pre - 1], k[:, :n_pre], self.top_k, self.pool_kernel)

    def gather(x):  # [B, L, KV, d] at idx [B, KV, K] -> [B, KV, K, d]
      return jnp.take_along_axis(jnp.swapaxes(x[:, :n_pre], 1, 2), idx[..., None], axis=2)

    keys = jnp.concatenate([gather(k), jnp.swapaxes(k[:, n_pre:], 1, 2)], axis=2)
    values = jnp.concatenate([gather(v), jnp.swapaxes(v[:, n_pre:], 1, 2)], axis=2)
    k_pos = jnp.concatenate([idx.astype(jnp.int32),
                             jnp.broadcast_to(ctx.q_pos[:, None, n_pre:],
                                              idx.shape[:2] + (q.shape[1] - n_pre,))], axis=2)
    out_suf, _ = attention(q[:, n_pre:], keys, values, ctx.q_pos[:, n_pre:], k_pos)
    return jnp.concatenate([out_pre.astype(q.dtype), out_suf], axis=1), state


def attention_flops(cfg: LlamaConfig, prefix_len: int, suffix_len: int, top_k: int) -> float:
  """Forward FLOPs of one sequence's attention products (QK and PV) under the pattern."""
  keys = prefix_len * (prefix_len + 1) / 2 + suffix_len * (top_k + (suffix_len + 1) / 2)
  return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys
