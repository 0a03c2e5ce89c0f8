"""What a sweep refuses before its first sample: an --out of other settings (another model,
hyper-parameter, chat, cache dtype or task option), records of an older version, an --out it
cannot write, work past the device's memory and bad counts; and what it resumes: the same
command, a part of it (--first-sample), several cache dtypes of one plan."""

import json
import shutil
import time

import pytest

from jax_longctx.app import eval as eval_lib
from jax_longctx.app import memory_estimate, run_settings
from jax_longctx.app.eval import EvalError, MethodSpec, run_sweep
from jax_longctx.app.tasks import TaskError
from jax_longctx.core.options import RunOptions
from pallas_kernels.options import KernelOptions
from tests.test_eval import tiny_text_lm  # noqa: F401 (a fixture)

LENGTH = 300


def _specs(budget=64):
  return MethodSpec.parse("full,streaming_llm", [f"streaming_llm.budget={budget}"])


@pytest.fixture(scope="module")
def first_run(tiny_text_lm, tmp_path_factory):  # noqa: F811
  """The records of one sweep (one sample of full and streaming_llm), run once."""
  out = tmp_path_factory.mktemp("first")
  run_sweep(tiny_text_lm, "passkey", _specs(), [LENGTH], [0.5], 1, str(out))
  return out / "results.jsonl"


@pytest.fixture
def out(first_run, tmp_path):
  """An --out holding the first sweep's records."""
  shutil.copy(first_run, tmp_path / "results.jsonl")
  return tmp_path


@pytest.fixture
def calls(monkeypatch):
  """The batches a sweep runs."""
  seen = []
  real = eval_lib.run_batch
  monkeypatch.setattr(eval_lib, "run_batch",
                      lambda *a, **kw: seen.append((a[2].label, a[3][0].seed)) or real(*a, **kw))
  return seen


def _other_model(lm):
  from jax_longctx.app.api import LM
  from jax_longctx.model import random_params
  return LM(lm.config, random_params(lm.config, seed=4), lm.tokenizer)


# change -> (run_sweep's arguments changed, what the refusal names)
CHANGES = {
    "hparam": (dict(specs=_specs(32)), "streaming_llm hparams budget 64 -> 32"),
    "chat": (dict(chat=True), "chat False -> True"),
    "model": (dict(lm=_other_model), "model fingerprint "),
    "kv_dtype": (dict(options=RunOptions(kv_dtype="int8")), "full kv_dtype float32 -> int8"),
    "task option": (dict(task_options={"max_new_tokens": 8}),
                    "full task_options max_new_tokens 12 -> 8"),
    "kernel option": (dict(options=RunOptions().replace_route(
        kernels=KernelOptions(topk_eight_bit="products"))),
                      "kernels None -> {'topk_eight_bit': 'products'}"),
}


@pytest.mark.parametrize("change", CHANGES)
def test_an_out_of_other_settings_is_refused_before_anything_runs(tiny_text_lm, out, calls,  # noqa: F811
                                                                   change):
  args, names = CHANGES[change]
  kw = dict(lm=tiny_text_lm, specs=_specs(), chat=False, options=RunOptions(), task_options=None)
  kw.update(args)
  if callable(kw["lm"]):
    kw["lm"] = kw["lm"](tiny_text_lm)
  before = (out / "results.jsonl").read_text()
  with pytest.raises(EvalError) as e:
    run_sweep(kw["lm"], "passkey", kw["specs"], [LENGTH], [0.5], 1, str(out), chat=kw["chat"],
              options=kw["options"], task_options=kw["task_options"])
  msg = str(e.value)
  assert msg.startswith(f"{out} holds records of other settings: ") and names in msg, msg
  assert msg.endswith(f"; rerun with another --out, or remove {out / 'results.jsonl'}")
  assert "\n" not in msg and calls == []
  assert (out / "results.jsonl").read_text() == before


def test_records_of_an_older_version_are_refused(tiny_text_lm, out, calls):  # noqa: F811
  recs = [json.loads(line) for line in open(out / "results.jsonl")]
  (out / "results.jsonl").write_text(
      "".join(json.dumps({k: v for k, v in r.items() if k != "run"}) + "\n" for r in recs))
  with pytest.raises(EvalError, match=r"holds records written by an older version of "
                     r"jax-longctx, without the settings they ran under; rerun with another --out"):
    run_sweep(tiny_text_lm, "passkey", _specs(), [LENGTH], [0.5], 1, str(out))
  assert calls == []


def test_the_same_command_resumes_and_its_parts_add_up(tiny_text_lm, out, calls):  # noqa: F811
  recs = run_sweep(tiny_text_lm, "passkey", _specs(), [LENGTH], [0.5], 1, str(out))
  assert calls == [] and len(recs) == 2
  rec = recs[0]
  assert rec["run"]["entry"]["hparams"] == rec["hparams"] and rec["run"]["sweep"]["chat"] is False
  # The second sample as another process's part, then the whole: nothing left to run.
  run_sweep(tiny_text_lm, "passkey", _specs(), [LENGTH], [0.5], 2, str(out), first_sample=1)
  assert calls == [("full", 1), ("streaming_llm", 1)]
  recs = run_sweep(tiny_text_lm, "passkey", _specs(), [LENGTH], [0.5], 2, str(out))
  assert len(calls) == 2 and len(recs) == 4


def test_one_plan_of_several_cache_dtypes_resumes(tiny_text_lm, tmp_path, calls):  # noqa: F811
  specs = MethodSpec.per_kv_dtype(MethodSpec.parse("full", []), ["int8", "float32"])
  for _ in range(2):
    recs = run_sweep(tiny_text_lm, "passkey", specs, [LENGTH], [0.5], 1, str(tmp_path))
  assert calls == [("full int8", 0), ("full float32", 0)]
  assert [r["run"]["entry"]["kv_dtype"] for r in recs] == ["int8", "float32"]


@pytest.mark.parametrize("kv_dtype,key,value", [("int8", "topk_eight_bit", "auto"),
                                                ("int8", "decode_int8_products", "auto")])
def test_records_of_a_quantized_cache_name_what_changed_its_numbers(  # noqa: F811
    tiny_text_lm, tmp_path, calls, kv_dtype, key, value):  # noqa: F811
  """An 8-bit cache's records name KernelOptions.topk_eight_bit (an int8 cache's also
  decode_int8_products) even at its default: records made before the default became "auto"
  are refused, not resumed as new. (A 4-bit cache's format is its kv_dtype's name.)"""
  specs = MethodSpec.per_kv_dtype(MethodSpec.parse("full", []), [kv_dtype, "float32"])
  recs = run_sweep(tiny_text_lm, "passkey", specs, [LENGTH], [0.5], 1, str(tmp_path))
  assert [r["run"]["entry"].get(key) for r in recs] == [value, None]
  for r in recs:
    r["run"]["entry"].pop(key, None)
  (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  with pytest.raises(EvalError, match=f"records of other settings: full {kv_dtype} {key} "
                                      f"None -> {value}"):
    run_sweep(tiny_text_lm, "passkey", specs, [LENGTH], [0.5], 1, str(tmp_path))
  assert len(calls) == 2


def test_work_past_the_memory_is_refused_at_once(tiny_text_lm, tmp_path, monkeypatch,  # noqa: F811
                                                  calls):
  monkeypatch.setattr(memory_estimate, "host_available", lambda: 2 * 10**9)
  t0 = time.perf_counter()
  with pytest.raises(memory_estimate.DoesNotFit) as e:
    run_sweep(tiny_text_lm, "passkey", MethodSpec.parse("full", []), [1 << 30], [0.5], 1,
              str(tmp_path))
  assert time.perf_counter() - t0 < 30 and calls == []
  msg = str(e.value)
  assert msg.startswith("--lengths 1024M: full needs ~"), msg
  assert " on this cpu device (" in msg and "\n" not in msg
  fits = msg.rsplit("the longest that fits is ~", 1)[1]
  assert fits.endswith(" tokens") and fits[:-len(" tokens")].endswith("M")


def test_a_length_past_the_trained_window_is_not_refused(tiny_text_lm, monkeypatch):  # noqa: F811
  """ReAttention reads past the model's window: only memory limits a length."""
  from jax_longctx.app import tasks
  window = tiny_text_lm.config.max_position_embeddings
  specs = MethodSpec.parse("reattention", ["n_local=512", "clip=32", "span=8"])  # its window
  eval_lib.check_memory(tiny_text_lm, [tasks.get("passkey")], specs, [8 * window], RunOptions(),
                        None, 1)


def test_the_cache_estimate_is_what_the_method_allocates(tiny_text_lm):  # noqa: F811
  from jax_longctx.methods import get
  cfg, opts = tiny_text_lm.config, RunOptions()
  full = memory_estimate.need(cfg, 1000, get("full"), length=4000, cache_len=4096, batch=2,
                              options=opts)
  per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
  assert full.cache == per_slot * 4096 * 2 + 4 * 2  # + the rows' lengths
  assert full.weights == 1000 and full.total > full.cache
  int8 = memory_estimate.need(cfg, 1000, get("full"), length=4000, cache_len=4096, batch=2,
                              options=RunOptions(kv_dtype="int8"))
  assert full.cache / 4 < int8.cache < full.cache / 2  # a byte a value, and the scales
  budget = [memory_estimate.need(cfg, 0, get("streaming_llm", budget=64), length=n,
                                 cache_len=n + 96, batch=1, options=opts).cache
            for n in (4000, 400_000)]
  assert budget[0] == budget[1] < per_slot * 4096
  assert memory_estimate.longest_fitting(lambda n: n * 3 <= 100, 1000) == 33
  runs = [("m", 4096, lambda n: memory_estimate.Need(0, 10 * n, 0))]
  with pytest.raises(memory_estimate.DoesNotFit, match=r"^--lengths 4K: m needs ~0.041 MB \("
                     r"0.041 MB of cache, .* on this cpu device \(0.03 MB available\); the "
                     r"longest that fits is ~2.9K tokens$"):
    memory_estimate.check(runs, 30_000, "cpu")
  with pytest.raises(memory_estimate.DoesNotFit, match=r"^--cache-len 8192: m needs .*; lower "
                     r"--cache-len$"):
    memory_estimate.check(runs, 30_000, "cpu", cache_len=8192)
  memory_estimate.check(runs, 40_960, "cpu")
  assert memory_estimate.tokens(10 << 20) == "10M" and memory_estimate.tokens(491520) == "480K"


def test_bad_out_and_counts_fail_before_any_sample(tiny_text_lm, tmp_path, calls):  # noqa: F811
  specs = MethodSpec.parse("full", [])
  (tmp_path / "file").write_text("")
  with pytest.raises(EvalError, match=r"^--out .*file is a file; it names a directory"):
    run_sweep(tiny_text_lm, "passkey", specs, [LENGTH], [0.5], 1, str(tmp_path / "file"))
  with pytest.raises(EvalError, match=r"^--out .*file/sub cannot be written: Not a directory$"):
    run_sweep(tiny_text_lm, "passkey", specs, [LENGTH], [0.5], 1, str(tmp_path / "file" / "sub"))
  with pytest.raises(EvalError, match="^--samples must be at least 1, got 0$"):
    run_sweep(tiny_text_lm, "passkey", specs, [LENGTH], [0.5], 0, str(tmp_path / "o"))
  with pytest.raises(TaskError, match="^task 'passkey' has no option foo; its options: "
                     "max_new_tokens$"):
    run_sweep(tiny_text_lm, "passkey", specs, [LENGTH], [0.5], 1, str(tmp_path / "o"),
              task_options={"foo": 1})
  assert calls == []


def test_settings_differences_name_each_leaf():
  old = {"a": 1, "b": {"c": 2, "d": [1, 2]}}
  new = {"a": 1, "b": {"c": 3, "d": [1, 2]}, "e": "x"}
  assert run_settings.differences(old, new) == ["b c 2 -> 3", "e None -> x"]
