"""RefreshKV's threshold calibration (issue 39): the paper's A.4 rule, the batched sweep, the
calibration written beside a checkpoint and used by later loads, and the fallback's notice;
the sweep on a tensor-parallel mesh (`mesh_sweep`, a process of its own on fake CPU devices:
python -m tests.test_calibration mesh_sweep)."""

import json
import os
import re
import sys
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import jax_longctx
from jax_longctx.app import calibration_store, cli
from jax_longctx.app.api import LM
from jax_longctx.app.calibration import (Rule, SweptRefreshKV, _run_text, calibrate_refreshkv,
                                         choose, pick_reading, summarize)
from jax_longctx.core.mesh import make_mesh
from jax_longctx.run.generation import prefill, teacher_forced_nll
from jax_longctx.core.options import RunOptions
from jax_longctx.methods import get
from jax_longctx.methods.refreshkv import FALLBACK_THRESHOLD, RefreshKV
from jax_longctx.model import place, random_params
from tests.conftest import run_on_eight_devices, tiny_config, write_tiny_checkpoint

# Table 9 (held-out Book perplexity; thresholds 0.80, 0.85, 0.90, 0.95) and full attention's.
TABLE9 = {"llama": (6.70, {5: [6.92, 6.86, 6.88, 6.88], 10: [6.95, 6.96, 6.96, 6.95]}),
          "qwen": (7.44, {5: [7.86, 7.80, 7.73, 7.66], 10: [7.95, 7.87, 7.84, 7.82]})}
# Table 1 (Book): SnapKV over full attention, which Table 9 does not report.
SNAP_RATIO = {"llama": 7.78 / 7.07, "qwen": 9.18 / 8.26}


def _settings(model, reading="before"):
  full, rows = TABLE9[model]
  snap = full * SNAP_RATIO[model]
  return [{"qc_stride": qc, "reading": reading, "threshold": t, "ppl": p,
           "gap_closed": (snap - p) / (snap - full), "stride": qc * (1 + 10 * (1 - t))}
          for qc, ps in rows.items() for t, p in zip((0.80, 0.85, 0.90, 0.95), ps)]


def test_rule_reproduces_the_papers_choices():
  assert choose(_settings("llama"), Rule())["before"]["threshold"] == 0.85
  assert choose(_settings("qwen"), Rule())["before"]["threshold"] == 0.95
  assert choose(_settings("qwen"), Rule(tolerance=0.0))["before"]["threshold"] == 0.95
  # A looser "similar" takes a cheaper threshold; a stride floor rules out the costly ones.
  assert choose(_settings("qwen"), Rule(tolerance=0.3))["before"]["threshold"] == 0.80
  assert choose(_settings("qwen"), Rule(min_stride=9))["before"]["threshold"] == 0.90
  with pytest.raises(ValueError, match="within tolerance"):
    choose(_settings("qwen"), Rule(min_stride=100))


def test_reading_is_compared_at_the_same_effective_stride():
  before = _settings("qwen", "before")  # strides 7.5-15 at QC 5
  # After RoPE: the same gaps, each at twice the stride (half the full steps): better.
  after = [dict(s, reading="after", stride=2 * s["stride"]) for s in before]
  settings = before + after
  chosen = choose(settings, Rule())
  assert pick_reading(settings, chosen)[0] == "after"
  worse = [dict(s, gap_closed=s["gap_closed"] - 0.2) for s in after]
  assert pick_reading(before + worse, choose(before + worse, Rule()))[0] == "before"


def test_swept_rows_decode_as_each_setting_alone(tiny):
  """One batch, one (threshold, reading) a row: each row's NLLs and full steps are those of
  RefreshKV with that setting alone."""
  cfg, params = tiny
  rng = np.random.default_rng(3)
  prompt = rng.integers(0, cfg.vocab_size, 30).tolist()
  targets = rng.integers(0, cfg.vocab_size, 14).tolist()
  rows = ((-0.2, False), (0.3, False), (0.3, True), (0.9, True))

  def run(method, n):
    options = RunOptions(prefill_chunk=8)
    cache, last = prefill(params, cfg, [prompt] * n, method, cache_len=64, options=options)
    nll, cache = teacher_forced_nll(params, cache, last, jnp.asarray([targets] * n), cfg=cfg,
                                    method=method, options=options)
    return np.asarray(nll), np.stack([np.asarray(layer.n_full) for layer in cache.state], 1)

  swept_nll, swept_full = run(SweptRefreshKV(budget=8, qc_stride=2, rows=rows), len(rows))
  for i, (t, after) in enumerate(rows):
    nll, full = run(RefreshKV(budget=8, qc_stride=2, threshold=t, similarity_after_rope=after), 1)
    np.testing.assert_allclose(swept_nll[i], nll[0], atol=1e-5)
    np.testing.assert_array_equal(swept_full[i], full[0])
  assert len({tuple(f) for f in swept_full}) > 1  # the rows did follow different schedules


def mesh_sweep():
  """One text's sweep (the anchors, both readings at two thresholds) on model=2 records what one
  device does: the same NLLs, the same full steps per layer (each layer's mean query is over all
  its heads, not one shard's), so the same choice."""
  cfg = tiny_config(max_position_embeddings=128)  # 6 query / 2 KV heads: 3 / 1 a shard
  params = random_params(cfg, seed=1)
  rng = np.random.default_rng(0)
  text = rng.integers(0, cfg.vocab_size, 40).tolist(), rng.integers(0, cfg.vocab_size, 20).tolist()
  task, sample = SimpleNamespace(split=lambda _: text), SimpleNamespace(n_tokens=60)
  rows = [(r, t) for r in ("before", "after") for t in (0.0, 0.5)]  # the random model's range
  mesh = make_mesh("model=2")
  one, many = (_run_text(lm, 40, 0, sample, task, (2,), rows, 8, 8)
               for lm in (LM(cfg, params, None), LM(cfg, place(params, cfg, mesh), None, mesh=mesh)))
  for a, b in zip(one, many):
    assert a["method"] == b["method"] and a.get("full_steps") == b.get("full_steps"), (a, b)
    np.testing.assert_allclose(a["nll"], b["nll"], atol=1e-4, err_msg=a["method"])
  assert len({tuple(r["full_steps"]) for r in one if "full_steps" in r}) > 1
  picks = [{reading: (s["threshold"], s["stride"]) for reading, s in choose(
      summarize(r, (2,), ("before", "after"), (0.0, 0.5))["settings"], Rule()).items()}
      for r in (one, many)]
  assert picks[0] == picks[1], picks


def test_a_sweep_on_a_tensor_parallel_mesh_is_one_devices():
  run_on_eight_devices("tests.test_calibration", "mesh_sweep")


@pytest.fixture
def checkpoint_copy(tmp_path):
  """A tiny random checkpoint of its own (a GGUF with every byte a token, converted): what a
  calibration writes beside a checkpoint and a later load reads does not depend on the weights,
  and the default model's 30 layers compiled each setting's programs for minutes."""
  return str(write_tiny_checkpoint(tmp_path))


def test_calibration_is_written_beside_the_checkpoint_and_used(checkpoint_copy, tmp_path, capsys):
  lm = jax_longctx.load(checkpoint_copy)
  out = str(tmp_path / "out")
  calib = calibrate_refreshkv(lm, lengths=(320,), texts=2, thresholds=(0.5, 0.97),
                              n_scored=24, qc_strides=(2,), out_dir=out)
  path = os.path.join(checkpoint_copy, calibration_store.FILE)
  assert calib["written_to"] == path
  with open(path) as f:
    stored = json.load(f)
  assert stored["threshold"] in (0.5, 0.97) and stored["reading"] in ("before", "after")
  assert len(stored["settings"]) == 4 and stored["n_texts"] == 2
  assert {"full", "snapkv_paper"} == set(stored["anchors"])
  # The stored choice is the rule's on the stored measurements.
  chosen = choose(stored["settings"], Rule(**stored["rule"]))
  assert stored["threshold"] == chosen[stored["reading"]]["threshold"]
  # A threshold that never refreshes has nothing on one that refreshes at almost every
  # comparison: the sweep measured what it says.
  by_t = {(s["reading"], s["threshold"]): s["stride"] for s in stored["settings"]}
  assert by_t[("before", 0.97)] < by_t[("before", 0.5)]
  for name in ("results.jsonl", "summary.md", "calibration.md", "calibration.png",
               calibration_store.FILE):
    assert os.path.exists(os.path.join(out, name)), name
  # A rerun resumes: nothing left to run, the same records.
  lines = open(os.path.join(out, "results.jsonl")).read()
  again = calibrate_refreshkv(lm, lengths=(320,), texts=2, thresholds=(0.5, 0.97), n_scored=24,
                              qc_strides=(2,), out_dir=out)
  assert open(os.path.join(out, "results.jsonl")).read() == lines
  assert again["threshold"] == stored["threshold"]
  # Loading the model afterwards: refreshkv takes the calibrated values, no notice; values the
  # user sets stay.
  capsys.readouterr()
  lm2 = jax_longctx.load(checkpoint_copy)
  m = lm2.resolve_method(get("refreshkv", qc_stride=5))
  assert (m.threshold, m.similarity_after_rope) == (stored["threshold"],
                                                    stored["similarity_after_rope"])
  assert m.qc_stride == 5
  mine = lm2.resolve_method(get("refreshkv", threshold=0.42, similarity_after_rope=True))
  assert (mine.threshold, mine.similarity_after_rope) == (0.42, True)
  assert capsys.readouterr().err == ""


def test_an_uncalibrated_model_gets_the_fallback_and_one_notice(checkpoint_copy, capsys):
  calibration_store._NOTIFIED.clear()
  lm = jax_longctx.load(checkpoint_copy)
  capsys.readouterr()
  m = lm.resolve_method(get("refreshkv"))
  assert (m.threshold, m.similarity_after_rope) == (FALLBACK_THRESHOLD, False)
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no calibrated threshold for model" in err
  assert f"jax-longctx calibrate refreshkv --model {checkpoint_copy}" in err
  lm.resolve_method(get("refreshkv"))
  assert capsys.readouterr().err == ""  # once per model
  assert lm.resolve_method(get("snapkv")) == get("snapkv")  # other methods: untouched
  # A calibration made for another model (its config differs) is not applied.
  calibration_store._NOTIFIED.clear()
  with open(os.path.join(checkpoint_copy, calibration_store.FILE), "w") as f:
    json.dump({"format": 1, "threshold": 0.99, "similarity_after_rope": True,
               "config_fingerprint": "another"}, f)
  assert lm.resolve_method(get("refreshkv")).threshold == FALLBACK_THRESHOLD
  assert "made for another model" in capsys.readouterr().err


def test_an_eval_record_shows_the_threshold_that_ran(default_lm, tmp_path, monkeypatch):
  """The sweep resolves each method for its model before running it (the run itself is not
  what is tested here: it is replaced by a stub that returns at once)."""
  from jax_longctx.app import eval as eval_lib
  monkeypatch.setattr(eval_lib, "run_batch",
                      lambda lm, task, spec, samples, *a, **kw: [{"score": 1.0}] * len(samples))
  calibration_store._NOTIFIED.clear()
  specs = eval_lib.MethodSpec.parse("rkv:refreshkv,mine:refreshkv", ["mine.threshold=0.5"])
  recs = eval_lib.run_sweep(default_lm, "ppl", specs, [300], [0.5], 1, str(tmp_path))
  hp = {r["method"]: r["hparams"] for r in recs}
  assert (hp["rkv"]["threshold"], hp["rkv"]["similarity_after_rope"]) == (FALLBACK_THRESHOLD,
                                                                          False)
  assert (hp["mine"]["threshold"], hp["mine"]["similarity_after_rope"]) == (0.5, False)


@pytest.mark.parametrize("argv, match", [
    (["--thresholds", "0.9,abc"], "--thresholds takes comma-separated numbers"),
    (["--thresholds", "1.5"], r"thresholds must be cosine similarities in \[-1, 1\]"),
    (["--readings", "sideways"], "readings must be among before, after"),
    (["--texts", "0"], r"texts \(0\) and every QC stride"),
    (["--tolerance", "2"], "tolerance must lie in"),
])
def test_bad_calibrate_input_is_a_one_line_error(argv, match, capsys):
  assert cli.main(["calibrate", "refreshkv", "--model", "/nonexistent", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and err.startswith("jax-longctx: error:")
  assert re.search(match, err), err


if __name__ == "__main__":
  {"mesh_sweep": mesh_sweep}[sys.argv[1]]()
  print("OK")
