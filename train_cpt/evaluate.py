"""Held-out perplexity of the suffix tokens under RefreshKV inference and under full attention.

Each held-out row's first L tokens are prefilled and its last S tokens are fed one per decode step
(teacher forcing), through the library's own inference path: what the training is meant to help
is RefreshKV decoding, and what it must not hurt is full attention.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.run.generation import prefill, teacher_forced_nll
from jax_longctx.methods import get


def heldout_perplexity(params, *, cfg, model_cfg, rows: np.ndarray) -> dict:
  """{"full_ppl", "refreshkv_ppl", "rows"} over `rows` [N, L + S], in the compute dtype."""
  compute = model_cfg.replace(dtype=cfg.compute_dtype)
  params = jax.tree.map(lambda x: jnp.asarray(x, compute.jnp_dtype), jax.device_get(params))
  prefixes = [r[:cfg.prefix_len].tolist() for r in rows]
  targets = jnp.asarray(rows[:, cfg.prefix_len:], jnp.int32)
  methods = {"full": get("full"),
             "refreshkv": get("refreshkv", budget=cfg.top_k, qc_stride=cfg.eval_qc_stride,
                              threshold=cfg.eval_threshold, pool_kernel=cfg.pool_kernel)}
  out = {"rows": int(len(rows))}
  for name, method in methods.items():
    cache, last = prefill(params, compute, prefixes, method, cache_len=cfg.row_len,
                          decode_room=cfg.suffix_len)
    nll, _ = teacher_forced_nll(params, cache, last, targets, cfg=compute, method=method)
    out[f"{name}_ppl"] = math.exp(float(jnp.mean(nll)))
  return out
