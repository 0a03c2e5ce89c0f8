"""The sweep runner: results, resume, corrupt files, summary and plots."""

import json
import os

import jax
import numpy as np
import pytest

from jax_longctx.app import eval as eval_lib
from jax_longctx.app.eval import EvalError, MethodSpec, run_sweep
from jax_longctx.methods import MethodError


def _specs():
  return MethodSpec.parse("full,streaming_llm", ["streaming_llm.budget=64"])


def test_sweep_writes_results_summary_and_plots_and_resumes(default_lm, tmp_path, monkeypatch):
  out = str(tmp_path / "sweep")
  run_sweep(default_lm, "passkey", _specs(), [300], [0.2, 0.8], 1, out)
  lines = [json.loads(l) for l in open(os.path.join(out, "results.jsonl"))]
  assert [(r["method"], r["seed"]) for r in lines] == [("full", 0), ("streaming_llm", 0)]
  rec = lines[1]
  for field in ("task", "hparams", "length", "depth", "seed", "prediction", "expected", "score",
                "prefill_s", "decode_s", "peak_bytes"):
    assert field in rec
  assert rec["hparams"]["budget"] == 64
  calls = []
  real = eval_lib.run_batch
  monkeypatch.setattr(eval_lib, "run_batch", lambda *a, **kw: calls.append(a) or real(*a, **kw))
  run_sweep(default_lm, "passkey", _specs(), [300], [0.2, 0.8], 2, out)  # one more sample each
  assert len(calls) == 2
  assert len(open(os.path.join(out, "results.jsonl")).readlines()) == 4
  summary = open(os.path.join(out, "summary.md")).read()
  assert "| full |" in summary and "(n=2)" in summary
  for png in ("passkey_by_length.png", "passkey_depth_heatmap.png"):
    assert os.path.getsize(os.path.join(out, png)) > 1000


def test_corrupt_results_file_is_reported_not_overwritten(default_lm, tmp_path):
  out = tmp_path / "sweep"
  out.mkdir()
  (out / "results.jsonl").write_text('{"task": "passkey"\n')
  with pytest.raises(EvalError, match="line 1 is corrupt"):
    run_sweep(default_lm, "passkey", _specs(), [300], [0.5], 1, str(out))
  assert (out / "results.jsonl").read_text() == '{"task": "passkey"\n'


_REC = '{"task": "passkey", "method": "full", "length": 300, "depth": 0.5, "seed": %d}\n'


@pytest.mark.parametrize("tail", ['{"task": "passk', (_REC % 2).rstrip("\n")])
def test_a_record_cut_short_is_dropped_and_cut_from_the_file(tmp_path, capsys, tail):
  """A last line without its newline is a write a kill interrupted (even one that parses: its
  newline never came): dropped with one line; the file ends at the line before."""
  good = _REC % 0 + _REC % 1
  (tmp_path / "results.jsonl").write_text(good + tail)
  assert [r["seed"] for r in eval_lib.load_results(str(tmp_path), repair=False)] == [0, 1]
  assert (tmp_path / "results.jsonl").read_text() == good + tail  # not the writer: left alone
  assert [r["seed"] for r in eval_lib.load_results(str(tmp_path))] == [0, 1]
  assert (tmp_path / "results.jsonl").read_text() == good
  err = capsys.readouterr().err.splitlines()
  assert err[-1] == (f"{tmp_path / 'results.jsonl'}: dropped its last line, a record cut short by "
                     f"an interrupted write ({len(tail)} bytes); its sample runs again")


def test_packed_records_read_as_they_were_and_a_rerun_unpacks_them(tmp_path):
  """A finished sweep's records packed (results.jsonl.gz) load as the plain file did; a rerun
  into the directory (writable_results) unpacks them first, so new records append to them; a
  file ending in a record cut short is not packed."""
  from jax_longctx.app import records
  good = _REC % 0 + _REC % 1
  (tmp_path / "results.jsonl").write_text(good)
  packed = records.pack_results(str(tmp_path))
  assert packed.endswith("results.jsonl.gz") and not (tmp_path / "results.jsonl").exists()
  assert [r["seed"] for r in eval_lib.load_results(str(tmp_path))] == [0, 1]
  again = tmp_path / "again"
  again.mkdir()
  (again / "results.jsonl").write_text(good)
  assert open(records.pack_results(str(again)), "rb").read() == open(packed, "rb").read()
  path = eval_lib.writable_results(str(tmp_path))
  assert not (tmp_path / "results.jsonl.gz").exists()
  eval_lib.append_record(path, json.loads(_REC % 2))
  assert [r["seed"] for r in eval_lib.load_results(str(tmp_path))] == [0, 1, 2]
  (tmp_path / "results.jsonl").write_text(good + '{"task": "pa')
  with pytest.raises(EvalError, match="cut short"):
    records.pack_results(str(tmp_path))
  assert (tmp_path / "results.jsonl").exists() and not (tmp_path / "results.jsonl.gz").exists()


def test_a_corrupt_line_before_the_last_stays_an_error(tmp_path):
  (tmp_path / "results.jsonl").write_text(_REC % 0 + '{"task": "pa\n' + _REC % 1 + '{"ta')
  with pytest.raises(EvalError, match="line 2 is corrupt"):
    eval_lib.load_results(str(tmp_path))


def test_ppl_sweep_records_per_token_nll_and_ratio_plot(default_lm, tmp_path):
  out = str(tmp_path / "ppl")
  specs = MethodSpec.parse("full,streaming_llm", ["streaming_llm.budget=64"])
  recs = run_sweep(default_lm, "ppl", specs, [400], [0.5], 1, out, task_options={"n_scored": 32})
  full = next(r for r in recs if r["method"] == "full")
  assert len(full["nll"]) == 32 and full["score"] > 1
  # Teacher-forced decoding with full attention equals one uncached forward over the text.
  from jax_longctx.app import tasks
  task = tasks.get("ppl", n_scored=32)
  prefix, targets = task.split(task.make(default_lm.tokenizer, 400, None, 0))
  logp = jax.nn.log_softmax(default_lm.logits([prefix + targets])[0], axis=-1)
  ref = [-float(logp[len(prefix) - 1 + i, t]) for i, t in enumerate(targets)]
  np.testing.assert_allclose(full["nll"], ref, atol=2e-3)
  assert os.path.exists(os.path.join(out, "ppl_ratio_by_position.png"))


def test_method_args_for_unlisted_methods_are_rejected():
  with pytest.raises(MethodError, match="not in --methods"):
    MethodSpec.parse("full", ["snapkv.budget=3"])


class _SlowTask:
  """A task whose builds are recorded: each is the entry's seed, and seed 9 fails."""

  def __init__(self):
    import threading
    self.second_started = threading.Event()
    self.calls = []

  def make(self, tok, length, depth, seed, *, chat):
    self.calls.append(seed)
    if seed == 1:
      self.second_started.set()
    if seed == 9:
      raise ValueError("bad sample 9")
    return (tok, length, depth, seed, chat)


def test_samples_are_built_ahead_in_order_on_a_thread():
  task = _SlowTask()
  batches = [[(None, 64, 0.5, 0)], [(None, 64, 0.5, 1), (None, 64, 0.5, 2)]]
  got = []
  for made in eval_lib.made_ahead(task, "tok", batches, chat=True):
    if not got:  # the next batch is built while this one "runs"
      assert task.second_started.wait(timeout=10)
    got.append(made)
  assert got == [[(e, ("tok", 64, 0.5, e[3], True)) for e in b] for b in batches]
  assert task.calls == [0, 1, 2]


def test_a_failed_sample_build_raises_at_its_turn():
  batches = [[(None, 64, 0.5, seed)] for seed in (0, 9, 2)]
  it = eval_lib.made_ahead(_SlowTask(), "tok", batches, chat=False)
  assert next(it)[0][1][3] == 0
  with pytest.raises(ValueError, match="bad sample 9"):
    next(it)
  assert list(eval_lib.made_ahead(_SlowTask(), "tok", [], chat=False)) == []


def test_batches_hold_one_method_and_length_each():
  todo = [("a", 1, d, 0) for d in range(3)] + [("a", 2, 0, 0), ("b", 2, 0, 0), ("b", 2, 1, 0)]
  assert [[e[:3] for e in b] for b in eval_lib.batched(todo, 2)] == [
      [("a", 1, 0), ("a", 1, 1)], [("a", 1, 2)], [("a", 2, 0)], [("b", 2, 0), ("b", 2, 1)]]
  with pytest.raises(EvalError, match="at least one sample"):
    run_sweep(None, "passkey", [], [300], [0.5], 1, "unused", batch_size=0)


def test_a_sweep_split_at_first_sample_plans_what_the_whole_does():
  """--first-sample K: samples K.. of each method and length, the seeds and depths the whole
  sweep gives them, so parts run in several processes add up to the sweep."""
  from jax_longctx.app import tasks as tasks_lib
  task, depths = tasks_lib.get("passkey"), [0.1, 0.5, 0.9]
  whole = eval_lib.plan(task, ["a", "b"], [100, 200], depths, 5)
  parts = [eval_lib.plan(task, ["a", "b"], [100, 200], depths, 5, first=k) for k in (0, 3)]
  assert parts[0] == whole
  assert parts[1] == [p for p in whole if p[3] >= 3] and len(parts[1]) == 8
  with pytest.raises(EvalError, match="--first-sample 5 must lie in"):
    run_sweep(None, "passkey", [], [300], [0.5], 5, "unused", first_sample=5)


_SAME = ("method", "seed", "depth", "n_tokens", "prediction", "expected")


@pytest.fixture(scope="module")
def tiny_text_lm(default_lm):
  """A tiny random model that reads the default model's tokens: prompts as the tasks make them,
  compiled in seconds."""
  from jax_longctx.app.api import LM
  from jax_longctx.model import random_params
  from tests.conftest import tiny_config
  cfg = tiny_config(vocab_size=default_lm.config.vocab_size, max_position_embeddings=1024)
  return LM(cfg, random_params(cfg, seed=3), default_lm.tokenizer)


@pytest.mark.parametrize("task", ["passkey", "ppl"])
def test_a_batched_sweep_records_what_single_runs_record(tiny_text_lm, tmp_path, task):
  """Three samples in batches of two (the last filled with a copy) against one at a time: the
  same predictions, scores and per-token NLL; each record has its own row's method report
  (RefreshKV's full steps, its rows refreshing apart) and the batch's size."""
  specs = MethodSpec.parse("full,streaming_llm,refreshkv", [  # threshold: rows refresh apart
      "streaming_llm.budget=64", "refreshkv.budget=64", "refreshkv.threshold=0.2"])
  options = {"n_scored": 16} if task == "ppl" else {}
  one, two = (run_sweep(tiny_text_lm, task, specs, [300], [0.2, 0.8], 3, str(tmp_path / str(n)),
                        task_options=options, batch_size=n) for n in (1, 2))
  assert [r["batch"] for r in two] == [2] * 9 and {r["batch"] for r in one} == {1}
  for a, b in zip(one, two):
    assert {f: a.get(f) for f in _SAME} == {f: b.get(f) for f in _SAME}
    np.testing.assert_allclose(b["score"], a["score"], rtol=1e-5)  # ppl: fp32 sums of a batch
    if task == "ppl":
      np.testing.assert_allclose(a["nll"], b["nll"], atol=1e-5)
    if a["method"] == "refreshkv":
      assert a["full_steps"] == b["full_steps"] and a["decode_steps"] == b["decode_steps"]
  full_steps = [r["full_steps"] for r in one if r["method"] == "refreshkv"]
  assert any(f != full_steps[0] for f in full_steps)  # the rows' own counts, not the batch's
