"""What every benchmark measures with: median times after warm-up, the facts of the device and
the software that ran them, the anchors a result is read against (the device-to-device copy
bandwidth for memory-bound steps, a dense GEMM's rate for compute-bound ones), and the run
options a benchmark's command line sets."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time


def median_time(fn, *, warmup: int = 1, reps: int = 5) -> tuple[float, list[float]]:
  """Median wall time of fn() over `reps` calls after `warmup` (fn must block until its device
  work is done)."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times), times


def timed(fn, *args, reps: int, inner: int, sync=None) -> float:
  """Median seconds per call of jitted fn over `reps` groups of back-to-back calls.

  A group is at least `inner` calls and at least ~20 ms, so that short kernels are timed with
  the device busy and clocked up rather than dominated by launch gaps. sync(out) waits for the
  device (default: jax.block_until_ready; torch calls bring their own).
  """
  import jax
  sync = sync or jax.block_until_ready
  sync(fn(*args))
  t = time.perf_counter()
  sync(fn(*args))
  inner = max(inner, int(0.02 / max(time.perf_counter() - t, 1e-6)))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    sync(out)
    times.append((time.perf_counter() - t) / inner)
  return statistics.median(times)


def device_facts() -> dict:
  """The device and software a record was measured on."""
  import jax
  dev = jax.devices()[0]
  return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
          "jax": jax.__version__, "python": platform.python_version()}


def jax_peak_bytes() -> int | None:
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def bytes_on(tree, device) -> int:
  """Bytes of `tree`'s arrays that `device` holds (its shards; a whole array where unsharded)."""
  import jax
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def write_json(path: str, record: dict) -> None:
  """Appends `record` as one line of the JSONL file `path`."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def printable(rec: dict, leave_out=()) -> str:
  return json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                     if k not in leave_out})


def has_cuda() -> bool:
  """Whether torch sees a CUDA device: the anchors below are measured through it (cuBLAS and
  cudaMemcpy are the rates a user's other tools reach, not XLA's)."""
  try:
    import torch
    return torch.cuda.is_available()
  except ImportError:
    return False


def gemm_tflops(n: int = 8192) -> float:
  """Dense bf16 matmul rate of an n x n x n GEMM (torch, cuBLAS): the compute anchor."""
  import torch
  a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  ms = []
  for _ in range(20):
    start.record()
    a @ b
    end.record()
    torch.cuda.synchronize()
    ms.append(start.elapsed_time(end))
  ms = sorted(ms[5:])
  del a, b
  torch.cuda.empty_cache()
  return 2 * n ** 3 / (ms[len(ms) // 2] / 1e3) / 1e12


def copy_bandwidth() -> float:
  """Bytes read + written per second by a large device-to-device copy (torch copy_): the memory
  anchor."""
  import torch
  n = 1 << 31  # 4 GiB of bf16
  x = torch.randn(n // 2, dtype=torch.float32, device="cuda").view(torch.bfloat16)
  y = torch.empty_like(x)
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  ms = []
  for _ in range(12):
    start.record()
    y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    ms.append(start.elapsed_time(end))
  ms = sorted(ms[2:])
  bw = 2 * x.numel() * x.element_size() / (ms[len(ms) // 2] / 1e3)
  del x, y
  torch.cuda.empty_cache()  # the runs measured after it need the memory
  return bw


def option_fields(cls, pairs, flag: str, default=None) -> dict:
  """Fields of the dataclass `cls` from KEY=VALUE strings (--kernel-option, --run-option), each
  value read as its field's type in `default` (cls() unless given; booleans: true / false;
  `none`: None; a field whose default is None: an integer, true / false, or else the string)."""
  names = {f.name for f in dataclasses.fields(cls)}
  default, fields = default if default is not None else cls(), {}
  for pair in pairs:
    key, _, value = pair.partition("=")
    if key not in names:
      raise SystemExit(f"{flag} {pair}: {cls.__name__} has no field {key!r}")
    current = getattr(default, key)
    if value.lower() == "none":
      fields[key] = None
    elif isinstance(current, bool) or (current is None and value.lower() in ("true", "false")):
      fields[key] = value.lower() in ("1", "true", "yes")
    elif current is None:
      fields[key] = int(value) if value.lstrip("-").isdigit() else value
    else:
      try:
        fields[key] = type(current)(value)
      except ValueError:
        kind = {int: "an integer", float: "a number"}.get(type(current), type(current).__name__)
        raise SystemExit(f"{flag} {pair}: {key} takes {kind}") from None
  return fields


def kernel_options(pairs):
  """KernelOptions from --kernel-option KEY=VALUE strings."""
  import pallas_kernels
  return pallas_kernels.KernelOptions(**option_fields(pallas_kernels.KernelOptions, pairs,
                                                      "--kernel-option"))


def run_options(*, mesh=None, kv_dtype=None, chunk=None, kernel_option=(), run_option=(),
                decode_tiling: str = ""):
  """The RunOptions of a benchmark's run. Every kernel choice a command line can make
  (--kernel-option, --decode-tiling, --run-option) is turned into options here and nowhere
  else, so a change of how runs choose kernels changes this one function. A --run-option names
  a field of RunOptions or of its kernel route (pallas_kernels.Route, e.g. add_norm_backend)."""
  from jax_longctx.core.options import RunOptions
  from pallas_kernels.route import Route

  tiling = None
  if decode_tiling:
    from pallas_kernels.gpu import Tiling
    tiling = Tiling(**option_fields(Tiling, decode_tiling.split(","), "--decode-tiling"))
  in_route = {f.name for f in dataclasses.fields(Route)} - {"kernels", "decode_tiling"}
  routed = [p for p in run_option if p.partition("=")[0] in in_route]
  others = [p for p in run_option if p.partition("=")[0] not in in_route]
  fields = {"prefill_chunk": chunk, **option_fields(RunOptions, others, "--run-option")}
  route = Route(kernels=kernel_options(kernel_option), decode_tiling=tiling,
                **option_fields(Route, routed, "--run-option"))
  return RunOptions(mesh=mesh or None, route=route, kv_dtype=kv_dtype or None, **fields)


def device_kernel_times(run, calls: int, per_call: int = 1) -> list[dict]:
  """Device kernels that `run()` launches, from a profiler trace of `calls` runs: name, launches
  and microseconds per unit (a run does `per_call` units, e.g. layers) and per device (a run
  over several devices: their mean), longest first."""
  import tempfile

  import jax
  run()  # compiled and warm before tracing
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(calls):
        run()
    return traced_kernel_times(d, calls * per_call)


def _device_kernels(trace_dir: str) -> list[tuple]:
  """(device pid, kernel name, start us, duration us) of every device kernel in the perfetto
  trace a `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` wrote. On the CPU, whose
  XLA work is host events, none."""
  import glob
  import gzip

  path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
  events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  device = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e["args"].get("name", "")).startswith("/device:")}
  return [(e["pid"], e["name"], float(e.get("ts", 0.0)), float(e["dur"])) for e in events
          if e.get("ph") == "X" and e.get("pid") in device and "dur" in e]


def traced_kernel_times(trace_dir: str, units: int) -> list[dict]:
  """The device kernels of a trace (`_device_kernels`): name, launches and microseconds per
  unit (the trace held `units` of them on each device) and per device that ran a kernel,
  longest first."""
  kernels = _device_kernels(trace_dir)
  total: dict[str, list[float]] = {}
  for _, name, _, dur in kernels:
    total.setdefault(name, []).append(dur)
  # devices that ran a kernel: a one-device run on a host of several lists them all
  units = units * max(len({k[0] for k in kernels}), 1)
  rows = [{"kernel": name[:120], "launches": len(d) / units, "us": sum(d) / units}
          for name, d in total.items()]
  return sorted(rows, key=lambda r: -r["us"])


def traced_busy(trace_dir: str, units: int) -> dict:
  """How full the devices were over a trace of `units` units: `span_us`, the first kernel's
  start to the last one's end, and `busy_us`, the time some kernel ran (overlaps counted once),
  per unit and per device that ran a kernel; span less busy is the devices' idle time between
  kernels (launch gaps, host waits). None for each where no device kernel ran."""
  by_device: dict[int, list[tuple[float, float]]] = {}
  for pid, _, ts, dur in _device_kernels(trace_dir):
    by_device.setdefault(pid, []).append((ts, ts + dur))
  if not by_device:
    return {"span_us": None, "busy_us": None}
  span = busy = 0.0
  for spans in by_device.values():
    spans.sort()
    span += max(stop for _, stop in spans) - spans[0][0]
    end = spans[0][0]
    for start, stop in spans:  # the union of the intervals, in start order
      busy += max(0.0, stop - max(start, end))
      end = max(end, stop)
  n = units * len(by_device)
  return {"span_us": span / n, "busy_us": busy / n}


class ChunkTrace:
  """A prefill's `on_chunk` part (`--prefill-profile`) that traces `count` consecutive chunks
  ending at the fraction `at` of the prompt's chunks (1: the last; the first chunk, which
  compiles, never), waiting for the device at both ends so the trace holds those chunks' work
  alone; `report` reads the trace into a record's fields and deletes it."""

  def __init__(self, count: int, at: float = 1.0):
    import tempfile
    if not 0 < at <= 1:
      raise ValueError(f"--prefill-profile-at {at}: a fraction of the prompt's chunks, in (0, 1]")
    self._dir = tempfile.TemporaryDirectory()
    self.count, self.at, self.chunks, self.live = count, at, 0, False

  def __call__(self, i: int, n: int, last) -> None:
    import jax
    end = min(n - 1, max(1, round(self.at * (n - 1))))
    begin = max(0, end - self.count)  # traced: the chunks after `begin`, up to `end`
    if i == begin < end and not self.chunks:
      jax.block_until_ready(last)
      jax.profiler.start_trace(self._dir.name, create_perfetto_trace=True)
      self.chunks, self.live = end - begin, True
    elif i == end and self.live:
      self.close(last)

  def close(self, last=None) -> None:
    import jax
    if self.live:
      jax.block_until_ready(last)
      jax.profiler.stop_trace()
      self.live = False

  def report(self, kernels: int) -> dict:
    """The traced chunks: how many, where, the `kernels` longest device kernels a chunk, and a
    chunk's span and busy microseconds (`traced_busy`)."""
    fields = {"prefill_profiled_chunks": self.chunks, "prefill_profile_at": self.at,
              "prefill_kernels_per_chunk": [], "prefill_span_us_per_chunk": None,
              "prefill_busy_us_per_chunk": None}
    if self.chunks:
      busy = traced_busy(self._dir.name, self.chunks)
      fields.update(prefill_kernels_per_chunk=traced_kernel_times(self._dir.name,
                                                                  self.chunks)[:kernels],
                    prefill_span_us_per_chunk=busy["span_us"],
                    prefill_busy_us_per_chunk=busy["busy_us"])
    self._dir.cleanup()
    return fields
