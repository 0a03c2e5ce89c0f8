"""Shared helpers for device benchmarks: timing, device facts, JSON output, child processes."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable


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


def bytes_on(tree, device) -> int:
  """Bytes of `tree`'s arrays that `device` holds (its shards; a whole array where unsharded)."""
  import jax
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def write_json(path: str, record: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


# A child process's record: this, then the record's JSON, one line of its stdout.
RESULT = "RESULT "
STDERR_KEPT = 8000  # characters of a child's stderr kept for its parent's error record


def child_result(rec: dict) -> None:
  """In a child process (`run_child`): hands `rec` to the parent."""
  print(RESULT + json.dumps(rec), flush=True)


@dataclasses.dataclass(frozen=True)
class ChildRun:
  records: list  # what the child handed over (`child_result`), in order
  returncode: int
  stderr: str  # the last STDERR_KEPT characters of its stderr
  timed_out: bool = False


def run_child(script: str, args: list[str], *, env: dict | None = None, cwd: str | None = None,
              timeout: float | None = None, echo_stderr: bool = False,
              on_record: Callable[[dict], None] | None = None) -> ChildRun:
  """Runs `python SCRIPT --child ARGS` and collects its records. Benchmarks run each setting in
  a child of its own: its peak memory is that setting's alone, and XLA_FLAGS (read once per
  process) can differ. on_record(rec) is called as each record arrives, so a parent cut off
  keeps what finished; echo_stderr passes the child's stderr (its progress lines) through as
  it comes; past `timeout` seconds the child is killed (timed_out)."""
  proc = subprocess.Popen([sys.executable, os.path.abspath(script), "--child", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=cwd)
  kept = [""]

  def read_stderr():  # in a thread: a child filling the stderr pipe would block otherwise
    for line in proc.stderr:
      if echo_stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
      kept[0] = (kept[0] + line)[-STDERR_KEPT:]

  reader = threading.Thread(target=read_stderr, daemon=True)
  reader.start()
  killed = threading.Event()
  timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill())) if timeout else None
  if timer:
    timer.start()
  records = []
  try:
    for line in proc.stdout:
      if line.startswith(RESULT):
        records.append(json.loads(line[len(RESULT):]))
        if on_record:
          on_record(records[-1])
    proc.wait()
    reader.join()
  finally:
    if timer:
      timer.cancel()
    if proc.poll() is None:  # the parent was interrupted: the child goes with it
      proc.kill()
  return ChildRun(records, proc.returncode, kept[0], killed.is_set())


def run_cases(cases: dict[str, Callable], only: str, record: Callable[[dict], None]) -> list[str]:
  """Runs each case (name -> a function returning a record or a list of them) unless `only`
  (comma list) leaves it out; hands every record, stamped with the case name and seconds, to
  `record`. A case that raises is recorded with its error and the rest still run (one broken
  case must not waste a device call). Returns the names of the failed cases."""
  wanted = set(filter(None, only.split(",")))
  failed = []
  for name, run in cases.items():
    if wanted and name not in wanted:
      continue
    t0 = time.time()
    try:
      recs = run()
    except Exception as e:  # noqa: BLE001 - reported in the record
      traceback.print_exc()
      recs = {"case": name, **getattr(e, "record", {}),
              "error": f"{type(e).__name__}: {str(e)[:3000]}"}
      failed.append(name)
    for rec in recs if isinstance(recs, list) else [recs]:
      rec.update(name=rec.get("name", name), seconds=round(time.time() - t0, 1))
      record(rec)
    gc.collect()
  return failed


def run_cases_to_json(cases: dict[str, Callable], out: str, facts: dict, only: str) -> list[str]:
  """`run_cases`, printing each record and rewriting the JSON file `out` ({facts, records,
  failed}) after every case, so a call cut off by its time limit still leaves what it measured."""
  records, failed = [], []

  def record(rec):
    records.append(rec)
    if "error" in rec:
      failed.append(rec["name"])
    print(printable(rec), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump({"facts": facts, "records": records, "failed": failed}, f, indent=1)

  run_cases(cases, only, record)
  return failed


def kernel_benchmark_main(doc: str, make_cases: Callable, config, *, inner: int, sweep_help: str,
                          smoke: Callable[[], None]) -> None:
  """The command line of a Mosaic GPU kernel's benchmark: --out, --reps, --inner, --sweep, --only
  and --smoke (tiny shapes on CPU through the interpreter: `smoke()` shrinks the module's shapes).
  Runs make_cases(key, args) through `run_cases_to_json`; exits 1 when a case failed."""
  import jax
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  p.add_argument("--out", required=True, help="JSON file (rewritten after every case)")
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--inner", type=int, default=inner)
  p.add_argument("--sweep", action="store_true", help=sweep_help)
  p.add_argument("--only", default="", help="comma list of case names to run")
  p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script)")
  args = p.parse_args()
  if args.smoke:
    smoke()
    args.reps, args.inner = 1, 1
  facts = {**device_facts(), "default_config": vars(config)}
  print(json.dumps(facts), flush=True)
  failed = run_cases_to_json(make_cases(jax.random.PRNGKey(0), args), args.out, facts, args.only)
  if failed:
    print(f"FAILED CASES: {failed}", flush=True)
    sys.exit(1)


def printable(rec: dict, leave_out=()) -> str:
  return json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                     if k not in leave_out})


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
  """Bytes read + written per second by a large device-to-device copy (torch copy_)."""
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
  torch.cuda.empty_cache()  # the children need the memory
  return bw


# Entry instructions of a compiled XLA program that launch no work of their own.
_NOT_LAUNCHED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def launched_ops(jitted, *args) -> list[str]:
  """The top-level operations of `jitted` compiled for `args` that launch work on the device
  (fusions named with their kind, custom calls with their target, sorts, copies...): how many
  separate kernels one call runs, each costing a launch whatever its size."""
  import re
  text = jitted.lower(*args).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  entry = entry[: entry.index("\n}")]
  ops = []
  for line in entry.splitlines()[1:]:
    m = re.search(r"=\s*\S+(?:\[[^\]]*\])?(?:\{[^}]*\})?\s+([a-z][a-z0-9-]*)\(", line)
    if not m or m.group(1) in _NOT_LAUNCHED:
      continue
    detail = re.search(r'(kind=\w+|custom_call_target="[^"]+")', line)
    ops.append(m.group(1) + (f" {detail.group(1)}" if detail else ""))
  return ops


def device_kernel_times(run, calls: int, per_call: int = 1) -> list[dict]:
  """Device kernels that `run()` launches, from a profiler trace of `calls` runs: name, launches
  and microseconds per unit (a run does `per_call` units, e.g. layers) and per device (a run
  over several devices: their mean), longest first."""
  import glob
  import gzip
  import tempfile

  import jax
  run()  # compiled and warm before tracing
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(calls):
        run()
    path = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  device = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and str(e["args"].get("name", "")).startswith("/device:")}
  total: dict[str, list[float]] = {}
  busy = set()  # devices that ran a kernel: a one-device run on a host of several lists them all
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in device and "dur" in e:
      total.setdefault(e["name"], []).append(float(e["dur"]))
      busy.add(e["pid"])
  units = calls * per_call * max(len(busy), 1)
  rows = [{"kernel": name[:120], "launches": len(d) / units, "us": sum(d) / units}
          for name, d in total.items()]
  return sorted(rows, key=lambda r: -r["us"])


def option_fields(cls, pairs, flag: str) -> dict:
  """Fields of the dataclass `cls` from KEY=VALUE strings (--kernel-option, --run-option), each
  value read as its field's default's type (booleans: true / false; `none`: None; a field whose
  default is None: an integer, true / false, or else the string)."""
  names = {f.name for f in dataclasses.fields(cls)}
  default, fields = cls(), {}
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
      fields[key] = type(current)(value)
  return fields


def kernel_options(pairs):
  """KernelOptions from --kernel-option KEY=VALUE strings."""
  import pallas_kernels
  return pallas_kernels.KernelOptions(**option_fields(pallas_kernels.KernelOptions, pairs,
                                                      "--kernel-option"))
