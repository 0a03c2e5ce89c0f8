"""Where a model's RefreshKV calibration lives, and the one place a method takes it.

The paper picks RefreshKV's similarity threshold per model on held-out text (Appendix A.4: 0.85
for Llama-3.1-8B, 0.95 for Qwen2-7B). `jax_longctx.app.calibration` runs that procedure and writes
`refreshkv_calibration.json` beside the model's checkpoint (inside a checkpoint directory, or
`<file>.refreshkv_calibration.json` beside a GGUF file); the package ships the files of its bundled
models in `jax_longctx/app/calibrations/<model>.json`. A calibration beside the checkpoint wins over a
shipped one (it is what the user ran last on this copy).

`resolve` fills a RefreshKV method's unset fields (`threshold`, `similarity_after_rope`: None)
from the calibration of the model it will run on; values the user set always stay. A model
without a calibration gets `FALLBACK_THRESHOLD` before RoPE and one notice line on stderr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

from jax_longctx.methods.refreshkv import FALLBACK_THRESHOLD, RefreshKV
from jax_longctx.core.errors import LongctxError

FILE = "refreshkv_calibration.json"
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibrations")
FORMAT = 1

_NOTIFIED: set[str] = set()  # models whose fallback notice this process has printed


class CalibrationError(LongctxError, ValueError):
  pass


def local_path(model_path: str) -> str:
  """The calibration file of the checkpoint at model_path (a directory or a file)."""
  if os.path.isdir(model_path):
    return os.path.join(model_path, FILE)
  return f"{model_path}.{FILE}"


def shipped_path(model_id: str) -> str:
  return os.path.join(SHIPPED_DIR, f"{model_id}.json")


def fingerprint(cfg) -> str:
  """The model's architecture (its config less the compute dtype): a calibration made for one
  model is never applied to another that happens to share a name."""
  fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"}
  return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read(path: str) -> dict:
  """A calibration file, checked for the fields `resolve` uses."""
  try:
    with open(path) as f:
      calib = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CalibrationError(f"{path}: not a readable calibration ({e})") from e
  if calib.get("format") != FORMAT or not isinstance(calib.get("threshold"), (int, float)) \
     or not isinstance(calib.get("similarity_after_rope"), bool):
    raise CalibrationError(f"{path}: not a format-{FORMAT} RefreshKV calibration (needs "
                           "'threshold' and 'similarity_after_rope')")
  return calib


def write(calib: dict, path: str) -> str:
  """Writes a calibration atomically (a temporary sibling renamed into place)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(calib, f, indent=1)
    f.write("\n")
  os.replace(tmp, path)
  return path


def find(model_path: str | None, model_id: str | None, cfg) -> tuple[dict | None, str]:
  """(the model's calibration or None, where it was found or why none applies)."""
  candidates = ([local_path(model_path)] if model_path else []) + (
      [shipped_path(model_id)] if model_id else [])
  for path in candidates:
    if not os.path.exists(path):
      continue
    calib = read(path)
    if calib.get("config_fingerprint") != fingerprint(cfg):
      return None, f"{path} was made for another model (its config differs)"
    return calib, path
  return None, "none found"


def resolve(method, model_path: str | None, model_id: str | None, cfg,
            model_arg: str | None = None):
  """The method with RefreshKV's unset threshold and query reading taken from the model's
  calibration (or the fallback, with a one-line notice); any other method unchanged."""
  if not isinstance(method, RefreshKV) or (method.threshold is not None
                                           and method.similarity_after_rope is not None):
    return method
  calib, where = find(model_path, model_id, cfg)
  if calib is None:
    name = model_id or model_path or "this model"
    if name not in _NOTIFIED:
      _NOTIFIED.add(name)
      print(f"jax-longctx: note: refreshkv has no calibrated threshold for model {name} ({where}); "
            f"using {FALLBACK_THRESHOLD} (the paper's Llama-3.1-8B value), queries before RoPE; "
            f"calibrate with: jax-longctx calibrate refreshkv --model {model_arg or name}",
            file=sys.stderr)
    threshold, after = FALLBACK_THRESHOLD, False
  else:
    threshold, after = float(calib["threshold"]), calib["similarity_after_rope"]
  return dataclasses.replace(
      method,
      threshold=threshold if method.threshold is None else method.threshold,
      similarity_after_rope=after if method.similarity_after_rope is None
      else method.similarity_after_rope)
