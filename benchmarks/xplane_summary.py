"""Per-step summary of a `jax.profiler` trace of a decode loop, joined with its optimized HLO.

    events = kernel_events(xplane_path, module="decode_loop")   # device kernels, or CPU thunks
    ops = hlo_ops(compiled_text)                                 # name -> OpInfo (shapes, source)
    summary = summarize(events, ops, steps=31)

Device planes ("/device:GPU:0") hold one event per kernel or memcpy with stats `hlo_op` and
`hlo_module` (from XLA's launch annotations); on CPU the XLA thunks are host events with the same
stats. Container thunks (a while loop around its body) are dropped: only leaves count. Each event
is matched by `hlo_op` to its instruction in the optimized HLO, which gives the bytes it moves
(operands + results, in-place updates counted by their update only) and the source line it came
from, labelled by what that line does (q/k/v projection, norm, attention, ...).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import linecache
import os
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8\w*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
# What a source line does, by the first keyword found in it (then by file).
_LINE_LABELS = (("qkv_proj", "qkv_proj"), ("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"),
                ("v_proj", "qkv_proj"), ("o_proj", "o_proj"), ("gate_up_proj", "gate_up_proj"),
                ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj"),
                ("down_proj", "down_proj"), ("lm_head", "lm_head"), ("vd->", "lm_head"),
                ("self.embed", "embed"),
                ("rsqrt", "rmsnorm"), ("self.scale", "rmsnorm"))
_FILE_LABELS = {"rope.py": "rope", "attention.py": "attention", "full.py": "attention",
                "cache.py": "cache_write", "generation.py": "sample/loop", "random.py": "rng",
                "prng.py": "rng", "flash.py": "attention", "gpu.py": "attention",
                "split_merge.py": "attention", "cache_write.py": "cache_write",
                "add_rmsnorm.py": "residual+rmsnorm"}


@dataclasses.dataclass
class OpInfo:
  name: str
  opcode: str
  kind: str  # gemm | fusion | copy | memcpy | collective | other
  bytes: int  # operands + results (an in-place update: its update only)
  source: str  # file:line, or ""
  label: str  # what the source line does (qkv_proj, rmsnorm, attention, ...)


@dataclasses.dataclass
class Event:
  name: str  # kernel name (GPU) or thunk name (CPU)
  op: str  # hlo_op
  start_ns: float
  end_ns: float
  line: str  # the trace line (a GPU stream or a host thread)


def _shape_bytes(text: str, skip_s8: bool = False) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if skip_s8 and dtype in ("s8", "u8"):
      continue  # a cuBLAS call's workspace result
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES.get(dtype, 1)
  return total


# RMSNorm.add_and_norm holds the residual add.
_FUNC_LABELS = (("add_and_norm", "residual"),
                ("RMSNorm", "rmsnorm"), ("rope", "rope"), ("rotate", "rope"),
                ("KVCache.write", "cache_write"), ("unembed", "lm_head"), ("sample", "sample"),
                ("attention", "attention"), ("attend", "attention"), ("_dense", "attention"),
                ("_scores", "attention"), ("_finish", "attention"), ("_visible", "attention"),
                ("_group", "attention"), ("_blocked", "attention"), ("keep_going", "loop"),
                ("decode_loop", "loop"), ("decode_while", "loop"), ("forward", "logits_row"),
                ("Llama.__call__", "embed/residual"),
                ("DecoderLayer", "residual"))


def _label(source_file: str, line: int, function: str, op_name: str) -> str:
  """What an op's source line does: a projection's name if the line names one, else by the
  function it is in, else by file."""
  text = linecache.getline(source_file, line) if source_file and line else ""
  for key, label in _LINE_LABELS:
    if key in text:
      return label
  for key, label in _FUNC_LABELS:
    if key in function:
      return label
  base = os.path.basename(source_file)
  if base in _FILE_LABELS:
    return _FILE_LABELS[base]
  if base:
    return f"{function or base}:{line}"
  return op_name.rsplit("/", 1)[-1] if op_name else "unknown"


class _Frames:
  """The module's stack-frame tables (FileNames, FunctionNames, FileLocations, StackFrames):
  newer XLA prints `stack_frame_id=N` in op metadata instead of source_file/source_line."""

  def __init__(self, text: str):
    tables: dict[str, dict[int, str]] = {}
    current = None
    for raw in text.splitlines():
      if raw in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        current = tables.setdefault(raw, {})
        continue
      m = re.match(r"^(\d+) (.*)$", raw) if current is not None else None
      if m:
        current[int(m.group(1))] = m.group(2).strip().strip('"')
      elif current is not None and raw.strip() == "":
        current = None
    self.t = tables

  def source(self, frame_id: int) -> tuple[str, int, str]:
    """(file, line, function) of a frame (its innermost location)."""
    frame = self.t.get("StackFrames", {}).get(frame_id, "")
    loc_id = re.search(r"file_location_id=(\d+)", frame)
    loc = self.t.get("FileLocations", {}).get(int(loc_id.group(1)), "") if loc_id else ""
    f = re.search(r"file_name_id=(\d+)", loc)
    fn = re.search(r"function_name_id=(\d+)", loc)
    ln = re.search(r"\bline=(\d+)", loc)
    return (self.t.get("FileNames", {}).get(int(f.group(1)), "") if f else "",
            int(ln.group(1)) if ln else 0,
            self.t.get("FunctionNames", {}).get(int(fn.group(1)), "") if fn else "")


def _source_of(rest: str, frames: _Frames) -> tuple[str, int, str, str]:
  """(file, line, function, op_name) from an instruction's metadata."""
  op_name = re.search(r'op_name="([^"]+)"', rest)
  op_name = op_name.group(1) if op_name else ""
  meta_file = re.search(r'source_file="([^"]+)"', rest)
  if meta_file:
    meta_line = re.search(r"source_line=(\d+)", rest)
    return meta_file.group(1), int(meta_line.group(1)) if meta_line else 0, "", op_name
  frame = re.search(r"stack_frame_id=(\d+)", rest)
  if frame:
    return (*frames.source(int(frame.group(1))), op_name)
  return "", 0, "", op_name


def _kind(opcode: str, rest: str, name: str) -> str:
  if opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    t = target.group(1) if target else ""
    return "gemm" if ("gemm" in t.lower() or "matmul" in t.lower()) else f"custom:{t}"
  if opcode in ("dot", "convolution"):
    return "gemm"
  if opcode == "fusion":
    if re.search(r"triton_gemm|__triton_nested_gemm|kind=kCustom.*gemm|cublas", rest) or \
        "gemm" in name:
      return "gemm"
    return "fusion"
  if opcode in ("copy", "copy-start", "copy-done"):
    return "copy"
  if opcode in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute"):
    return "collective"
  return opcode


def weight_labels(cfg, fused: bool) -> dict[int, list[tuple[str, int]]]:
  """Bytes of each projection weight -> [(label, bytes of its output row)], to name GEMMs whose
  metadata XLA dropped (by weight size, then by output size: gate/up and down have the same
  size; q and o at most shapes share both, and get both names)."""
  d, h, kv, hd, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
  item = 2 if "16" in str(cfg.dtype) else 4
  shapes = {"o_proj": (h * hd, d), "down_proj": (f, d), "lm_head": (d, cfg.vocab_size)}
  shapes.update({"qkv_proj": (d, (h + 2 * kv) * hd), "gate_up_proj": (d, 2 * f)} if fused else
                {"q_proj": (d, h * hd), "k/v_proj": (d, kv * hd), "gate/up_proj": (d, f)})
  out: dict[int, list[tuple[str, int]]] = {}
  for label, (n_in, n_out) in shapes.items():
    out.setdefault(n_in * n_out * item, []).append((label, n_out * item))
  return out


def _weight_label(weights: dict, operand_bytes: list[int], result_bytes: int) -> str | None:
  for b in operand_bytes:
    if b in weights:
      exact = [lab for lab, o in weights[b] if result_bytes % o == 0] or \
          [lab for lab, _ in weights[b]]
      return "|".join(exact)
  return None


def hlo_ops(hlo_text: str, weights: dict | None = None) -> dict[str, OpInfo]:
  """Every instruction of an optimized HLO module's text by name. A fusion or call takes its
  source from the dot inside it if any (a GEMM fusion is its dot), else from its root.
  weights: `weight_labels`, to name GEMMs that carry no source."""
  frames = _Frames(hlo_text)
  types: dict[str, str] = {}  # instruction name -> result type text
  inner: dict[str, dict] = {}  # computation -> {"dot": rest, "root": rest, "any": rest}
  instrs, comp = [], None
  for raw in hlo_text.splitlines():
    if raw and not raw[0].isspace() and raw.rstrip().endswith("{"):
      comp = raw.split()[1 if raw.startswith("ENTRY") else 0].lstrip("%")
      continue
    m = _INSTR.match(raw)
    if not m:
      continue
    name, result, opcode, rest = m.groups()
    types[name] = result
    instrs.append((name, result, opcode, rest))
    if comp is not None and ("stack_frame_id" in rest or "source_file" in rest):
      slot = inner.setdefault(comp, {})
      key = "dot" if opcode in ("dot", "convolution") else ("root" if "ROOT" in raw else "any")
      slot.setdefault(key, rest)
  ops = {}
  for name, result, opcode, rest in instrs:
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    meta = rest
    if called and called.group(1) in inner:
      slot = inner[called.group(1)]
      meta = slot.get("dot") or slot.get("root") or slot.get("any") or rest
    source_file, line, function, op_name = _source_of(meta, frames)
    kind = _kind(opcode, rest, name)
    if kind == "fusion" and called and "dot" in inner.get(called.group(1), {}):
      kind = "gemm"
    operand_text = rest.split(")", 1)[0]
    if _SHAPE.search(operand_text):  # older XLA prints operand shapes inline
      sizes = [_shape_bytes(t) for t in re.split(r",\s*(?=[a-z])", operand_text)]
    else:
      sizes = [_shape_bytes(types.get(o, "")) for o in re.findall(r"%?([\w.\-]+)", operand_text)]
    in_b = sum(sizes)
    out_b = _shape_bytes(result, skip_s8=(kind == "gemm"))
    if re.search(r"dynamic[-_]update[-_]slice|scatter", name + " " + opcode):
      # updated in place: the buffer written into is an operand of the result's shape
      out_b, in_b = 0, max(in_b - _shape_bytes(result), 0) * 2
    label = _label(source_file, line, function, op_name)
    if kind == "gemm" and not source_file and weights:
      label = _weight_label(weights, sizes, out_b) or label
    ops[name] = OpInfo(name, opcode, kind, out_b + in_b,
                       f"{os.path.basename(source_file)}:{line}" if source_file else "", label)
  return ops


def find_xplane(trace_dir: str) -> str:
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True),
                 key=os.path.getmtime)
  if not paths:
    raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
  return paths[-1]


# Lines that profilers derive from the kernels (they would count every kernel twice).
_DERIVED_LINES = {"XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework Name Scope",
                  "Framework Ops", "Source code", "Launch Stats", "TensorFlow Name Scope",
                  "TensorFlow Ops"}


def kernel_events(xplane_path: str, module: str) -> tuple[list[Event], str, dict]:
  """(leaf events of HLO module `module` (a substring of its name), the plane they came from,
  host-side totals by event name: {plane/name: (count, ns)}).

  Device planes win when they hold any such event (GPU); else host planes (CPU). If no device
  event names an HLO op, every kernel and memcpy on the device's stream lines is taken."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(xplane_path)
  found: dict[str, list[Event]] = collections.defaultdict(list)
  unannotated: dict[str, list[Event]] = collections.defaultdict(list)
  host: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  for plane in data.planes:
    is_device = plane.name.startswith("/device:")
    for line in plane.lines:
      if line.name in _DERIVED_LINES:
        continue
      for ev in line.events:
        stats = dict(ev.stats)
        op, mod = stats.get("hlo_op"), str(stats.get("hlo_module", ""))
        if not is_device and not ev.name.startswith("$"):  # $: Python frames
          h = host[f"{plane.name}/{ev.name[:60]}"]
          h[0] += 1
          h[1] += ev.end_ns - ev.start_ns
        if op is None and "memcpy_details" in stats:
          op = "memcpy"  # a copy with no annotation (the loop predicate, on some versions)
        e = Event(ev.name, str(op or ev.name), ev.start_ns, ev.end_ns, f"{plane.name}/{line.name}")
        if op is None:
          if is_device and line.name.startswith("Stream"):
            unannotated[plane.name].append(e)
          continue
        if mod and module not in mod:
          continue
        found[plane.name].append(e)
  device = [p for p in found if p.startswith("/device:")]
  if not device and unannotated:
    found, device = unannotated, list(unannotated)
  plane = device[0] if device else next(iter(found), "")
  return _leaves(found.get(plane, [])), plane, {k: tuple(v) for k, v in host.items()}


def _leaves(events: list[Event]) -> list[Event]:
  """Drops events that contain another event of their line (a while thunk around its body)."""
  by_line = collections.defaultdict(list)
  for e in events:
    by_line[e.line].append(e)
  out = []
  for evs in by_line.values():
    evs.sort(key=lambda e: (e.start_ns, -e.end_ns))
    for i, e in enumerate(evs):
      nxt = evs[i + 1] if i + 1 < len(evs) else None
      if nxt is not None and nxt.start_ns < e.end_ns and nxt.end_ns <= e.end_ns:
        continue
      out.append(e)
  return sorted(out, key=lambda e: e.start_ns)


def _busy_ns(events: list[Event]) -> float:
  """Time at least one event runs (overlapping streams counted once)."""
  busy, end = 0.0, float("-inf")
  for e in events:
    if e.end_ns > end:
      busy += e.end_ns - max(e.start_ns, end)
      end = e.end_ns
  return busy


def summarize(events: list[Event], ops: dict[str, OpInfo], steps: int, top: int = 25,
              host: dict | None = None) -> dict:
  """Per decode step: kernels, busy and wall time, gaps between kernels (what the device waited
  for), time and achieved bandwidth by kind and label, and the top ops."""
  if not events:
    return {"error": "no events of the module in the trace"}
  wall = events[-1].end_ns - events[0].start_ns
  busy = _busy_ns(events)
  groups: dict[tuple, dict] = collections.defaultdict(lambda: {"n": 0, "ns": 0.0, "bytes": 0})
  per_op: dict[str, dict] = collections.defaultdict(lambda: {"n": 0, "ns": 0.0})
  gaps_before: dict[str, float] = collections.defaultdict(float)
  gap_hist = {"<2us": 0, "2-5us": 0, "5-20us": 0, "20-100us": 0, ">=100us": 0}
  gap_pairs: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
  gap_sum, end, prev = 0.0, events[0].start_ns, "start"
  # Inside a command buffer (CUDA graph) the event names the buffer, not the HLO op; its kernel
  # is named after the fusion, with "." and "-" made "_".
  by_kernel = {re.sub(r"[.-]", "_", name): name for name in ops}
  for e in events:
    if e.op not in ops and by_kernel.get(e.name) is not None:
      e = dataclasses.replace(e, op=by_kernel[e.name])
    info = ops.get(e.op) or OpInfo(e.op, "?", "memcpy" if "memcpy" in e.name.lower() else "?",
                                   0, "", "unknown")
    g = groups[(info.kind, info.label)]
    g["n"] += 1
    g["ns"] += e.end_ns - e.start_ns
    g["bytes"] += info.bytes
    p = per_op[e.op]
    p["n"] += 1
    p["ns"] += e.end_ns - e.start_ns
    p.update(kernel=e.name[:80], kind=info.kind, label=info.label, source=info.source,
             bytes=info.bytes)
    gap = e.start_ns - end
    if gap > 0:
      gap_sum += gap
      gaps_before[f"{info.kind}:{info.label}"] += gap
      us = gap / 1e3
      key = ("<2us" if us < 2 else "2-5us" if us < 5 else "5-20us" if us < 20 else
             "20-100us" if us < 100 else ">=100us")
      gap_hist[key] += 1
      pair = gap_pairs[f"{prev} -> {info.kind}:{info.label}"]
      pair[0] += 1
      pair[1] += gap
    if e.end_ns >= end:
      prev = f"{info.kind}:{info.label}"
    end = max(end, e.end_ns)

  def ms(ns):
    return round(ns / steps / 1e6, 4)

  by_kind = [{"kind": k, "label": lab, "kernels_per_step": round(v["n"] / steps, 2),
              "ms_per_step": ms(v["ns"]),
              "GB_per_step": round(v["bytes"] / steps / 1e9, 4),
              "TB_s": round(v["bytes"] / v["ns"] / 1e3, 3) if v["ns"] and v["bytes"] else None}
             for (k, lab), v in sorted(groups.items(), key=lambda kv: -kv[1]["ns"])]
  top_ops = [{"op": op, **{k: v for k, v in p.items() if k not in ("n", "ns")},
              "per_step": round(p["n"] / steps, 2), "us_each": round(p["ns"] / p["n"] / 1e3, 2),
              "TB_s": round(p["bytes"] / (p["ns"] / p["n"]) / 1e3, 3) if p.get("bytes") else None}
             for op, p in sorted(per_op.items(), key=lambda kv: -kv[1]["ns"])[:top]]
  return {
      "steps": steps, "events": len(events), "kernels_per_step": round(len(events) / steps, 1),
      "wall_ms_per_step": ms(wall), "busy_ms_per_step": ms(busy),
      "idle_ms_per_step": ms(wall - busy), "gap_ms_per_step": ms(gap_sum),
      "gap_histogram_per_step": {k: round(v / steps, 1) for k, v in gap_hist.items()},
      "gap_ms_before": dict(sorted(((k, ms(v)) for k, v in gaps_before.items()),
                                   key=lambda kv: -kv[1])[:12]),
      "gap_pairs": {k: {"per_step": round(n / steps, 2), "us_mean": round(ns / n / 1e3, 2),
                        "ms_per_step": ms(ns)}
                    for k, (n, ns) in sorted(gap_pairs.items(), key=lambda kv: -kv[1][1])[:12]},
      "host_top": {k: {"per_step": round(n / steps, 2), "ms_per_step": ms(ns)}
                   for k, (n, ns) in sorted((host or {}).items(), key=lambda kv: -kv[1][1])[:15]},
      "bytes_GB_per_step": round(sum(v["bytes"] for v in groups.values()) / steps / 1e9, 4),
      "by_kind": by_kind, "top_ops": top_ops}


def markdown(name: str, s: dict) -> str:
  """A table of one summary's groups, headed by its per-step totals."""
  if "error" in s:
    return f"### {name}\n\n{s['error']}\n"
  head = (f"### {name}\n\n{s['kernels_per_step']} kernels/step; wall {s['wall_ms_per_step']} ms, "
          f"busy {s['busy_ms_per_step']} ms, idle {s['idle_ms_per_step']} ms per step; "
          f"gaps {s['gap_histogram_per_step']}; {s['bytes_GB_per_step']} GB/step counted\n\n"
          f"idle before (kind:label -> ms/step): {s['gap_ms_before']}\n\n"
          f"largest gaps (previous -> next: count/step, mean us, ms/step): {s['gap_pairs']}\n\n"
          f"host (plane/event: count/step, ms/step): {s['host_top']}\n\n"
          "| kind | label | kernels/step | ms/step | GB/step | TB/s |\n|---|---|---|---|---|---|\n")
  rows = [f"| {g['kind']} | {g['label']} | {g['kernels_per_step']} | {g['ms_per_step']} | "
          f"{g['GB_per_step']} | {g['TB_s']} |" for g in s["by_kind"]]
  ops = ["\n| op | kernel | kind | label | source | per step | us each | MB | TB/s |",
         "|---|---|---|---|---|---|---|---|---|"]
  ops += [f"| {o['op']} | `{o['kernel'][:40]}` | {o['kind']} | {o['label']} | {o['source']} | "
          f"{o['per_step']} | {o['us_each']} | {round(o['bytes'] / 1e6, 2)} | {o['TB_s']} |"
          for o in s["top_ops"]]
  return head + "\n".join(rows + ops) + "\n"
