"""RULER and compression sweeps through the command line on the default model (in this process,
so the compiled programs are shared): every RULER task once, a compression sweep's records,
table and plot, and bad input as one line."""

import json

import pytest

from jax_longctx.app import cli, tasks
from jax_longctx.app.eval import BudgetPoint, MethodSpec
from jax_longctx.app.tasks.ruler import LEFT_OUT_NOTE
from jax_longctx.app.tasks.ruler_suite import NAMES
from tests.test_cli import _one_line_error


# One sample, two new tokens, one cache size and prefill chunk: every run here shares full
# attention's programs (and a 448-token chunk pads RULER's shortest prompts less than 512).
ONE_COMPILE = ("--samples", "1", "--chat", "--task-arg", "max_new_tokens=2", "--cache-len", "1024",
               "--chunk-size", "448")


def _records(out) -> list[dict]:
  return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_every_ruler_task_runs_through_the_cli(default_lm, tmp_path):
  out = tmp_path / "ruler"
  # RULER's shortest prompts (chat template): the niah tasks and fwe fit in 448 tokens with
  # their tokens to generate; vt's solved example and cwe's need ~880. Two new tokens each.
  short = "ruler:" + ",".join(n for n in NAMES if n not in ("vt", "cwe"))
  for task, length in ((short, "448"), ("ruler:vt,cwe", "896")):
    assert cli.main(["eval", "--task", task, "--lengths", length, *ONE_COMPILE,
                     "--out", str(out)]) == 0
  recs = _records(out)
  assert sorted(r["task"] for r in recs) == sorted(f"ruler:{n}" for n in NAMES)
  assert all(0 <= r["score"] <= 1 and r["depth"] is None for r in recs)
  summary = (out / "summary.md").read_text()
  assert LEFT_OUT_NOTE in summary and "### RULER: full" in summary
  assert "| niah_multikey_3 | " in summary and "| **average** | " in summary
  assert "(9 tasks, n=9)" in summary and "(2 tasks, n=2)" in summary
  assert (out / "ruler_by_length.png").stat().st_size > 1000


def test_a_compression_sweep_records_each_budget_and_plots_the_curve(default_lm, tmp_path):
  out = tmp_path / "press"
  assert cli.main(["eval", "--task", "ruler:fwe", "--lengths", "256", *ONE_COMPILE, "--methods",
                   "full,streaming_llm", "--compression-ratios", "0.5", "--out", str(out)]) == 0
  recs = {r["method"]: r for r in _records(out)}
  assert sorted(recs) == ["full", "streaming_llm@cr0.5"]
  half = recs["streaming_llm@cr0.5"]
  assert (half["base_method"], half["compression_ratio"], half["budget_tokens"],
          half["hparams"]["budget"]) == ("streaming_llm", 0.5, 128, 128)
  assert half["prompt_compression"] == round(1 - 128 / half["n_tokens"], 4)
  assert "compression_ratio" not in recs["full"]
  summary = (out / "summary.md").read_text()
  assert "### ruler at 256 by compression ratio" in summary
  assert "| streaming_llm | " in summary and "full attention: " in summary
  assert (out / "compression_ruler_256.png").stat().st_size > 1000


def test_budget_points_as_ratios_and_as_tokens():
  ratio, tokens = BudgetPoint(ratio=0.25), BudgetPoint(tokens=1000)
  assert (ratio.tag, ratio.kept(4096)) == ("cr0.25", 3072)
  assert ratio.fields(4096, 3968) == {"compression_ratio": 0.25, "budget_tokens": 3072,
                                      "prompt_compression": round(1 - 3072 / 3968, 4)}
  assert (tokens.tag, tokens.fields(4000, 500)) == (
      "1000tok", {"compression_ratio": 0.75, "budget_tokens": 1000, "prompt_compression": 0.0})
  specs = MethodSpec.at_points(MethodSpec.parse("full,sk:snapkv", []), [ratio, tokens])
  assert [s.label for s in specs] == ["full", "sk@cr0.25", "sk@1000tok"]
  assert specs[1].at(4096).method.budget == 3072 and specs[2].at(8192).method.budget == 1000


@pytest.mark.parametrize("argv, says", [
    (["--task", "ruler:vt,nope"], "unknown RULER task 'nope'; RULER's tasks here: niah_single_1, "
     "niah_single_2, niah_single_3, niah_multikey_1, niah_multikey_2, niah_multikey_3, "
     "niah_multivalue, niah_multiquery, vt, cwe, fwe"),
    (["--task", "ruler:qa_2"], "RULER's qa_2 (HotpotQA) is not offered: RULER downloads its data"),
    (["--task", "ruler", "--methods", "full,reattention", "--compression-ratios", "0.5"],
     "reattention (reattention) has no budget to sweep"),
    (["--task", "ruler", "--methods", "snapkv", "--compression-ratios", "1.5"],
     "a compression ratio lies in [0, 1), got 1.5"),
    (["--task", "ruler", "--methods", "snapkv", "--budgets", "0.5"],
     "--budgets takes kept tokens as integers"),
    (["--task", "ruler", "--methods", "snapkv", "--compression-ratios", "0.5", "--method-arg",
      "snapkv.budget=64"], "drop budget from --method-arg"),
])
def test_bad_ruler_and_sweep_input_is_one_line_before_the_model_loads(argv, says, capsys,
                                                                      tmp_path):
  err = _one_line_error(["eval", *argv, "--out", str(tmp_path / "o")], capsys)
  assert says in err
  assert not (tmp_path / "o").exists()


def test_a_length_too_short_for_a_task_names_its_minimum(default_lm, capsys, tmp_path):
  need = tasks.get("ruler:cwe").min_length(default_lm.tokenizer, 600, chat=True)
  err = _one_line_error(["eval", "--task", "ruler:fwe,cwe", "--chat", "--lengths", "600",
                         "--out", str(tmp_path / "o")], capsys)
  assert err.endswith(f"ruler:cwe needs a length of at least {need} tokens (its template, answer "
                      "prefix and 120 tokens to generate), got 600")
  assert not (tmp_path / "o" / "results.jsonl").exists()
