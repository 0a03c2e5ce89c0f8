"""Prints benchmark JSON lines (stdin) as short rows: case, shape, tiling and the timings."""

import json
import sys

KEYS = ("ms", "tflops", "speedup", "anchor_ms", "ours_ms", "ours_tflops", "cudnn_tflops",
        "ratio_to_cudnn", "fraction_of_bw", "ratio_to_dense", "dense_ms", "k_read_ms", "error")

for line in sys.stdin:
  try:
    r = json.loads(line)
  except ValueError:
    print(line.rstrip()[:300])
    continue
  shown = {k: (round(r[k], 4) if isinstance(r[k], float) else str(r[k])[:300]) for k in KEYS if k in r}
  print(r.get("case"), r.get("q_len", ""), r.get("kv_len", ""), r.get("top_k", ""), r.get("tiling", ""),
        shown, flush=True)
