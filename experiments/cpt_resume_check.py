"""A CPT job killed mid-run resumes to the same loss curve, on whatever device JAX runs on.

    python experiments/cpt_resume_check.py --out $OUT/cpt_resume.json [--set KEY=VALUE ...]

Three `jax-longctx train-cpt` processes (`python -m train_cpt.cli`) on random weights of a named
shape (default the 135M at L 2048; `--set` overrides): one runs the whole job; one is killed with
SIGKILL once its log passes a checkpoint (no chance to clean up), then started again with the same
command and resumes from that checkpoint. Written: each step's loss in both runs, whether they are
equal bit for bit, the largest difference, and the device. tests/test_train_cpt.py checks the same
on CPU; this is for accelerators, whose reductions may differ run to run (`XLA_FLAGS` is recorded:
run it once with `--xla_gpu_deterministic_ops=true` too when the first is not bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = dict(model="random:smollm2-135m", prefix_len=2048, suffix_len=50, top_k=512, steps=12,
           warmup_steps=2, global_batch=4, micro_batch=2, lr=1e-3, save_every=4, eval_rows=0,
           remat="layer", loss_chunk=512)


def _command(config: str, out_dir: str) -> list[str]:
  # train_cpt.cli's own entry: works without the package installed (a tree carried to a GPU)
  return [sys.executable, "-m", "train_cpt.cli", "--config", config, "--set", f"out_dir={out_dir}"]


def _losses(out_dir: str) -> dict[int, float]:
  from train_cpt import read_log
  return {s: r["loss"] for s, r in read_log(out_dir)[0].items()}


def _kill_after(cmd: list[str], log: str, step: int, timeout_s: float) -> int:
  """Runs cmd, SIGKILLs it once its log has a step past `step`; returns the last logged step."""
  proc = subprocess.Popen(cmd, cwd=ROOT)
  deadline = time.time() + timeout_s
  while time.time() < deadline and proc.poll() is None:
    lines = open(log).read().splitlines() if os.path.exists(log) else []
    if max((json.loads(x).get("step", 0) for x in lines if x.strip()), default=0) > step:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.05)
  if proc.wait(timeout=120) != -signal.SIGKILL:
    raise SystemExit(f"the job was not killed mid-run (exit {proc.returncode}): make it longer")
  return max(_losses(os.path.dirname(log)))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--out", default="cpt_resume.json")
  p.add_argument("--timeout", type=float, default=500.0, help="seconds for each run")
  args = p.parse_args()
  job = {**JOB, **dict(a.split("=", 1) for a in args.set)}
  with tempfile.TemporaryDirectory() as tmp:
    config = os.path.join(tmp, "job.json")
    with open(config, "w") as f:
      json.dump(job, f)
    t0 = time.perf_counter()
    subprocess.run(_command(config, f"{tmp}/whole"), cwd=ROOT, check=True, timeout=args.timeout)
    whole_s = time.perf_counter() - t0
    cut = _command(config, f"{tmp}/killed")
    killed_at = _kill_after(cut, f"{tmp}/killed/log.jsonl", int(job["save_every"]), args.timeout)
    subprocess.run(cut, cwd=ROOT, check=True, timeout=args.timeout)
    ref, got = _losses(f"{tmp}/whole"), _losses(f"{tmp}/killed")
  from benchmarks.common import device_facts, write_json
  diffs = [abs(ref[s] - got[s]) for s in ref if s in got]
  rec = {"job": job, "killed_after_step": killed_at, "steps": sorted(ref),
         "loss_whole": [ref[s] for s in sorted(ref)],
         "loss_resumed": [got.get(s) for s in sorted(ref)],
         "same_steps": sorted(ref) == sorted(got), "bit_for_bit": ref == got,
         "max_abs_diff": max(diffs, default=None), "whole_run_s": whole_s,
         "xla_flags": os.environ.get("XLA_FLAGS", ""), **device_facts()}
  write_json(args.out, rec)
  print(json.dumps({k: rec[k] for k in ("killed_after_step", "bit_for_bit", "max_abs_diff",
                                        "same_steps")}), flush=True)
  if not rec["same_steps"]:
    raise SystemExit("the resumed run did not log the same steps")


if __name__ == "__main__":
  main()
