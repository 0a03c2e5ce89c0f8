"""ReAttention on an 8-bit cache: how often each decode step selects the scope the bf16 cache
selects (issue 54's "share of decode steps whose top-k scope equals bf16's").

    python experiments/reattention_scope_agreement.py --model default --length 16k --texts 2 \
        --n-scored 16 --kv-dtypes int8,float8_e4m3fn --method-arg n_local=2048 \
        --method-arg clip=191 --out docs/results/kv_quant/smollm2-135m/reattention_scope_16k_cpu

(about an hour on 2 CPU cores: docs/CLAIMS.md has its table.)

The ppl task's evaluation texts (the same texts as `eval --task ppl`) are prefilled and their
last n_scored tokens fed one at a time (teacher forcing: every cache dtype sees the same tokens),
all texts as one batch, through ReAttention whose every decode step reports its scope
(experiments/scope_trace.py): once with the cache in the model's dtype, once per 8-bit dtype.
A (text, decode step, layer) agrees when the 8-bit run attends to exactly the cache slots the
bf16 run does; reported overall, per layer, as the share of (text, step) whose every layer
agrees, and as the mean Jaccard overlap of the slots picked by score (the spans: every scope
holds the global tokens and the local window), beside the pooled NLL of the scored tokens. The model loads with key smoothing (as an 8-bit `load` does; exact for
the bf16 run too) unless --no-key-smoothing. Writes OUT/results.json, OUT/summary.md and
OUT/scope_agreement_by_layer.png; `--replot OUT...` redraws the figure from OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import numpy as np

from experiments import scope_trace
from jax_longctx import load
from jax_longctx.app import plots, tasks
from jax_longctx.methods import get, parse_method_args
from jax_longctx.run.driver import continuation_nll


def selected(slots: np.ndarray, last: int, method) -> np.ndarray:
  """The slots a scope picked by score: neither the n_global first nor the n_local latest
  (which every scope holds)."""
  return slots[(slots >= method.n_global) & (slots <= last - method.n_local)]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
  union = len(np.union1d(a, b))
  return len(np.intersect1d(a, b)) / union if union else 1.0


def agreement(base: dict, other: dict, layers: int, method) -> dict:
  """Scopes of one run against the baseline's, over the (text, layer, step) keys both hold."""
  keys = sorted(set(base) & set(other))
  if not keys:
    raise SystemExit("no decode step was recorded in both runs")
  same = {k: bool(np.array_equal(base[k], other[k])) for k in keys}
  picked = [jaccard(selected(base[k], k[2], method), selected(other[k], k[2], method))
            for k in keys]
  steps = sorted({(row, pos) for row, _, pos in keys})
  by_layer = [float(np.mean([same[k] for k in keys if k[1] == layer])) for layer in range(layers)]
  return {"compared": len(keys), "equal_share": float(np.mean(list(same.values()))),
          "all_layers_equal_share": float(np.mean(
              [all(same.get((row, layer, pos), True) for layer in range(layers))
               for row, pos in steps])),
          "selected_jaccard": float(np.mean(picked)), "equal_share_by_layer": by_layer}


def run(lm, method, prefixes, targets, kv_dtype, chunk):
  options = lm.run_options(chunk).replace(kv_dtype=kv_dtype)
  t0 = time.perf_counter()
  nll, _ = continuation_nll(lm.params, lm.config, method, prefixes, targets,
                            cache_len=-(-(len(prefixes[0]) + len(targets[0]) + 1) // 256) * 256,
                            options=options)
  scopes = scope_trace.taken()
  print(f"[scope] {kv_dtype or lm.config.dtype}: {len(scopes)} scopes, "
        f"{time.perf_counter() - t0:.0f} s", flush=True)
  return nll, scopes


def plot(results: dict, path: str) -> str:
  """scope_agreement_by_layer.png: per 8-bit cache dtype, the share of decode steps whose scope
  is the base cache's, by layer (0-100 %)."""
  series = {f"{kv} cache": (list(range(len(r["equal_share_by_layer"]))),
                            [100 * x for x in r["equal_share_by_layer"]])
            for kv, r in results["dtypes"].items()}
  plots.line_plot(series, title=f"ReAttention, model {results['model']} at {results['length']} "
                  "tokens: scope agreement", by="layer", xlabel="layer",
                  ylabel=f"decode steps with the {results['base']} scope (%)", percent=True,
                  path=path)
  return path


def replot(out_dir: str) -> str:
  """OUT/scope_agreement_by_layer.png again from OUT/results.json (no model)."""
  with open(os.path.join(out_dir, "results.json")) as f:
    return plot(json.load(f), os.path.join(out_dir, "scope_agreement_by_layer.png"))


def summary(results: dict) -> str:
  base = results["base"]
  lines = [f"# ReAttention's scope on an 8-bit cache against the {base} cache's: "
           f"{results['model']}, {results['length']} tokens, {results['texts']} texts x "
           f"{results['n_scored']} decode steps x {results['layers']} layers", "",
           "A (step, layer) is equal when its scope holds exactly the slots the base run's does; "
           "the Jaccard overlap is of the slots picked by score (the spans: not the global "
           "tokens or the local window, which every scope holds).", "",
           f"| cache | (step, layer) equal | steps with every layer equal | picked slots' "
           f"Jaccard | pooled NLL | vs {base} |", "|---|---|---|---|---|---|",
           f"| {results['base']} | - | - | - | {results['base_nll']:.4f} | |"]
  for kv, r in results["dtypes"].items():
    lines.append(f"| {kv} | {100 * r['equal_share']:.1f}% | "
                 f"{100 * r['all_layers_equal_share']:.1f}% | {r['selected_jaccard']:.4f} | "
                 f"{r['nll']:.4f} | {100 * (r['nll'] / results['base_nll'] - 1):+.2f}% |")
  lines += ["", f"Method: {results['hparams']}; key smoothing: {results['key_smoothing']}; "
            f"{results['device']}, jax {results['jax']}.", ""]
  return "\n".join(lines)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="default")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
  p.add_argument("--length", default="16k")
  p.add_argument("--texts", type=int, default=4)
  p.add_argument("--n-scored", type=int, default=32, help="decode steps per text")
  p.add_argument("--kv-dtypes", default="int8,float8_e4m3fn")
  p.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                 help="a ReAttention hyper-parameter, e.g. n_local=2048")
  p.add_argument("--chunk-size", type=int, default=None)
  p.add_argument("--no-key-smoothing", action="store_true")
  p.add_argument("--out")
  p.add_argument("--replot", nargs="+", metavar="DIR",
                 help="only redraw DIR/scope_agreement_by_layer.png from DIR/results.json")
  args = p.parse_args()
  if args.replot:
    for out_dir in args.replot:
      print(replot(out_dir))
    return 0
  if not args.out:
    p.error("--out is required (or --replot DIR...)")
  length = tasks.parse_length(args.length)
  kv_dtypes = [x.strip() for x in args.kv_dtypes.split(",") if x.strip()]
  method = get("reattention_traced", **parse_method_args(args.method_arg))
  lm = load(args.model, dtype=args.dtype, serving=True, smooth_keys=not args.no_key_smoothing)
  task = tasks.get("ppl", n_scored=args.n_scored)
  prefixes, targets = zip(*(task.split(task.make(lm.tokenizer, length, None, seed))
                            for seed in range(args.texts)))
  base_nll, base = run(lm, method, prefixes, targets, None, args.chunk_size)
  hparams = {k: v for k, v in method.hparams().items() if k not in ("steps", "from_position")}
  results = {"model": args.model, "length": length, "texts": args.texts,
             "n_scored": args.n_scored, "layers": lm.config.num_layers,
             "base": lm.config.dtype, "base_nll": float(base_nll.mean()), "hparams": hparams,
             "key_smoothing": lm.config.key_smoothing, "device": jax.devices()[0].device_kind,
             "host": platform.node(), "jax": jax.__version__, "dtypes": {}}
  for kv in kv_dtypes:
    nll, scopes = run(lm, method, prefixes, targets, kv, args.chunk_size)
    results["dtypes"][kv] = {**agreement(base, scopes, lm.config.num_layers, method),
                             "nll": float(nll.mean())}
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(args.out, "summary.md"), "w") as f:
    f.write(summary(results))
  plot(results, os.path.join(args.out, "scope_agreement_by_layer.png"))
  print(summary(results))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
