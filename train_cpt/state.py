"""What a job trains: the model and its rows, and the sharded training state (fp32 params, AdamW).

The model is a checkpoint (with its tokenizer, trained on text files) or, for `random:<preset>`,
random weights of a named shape trained on random token rows: the paper's 8B at its L, for step
time and memory, without its weights or data. The state can also be built abstractly (shapes and
shardings, nothing allocated) to compile a step and read its memory (benchmarks/cpt_memory.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_longctx.app.api import load
from jax_longctx.core import mesh as core_mesh
from jax_longctx.core.config import LlamaConfig, preset
from jax_longctx.model import abstract_model, random_params
from train_cpt import data as data_lib
from train_cpt import sharding
from train_cpt.config import TrainConfig, TrainConfigError


class Source:
  """The model's config, a way to make its fp32 weights, its tokenizer (None for random weights)
  and the (train, held-out) rows."""

  def __init__(self, cfg: TrainConfig):
    self.cfg = cfg
    if cfg.random_preset:
      self.config = preset(cfg.random_preset, dtype="float32")
      self.tokenizer, self._lm = None, None
      return
    if not cfg.text_files:
      raise TrainConfigError("text_files is empty: give glob patterns of the training text")
    self._lm = load(cfg.model, dtype=jnp.float32)
    if self._lm.tokenizer is None:
      raise TrainConfigError(f"{cfg.model}: the checkpoint has no tokenizer.json to read the text "
                             "with")
    self.config, self.tokenizer = self._lm.config, self._lm.tokenizer

  def rows(self) -> tuple[np.ndarray, np.ndarray]:
    cfg = self.cfg
    if self._lm is None:  # random tokens: a global batch to train on, eval_rows held out
      rng = np.random.default_rng(cfg.seed)
      rows = rng.integers(0, self.config.vocab_size, (cfg.global_batch + max(cfg.eval_rows, 1),
                                                      cfg.row_len), dtype=np.int32)
      return rows[:cfg.global_batch], rows[cfg.global_batch:]
    return data_lib.load(list(cfg.text_files), self.tokenizer, cfg.row_len, cfg.heldout)

  def params(self, mesh):
    """fp32 weights sharded over `mesh` (random ones made shard by shard where they live)."""
    shardings = sharding.shard_like_params(mesh, abstract_model(self.config)[1])
    if self._lm is None:  # leaf by leaf (one small compile per shape), each into its shards
      return random_params(self.config, self.cfg.seed, shardings=shardings)
    return jax.device_put(self._lm.params, shardings)


def training_mesh(cfg: TrainConfig, devices=None):
  """core/mesh.py's mesh for the job: `cfg.fsdp` devices along fsdp (0: every device), the rest
  along data."""
  devices = list(jax.devices() if devices is None else devices)
  fsdp = cfg.fsdp or len(devices)
  if len(devices) % fsdp:
    raise TrainConfigError(f"fsdp={fsdp} does not divide the {len(devices)} devices")
  mesh = core_mesh.make_mesh(f"data={len(devices) // fsdp},fsdp={fsdp}", devices)
  if cfg.micro_batch % mesh.size:
    raise TrainConfigError(f"micro_batch={cfg.micro_batch} must be a multiple of the {mesh.size} "
                           "devices (each device takes whole rows)")
  return mesh


def init_state(params, opt, mesh) -> dict:
  """{"params", "opt_state"}, the optimizer state sharded as the params are."""
  opt_shapes = jax.eval_shape(opt.init, params)
  opt_state = jax.jit(opt.init, out_shardings=sharding.shard_like_params(mesh, opt_shapes))(params)
  return {"params": params, "opt_state": opt_state}


def abstract_state(model_cfg: LlamaConfig, opt, mesh) -> dict:
  """`init_state`'s shapes, dtypes and shardings, nothing allocated."""
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
                        abstract_model(model_cfg)[1])
  return {"params": _placed(shapes, mesh), "opt_state": _placed(jax.eval_shape(opt.init, shapes),
                                                                mesh)}


def abstract_batch(cfg: TrainConfig, mesh) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct((cfg.accumulation, cfg.micro_batch, cfg.row_len), jnp.int32,
                              sharding=sharding.batch_sharding(mesh))


def _placed(tree, mesh):
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree,
                      sharding.shard_like_params(mesh, tree))
