"""benchmarks/decode_profile.py on CPU (--smoke) and its HLO parsing on a GPU-style module; the
child processes benchmarks run their settings in (common.run_child)."""

import json
import os
import subprocess
import sys

from benchmarks import xplane_summary
from benchmarks.common import run_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What XLA GPU prints: operands by name only, a cuBLAS call with a workspace result, an in-place
# cache update fusion, metadata through the stack-frame tables.
GPU_HLO = """HloModule jit_decode_loop, is_scheduled=true

FileNames
1 "{src}"

FunctionNames
1 "Attention._qkv"
2 "KVCache.write"

FileLocations
1 {{file_name_id=1 function_name_id=1 line=2 end_line=2 column=1 end_column=9}}
2 {{file_name_id=1 function_name_id=2 line=1 end_line=1 column=1 end_column=9}}

StackFrames
1 {{file_location_id=1 parent_frame_id=1}}
2 {{file_location_id=2 parent_frame_id=1}}

%fused_computation.7 (param_0: bf16[1,8,1024,128], param_1: bf16[1,8,1,128], param_2: s32[]) -> bf16[1,8,1024,128] {{
  %param_0 = bf16[1,8,1024,128]{{3,2,1,0}} parameter(0)
  %param_1 = bf16[1,8,1,128]{{3,2,1,0}} parameter(1)
  %param_2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dynamic-update-slice.3 = bf16[1,8,1024,128]{{3,2,1,0}} dynamic-update-slice(%param_0, %param_1, %c, %c, %param_2, %c), metadata={{op_name="jit(decode_loop)/while/body/scatter" stack_frame_id=2}}
}}

ENTRY %main.9 (w: bf16[4096,1024], x: bf16[1,4096], k: bf16[1,8,1024,128], kn: bf16[1,8,1,128], i: s32[]) -> bf16[1,1024] {{
  %w = bf16[4096,1024]{{1,0}} parameter(0)
  %x = bf16[1,4096]{{1,0}} parameter(1)
  %k = bf16[1,8,1024,128]{{3,2,1,0}} parameter(2)
  %kn = bf16[1,8,1,128]{{3,2,1,0}} parameter(3)
  %i = s32[] parameter(4)
  %custom-call.1 = (bf16[1,1024]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={{op_name="jit(decode_loop)/while/body/dot_general" stack_frame_id=1}}
  %dynamic-update-slice_fusion.2 = bf16[1,8,1024,128]{{3,2,1,0}} fusion(%k, %kn, %i), kind=kLoop, calls=%fused_computation.7
  ROOT %get-tuple-element.4 = bf16[1,1024]{{1,0}} get-tuple-element(%custom-call.1), index=0
}}
"""


def test_hlo_ops_reads_gpu_style_modules(tmp_path):
  src = tmp_path / "model.py"
  src.write_text("    k = self.k.at[b_idx].set(k_new)\n    k = jnp.einsum(x, self.k_proj[...])\n")
  ops = xplane_summary.hlo_ops(GPU_HLO.format(src=src))
  gemm = ops["custom-call.1"]
  assert (gemm.kind, gemm.label, gemm.source) == ("gemm", "qkv_proj", "model.py:2")
  assert gemm.bytes == 2 * (4096 * 1024 + 4096 + 1024)  # weight + x + out, not the workspace
  dus = ops["dynamic-update-slice_fusion.2"]
  assert (dus.kind, dus.label) == ("fusion", "cache_write")
  assert dus.bytes == 2 * (8 * 128 * 2 + 4)  # what is not the cache, read and written


def test_summarize_counts_steps_gaps_and_groups():
  ev = xplane_summary.Event
  ops = {"a": xplane_summary.OpInfo("a", "fusion", "gemm", 10**8, "m.py:1", "qkv_proj"),
         "b": xplane_summary.OpInfo("b", "fusion", "fusion", 10, "m.py:2", "rmsnorm")}
  us = 1000  # ns
  events = [ev("k", "a", 0, 100 * us, "s"), ev("k", "b", 110 * us, 120 * us, "s"),
            ev("k", "a", 1000 * us, 1100 * us, "s"), ev("k", "b", 1110 * us, 1120 * us, "s")]
  s = xplane_summary.summarize(events, ops, steps=2)
  assert s["kernels_per_step"] == 2 and s["busy_ms_per_step"] == 0.11
  assert s["gap_ms_per_step"] == 0.45 and s["idle_ms_per_step"] == 0.45  # (10 + 880 + 10) / 2
  assert s["by_kind"][0]["label"] == "qkv_proj" and s["by_kind"][0]["TB_s"] == 1.0  # 100 MB in 100 us
  assert next(iter(s["gap_pairs"])) == "fusion:rmsnorm -> gemm:qkv_proj"


def test_smoke_run_writes_records_and_summary(tmp_path):
  out = tmp_path / "profile"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "decode_profile.py"), "--smoke",
       "--new-tokens", "4", "--reps", "1", "--variants", "base,fused", "--out", str(out)],
      capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = (out / "results.jsonl").read_text().splitlines()
  recs = {r["variant"]: r for r in map(json.loads, lines)}
  for name in ("base", "fused"):
    rec = recs[name]
    assert "error" not in rec and "profile_error" not in rec, rec
    assert rec["decode_ms"] > 0 and rec["profile"]["kernels_per_step"] > 0
    labels = {g["label"] for g in rec["profile"]["by_kind"]}
    assert {"lm_head", "rmsnorm", "attention", "cache_write"} <= labels, labels
    assert ("qkv_proj" if name == "fused" else "k/v_proj") in labels, labels
    assert (out / f"{name}.hlo.txt.gz").exists()
  assert recs["fused"]["fused"] and not recs["base"]["fused"]
  assert "| base |" in (out / "summary.md").read_text()


def test_smoke_runs_the_decode_switch_variants(tmp_path):
  """The small-kernel and split-plan variants run (GPU kernels interpreted on CPU) and say in
  their records which switches they set."""
  out = tmp_path / "profile"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "decode_profile.py"), "--smoke",
       "--new-tokens", "4", "--reps", "1", "--variants", "small_kernels,split64",
       "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  recs = {r["variant"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
  for rec in recs.values():
    assert "error" not in rec and "profile_error" not in rec, rec
    assert rec["decode_ms"] > 0
  small = recs["small_kernels"]
  assert all(small[k] for k in ("merge_kernel", "cache_kernel", "add_norm", "q_in_kernel"))
  assert recs["split64"]["decode_tiling"] == {"key_splits": 64}


CHILD = """import sys, time
sys.path.insert(0, {root!r})
from benchmarks.common import child_result
print("not a record")
for i in range(int(sys.argv[2])):
  child_result({{"i": i}})
  print("progress", i, file=sys.stderr, flush=True)
time.sleep(float(sys.argv[3]))
sys.exit(int(sys.argv[4]))
"""


def test_a_child_hands_its_records_over(tmp_path, capsys):
  """Records in order (each to on_record as it comes), stdout's other lines left out, the
  stderr kept and echoed, the exit status; a child past its timeout is killed."""
  script = tmp_path / "child.py"
  script.write_text(CHILD.format(root=ROOT))
  seen = []
  run = run_child(str(script), ["3", "0", "2"], echo_stderr=True, on_record=seen.append)
  assert run.records == seen == [{"i": 0}, {"i": 1}, {"i": 2}]
  assert run.returncode == 2 and not run.timed_out
  assert run.stderr == "progress 0\nprogress 1\nprogress 2\n" == capsys.readouterr().err
  run = run_child(str(script), ["1", "60", "0"], timeout=1)
  assert run.timed_out and run.records == [{"i": 0}] and run.returncode != 0
