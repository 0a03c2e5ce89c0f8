"""The CPT job's optimizer: AdamW on a warm-up-then-linear schedule, its moments kept in fp32 or
bf16.

Why bf16 moments: an 8B model's fp32 master weights, fp32 moments and fp32 gradients are 120 GB,
more than one H200 holds beside the activations (BENCHMARKS.md, "Continued pretraining at
scale"); the paper's run used an 8-bit optimizer. optax's `adamw(mu_dtype=...)` stores only the
first moment in that dtype, so `scale_by_adam_stored` keeps both there and computes every update
in fp32 (the moments are read up to fp32, updated, rounded back), so only the stored state loses
precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from train_cpt.config import TrainConfig


def schedule(cfg: TrainConfig):
  """Linear warm-up to lr, then linear decay to 0 at the last step."""
  return optax.join_schedules([
      optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1)),
      optax.linear_schedule(cfg.lr, 0.0, cfg.steps - cfg.warmup_steps)], [cfg.warmup_steps])


def scale_by_adam_stored(b1: float, b2: float, eps: float,
                         dtype) -> optax.GradientTransformation:
  """Adam's scaling (`optax.scale_by_adam`'s arithmetic, fp32) with mu and nu stored in `dtype`."""
  dtype = jnp.dtype(dtype)

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, dtype)  # noqa: E731
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=jax.tree.map(zeros, params), nu=jax.tree.map(zeros, params))

  def update(updates, state, params=None):
    del params
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    mu = jax.tree.map(lambda g, m: b1 * f32(m) + (1 - b1) * f32(g), updates, state.mu)
    nu = jax.tree.map(lambda g, v: b2 * f32(v) + (1 - b2) * jnp.square(f32(g)), updates, state.nu)
    count = optax.safe_increment(state.count)
    step = count.astype(jnp.float32)
    mu_scale, nu_scale = 1 / (1 - b1 ** step), 1 / (1 - b2 ** step)
    scaled = jax.tree.map(lambda g, m, v: (m * mu_scale / (jnp.sqrt(v * nu_scale) + eps))
                          .astype(g.dtype), updates, mu, nu)
    stored = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)  # noqa: E731
    return scaled, optax.ScaleByAdamState(count=count, mu=stored(mu), nu=stored(nu))

  return optax.GradientTransformation(init, update)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW (decoupled weight decay), after global-norm clipping when `grad_clip` is set. With
  fp32 moments it is `optax.adamw` itself (the checkpoints of earlier runs keep resuming)."""
  if cfg.moments_dtype == "float32":
    adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
  else:
    adamw = optax.chain(scale_by_adam_stored(cfg.b1, cfg.b2, cfg.eps, cfg.moments_dtype),
                        optax.add_decayed_weights(cfg.weight_decay),
                        optax.scale_by_learning_rate(schedule(cfg)))
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip else adamw
