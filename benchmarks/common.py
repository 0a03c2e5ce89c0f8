"""Shared helpers for device benchmarks: timing, device facts, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time


def median_time(fn, *, warmup: int = 1, reps: int = 5) -> tuple[float, list[float]]:
  """Median wall time of fn() (fn must block until its device work is done)."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times), times


def device_facts() -> dict:
  import jax
  dev = jax.devices()[0]
  return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
          "jax": jax.__version__, "python": platform.python_version()}


def jax_peak_bytes() -> int | None:
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def write_json(path: str, record: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")
