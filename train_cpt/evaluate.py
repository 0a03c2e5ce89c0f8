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
  methods = {"full": get("full"),
             "refreshkv": get("refreshkv", budget=cfg.top_k, qc_stride=cfg.eval_qc_stride,
                              threshold=cfg.eval_threshold, pool_kernel=cfg.pool_kernel)}
  out = {"rows": int(len(rows))}
  for name, method in methods.items():
    nll = suffix_nll(params, compute, method, rows, cfg.prefix_len)
    out[f"{name}_ppl"] = math.exp(float(np.mean(nll)))
  return out


def suffix_nll(params, model_cfg, method, rows: np.ndarray, prefix_len: int) -> np.ndarray:
  """NLL [N, T - prefix_len] of each row's tokens after `prefix_len`: the prefix prefilled under
  `method`, the rest fed one token per decode step (teacher forcing), in a cache just long
  enough (so a budget given as a fraction is of T, the row's length)."""
  rows = np.asarray(rows, np.int32)
  cache, last = prefill(params, model_cfg, [r[:prefix_len].tolist() for r in rows], method,
                        cache_len=rows.shape[1], decode_room=rows.shape[1] - prefix_len)
  nll, _ = teacher_forced_nll(params, cache, last, jnp.asarray(rows[:, prefix_len:]),
                              cfg=model_cfg, method=method)
  return np.asarray(nll, np.float64)
