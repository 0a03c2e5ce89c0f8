"""`jax-longctx bench`: a tiny random shape on CPU through the command line (the table, the JSONL
record's fields), and the table's rows and the anchors' shares from records like a GPU's."""

import argparse
import json

import pytest

from jax_longctx.app import bench
from jax_longctx.app.cli import main

HEADER = "| setting | prefill tok/s | of GEMM | decode ms/step | of bound | peak per GPU |"
# What a record of benchmarks/decode.py held, and what a reader of BENCHMARKS.md compares.
FIELDS = {"impl", "model", "context", "batch", "new_tokens", "method", "method_args", "label",
          "mesh", "kernel_options", "run_options", "decode_tiling", "key_smoothing", "xla_flags",
          "hparams", "kv_dtype", "fill_cache", "cache_bytes", "peak_bytes_after_params",
          "in_use_after_params_per_device", "params_bytes_per_device", "weights_bytes_total",
          "resident_bytes", "prefill_tok_s", "prefill_warmup", "prefill_chunk", "prefill_s",
          "prefill_host_enqueue_s", "prefill_first_chunk_s", "decode_ms", "decode_times_s",
          "decode_compile_s", "decode_compiled_ahead", "decode_ahead_wait_s", "weight_bytes",
          "kv_bytes", "peak_bytes", "device_count", "peak_bytes_per_device", "variant", "device",
          "platform", "jax", "python"}


def test_a_tiny_shape_on_cpu(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the child runs on the CPU whatever this machine has
  out = tmp_path / "bench.jsonl"
  status = main(["bench", "--model", "smollm2-135m", "--shape", "num_layers=2",
                 "--shape", "vocab_size=1024", "--contexts", "256", "--batches", "1",
                 "--reps", "2", "--new-tokens", "4", "--chunk", "128", "--prefill-profile", "1",
                 "--prefill-profile-at", "0.5",
                 "--out", str(out)])
  assert status == 0, capsys.readouterr().err[-3000:]
  lines = capsys.readouterr().out.splitlines()
  assert lines[:2] == [HEADER, "|---|---|---|---|---|---|"]
  cells = [c.strip() for c in lines[2].strip("|").split("|")]
  assert cells[0] == "full, 256, batch 1, one device"
  assert float(cells[1].replace(",", "")) > 0 and float(cells[3]) > 0
  assert cells[2] == cells[4] == "-"  # no GPU: no anchors
  (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
  assert FIELDS <= set(rec), FIELDS - set(rec)
  assert "error" not in rec and rec["shape"] == ["num_layers=2", "vocab_size=1024"]
  assert len(rec["decode_times_s"]) == 2 and rec["prefill_chunk"] == 128
  assert rec["decode_compiled_ahead"]  # two chunks: the loop compiled during the warm-up prefill
  assert rec["platform"] == "cpu" and rec["jax"]
  # the timed prefill's second chunk traced (half way, but never the first); the CPU's XLA work
  # is host events, no device kernels
  assert rec["prefill_profiled_chunks"] == 1 and rec["prefill_kernels_per_chunk"] == []
  assert rec["prefill_profile_at"] == 0.5 and rec["prefill_busy_us_per_chunk"] is None


def test_traced_kernels_are_per_unit_and_per_device(tmp_path):
  """A trace of 2 units on two GPUs: each kernel's microseconds and launches a unit a device;
  host events and a third, idle device count for nothing."""
  import gzip

  from jax_longctx.app.bench_measure import traced_kernel_times
  meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
          for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (3, "/device:GPU:2"),
                            (9, "/host:CPU"))]
  kernels = [("topk", 1, 30.0), ("topk", 1, 34.0), ("topk", 2, 32.0), ("topk", 2, 32.0),
             ("gemm", 1, 10.0), ("gemm", 2, 6.0), ("python", 9, 500.0)]
  events = meta + [{"ph": "X", "name": n, "pid": pid, "ts": 0, "dur": d} for n, pid, d in kernels]
  (tmp_path / "plugins").mkdir()
  with gzip.open(tmp_path / "plugins" / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  rows = traced_kernel_times(str(tmp_path), units=2)
  assert rows == [{"kernel": "topk", "launches": 1.0, "us": 32.0},
                  {"kernel": "gemm", "launches": 0.5, "us": 4.0}]


def test_traced_busy_is_the_union_of_kernels_over_their_span(tmp_path):
  """Per unit and device: the span from the first kernel's start to the last one's end, and the
  time some kernel ran, overlaps once (a kernel inside another's time adds nothing)."""
  from jax_longctx.app.bench_measure import traced_busy
  _trace(tmp_path, [("a", 1, 0.0, 10.0), ("b", 1, 5.0, 10.0), ("c", 1, 6.0, 2.0),
                    ("d", 1, 30.0, 10.0), ("a", 2, 100.0, 20.0), ("b", 2, 105.0, 5.0),
                    ("python", 9, 0.0, 500.0)])
  # GPU 0: busy 0-15 and 30-40 (25) over 0-40; GPU 1: 20 over 20; two units
  assert traced_busy(str(tmp_path), units=2) == {"span_us": 15.0, "busy_us": 11.25}


def test_traced_busy_without_device_kernels(tmp_path):
  from jax_longctx.app.bench_measure import traced_busy
  _trace(tmp_path, [("python", 9, 0.0, 500.0)])
  assert traced_busy(str(tmp_path), units=1) == {"span_us": None, "busy_us": None}


def _trace(tmp_path, kernels):
  """A perfetto trace of (name, pid, start, duration) events: pids 1-2 GPUs, 9 the host."""
  import gzip
  meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
          for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (9, "/host:CPU"))]
  events = meta + [{"ph": "X", "name": n, "pid": pid, "ts": ts, "dur": d}
                   for n, pid, ts, d in kernels]
  (tmp_path / "plugins").mkdir()
  with gzip.open(tmp_path / "plugins" / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_chunk_trace_spans_the_chunks_asked(monkeypatch):
  """K chunks ending at the fraction `at` of the prompt's chunks: traced from the wait after
  chunk begin to the wait after chunk end; never the first chunk; fewer where there are fewer."""
  import jax

  from jax_longctx.app.bench_measure import ChunkTrace
  calls = []
  monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: calls.append("start"))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))

  def run(count, at, n):
    calls.clear()
    trace = ChunkTrace(count, at)
    for i in range(n):
      calls.append(i)  # chunk i runs, then the prefill calls its hook
      trace(i, n, None)
    trace.close()
    if "start" not in calls:
      return trace.chunks, []
    return trace.chunks, calls[calls.index("start") + 1:calls.index("stop")]

  assert run(3, 1.0, 11) == (3, [8, 9, 10])
  assert run(3, 0.5, 11) == (3, [3, 4, 5])
  assert run(20, 0.5, 11) == (5, [1, 2, 3, 4, 5])  # all but the first, up to the fraction's
  assert run(2, 1.0, 1) == (0, [])  # one chunk: nothing traced
  with pytest.raises(ValueError, match="prefill-profile-at 0"):
    ChunkTrace(2, 0.0)


def _args(*argv):
  p = argparse.ArgumentParser()
  bench.add_arguments(p)
  return p.parse_args(list(argv))


@pytest.mark.parametrize("value", ["0", "1.5", "half"])
def test_prefill_profile_at_outside_the_prompt_is_refused_at_parse(value, capsys):
  with pytest.raises(SystemExit):
    _args("--prefill-profile-at", value)
  assert "not a fraction of the prompt in (0, 1]" in capsys.readouterr().err


def test_settings_cover_the_grid_and_route_options_by_label():
  runs = bench.settings(_args("--contexts", "32768,131072", "--batches", "1,8",
                              "--methods", "full,snap:snapkv", "--method-arg", "snap.budget=4096",
                              "--kernel-option", "snap.decode_merge_kernel=false",
                              "--meshes", "none;model=2", "--kv-dtypes", "none;int8",
                              "--impls", "jax,hf"))
  jax_runs = [s for s in runs if s.impl == "jax"]
  assert len(jax_runs) == 2 * 2 * 2 * 3  # methods x meshes x kv dtypes x (4 pairs less 131072x8)
  assert {(s.context, s.batch) for s in runs} == {(32768, 1), (32768, 8), (131072, 1)}
  snap = [s for s in jax_runs if s.label == "snap"]
  assert all(s.method == "snapkv" and s.method_args == ["budget=4096"]
             and s.kernel_options == ["decode_merge_kernel=false"] for s in snap)
  assert all(not s.method_args and not s.kernel_options for s in jax_runs if s.label == "full")
  assert {s.mesh for s in jax_runs} == {"", "model=2"}
  assert len([s for s in runs if s.impl == "hf"]) == 3


def test_a_row_reads_as_the_benchmarks_table():
  rec = {"impl": "jax", "label": "full", "context": 32768, "batch": 1, "mesh": "model=2",
         "kv_dtype": None, "prefill_tok_s": 45223.0, "prefill_flops_per_token": 1.5e10,
         "device_count": 2, "decode_ms": 5.576, "weight_bytes": 8e9, "kv_bytes": 2e9,
         "peak_bytes_per_device": [11.9e9, 10.5e9]}
  rec = bench.with_anchors(rec, bw=3.0e12, gemm=500.0)
  assert rec["bound_ms"] == 10e9 / 3.0e12 * 1e3 and rec["of_bound"] == rec["bound_ms"] / 5.576
  assert rec["prefill_of_gemm"] == 45223.0 * 1.5e10 / 1e12 / 1000.0
  assert bench.table_row(rec) == (f"| full, 32K, batch 1, `model=2` | 45,223 | "
                                  f"{rec['prefill_of_gemm']:.1%} | 5.576 | "
                                  f"{rec['of_bound']:.1%} | 11.9 / 10.5 GB |")
  failed = {"impl": "hf", "label": "full", "context": 131072, "batch": 8, "error": "OOM"}
  assert bench.table_row(failed).startswith("| full, 128K, batch 8, transformers | OOM |")


def test_a_kernel_row_sets_each_case_beside_its_anchor():
  topk = {"name": "topk_decode", "q_len": 1, "kv_len": 131072, "top_k": 4, "ms": 0.05,
          "anchor_ms": 0.2, "k_read_ms": 0.03}
  assert bench.kernel_row(topk) == ("| topk_decode | q_len 1, kv_len 131072, top_k 4 | 0.0500 | "
                                    "einsum + top_k | 0.2000 | 4.00x |")
  flash = {"name": "flash_prefill", "kv_len": 16384, "ours_ms": 2.0, "cudnn_ms": 1.5}
  assert bench.kernel_row(flash).endswith("| 2.0000 | cuDNN | 1.5000 | 0.75x |")
  assert bench.kernel_row({"name": "check_topk"}) == "| check_topk |  | checked | | | |"


def test_a_filled_cache_decodes_on_the_program_of_the_first_loop():
  """--fill-cache over an 8-bit cache of pre-RoPE keys (ReAttention's, with a key offset): every
  buffer committed, as the decode loop's outputs are, so the timed loops run the first loop's
  program (an uncommitted offset compiled it again, and one timed loop then read as ~0.4 s a
  step at 2M tokens)."""
  import jax

  from jax_longctx.app.bench_decode import filled_cache
  from jax_longctx.core.options import RunOptions
  from jax_longctx.methods import get
  from jax_longctx.model import random_params
  from jax_longctx.run.generation import Sampling, decode_loop, row_keys
  from tests.conftest import tiny_config

  cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=64)
  method = get("reattention", n_global=4, n_local=32, span=4, clip=4, chunk=16)
  options = RunOptions(kv_dtype="int8")
  cache = filled_cache(cfg, method, 2, 128, 256, options)
  assert any(getattr(s.k, "offset", None) is not None for s in cache.state)
  assert all(x.committed for x in jax.tree.leaves(cache))
  params, last = random_params(cfg), jax.numpy.zeros((2, cfg.vocab_size))
  kw = dict(cfg=cfg, method=method, max_new_tokens=3, sampling=Sampling(), options=options)
  stops = jax.numpy.asarray([-1], jax.numpy.int32)
  compiled = decode_loop._cache_size()
  for _ in range(2):
    _, _, cache = decode_loop(params, cache, last, stops, row_keys(0, 2), **kw)
  assert decode_loop._cache_size() == compiled + 1
