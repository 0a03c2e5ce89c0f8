"""RULER's tables and the compression curves of issue 55 on one GPU (docs/EVAL.md), committed under
docs/results/ruler/: Qwen2.5-Coder-1.5B, bf16, chat template.

    python experiments/ruler_tables.py list          # every part, its samples and estimated time
    python experiments/ruler_tables.py plan          # the parts grouped into device calls
    python experiments/ruler_tables.py run PART...   # (on the GPU machine) run them, in order
    python experiments/ruler_tables.py run all       # every part not yet complete

Directories (each one resumable results.jsonl, its summary.md and plots):
  full/      full attention, RULER's 11 tasks at 4K, 8K, 16K, 32K, SAMPLES (50) per task and length
  press_4k/  the compression sweep at 4K: snapkv, h2o, tova, streaming_llm, quest, citrus_shared
             (CItruS's shared cache) and refreshkv at compression ratios 0.25, 0.5, 0.75 (kept
             tokens = (1 - ratio) x 4096), PRESS_SAMPLES (20) per task, and full attention on the
             same samples (its first PRESS_SAMPLES of full/, seeded, else run)
  long/      ReAttention (the paper's split of the 32K window: 16K local, clip 511) and full
             attention at 64K and 128K, LONG_SAMPLES (10) per task and length

A part is one eval process: one method (at one compression ratio), one length, the tasks that
fit in the time of a device command (estimated below). Before it runs, the part's directory under
OUT is seeded with the records already made: SEED_FROM (the repo's copy, carried with the tree)
and /tmp/ruler_state (an earlier call on the same warm machine); the eval then resumes, and is
stopped at DEADLINE seconds after `run` started (default 540: under a 10-minute command), its
records kept. Run a part again until it prints "complete". After each call copy OUT's files into
docs/results/ruler/ (every file of a part's directory: results.jsonl, summary.md, plots).

GPUS=N (default 1): on a machine of N GPUs, `run` deals its parts to N processes, one a GPU
(CUDA_VISIBLE_DEVICES), the most work left first onto the least loaded, each writing under its
own /tmp/ruler_lanes/<i>; when they end (by DEADLINE) their records are united into OUT and the
machine's state. `GPUS=N plan` packs the parts into calls of N such lanes: the device time a
call holds is its longest lane, so 4 GPUs take about a quarter of one GPU's calls.
LANES_PER_GPU=K (default 1) runs K such processes on each GPU, each with 0.9 / K of its memory:
the model is small and the samples short, so one process leaves its GPU idle between steps.
How much faster K processes finish is not measured apart from the estimates' error (the
committed tables took 20 min of calls on 4 H200s with K=2, against the plan's 39 min), so `plan`
does not count on it; instead `run all` deals every part not yet complete by the work it has
left, and stops at DEADLINE: give the same command call after call until every part prints
"complete".

Environment: MODEL (qwen2.5-coder-1.5b), OUT (docs/results/ruler), SEED_FROM (docs/results/ruler),
SAMPLES (50), PRESS_SAMPLES (20), LONG_SAMPLES (10), DTYPE (bfloat16), BATCH, DEADLINE (540),
CALL_BUDGET (510: the estimated seconds one part and one planned call may take). JAX_COMPILATION_CACHE_DIR
defaults to /tmp/jax_ruler_cache, so later calls on a warm machine reuse compiled programs (set
it empty for none). Progress: a line per part before and after ("[ruler] PART: done/total
..."), the eval's progress bar in between (tqdm, where installed).

Samples run in batches (`eval --batch-size`): BATCH (default 8 up to 32K, 1 at 64K / 128K)
sets one size for every part. Estimates (seconds, one H100 / H200): per sample, max(device,
host), a decode step shared by a batch's rows at DECODE_BATCH_COST (1.5, not measured) times
one row's. Device: prefill by method
and length plus the answer's tokens at ~5 ms each (RefreshKV ~12, ReAttention ~6), from the
committed GPU records of this model (docs/results/{qwen,citrus,resa,refreshkv,reattention}/
*1.5b*: median prefill 0.06 / 0.22 / 0.34 s at 8K / 16K / 32K for full attention in a process of
its own; in runs that shared the GPU with 3-4 others, halved here: full 2.7 / 5.5-10 s at 64K /
128K, ReAttention 6-11 / 11-28 s, SnapKV, Quest, RefreshKV 0.2-0.6 s at 16K, CItruS, StreamingLLM,
H2O 1-1.5 s, scaled by length to 4K) and RULER's answers (~12 tokens for one needle, ~45 for four,
~25 vt, ~60 cwe, ~20 fwe). Host: building a sample, measured on this repo's 2-core CPU machine
with the default model's tokenizer: 0.04 / 0.23 / 1.0 s at 4K / 32K / 128K (built on a thread
while the one before runs). Plus per part: loading the model (~60 s; the first part on a fresh
machine also converts it, ~60 s more) and compiling prefill and four decode programs (RULER's four
answer lengths) per method and length, from the first samples of the same records (20-150 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jax_longctx.app.eval import RESULTS, load_results, unpack_results
from jax_longctx.app.report import write_report
from jax_longctx.app.tasks.ruler_suite import NAMES

K = 1024
STATE = "/tmp/ruler_state"
LANES = "/tmp/ruler_lanes"  # one directory a GPU's process when GPUS > 1
PRESS = ("snapkv", "h2o", "tova", "streaming_llm", "quest", "citrus_shared", "refreshkv")
RATIOS = (0.25, 0.5, 0.75)
REATTENTION_ARGS = ("reattention.n_local=16384", "reattention.clip=511")

# Device seconds per sample: prefill by (method, length); at 4K for the compression methods.
# Full attention to 32K from a single-process run (docs/results/qwen/passkey_1.5b_gpu); the rest
# from runs that shared the GPU with 3-4 others (docs/MODELS.md), halved.
PREFILL = {("full", 4 * K): 0.05, ("full", 8 * K): 0.1, ("full", 16 * K): 0.25,
           ("full", 32 * K): 0.45, ("full", 64 * K): 1.5, ("full", 128 * K): 4.5,
           ("reattention", 64 * K): 5.0, ("reattention", 128 * K): 12.0,
           ("snapkv", 4 * K): 0.06, ("h2o", 4 * K): 0.15, ("tova", 4 * K): 0.15,
           ("streaming_llm", 4 * K): 0.15, ("quest", 4 * K): 0.05,
           ("citrus_shared", 4 * K): 0.2, ("refreshkv", 4 * K): 0.05}
MS_PER_TOKEN = {"refreshkv": 12.0, "reattention": 6.0}
ANSWER = {"niah_multivalue": 45, "niah_multiquery": 45, "vt": 25, "cwe": 60, "fwe": 20}
# Compiling (prefill, each of the four decode programs), seconds.
COMPILE = {"full": (10, 6), "snapkv": (15, 6), "h2o": (15, 8), "tova": (15, 8),
           "streaming_llm": (20, 15), "quest": (8, 10), "citrus_shared": (40, 15),
           "refreshkv": (25, 30), "reattention": (25, 15)}
LOAD_S = 60
HOST_S = {4 * K: 0.04, 8 * K: 0.07, 16 * K: 0.12, 32 * K: 0.23, 64 * K: 0.5, 128 * K: 1.0}


# Samples a batch (`eval --batch-size`) by length: up to 32K eight, which share each decode
# step's weight reads; 64K and 128K one at a time (prefill-bound there).
BATCH = {n * K: 8 for n in (4, 8, 16, 32)} | {64 * K: 1, 128 * K: 1}
# A decode step of 8 rows against one row (an estimate, not measured yet: the weights are read
# once a step; the cache reads and the sampling grow with the rows).
DECODE_BATCH_COST = 1.5


def batch_size(length: int) -> int:
  return int(os.environ.get("BATCH", BATCH[length]))


def sample_seconds(method: str, length: int, task: str) -> float:
  """Estimated seconds a sample, in batches of batch_size(length): the prefill per sample, a
  decode step shared by the batch's rows."""
  b = batch_size(length)
  decode = ANSWER.get(task, 12) * MS_PER_TOKEN.get(method, 5.0) / 1e3
  device = PREFILL[(method, length)] + decode * (DECODE_BATCH_COST if b > 1 else 1.0) / b
  return max(device, HOST_S[length])


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  directory: str
  method: str
  length: int
  tasks: tuple[str, ...]
  samples: int
  ratios: tuple[float, ...] = ()  # compression ratios (a sweep), or none

  @property
  def labels(self) -> tuple[str, ...]:  # the records' method labels
    return tuple(f"{self.method}@cr{r:g}" for r in self.ratios) or (self.method,)

  def seconds(self, done: int = 0) -> float:
    """Estimated seconds for the samples not yet `done`, model load and compiles included."""
    per = sum(sample_seconds(self.method, self.length, t) for t in self.tasks) / len(self.tasks)
    prefill, decode = COMPILE[self.method]
    return LOAD_S + len(self.labels) * (prefill + 4 * decode) + per * max(0, self.total - done)

  @property
  def total(self) -> int:
    return self.samples * len(self.tasks) * len(self.labels)

  def command(self, out_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", "jax_longctx", "eval", "--model", os.environ.get(
        "MODEL", "qwen2.5-coder-1.5b"), "--dtype", os.environ.get("DTYPE", "bfloat16"), "--chat",
        "--task", "ruler:" + ",".join(self.tasks), "--lengths", str(self.length),
        "--samples", str(self.samples), "--methods", self.method, "--out", out_dir,
        "--batch-size", str(batch_size(self.length))]
    if self.ratios:
      cmd += ["--compression-ratios", ",".join(f"{r:g}" for r in self.ratios)]
    if self.method == "reattention":
      cmd += [a for arg in REATTENTION_ARGS for a in ("--method-arg", arg)]
    return cmd


def split(directory: str, method: str, length: int, samples: int,
          ratios: tuple[float, ...] = ()) -> list[Part]:
  """One method at one length as the fewest parts that each fit in CALL_BUDGET estimated
  seconds: every ratio in one process, else one ratio a part, then RULER's tasks in contiguous
  groups."""
  budget = float(os.environ.get("CALL_BUDGET", 510))
  tag = ("" if directory == "full" else f"{directory}_") + f"{method}_{length // K}k"
  options = [(tag, ratios)] + ([(f"{tag}_cr{r:g}", (r,)) for r in ratios] if ratios else [])
  for k in range(1, len(NAMES) + 1):
    bounds = [round(i * len(NAMES) / k) for i in range(k + 1)]
    for grouped in ([options[0]], options[1:]) if k == 1 else (options[1:] or options,):
      parts = [Part(name + (f"_{i + 1}of{k}" if k > 1 else ""), directory, method, length,
                    NAMES[a:b], samples, rs)
               for name, rs in grouped for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
      if parts and all(p.seconds() <= budget for p in parts):
        return parts
  return parts


def all_parts() -> list[Part]:
  samples = int(os.environ.get("SAMPLES", 50))
  press, long_samples = (int(os.environ.get(v, d)) for v, d in (("PRESS_SAMPLES", 20),
                                                                ("LONG_SAMPLES", 10)))
  parts = [p for n in (4, 8, 16, 32) for p in split("full", "full", n * K, samples)]
  parts += split("press", "full", 4 * K, press)  # seeded from full/ when that ran first
  parts += [p for m in PRESS for p in split("press", m, 4 * K, press, RATIOS)]
  parts += [p for m in ("full", "reattention") for n in (64, 128)
            for p in split("long", m, n * K, long_samples)]
  return parts


DIRECTORIES = {"full": "full", "press": "press_4k", "long": "long"}


def _key(rec: dict) -> tuple:  # what identifies a sample (eval's resume key)
  return (rec["task"], rec["method"], rec["length"], rec["depth"], rec["seed"])


def seed(part: Part, out_dir: str) -> int:
  """Unites the part directory's records under OUT with those already made elsewhere (and, for
  the compression sweep, full attention's 4K records from full/); returns the count."""
  sources = [os.path.join(d, DIRECTORIES[part.directory]) for d in (
      os.environ.get("SEED_FROM", os.path.join(ROOT, "docs/results/ruler")), STATE)]
  extra = []
  if part.directory == "press":
    extra = [os.path.join(d, "full") for d in (os.environ.get(
        "SEED_FROM", os.path.join(ROOT, "docs/results/ruler")), STATE)]
  def wanted(src, r):
    return src not in extra or (r["method"] == "full" and r["length"] == 4 * K
                                and r["seed"] < part.samples)  # the sweep's own samples
  return unite(out_dir, sources + extra, wanted)


def unite(out_dir: str, sources: list[str], wanted=lambda src, rec: True) -> int:
  """Adds to out_dir's results the records of `sources` (directories) it lacks; the count."""
  merged = {_key(r): r for r in load_results(out_dir)}
  before = len(merged)
  for src in sources:
    if os.path.abspath(src) == os.path.abspath(out_dir):
      continue
    for r in load_results(src, repair=False):
      if wanted(src, r):
        merged.setdefault(_key(r), r)
  if len(merged) > before:
    os.makedirs(out_dir, exist_ok=True)
    unpack_results(out_dir)  # a packed sweep's records become the plain file written here
    tmp = os.path.join(out_dir, RESULTS + ".tmp")
    with open(tmp, "w") as f:
      f.write("".join(json.dumps(r) + "\n" for r in merged.values()))
    os.replace(tmp, os.path.join(out_dir, RESULTS))
  return len(merged)


def done_count(part: Part, out_dir: str) -> int:
  names = {f"ruler:{t}" for t in part.tasks}
  return sum(1 for r in load_results(out_dir, repair=False) if r["task"] in names
             and r["method"] in part.labels and r["length"] == part.length)


def gpus() -> int:
  n = int(os.environ.get("GPUS", 1))
  if n < 1:
    sys.exit(f"GPUS={n}: give the number of GPUs to run parts on side by side (1 or more)")
  return n


def lanes_per_gpu() -> int:
  n = int(os.environ.get("LANES_PER_GPU", 1))
  if n < 1:
    sys.exit(f"LANES_PER_GPU={n}: give the number of processes to share each GPU (1 or more)")
  return n


def run(names: list[str]) -> int:
  parts = {p.name: p for p in all_parts()}
  if names == ["all"]:
    names = list(parts)
  unknown = [n for n in names if n not in parts]
  if unknown:
    sys.exit(f"unknown part(s) {', '.join(unknown)}; see: python {sys.argv[0]} list")
  out = os.environ.get("OUT", os.path.join(ROOT, "docs/results/ruler"))
  deadline = time.monotonic() + float(os.environ.get("DEADLINE", 540))
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_ruler_cache")
  if not os.environ["JAX_COMPILATION_CACHE_DIR"]:  # set empty: no persistent cache
    del os.environ["JAX_COMPILATION_CACHE_DIR"]
  if gpus() * lanes_per_gpu() > 1:
    return run_lanes([parts[n] for n in names], gpus(), out, deadline, lanes_per_gpu())
  incomplete = 0
  for name in names:
    part = parts[name]
    out_dir = os.path.join(out, DIRECTORIES[part.directory])
    seed(part, out_dir)
    done = done_count(part, out_dir)
    left = deadline - time.monotonic()
    print(f"[ruler] {name}: {done}/{part.total} done, ~{part.seconds(done) / 60:.1f} min to go, "
          f"{left / 60:.1f} min left in this call", flush=True)
    if done < part.total and left > 60:
      t0 = time.monotonic()
      try:
        subprocess.run(part.command(out_dir), cwd=ROOT, timeout=left)
      except subprocess.TimeoutExpired:
        print(f"[ruler] {name}: stopped at the deadline; its records are kept", flush=True)
      print(f"[ruler] {name}: ran {time.monotonic() - t0:.0f} s", flush=True)
    records = load_results(out_dir)
    if records:
      write_report(records, out_dir)
      if not os.environ.get("RULER_LANE"):  # a lane's records reach the state through its parent
        unite(os.path.join(STATE, DIRECTORIES[part.directory]), [out_dir])
    done = done_count(part, out_dir)
    incomplete += done < part.total
    print(f"[ruler] {name}: {done}/{part.total} " + (
        "complete" if done >= part.total else "not complete: run it again"), flush=True)
  return 1 if incomplete else 0


def deal(parts: list[Part], n: int, done: dict[str, int] | None = None) -> list[list[Part]]:
  """The parts over n lanes: the most work left first, each onto the lane with the least work
  so far. done: samples a part has already (its estimate counts only the rest)."""
  done = done or {}
  def left(p: Part) -> float:
    return p.seconds(done.get(p.name, 0))
  lanes: list[list[Part]] = [[] for _ in range(n)]
  for p in sorted(parts, key=lambda p: -left(p)):
    min(lanes, key=lambda lane: sum(left(q) for q in lane)).append(p)
  return lanes


def run_lanes(parts: list[Part], n: int, out: str, deadline: float, per_gpu: int = 1) -> int:
  """`run` over n GPUs of one machine, per_gpu processes a GPU (each with 0.9 / per_gpu of its
  memory unless XLA_PYTHON_CLIENT_MEM_FRACTION is set): the parts not yet complete dealt to the
  processes by the work they have left (`deal`; so the same list can be given call after call),
  each resuming from the same seeds into its own directory, stopped by the same deadline; then
  their records united into OUT (and the machine's state) and each part's count printed."""
  shutil.rmtree(LANES, ignore_errors=True)
  done = {}
  for p in parts:  # what earlier calls made (SEED_FROM, the machine's state), united into OUT
    out_dir = os.path.join(out, DIRECTORIES[p.directory])
    seed(p, out_dir)
    done[p.name] = done_count(p, out_dir)
  todo = [p for p in parts if done[p.name] < p.total]
  procs = []
  lanes = n * per_gpu
  for i, lane in enumerate(deal(todo, lanes, done)):
    if lane:
      env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i % n), GPUS="1", LANES_PER_GPU="1",
                 RULER_LANE="1", OUT=os.path.join(LANES, str(i)),
                 DEADLINE=str(max(0.0, deadline - time.monotonic() - 20)))  # 20 s to unite
      if per_gpu > 1:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / per_gpu:.2f}")
      print(f"[ruler] GPU {i % n}, lane {i}: {' '.join(p.name for p in lane)}", flush=True)
      procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "run",
                                     *(p.name for p in lane)], env=env, cwd=ROOT))
  for proc in procs:
    proc.wait()
  incomplete = 0
  for directory in sorted({DIRECTORIES[p.directory] for p in parts}):
    out_dir = os.path.join(out, directory)
    unite(out_dir, [os.path.join(LANES, str(i), directory) for i in range(lanes)])
    records = load_results(out_dir)
    if records:
      write_report(records, out_dir)
      unite(os.path.join(STATE, directory), [out_dir])
  for p in parts:
    done = done_count(p, os.path.join(out, DIRECTORIES[p.directory]))
    incomplete += done < p.total
    print(f"[ruler] {p.name}: {done}/{p.total} " + (
        "complete" if done >= p.total else "not complete: run it again"), flush=True)
  return 1 if incomplete else 0


def plan(budget: float, n: int = 1) -> list[list[Part]]:
  """Parts in order, packed into calls whose every GPU's share (`deal`) takes at most `budget`
  estimated seconds (model loads and compiles counted per part)."""
  calls: list[list[Part]] = []
  for p in all_parts():
    if calls and max(sum(q.seconds() for q in lane)
                     for lane in deal(calls[-1] + [p], n)) <= budget:
      calls[-1].append(p)
    else:
      calls.append([p])
  return calls


def call_seconds(call: list[Part], n: int) -> float:
  return max(sum(p.seconds() for p in lane) for lane in deal(call, n))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  sub = ap.add_subparsers(dest="cmd", required=True)
  sub.add_parser("list")
  sub.add_parser("plan")
  r = sub.add_parser("run")
  r.add_argument("parts", nargs="+")
  args = ap.parse_args()
  if args.cmd == "run":
    return run(args.parts)
  if args.cmd == "list":
    total = 0.0
    for p in all_parts():
      total += p.seconds()
      print(f"{p.name:36s} {','.join(p.labels):42s} {p.length // K:4d}K {p.total:5d} samples "
            f"~{p.seconds() / 60:4.1f} min  {','.join(p.tasks)}")
    print(f"total ~{total / 60:.0f} min of device commands")
    return 0
  n = gpus()
  calls = plan(float(os.environ.get("CALL_BUDGET", 510)), n)
  prefix = f"GPUS={n} " if n > 1 else ""
  for i, call in enumerate(calls, 1):
    print(f"call {i:2d} (~{call_seconds(call, n) / 60:.1f} min): {prefix}python "
          "experiments/ruler_tables.py run " + " ".join(p.name for p in call))
  print(f"{len(calls)} calls, ~{sum(call_seconds(c, n) for c in calls) / 60:.0f} min"
        + (f" on {n} GPUs" if n > 1 else ""))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
