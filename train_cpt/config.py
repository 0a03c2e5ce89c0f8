"""The training job's settings: a frozen dataclass read from a TOML or JSON file.

Defaults follow RefreshKV's continued pretraining (paper §6, Appendix A.1: AdamW, lr 5e-6, 20
warm-up steps then linear decay, weight decay 0) at the scale of the default model (L 4096,
S 50, K 512 instead of the paper's 8K / 50 / 2048 for Llama-3.1-8B).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib

from jax_longctx.core.config import PRESETS
from jax_longctx.core.errors import LongctxError
from jax_longctx.core.options import REMAT_POLICIES


class TrainConfigError(LongctxError, ValueError):
  """Bad training settings (the model's own config errors are jax_longctx.core.config.ConfigError)."""


RANDOM = "random:"  # model = "random:llama-3.1-8b": random weights of that preset
REMAT_CHOICES = ("none", *REMAT_POLICIES)
MOMENTS_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  # "default", a converted checkpoint, an HF directory or a GGUF file; or "random:<preset>":
  # random weights of a named shape (jax_longctx.core.config.PRESETS) trained on random token
  # rows, for timing and memory at a model's scale without its weights (text_files empty).
  model: str = "default"
  text_files: tuple[str, ...] = ()  # glob patterns of UTF-8 text files
  out_dir: str = "cpt_run"  # checkpoints/, log.jsonl, final/ (the trained model)
  prefix_len: int = 4096  # L: tokens that attend fully
  suffix_len: int = 50  # S: tokens that see the top K of the prefix plus the local tokens
  top_k: int = 512  # K
  pool_kernel: int = 7
  steps: int = 200
  global_batch: int = 8  # rows per optimizer step
  micro_batch: int = 1  # rows per forward/backward (across all devices); the rest accumulates
  lr: float = 5e-6
  warmup_steps: int = 20
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  grad_clip: float = 0.0  # global-norm clipping; 0: off (the paper does not mention any)
  compute_dtype: str = "bfloat16"  # master weights stay fp32
  # AdamW's two moments: "float32", or "bfloat16" (half their memory; updates still computed in
  # fp32, train_cpt/optimizer.py): what lets the 8B train on one H200.
  moments_dtype: str = "float32"
  heldout: float = 0.05  # fraction of rows held out for evaluation
  seed: int = 0
  save_every: int = 50
  keep_checkpoints: int = 2
  eval_every: int = 50
  eval_rows: int = 8  # 0: no evaluation (timing runs)
  eval_qc_stride: int = 10  # RefreshKV inference used for the held-out perplexity
  eval_threshold: float = 0.85
  # Devices along the parameter-sharding axis (0: every device); the others are data parallel.
  fsdp: int = 1
  # Memory (neither changes what is computed): what each decoder layer keeps for the backward
  # pass ("none": everything; "layer": its input only; "dots": also its weight-matmul outputs),
  # and positions per cross-entropy chunk (0: the [B, L + S, V] logits at once; train_cpt/loss.py).
  remat: str = "none"
  loss_chunk: int = 0
  # Query rows per block of the prefix's attention (train_cpt/pattern.py); 0: one call, cuDNN's
  # flash attention on GPU, the whole [L, L] score matrix on XLA backends (CPU, TPU).
  prefix_block: int = 0

  def __post_init__(self):
    checks = [
        (self.prefix_len > 0 and self.suffix_len > 0, "prefix_len and suffix_len must be > 0"),
        (0 < self.top_k <= self.prefix_len, f"top_k={self.top_k} must be in 1..prefix_len"),
        (self.global_batch % max(self.micro_batch, 1) == 0 and self.micro_batch > 0,
         f"micro_batch={self.micro_batch} must divide global_batch={self.global_batch}"),
        (self.steps > 0 and 0 <= self.warmup_steps < self.steps,
         f"need steps > warmup_steps >= 0 (steps={self.steps}, warmup={self.warmup_steps})"),
        (self.save_every > 0 and self.eval_every > 0, "save_every and eval_every must be > 0"),
        (0 < self.heldout < 1, f"heldout={self.heldout} must be in (0, 1)"),
        (self.fsdp >= 0, "fsdp must be >= 1 (or 0: every device)"),
        (self.remat in REMAT_CHOICES, f"remat={self.remat!r} must be one of {REMAT_CHOICES}"),
        (self.moments_dtype in MOMENTS_DTYPES,
         f"moments_dtype={self.moments_dtype!r} must be one of {MOMENTS_DTYPES}"),
        (self.loss_chunk >= 0, f"loss_chunk={self.loss_chunk} must be >= 0 (0: unchunked)"),
        (self.prefix_block >= 0, f"prefix_block={self.prefix_block} must be >= 0 (0: one call)"),
        (self.random_preset is None or self.random_preset.lower() in PRESETS,
         f"model={self.model!r}: no such preset; known: {', '.join(PRESETS)}"),
        (self.eval_rows >= 0, f"eval_rows={self.eval_rows} must be >= 0"),
        (not (self.random_preset and self.text_files),
         f"model={self.model!r} trains on random tokens: leave text_files empty"),
    ]
    for ok, msg in checks:
      if not ok:
        raise TrainConfigError(msg)

  @property
  def random_preset(self) -> str | None:
    """The preset name of a "random:<preset>" model, else None."""
    return self.model[len(RANDOM):] if self.model.startswith(RANDOM) else None

  @property
  def remat_option(self) -> str | None:
    """`remat` as `RunOptions.remat` spells it."""
    return None if self.remat == "none" else self.remat

  @property
  def row_len(self) -> int:
    return self.prefix_len + self.suffix_len

  @property
  def accumulation(self) -> int:
    return self.global_batch // self.micro_batch

  def training_fields(self) -> dict:
    """What must not change when a run resumes (evaluation and logging settings may)."""
    skip = {"out_dir", "save_every", "keep_checkpoints", "eval_every", "eval_rows",
            "eval_qc_stride", "eval_threshold"}
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}


def _coerce(name: str, value, default):
  """A file's or command line's value as the field's type (strings from --set included)."""
  if isinstance(default, tuple):
    return tuple([value] if isinstance(value, str) else value)
  if isinstance(default, str):
    return str(value)
  try:
    number = float(value)
  except (TypeError, ValueError) as e:
    raise TrainConfigError(f"{name}={value!r}: expected a number") from e
  if isinstance(default, int):
    if not number.is_integer():
      raise TrainConfigError(f"{name}={value!r}: expected a whole number")
    return int(number)
  return number


def load_config(path: str | None, overrides: dict | None = None) -> TrainConfig:
  """Settings from a .toml or .json file (or none), then `overrides`; unknown keys are errors."""
  values: dict = {}
  if path is not None:
    if not os.path.exists(path):
      raise TrainConfigError(f"config file not found: {path}")
    with open(path, "rb") as f:
      values = json.load(f) if path.endswith(".json") else tomllib.load(f)
    base = os.path.dirname(os.path.abspath(path))
    if "text_files" in values:  # relative to the config file
      files = values["text_files"]
      values["text_files"] = [os.path.join(base, p) for p in
                              ([files] if isinstance(files, str) else files)]
  values.update(overrides or {})
  fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise TrainConfigError(f"unknown training settings {unknown}; known: {', '.join(sorted(fields))}")
  return TrainConfig(**{k: _coerce(k, v, fields[k]) for k, v in values.items()})
