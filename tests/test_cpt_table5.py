"""RefreshKV's Table 5 run (experiments/refreshkv_cpt_table5.py) end to end on a tiny model with
the default model's tokenizer: eval before, two CPT steps, eval after, report. The windows must be
train_cpt's held-out text (scored as a direct prefill would), the eval must resume, and the
report must be written; its numbers and verdict are checked on synthetic records."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import refreshkv_cpt_table5 as table5
from jax_longctx.app.api import load
from jax_longctx.methods import get
from jax_longctx.run.generation import prefill, teacher_forced_nll
from tests.conftest import write_cpt_job
from train_cpt import load_config, train

# One input size: each compiles 14 programs (~20 s on 2 cores); the report's several lengths are
# tested on synthetic records below.
LENGTHS = (96,)
WINDOWS = 2
LABELS = ("full", "streaming_llm", "h2o", "snapkv", "refreshkv_s10", "refreshkv_s25",
          "refreshkv_s50")


def test_windows_are_spread_and_score_distinct_tokens():
  assert table5.window_starts(1000, 300, 3) == [0, 350, 700]
  starts = table5.window_starts(400, 300, 10)  # only 3 fit 50 apart
  assert starts == [0, 50, 100]
  assert table5.window_starts(300, 300, 5) == [0]
  with pytest.raises(table5.Table5Error, match="299 tokens, fewer than one window of 300"):
    table5.window_starts(299, 300, 1)


def test_every_method_at_k_of_an_eighth_of_l():
  specs = table5.methods(8192)
  assert tuple(specs) == LABELS
  assert all(hp["budget"] == 1024 for name, hp in specs.values() if name != "full")
  assert [hp["fixed_stride"] for name, hp in specs.values() if name == "refreshkv"] == [10, 25, 50]


@pytest.fixture(scope="module")
def job(default_lm, tmp_path_factory):
  """A tiny random model with the default model's tokenizer, three prose files, a CPT config."""
  root = tmp_path_factory.mktemp("table5")
  config = write_cpt_job(root, default_lm.tokenizer, prefix_len=48, suffix_len=8, top_k=6,
                         steps=2, global_batch=2, micro_batch=2, lr=1e-3, warmup_steps=0,
                         heldout=0.1, save_every=2, eval_every=2, eval_rows=0,
                         compute_dtype="float32")
  return root, str(root / "model"), config


def _eval(model, config, out):
  return table5.main(["eval", "--model", model, "--config", config, "--lengths",
                      ",".join(map(str, LENGTHS)), "--max-windows", str(WINDOWS), "--batch", "2",
                      "--out", str(out)])


def _lines(path) -> list[dict]:
  return [json.loads(x) for x in path.read_text().splitlines()]


def test_before_cpt_after_and_report(job):
  root, model, config = job
  out = root / "run"
  out.mkdir()
  assert _eval(model, config, out / "before.jsonl") == 0
  before = _lines(out / "before.jsonl")
  assert sorted((r["method"], r["length"], r["window"]) for r in before) == sorted(
      (m, n, w) for m in LABELS for n in LENGTHS for w in range(WINDOWS))
  assert all(len(r["nll"]) == table5.SUFFIX and r["model"] == model for r in before)

  # The windows are the held-out rows of train_cpt, read independently here: the files in
  # sorted order, tokenized, joined with end of text, cut into rows of L + S; the last 10% of
  # rows held out. Every window lies in them, after every training token.
  cfg = load_config(config)
  tok = load(model).tokenizer
  joined = []
  for name in sorted(os.listdir(root / "text")):
    joined += tok.encode((root / "text" / name).read_text()) + [tok.token_id(tok.eos_token)]
  n_rows = len(joined) // cfg.row_len
  n_train = n_rows - round(n_rows * cfg.heldout)
  train_tokens = np.asarray(joined[:n_train * cfg.row_len], np.int32)
  held = np.asarray(joined[n_train * cfg.row_len:n_rows * cfg.row_len], np.int32)
  lm = load(model, dtype="float32")
  method = get("full")
  for length in LENGTHS:
    full = {r["seed"]: r for r in before if r["method"] == "full" and r["length"] == length}
    assert sorted(full) == [0, len(held) - length - table5.SUFFIX]  # the first and the last
    windows = np.stack([held[s:s + length + table5.SUFFIX] for s in sorted(full)])
    assert all(w[-table5.SUFFIX:].tobytes() not in train_tokens.tobytes() for w in windows)
    cache, last = prefill(lm.params, lm.config, windows[:, :length].tolist(), method,
                          cache_len=windows.shape[1], decode_room=table5.SUFFIX)
    nll, _ = teacher_forced_nll(lm.params, cache, last, jnp.asarray(windows[:, length:]),
                                cfg=lm.config, method=method)
    np.testing.assert_allclose([full[s]["nll"] for s in sorted(full)], nll, rtol=1e-5, atol=1e-5)

  # Resumes: a run cut after 5 records writes the rest (the 6th window alone, in a batch padded
  # to 2), and they are what the first run wrote.
  lines = (out / "before.jsonl").read_text().splitlines(keepends=True)
  (out / "before.jsonl").write_text("".join(lines[:5]) + lines[5][:20])  # the 6th cut short
  os.remove(str(out / "before.jsonl") + ".done")
  assert _eval(model, config, out / "before.jsonl") == 0
  again = {(r["method"], r["length"], r["seed"]): r["nll"] for r in _lines(out / "before.jsonl")}
  assert len(again) == len(before) == len(_lines(out / "before.jsonl"))
  for r in before:
    np.testing.assert_allclose(again[(r["method"], r["length"], r["seed"])], r["nll"], rtol=1e-6)
  mtime = os.path.getmtime(out / "before.jsonl")
  assert _eval(model, config, out / "before.jsonl") == 0  # complete: returns at once
  assert os.path.getmtime(out / "before.jsonl") == mtime

  train(load_config(config, {"out_dir": str(out / "cpt")}))
  assert _eval(str(out / "cpt" / "final"), config, out / "after.jsonl") == 0
  after = _lines(out / "after.jsonl")
  assert {r["tokens_sha1"] for r in after} == {r["tokens_sha1"] for r in before}

  assert table5.main(["report", str(out)]) == 0
  md = (out / "table5.md").read_text()
  for label in ("| Vanilla | - |", "| SnapKV | - |", "| RefreshKV | 10 |", "| RefreshKV | 50 |"):
    assert label in md
  assert "The paper's claim" in md
  assert "out of the comparison: refreshkv_s50 and snapkv at L = 96." in md
  t = json.loads((out / "table5.json").read_text())
  assert t["lengths"] == list(LENGTHS) and len(t["rows"]) == len(LABELS)
  cell = t["rows"][0]["cells"][str(LENGTHS[0])]
  assert cell["windows"] == WINDOWS and cell["ppl_before"] != cell["ppl_after"]
  assert len(t["refreshkv_vs_eviction"]) == 3 * 3 * len(LENGTHS)
  assert (out / "table5.png").stat().st_size > 0


def test_bad_input_is_one_line(job, tmp_path, capsys):
  root, model, config = job
  bare = tmp_path / "bare.json"
  bare.write_text(json.dumps({k: v for k, v in json.loads(open(config).read()).items()
                              if k != "text_files"}))
  assert table5.main(["eval", "--model", model, "--config", str(bare), "--out",
                      str(tmp_path / "x.jsonl")]) == 2
  assert capsys.readouterr().err.strip() == (
      "refreshkv_cpt_table5.py: error: the config names no text (text_files is empty or the "
      f"model is {model!r}): give --set text_files=GLOB")
  assert table5.main(["report", str(tmp_path)]) == 2
  assert "no Table 5 records" in capsys.readouterr().err


def _records(label, length, nll_by_window, model):
  name, hparams = table5.methods(length)[label]
  return [{"task": table5.TASK, "method": label, "name": name, "length": length, "depth": None,
           "hparams": get(name, **hparams).hparams(), "seed": 100 * w, "window": w,
           "tokens_sha1": f"{length}-{w}", "nll": list(nll), "model": model}
          for w, nll in enumerate(nll_by_window)]


def _write(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_report_numbers_and_verdict_on_known_records(tmp_path):
  # 20 windows of 50 tokens, each method at its own level; CPT lowers every token's NLL by 0.05
  # under RefreshKV 10, 0.02 or 0.01 under the eviction methods, 0 under full attention.
  rng = np.random.default_rng(0)
  base = rng.uniform(1, 3, (20, table5.SUFFIX))
  level = {"full": 0.0, "streaming_llm": 0.6, "h2o": 0.7, "snapkv": 0.5, "refreshkv_s10": 0.2,
           "refreshkv_s50": 0.5}
  gain = {"full": 0.0, "streaming_llm": 0.02, "h2o": 0.02, "snapkv": 0.01, "refreshkv_s10": 0.05,
          "refreshkv_s50": 0.01}
  before, after = [], []
  for length in (8192, 16384):
    for label in level:
      before += _records(label, length, base + level[label], "m0")
      after += _records(label, length, base + level[label] - gain[label], "m1")
  _write(tmp_path / "before.jsonl", before)
  _write(tmp_path / "after.jsonl", after)
  md = table5.write_report(str(tmp_path))
  t = json.loads((tmp_path / "table5.json").read_text())
  assert t["lengths"] == [8192, 16384]
  rkv = t["rows"][4]["cells"]["16384"]  # RefreshKV 10
  assert rkv["change"] == pytest.approx(-0.05) and rkv["windows"] == 20
  assert rkv["ppl_after"] / rkv["ppl_before"] == pytest.approx(np.exp(-0.05))
  s10 = [v for v in t["refreshkv_vs_eviction"] if v["refreshkv"] == "refreshkv_s10"]
  assert [round(v["gain_difference"], 9) for v in s10] == [0.03, 0.03, 0.03, 0.03, 0.04, 0.04]
  assert "| RefreshKV | 10 |" in md and "| H2O | - |" in md
  # RefreshKV 50 takes no full step among the 50 scored tokens: it is the paper's SnapKV.
  assert "left out of the comparison: refreshkv_s50 and snapkv at L = 8192, refreshkv_s50 and " \
      "snapkv at L = 16384." in md
  # Stride 50 gained as much as Streaming and H2O: not more.
  assert "At L = 16384, RefreshKV gained more from CPT than the eviction method in 3 of 5" in md
  assert md.rstrip().endswith("in 4 of 10 pairs RefreshKV did not gain more.")
  # Before and after must have read the same text in each window.
  after[0]["tokens_sha1"] = "other"
  _write(tmp_path / "after.jsonl", after)
  with pytest.raises(table5.Table5Error, match="different text at L=8192, window start 0"):
    table5.write_report(str(tmp_path))
