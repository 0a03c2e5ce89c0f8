"""experiments/ruler_tables.py's packing of parts onto calls and GPUs, and its lanes (a process a
GPU) uniting their records, with the eval replaced by a stand-in that writes a part's records:
the script's own logic, in well under a second."""

import json
import os

import pytest

from experiments import ruler_tables as rt


def test_deal_puts_the_longest_first_onto_the_least_loaded_gpu():
  parts = rt.all_parts()
  lanes = rt.deal(parts, 4)
  assert sorted(p.name for lane in lanes for p in lane) == sorted(p.name for p in parts)
  loads = [sum(p.seconds() for p in lane) for lane in lanes]
  longest = max(p.seconds() for p in parts)
  # greedy longest-first: no GPU ends more than one part's time after another
  assert max(loads) - min(loads) <= longest, loads


@pytest.mark.parametrize("n", [1, 2, 4])
def test_plan_keeps_every_gpu_of_every_call_within_the_budget(n):
  budget = 510.0
  calls = rt.plan(budget, n)
  assert [p.name for c in calls for p in c] == [p.name for p in rt.all_parts()]
  assert all(rt.call_seconds(c, n) <= budget for c in calls if len(c) > 1)
  if n > 1:  # side by side, fewer calls than one GPU needs
    assert len(calls) < len(rt.plan(budget, 1))


def _fake_eval(cmd, cwd=None, timeout=None):
  """Stands in for `jax-longctx eval`: writes every sample of the command's part."""
  arg = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--")}
  labels = ([f"{arg['--methods']}@cr{r}" for r in arg["--compression-ratios"].split(",")]
            if "--compression-ratios" in arg else [arg["--methods"]])
  tasks = arg["--task"].removeprefix("ruler:").split(",")
  os.makedirs(arg["--out"], exist_ok=True)
  with open(os.path.join(arg["--out"], rt.RESULTS), "a") as f:
    for task in tasks:
      for label in labels:
        for seed in range(int(arg["--samples"])):
          f.write(json.dumps({"task": f"ruler:{task}", "method": label, "length":
                              int(arg["--lengths"]), "depth": 0.5, "seed": seed,
                              "score": 1.0}) + "\n")


class _InProcess:
  """Stands in for a lane's process: runs `ruler_tables.run` here, under the lane's environment."""

  def __init__(self, cmd, env, cwd):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
      self.returncode = rt.run(cmd[cmd.index("run") + 1:])
    finally:
      os.environ.clear()
      os.environ.update(saved)

  def wait(self):
    return self.returncode


def test_lanes_unite_their_records_into_out_and_the_machine_state(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(rt, "STATE", str(tmp_path / "state"))
  monkeypatch.setattr(rt, "LANES", str(tmp_path / "lanes"))
  monkeypatch.setattr(rt.subprocess, "run", _fake_eval)
  monkeypatch.setattr(rt.subprocess, "Popen", _InProcess)
  monkeypatch.setattr(rt, "write_report", lambda records, out_dir: None)
  out, seeds = tmp_path / "out", tmp_path / "seeds"
  for k, v in {"OUT": str(out), "SEED_FROM": str(seeds), "GPUS": "2", "SAMPLES": "2",
               "PRESS_SAMPLES": "1", "JAX_COMPILATION_CACHE_DIR": ""}.items():
    monkeypatch.setenv(k, v)
  # a record made by an earlier call: seeded into its lane, kept, not made again
  (seeds / "full").mkdir(parents=True)
  earlier = {"task": "ruler:niah_single_1", "method": "full", "length": 4096, "depth": 0.5,
             "seed": 0, "score": 0.0}
  (seeds / "full" / rt.RESULTS).write_text(json.dumps(earlier) + "\n")
  names = ["full_4k", "full_8k", "press_snapkv_4k"]
  assert rt.run(names) == 0
  parts = {p.name: p for p in rt.all_parts()}
  for name in names:
    part = parts[name]
    out_dir = out / rt.DIRECTORIES[part.directory]
    assert rt.done_count(part, str(out_dir)) == part.total, name
    assert rt.done_count(part, os.path.join(rt.STATE, rt.DIRECTORIES[part.directory])) == part.total
  full = rt.load_results(str(out / "full"))
  assert len(full) == len({rt._key(r) for r in full}) == 2 * 11 * 2  # 2 lengths, 11 tasks, 2 samples
  assert earlier in full  # the earlier call's record (score 0) is not replaced by a new one
  printed = capsys.readouterr().out
  assert printed.count("[ruler] GPU ") == 2 and printed.count("complete") >= len(names)


def test_gpus_below_one_is_one_line(monkeypatch):
  monkeypatch.setenv("GPUS", "0")
  with pytest.raises(SystemExit, match="GPUS=0"):
    rt.gpus()


def test_lanes_share_a_gpu_and_a_second_call_deals_only_what_is_left(tmp_path, monkeypatch,
                                                                      capsys):
  monkeypatch.setattr(rt, "STATE", str(tmp_path / "state"))
  monkeypatch.setattr(rt, "LANES", str(tmp_path / "lanes"))
  monkeypatch.setattr(rt.subprocess, "run", _fake_eval)
  monkeypatch.setattr(rt, "write_report", lambda records, out_dir: None)
  envs = []

  def lane(cmd, env, cwd):
    keep = ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    envs.append({k: env.get(k) for k in keep} | {"parts": cmd[cmd.index("run") + 1:]})
    return _InProcess(cmd, env, cwd)

  monkeypatch.setattr(rt.subprocess, "Popen", lane)
  for k, v in {"OUT": str(tmp_path / "out"), "SEED_FROM": str(tmp_path / "none"), "GPUS": "1",
               "LANES_PER_GPU": "2", "SAMPLES": "1", "JAX_COMPILATION_CACHE_DIR": ""}.items():
    monkeypatch.setenv(k, v)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert rt.run(["full_4k", "full_8k"]) == 0
  assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "0"]  # two lanes, one GPU
  assert {e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in envs} == {"0.45"}
  assert sorted(p for e in envs for p in e["parts"]) == ["full_4k", "full_8k"]
  # the next call, given more: the complete parts (now in the machine's state) are not dealt
  envs.clear()
  rt.run(["full_4k", "full_8k", "full_16k"])
  assert [e["parts"] for e in envs] == [["full_16k"]]
  assert "full_4k: 11/11 complete" in capsys.readouterr().out


def test_run_all_names_every_part(monkeypatch):
  called = []
  monkeypatch.setattr(rt, "run_lanes", lambda parts, *a: called.extend(p.name for p in parts) or 0)
  monkeypatch.setenv("GPUS", "2")
  monkeypatch.delenv("RULER_LANE", raising=False)
  assert rt.run(["all"]) == 0
  assert called == [p.name for p in rt.all_parts()]
