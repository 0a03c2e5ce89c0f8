"""The settings an eval record was computed under, and whether an --out's records can be resumed.

Each record carries `run`: `sweep`, what every record of one command shares (the model's
identity: checkpoint path, name, config and a fingerprint of its weights; chat; the platform,
the prefill chunk asked, the device mesh and the kernel options asked), and `entry`, what one
method at one length runs with (the task and all its options, the method's class and every
hyper-parameter as resolved for the model, the cache's dtype, the length and the cache's size).
Key smoothing and the model's dtype are in its config.

A sweep resumes from an --out only when its records were made so: every record's `sweep` must be
this command's, and a record of a (task, method label, length) this command plans must carry the
`entry` it plans. Anything else is refused before a sample runs, in one line naming what differs
(a record of other settings is never reported as this command's). Records of tasks, labels or
lengths the command does not plan, made under the same `sweep`, stay: several commands may fill
one --out (RULER's tasks one at a time, a sweep grown by a length), and the summary reads them
all. Records written before `run` existed cannot be told apart and are refused too. The batch
size is left out: a batch's records are those of single runs, so a sweep may resume with
another --batch-size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import numpy as np

from jax_longctx.core.errors import LongctxError
from pallas_kernels.quant import EIGHT_BIT

VERSION = 1


def plain(value: Any) -> Any:
  """`value` as JSON gives it back (tuples as lists, keys as strings), so what a record holds
  compares equal to what a command plans."""
  return json.loads(json.dumps(value, default=str))


def fingerprint(params) -> str:
  """A digest of a few weights that every layout of the same model shares (fused or not):
  three rows of the embedding and every norm's scale; with the config and path in `model`
  it tells two checkpoints apart without reading every weight off the device."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if names[0] == "embed" and leaf.ndim == 2:
      part = leaf[np.array([0, leaf.shape[0] // 2, leaf.shape[0] - 1]), :512]
    elif names[-1] == "scale" and leaf.ndim == 1:
      part = leaf
    else:
      continue
    h.update("/".join(names).encode())
    h.update(_on_host(part).astype(np.float32).tobytes())
  return h.hexdigest()[:16]


def _on_host(x) -> np.ndarray:
  """x as numpy, the same in every process: weights placed over several processes' devices
  are gathered (each process hashes the whole, so all plan the same samples)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def model_identity(lm) -> dict:
  return plain({"path": lm.path, "model_id": lm.model_id,
                "config": dataclasses.asdict(lm.config), "fingerprint": fingerprint(lm.params)})


def kernel_choices(options) -> dict:
  """The kernel options of the run's route that differ from the library's defaults (the
  defaults are the version's own)."""
  kernels = options.route.kernels
  default = type(kernels)()
  return {f.name: getattr(kernels, f.name) for f in dataclasses.fields(kernels)
          if getattr(kernels, f.name) != getattr(default, f.name)}


def sweep_settings(lm, chat: bool, options) -> dict:
  """What every record of one command shares (`kernels` only where a kernel option was asked:
  records of the default route keep the settings they had before it was recorded)."""
  mesh = None if options.mesh is None else dict(options.mesh.shape)
  settings = {"version": VERSION, "model": model_identity(lm), "chat": chat,
              "platform": jax.default_backend(), "prefill_chunk": options.prefill_chunk,
              "mesh": mesh}
  kernels = kernel_choices(options)
  if kernels:
    settings["kernels"] = kernels
  return plain(settings)


def task_options(task) -> dict:
  """Every option of a task as it runs (defaults included)."""
  return dataclasses.asdict(task) if dataclasses.is_dataclass(task) else {}


def entry_settings(task, method, kv_dtype: str, length: int, cache_len: int,
                   options) -> dict:
  """What one method at one length runs with. An 8-bit cache's entry also names its top-k
  route (KernelOptions.topk_eight_bit) even when it is the default: the default changed from
  "dequantize" to "auto", and records made under the old one must not be resumed as new; an
  int8 cache's its decode products (decode_int8_products) for the same reason (the default
  changed from off to auto: on the GPU's kernel). A 4-bit cache's format (its group and
  scales' dtype) is its kv_dtype's name (quant4.FORMATS)."""
  entry = {"task": task.name, "task_options": task_options(task),
           "method": type(method).__name__, "hparams": method.hparams(),
           "kv_dtype": kv_dtype, "length": length, "cache_len": cache_len}
  if kv_dtype in EIGHT_BIT:
    entry["topk_eight_bit"] = options.route.kernels.topk_eight_bit
  if kv_dtype == "int8":
    products = options.route.kernels.decode_int8_products
    entry["decode_int8_products"] = "auto" if products is None else products
  return plain(entry)


def digest(settings: dict) -> str:
  return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def differences(old: Any, new: Any, at: str = "") -> list[str]:
  """'hparams budget 256 -> 128' for each leaf where two settings differ."""
  if isinstance(old, dict) and isinstance(new, dict):
    return [d for k in sorted(set(old) | set(new), key=str)
            for d in differences(old.get(k), new.get(k), f"{at} {k}".strip())]
  return [] if old == new else [f"{at} {old} -> {new}"]


class Mismatch(LongctxError):
  """Records of an --out that this command cannot resume from; str(): what differs."""


def check_resumable(records: list[dict], sweep: dict, planned: dict[tuple, dict]) -> None:
  """Raises Mismatch naming what differs when a record was made under other settings than this
  command's (`sweep`; `planned`: (task, label, length) -> entry settings)."""
  for rec in records:
    run = rec.get("run")
    if not isinstance(run, dict) or run.get("sweep", {}).get("version") != VERSION:
      raise Mismatch("records written by an older version of jax-longctx, without the settings "
                     "they ran under")
    found = differences(run["sweep"], sweep)
    entry = planned.get((rec["task"], rec["method"], rec["length"]))
    if not found and entry is not None:
      found = [f"{rec['method']} {d}" for d in differences(run.get("entry"), entry)]
    if found:
      more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
      raise Mismatch(f"records of other settings: {'; '.join(found[:3])}{more}")
