"""summary.md and curves.png of a train-cpt run's log.jsonl (docs/results/refreshkv/cpt).

    PYTHONPATH=. python experiments/refreshkv_cpt_report.py RUN_DIR [OUT_DIR]
    PYTHONPATH=. python experiments/refreshkv_cpt_report.py DIR/PREFIXlog.jsonl [OUT_DIR]

RUN_DIR: the run's folder (its log.jsonl); or a log saved under another name, whose prefix the
outputs take (cpt_log.jsonl -> cpt_summary.md, cpt_curves.png). OUT_DIR: RUN_DIR, or the log's
folder.
"""

import os
import statistics
import sys

from jax_longctx.app import plots
from train_cpt import read_log


def summary(steps: dict[int, dict], evals: list[dict]) -> str:
  timed = [steps[s] for s in sorted(steps)][1:]  # the first step includes compilation
  lines = ["| step | held-out ppl, full attention | held-out ppl, RefreshKV | ratio |",
           "|---|---|---|---|"]
  for e in evals:
    lines.append(f"| {e['step']} | {e['full_ppl']:.2f} | {e['refreshkv_ppl']:.2f} | "
                 f"{e['refreshkv_ppl'] / e['full_ppl']:.3f} |")
  tok_s = statistics.median(r["tokens_per_s"] for r in timed)
  mfu = [r["mfu"] for r in timed if "mfu" in r]
  lines += ["", f"Training step (median of steps 2..{len(steps)}): {tok_s:.0f} tokens/s"
            + (f", model FLOPs utilization {100 * statistics.median(mfu):.1f}%" if mfu else "")]
  return "\n".join(lines)


def plot(steps: dict[int, dict], evals: list[dict], path: str) -> str:
  """The training loss by step and, where the run evaluated, the held-out perplexity of full
  attention and RefreshKV by step (a panel left out when the log holds no evaluation)."""
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(11 if evals else 6, 3.8),
                           squeeze=False)
  loss = axes[0, 0]
  xs = sorted(steps)
  plots.draw_lines(loss, {"training loss": (xs, [steps[s]["loss"] for s in xs])},
                   ylabel="training loss (nats/token,\nmean over all L + S tokens)",
                   marker="" if len(xs) > 30 else "o", linewidth=1)
  loss.set_xlabel("training step")
  loss.set_title("training loss" + ("" if evals else " (the log holds no held-out evaluation)"),
                 fontsize="medium")
  if evals:
    ax = axes[0, 1]
    plots.draw_lines(ax, {label: ([e["step"] for e in evals], [e[key] for e in evals])
                          for key, label in (("full_ppl", "full attention"),
                                             ("refreshkv_ppl", "RefreshKV"))},
                     ylabel="perplexity of the S tokens\n(lower is better)")
    ax.set_xlabel("training step")
    ax.set_title("held-out perplexity", fontsize="medium")
    plots.legend_outside(ax)
  fig.tight_layout()
  return plots.save(fig, path)


def main(log: str, out_dir: str | None = None) -> None:
  prefix = "" if os.path.isdir(log) else os.path.basename(log).removesuffix("log.jsonl")
  out_dir = out_dir or (log if os.path.isdir(log) else os.path.dirname(log) or ".")
  steps, evals = read_log(log)
  text = summary(steps, evals)
  with open(os.path.join(out_dir, f"{prefix}summary.md"), "w") as f:
    f.write(text + "\n")
  plot(steps, evals, os.path.join(out_dir, f"{prefix}curves.png"))
  print(text)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
