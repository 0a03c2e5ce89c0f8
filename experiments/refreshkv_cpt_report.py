"""summary.md and curves.png of a train-cpt run's log.jsonl (docs/results/refreshkv/cpt).

    PYTHONPATH=. python experiments/refreshkv_cpt_report.py RUN_DIR [OUT_DIR]
"""

import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from train_cpt import read_log  # noqa: E402


def main(run_dir: str, out_dir: str) -> None:
  steps, evals = read_log(run_dir)
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
  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
  a.plot(sorted(steps), [steps[s]["loss"] for s in sorted(steps)])
  a.set(xlabel="step", ylabel="training loss (all L + S tokens)")
  for key, label in (("full_ppl", "full attention"), ("refreshkv_ppl", "RefreshKV")):
    b.plot([e["step"] for e in evals], [e[key] for e in evals], marker="o", label=label)
  b.set(xlabel="step", ylabel="held-out perplexity of the S tokens")
  b.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "curves.png"), dpi=120)
  print("\n".join(lines))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])
