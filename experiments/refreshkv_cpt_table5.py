"""The RefreshKV paper's Table 5 (Section 6): perplexity of the last 50 tokens of held-out text at
input sizes L (8K and 16K), K = L/8, for full attention, StreamingLLM, H2O, SnapKV and RefreshKV
at fixed strides 10, 25 and 50, before and after continued pretraining (train_cpt).

    python experiments/refreshkv_cpt_table5.py eval --model MODEL \\
        --config train_cpt/configs/qwen2.5-coder-1.5b_shakespeare.toml --set "text_files=GLOB" \\
        --lengths 8192,16384 --max-windows 32 --batch 4 --out OUT/before.jsonl
    python experiments/refreshkv_cpt_table5.py eval --model OUT/cpt/final ... --out OUT/after.jsonl
    python experiments/refreshkv_cpt_table5.py report OUT   # OUT/table5.md, .json, .png

experiments/refreshkv_cpt_table5.sh runs all of it (before, CPT, after, report).

Which text: exactly the rows train_cpt holds out for the config (its text files read with the
model's tokenizer, packed into rows of its L + S, the last `heldout` fraction: the call
`train_cpt.state.Source` makes), so the training never saw it. Those rows are the end of one
token stream; joined back, it is cut into windows of the input size + 50 tokens, up to
--max-windows of them spread evenly over it (their starts at least 50 apart). Where fewer
windows fit side by side, they overlap in their prefixes, but each scores 50 tokens of its own.
Each window's first L tokens are prefilled under the method and its last 50 fed one per decode
step (teacher forcing; `train_cpt.evaluate.suffix_nll`). The model after CPT carries the
tokenizer it was trained with, so before and after read the same windows (each record has a hash
of its tokens; the report pairs only identical ones).

The first scored token is predicted by the prefill, the other 49 by decode steps 1..49, and a
fixed stride s takes full attention at the steps that are multiples of s: at stride 50 none, so
RefreshKV 50 scores exactly as the paper's SnapKV here (its partial cache is SnapKV's, never
refreshed); the report says so and leaves that pair out of the claim.

--out gets one JSON record per (method, length, window) as it finishes; a killed run continues
where it stopped. When every record is there, FILE.done holds the run's settings, and the same
command returns at once. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import jax
import numpy as np

from experiments.cpt_table5_report import TASK, Table5Error, write_report
from jax_longctx.app.api import load
from jax_longctx.app.eval import append_record, read_records
from jax_longctx.core.errors import LongctxError
from jax_longctx.core.progress import progress
from jax_longctx.methods import get, parse_method_args
from train_cpt import data as data_lib
from train_cpt.config import load_config
from train_cpt.evaluate import suffix_nll

SUFFIX = 50  # scored tokens per window (the paper's S; Table 5 reports the last 50 tokens)
STRIDES = (10, 25, 50)  # RefreshKV's fixed strides in Table 5


def methods(length: int) -> dict[str, tuple[str, dict]]:
  """{label: (registry name, hparams)} of Table 5's rows at input size `length`. K = L/8 in
  tokens (an int budget: a fraction would be of the whole cache, L + 50 slots); SnapKV as the
  RefreshKV paper ran it (observation window 1, pooling 7, fixed size while decoding)."""
  k = length // 8
  return {"full": ("full", {}),
          "streaming_llm": ("streaming_llm", {"budget": k}),
          "h2o": ("h2o", {"budget": k}),
          "snapkv": ("snapkv", {"budget": k, "window": 1, "pool_kernel": 7, "keep_size": True}),
          **{f"refreshkv_s{s}": ("refreshkv", {"budget": k, "fixed_stride": s})
             for s in STRIDES}}


def window_starts(n_tokens: int, window: int, max_windows: int) -> list[int]:
  """Starts of up to `max_windows` windows of `window` tokens spread evenly over `n_tokens`, at
  least SUFFIX apart (so no two score the same token); the first at 0, the last near the end."""
  if n_tokens < window:
    raise Table5Error(f"the held-out text has {n_tokens} tokens, fewer than one window of "
                      f"{window}: lower the length or raise heldout")
  n = max(1, min(max_windows, (n_tokens - window) // SUFFIX + 1))
  stride = (n_tokens - window) // (n - 1) if n > 1 else 0
  return [i * stride for i in range(n)]


def text_files(cfg) -> list[str]:
  if cfg.random_preset or not cfg.text_files:
    raise Table5Error("the config names no text (text_files is empty or the model is "
                      f"{cfg.model!r}): give --set text_files=GLOB")
  return list(cfg.text_files)


def heldout_stream(cfg, tokenizer) -> np.ndarray:
  """The held-out rows of train_cpt for `cfg`, joined back into one token stream."""
  _, held = data_lib.load(text_files(cfg), tokenizer, cfg.row_len, cfg.heldout)
  return held.reshape(-1)


def _key(rec: dict) -> tuple:
  return rec["method"], rec["length"], rec["seed"]


def _settings(args, cfg) -> dict:
  """What fixes the records (FILE.done holds it): not --batch, which changes nothing scored."""
  return {"model": args.model, "dtype": args.dtype, "lengths": args.lengths,
          "max_windows": args.max_windows, "text_files": text_files(cfg),
          "row_len": cfg.row_len, "heldout": cfg.heldout}


def evaluate(args) -> int:
  cfg = load_config(args.config, parse_method_args(args.set))
  args.dtype = args.dtype or cfg.compute_dtype
  settings, done_path = _settings(args, cfg), args.out + ".done"
  if os.path.exists(done_path):
    with open(done_path) as f:
      if json.load(f) == settings:
        print(f"{args.out}: complete", file=sys.stderr)
        return 0
  records = read_records(args.out, key=_key)
  others = sorted({r["model"] for r in records} - {args.model})
  if others:
    raise Table5Error(f"{args.out} holds records of model {others[0]}, not {args.model}: give "
                      "another --out")
  lm = load(args.model, dtype=args.dtype)
  if lm.tokenizer is None:
    raise Table5Error(f"{args.model}: the checkpoint has no tokenizer.json to read the text with")
  stream = heldout_stream(cfg, lm.tokenizer)
  # Committed to the device whichever way the checkpoint was saved: a restored checkpoint of jax
  # arrays comes back committed, one of host arrays (train_cpt's final/) not, and the two
  # compile apart; this way the eval after CPT reuses the programs compiled before it.
  params = jax.device_put(lm.params, jax.devices()[0])
  seen = {_key(r) for r in records}
  todo = []  # (length, label, window indices, windows [W, L + SUFFIX], starts)
  for length in args.lengths:
    size = length + SUFFIX
    starts = window_starts(len(stream), size, args.max_windows)
    windows = np.stack([stream[s:s + size] for s in starts])
    print(f"L={length}: {len(starts)} windows of {size} tokens from {len(stream)} held-out tokens "
          f"(starts {starts[1] if len(starts) > 1 else 0} apart)", file=sys.stderr)
    for label in methods(length):
      left = [i for i, s in enumerate(starts) if (label, length, s) not in seen]
      todo += [(length, label, left[b:b + args.batch], windows, starts)
               for b in range(0, len(left), args.batch)]
  for length, label, batch, windows, starts in progress(todo, desc="table5 eval"):
    name, hparams = methods(length)[label]
    method = get(name, **hparams)
    rows = windows[batch + batch[-1:] * (args.batch - len(batch))]  # one shape: one compile
    nll = suffix_nll(params, lm.config, method, rows, length)
    for j, i in enumerate(batch):
      append_record(args.out, {  # "seed" names the window (its start), as gap_stats pairs texts
          "task": TASK, "method": label, "name": name, "hparams": method.hparams(),
          "length": length, "depth": None, "seed": starts[i], "window": i,
          "tokens_sha1": hashlib.sha1(windows[i].tobytes()).hexdigest(),
          "nll": nll[j].tolist(), "model": args.model, "dtype": args.dtype})
  with open(done_path, "w") as f:
    json.dump(settings, f)
  print(f"{args.out}: {len(todo)} batches run, complete", file=sys.stderr)
  return 0


def _lengths(text: str) -> list[int]:
  try:
    out = [int(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r}: expected token counts like 8192,16384")
  if not out or min(out) < 8:
    raise argparse.ArgumentTypeError(f"{text!r}: each length must be >= 8 (K = L/8 tokens)")
  return out


def _positive(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
  return int(text)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="refreshkv_cpt_table5.py", description=__doc__.split("\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  e = sub.add_parser("eval", help="score the held-out windows under every method of Table 5")
  e.add_argument("--model", required=True, help="a converted checkpoint, 'default' or a bundled "
                 "model's name (needs its tokenizer)")
  e.add_argument("--config", required=True, help="the train_cpt config whose held-out rows to use")
  e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="override a setting of the config (as train-cpt takes it); repeatable")
  e.add_argument("--lengths", type=_lengths, default=[8192, 16384], help="input sizes L")
  e.add_argument("--max-windows", type=_positive, default=32)
  e.add_argument("--batch", type=_positive, default=4, help="windows per prefill")
  e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="the weights' and activations' dtype (default: the config's compute_dtype)")
  e.add_argument("--out", required=True, help="JSONL file of records (appended, resumable)")
  r = sub.add_parser("report", help="DIR/before.jsonl, DIR/after.jsonl -> DIR/table5.*")
  r.add_argument("dir")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  try:
    if args.command == "eval":
      return evaluate(args)
    print(write_report(args.dir))
    return 0
  except LongctxError as e:
    print(f"refreshkv_cpt_table5.py: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
