"""benchmarks/decode_loop.py on CPU: a variant's loop runs the interpreted GPU kernel and times
it; a variant naming another cache is left out; records carry the variant and the tree."""

import json
import subprocess
import sys


def test_smoke_writes_one_record_per_variant_and_cache(tmp_path):
  out = tmp_path / "loop.jsonl"
  variants = {"default": {}, "groups": {"options": {"decode_row_groups": True}},
              "bf16_only": {"dtype": "bfloat16"}}
  subprocess.run([sys.executable, "-m", "benchmarks.decode_loop", "--smoke", "--label", "before",
                  "--variants", json.dumps(variants), "--out", str(out)], check=True)
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r["dtype"], r["variant"]) for r in recs] == [
      ("int8", "default"), ("int8", "groups"), ("bfloat16", "default"),
      ("bfloat16", "groups"), ("bfloat16", "bf16_only")]
  assert all(r["us"] > 0 and r["tree"] == "before" and "error" not in r for r in recs)


def test_smoke_runs_a_batch_of_sequences(tmp_path):
  """--check records the call's largest differences from the jnp reference (its products: the
  interpreted Triton kernel converts the keys, so the LSE moves by the queries' rounding)."""
  out = tmp_path / "loop.jsonl"
  subprocess.run([sys.executable, "-m", "benchmarks.decode_loop", "--smoke", "--batches", "3",
                  "--check",
                  "--dtypes", "int8", "--variants",
                  json.dumps({"values": {"options": {"decode_int8_values": True}}}),
                  "--out", str(out)], check=True)
  [rec] = [json.loads(line) for line in out.read_text().splitlines()]
  assert rec["batch"] == 3 and rec["variant"] == "values" and rec["us"] > 0, rec
  assert 0 < rec["err_lse"] < 0.5 and 0 < rec["err_out"] < 0.5, rec
