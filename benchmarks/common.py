"""What the scripts of benchmarks/ share: the library's measuring helpers (jax_longctx.app.
bench_measure, bench_process: the ones `jax-longctx bench` measures with), and what only the
scripts use: a script's own child processes, cases written to one JSON file, the command line of
a Mosaic GPU kernel's benchmark, the kernels a compiled program launches.

Run the scripts from the repository's root as modules (`python -m benchmarks.decode ...`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from jax_longctx.app import bench_process
from jax_longctx.app.bench_measure import (bytes_on, copy_bandwidth, device_facts,  # noqa: F401
                                           device_kernel_times, gemm_tflops, jax_peak_bytes,
                                           kernel_options, median_time, option_fields, printable,
                                           write_json)
from jax_longctx.app.bench_process import (RESULT, STDERR_KEPT, ChildRun,  # noqa: F401
                                           child_result, run_cases)

# The folder that holds benchmarks/: a script's child imports `benchmarks` from there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(script: str, args: list[str], *, env: dict | None = None, **kw) -> ChildRun:
  """Runs `python SCRIPT --child ARGS` (bench_process.run_child: the records it hands over, its
  stderr, its status), with the repository's root importable there however the parent was
  started. Benchmarks run each setting in a child of its own: its peak memory is that
  setting's alone, and XLA_FLAGS (read once per process) can differ."""
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
  return bench_process.run_child([os.path.abspath(script), "--child", *args], env=env, **kw)


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
