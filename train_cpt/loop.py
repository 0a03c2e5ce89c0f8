"""The continued-pretraining job: optax AdamW over the RefreshKV pattern, orbax checkpoints, eval.

One optimizer step = `accumulation` forward/backward passes over micro-batches (lax.scan, fp32
gradient sums), then AdamW on the fp32 master weights; the forward runs in `compute_dtype`. The
state (params, optimizer state) is saved every `save_every` steps; the batch of a step is a
function of the step, so a job killed and started again resumes from its latest checkpoint and
follows the same loss curve (tests/test_train_cpt.py checks it bit for bit).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import optax

from jax_longctx.checkpoints.pipeline import atomic_dir, save_orbax
from jax_longctx.core.config import save_config_file
from jax_longctx.core.progress import progress
from train_cpt import data as data_lib
from train_cpt import sharding
from train_cpt import state as state_lib
from train_cpt.config import TrainConfig, TrainConfigError
from train_cpt.evaluate import heldout_perplexity
from train_cpt.loss import sequence_loss
from train_cpt.optimizer import optimizer, schedule
from train_cpt.pattern import CptAttention, attention_flops

# bf16 dense peak of the GPUs this job is timed on (for model FLOPs utilization).
_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def make_train_step(cfg: TrainConfig, model_cfg, opt):
  method = CptAttention(cfg.prefix_len, cfg.top_k, cfg.pool_kernel, cfg.prefix_block)
  compute = model_cfg.replace(dtype=cfg.compute_dtype)
  loss_fn = functools.partial(sequence_loss, model_cfg=compute, method=method,
                              compute_dtype=jnp.dtype(cfg.compute_dtype),
                              remat=cfg.remat_option, loss_chunk=cfg.loss_chunk)

  def step(params, opt_state, batch):  # batch [accumulation, micro_batch, L + S]
    def micro(carry, tokens):
      grads, total = carry
      loss, g = jax.value_and_grad(loss_fn)(params, tokens)
      return (jax.tree.map(jnp.add, grads, g), total + loss), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    (grads, total), _ = jax.lax.scan(micro, (zeros, jnp.float32(0)), batch)
    grads = jax.tree.map(lambda g: g / batch.shape[0], grads)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, total / batch.shape[0], \
        optax.global_norm(grads)

  return step


def jit_step(cfg: TrainConfig, model_cfg, opt, state):
  """The jitted step for `state` (arrays or `state_lib.abstract_state`), its params and optimizer
  state donated and kept where they are."""
  shardings = jax.tree.map(lambda x: x.sharding, state)
  return jax.jit(make_train_step(cfg, model_cfg, opt), donate_argnums=(0, 1),
                 out_shardings=(shardings["params"], shardings["opt_state"], None, None))


def flops_per_step(cfg: TrainConfig, model_cfg) -> float:
  """Model FLOPs of one optimizer step (forward + backward = 3x forward; what `remat` recomputes
  is not counted, as model FLOPs utilization counts it)."""
  head = 0 if model_cfg.tie_word_embeddings else model_cfg.vocab_size * model_cfg.hidden_size
  matmul_params = model_cfg.num_params() - head  # the embedding lookup is not a product
  per_row = 2.0 * matmul_params * cfg.row_len + attention_flops(
      model_cfg, cfg.prefix_len, cfg.suffix_len, cfg.top_k)
  return 3.0 * per_row * cfg.global_batch


def _peak_flops() -> float | None:
  kind = jax.devices()[0].device_kind
  peak = next((v for k, v in _PEAK_FLOPS.items() if k in kind), None)
  return peak * len(jax.devices()) if peak else None


class Run:
  """A training job's directory: config record, checkpoints, log, final model."""

  def __init__(self, cfg: TrainConfig):
    import orbax.checkpoint as ocp

    self.cfg, self.dir = cfg, os.path.abspath(cfg.out_dir)
    os.makedirs(self.dir, exist_ok=True)
    self._check_config()
    self.manager = ocp.CheckpointManager(
        os.path.join(self.dir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints))
    self._ocp = ocp

  def _check_config(self):
    path = os.path.join(self.dir, "train_config.json")
    fields = self.cfg.training_fields()
    if os.path.exists(path):
      with open(path) as f:
        saved = json.load(f)
      # A setting newer than the run's record had its default value then.
      defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
      changed = sorted(k for k in fields
                       if json.dumps(fields[k]) != json.dumps(saved.get(k, defaults[k])))
      if changed:
        raise TrainConfigError(f"{self.dir} holds a run with other settings ({', '.join(changed)}); "
                          "resume with the same settings or use another out_dir")
    else:
      with open(path, "w") as f:
        json.dump(fields, f, indent=1)

  def log(self, record: dict) -> None:
    with open(os.path.join(self.dir, "log.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")

  def restore(self, state):
    """(state, step) from the latest checkpoint, or (state, 0) when there is none."""
    step = self.manager.latest_step()
    if step is None:
      return state, 0
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return self.manager.restore(step, args=self._ocp.args.StandardRestore(target)), step

  def save(self, step: int, state) -> None:
    self.manager.save(step, args=self._ocp.args.StandardSave(state))


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> dict:
  """Runs (or resumes) the job. Returns the last evaluation. `stop_after`: leave after that many
  steps of this invocation (a planned interruption; checkpoints as usual)."""
  source = state_lib.Source(cfg)
  run = Run(cfg)
  train_rows, held_rows = source.rows()
  batches = data_lib.Batches(train_rows, cfg.global_batch, cfg.seed)
  mesh = state_lib.training_mesh(cfg)
  opt = optimizer(cfg)
  state, start = run.restore(state_lib.init_state(source.params(mesh), opt, mesh))
  step_fn = jit_step(cfg, source.config, opt, state)
  lr_at = schedule(cfg)
  flops, peak = flops_per_step(cfg, source.config), _peak_flops()
  evaluate = functools.partial(heldout_perplexity, cfg=cfg, model_cfg=source.config,
                               rows=held_rows[:cfg.eval_rows])
  last_eval = {}
  if start == 0 and cfg.eval_rows:
    last_eval = {"step": 0, **evaluate(state["params"])}
    run.log({"eval": last_eval})
  stop = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
  bar = progress(range(start, stop), total=cfg.steps, initial=start, desc="train-cpt")
  for step in bar:
    batch = batches(step).reshape(cfg.accumulation, cfg.micro_batch, cfg.row_len)
    t0 = time.perf_counter()
    params, opt_state, loss, gnorm = step_fn(state["params"], state["opt_state"],
                                             jax.device_put(batch, sharding.batch_sharding(mesh)))
    loss = float(loss)  # waits for the step
    dt = time.perf_counter() - t0
    state = {"params": params, "opt_state": opt_state}
    rec = {"step": step + 1, "loss": loss, "grad_norm": float(gnorm), "lr": float(lr_at(step)),
           "step_s": dt, "tokens_per_s": cfg.global_batch * cfg.row_len / dt}
    if peak:
      rec["mfu"] = flops / dt / peak
    run.log(rec)
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
    done = step + 1 == cfg.steps
    if (step + 1) % cfg.save_every == 0 or done:
      run.save(step + 1, state)
    if cfg.eval_rows and ((step + 1) % cfg.eval_every == 0 or done):
      last_eval = {"step": step + 1, **evaluate(state["params"])}
      run.log({"eval": last_eval})
  run.manager.wait_until_finished()
  if stop == cfg.steps:
    with atomic_dir(os.path.join(run.dir, "final"), overwrite=True) as tmp:
      save_orbax(jax.device_get(state["params"]), tmp)
      save_config_file(source.config, tmp)
      if source.tokenizer is not None:
        source.tokenizer.save(tmp)
  return last_eval


def read_log(out_dir: str) -> tuple[dict[int, dict], list[dict]]:
  """(the last record of each step, the evaluations) of a run's log.jsonl; `out_dir` may also
  name a log file itself (one saved under another name)."""
  steps, evals = {}, []
  path = os.path.join(out_dir, "log.jsonl") if os.path.isdir(out_dir) else out_dir
  with open(path) as f:
    for line in f:
      rec = json.loads(line)
      if "eval" in rec:
        evals.append(rec["eval"])
      else:
        steps[rec["step"]] = rec
  return steps, evals

