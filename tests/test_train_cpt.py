"""RefreshKV continued pretraining: pattern, data, settings, sharding, kill and resume."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_longctx.methods import PrefillEnd, get
from tests.conftest import xla_flags
from tests.test_method_references import CFG, G, KV, _ctx, _inputs, _rot
from train_cpt import TrainConfigError, load_config, read_log, train
from train_cpt.data import Batches, DataError, pack, split
from train_cpt.pattern import CptAttention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pattern_selects_what_refreshkv_inference_keeps_and_attends_only_there():
  prefix, suffix, k_top = 24, 6, 5
  q, k, v = _inputs(prefix + suffix, 7)
  b = q.shape[0]
  out, _ = CptAttention(prefix, k_top).prefill(None, *map(jnp.asarray, (q, k, v)),
                                               _ctx(0, prefix + suffix))
  # RefreshKV's partial cache right after prefilling the prefix: the same K tokens.
  method = get("refreshkv", budget=k_top)
  state = method.init_state(CFG, b, prefix + suffix, jnp.float32, prefix)
  _, state = method.prefill(state, *(jnp.asarray(x[:, :prefix]) for x in (q, k, v)),
                            _ctx(0, prefix))
  state = method.end_of_prefill(state, PrefillEnd(CFG, 0, jnp.full((b,), prefix), suffix))
  qr, kr = _rot(q), _rot(k)
  for i in range(b):
    for h in range(KV * G):
      kept = sorted(int(p) for p in np.asarray(state.part.pos[i, h // G]) if p >= 0)
      assert len(kept) == k_top
      for t in range(prefix + suffix):
        seen = list(range(t + 1)) if t < prefix else kept + list(range(prefix, t + 1))
        logits = kr[i, seen, h // G] @ qr[i, t, h] / np.sqrt(q.shape[-1])
        p = np.exp(logits - logits.max())
        ref = (p / p.sum()) @ v[i, seen, h // G]
        np.testing.assert_allclose(np.asarray(out[i, t, h]), ref, atol=2e-5)


def test_selection_carries_no_gradient_but_the_gathered_keys_do():
  prefix, suffix = 16, 4
  q, k, v = map(jnp.asarray, _inputs(prefix + suffix, 2))

  def loss(k):
    out, _ = CptAttention(prefix, 4).prefill(None, q, k, v, _ctx(0, prefix + suffix))
    return jnp.sum(out[:, prefix:] ** 2)

  grad = np.asarray(jax.grad(loss)(k))
  assert np.all(np.isfinite(grad)) and np.abs(grad[:, :prefix]).max() > 0


def test_batches_are_a_function_of_the_step():
  rows = np.arange(40, dtype=np.int32).reshape(10, 4)
  a, b = Batches(rows, 3, seed=1), Batches(rows, 3, seed=1)
  np.testing.assert_array_equal(a(7), b(7))
  epoch = np.concatenate([a(i) for i in range(3)])
  assert len({tuple(r) for r in epoch}) == 9  # one epoch: rows without repetition
  assert not np.array_equal(a(0), Batches(rows, 3, seed=2)(0))


def test_data_errors_are_named():
  assert pack([[1, 2, 3], [4, 5]], 3, separator=0).tolist() == [[1, 2, 3], [0, 4, 5]]
  with pytest.raises(DataError, match="do not fill one row of 99"):
    pack([[1, 2]], 99, separator=None)
  with pytest.raises(DataError, match="nothing to train on"):
    split(np.zeros((1, 4), np.int32), 0.5)
  with pytest.raises(DataError, match="global batch 5 is larger than the 2 training rows"):
    Batches(np.zeros((2, 4), np.int32), 5, 0)


@pytest.mark.parametrize("overrides, match", [
    ({"learning_rate": 1}, r"unknown training settings \['learning_rate'\]"),
    ({"top_k": 9000}, "top_k=9000 must be in 1..prefix_len"),
    ({"micro_batch": 3}, "micro_batch=3 must divide global_batch=8"),
    ({"steps": "many"}, "steps='many': expected a number"),
])
def test_bad_settings_are_named(overrides, match):
  with pytest.raises(TrainConfigError, match=match):
    load_config(None, overrides)


def test_module_entry_runs_without_the_package_installed_and_names_errors(tmp_path):
  """`python -m train_cpt.cli` (no entry point needed: a source tree on a GPU machine): a bad
  setting is one line and exit status 2."""
  cfg = tmp_path / "job.json"
  cfg.write_text(json.dumps({"model": "random:smollm2-135m", "learning_rate": 1}))
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-m", "train_cpt.cli", "--config", str(cfg)], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1].startswith(
      "train-cpt: error: unknown training settings ['learning_rate']")


@pytest.fixture(scope="module")
def tiny_job(default_lm, tmp_path_factory):
  """A tiny random model with the default model's tokenizer, prose files and a config."""
  from tests.conftest import write_cpt_job

  root = tmp_path_factory.mktemp("cpt")
  return root, write_cpt_job(
      root, default_lm.tokenizer, prefix_len=48, suffix_len=8, top_k=12, steps=40,
      global_batch=4, micro_batch=2, lr=1e-3, warmup_steps=2, save_every=2, eval_every=40,
      eval_rows=2, compute_dtype="float32")


def _cli(config, out_dir, *extra):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_LONGCTX_QUIET="1")
  return [sys.executable, "-m", "jax_longctx", "train-cpt", "--config", config,
          "--set", f"out_dir={out_dir}", *extra], env


def test_killed_job_resumes_on_the_same_loss_curve(tiny_job):
  root, config = tiny_job
  whole = load_config(config, {"out_dir": str(root / "whole")})
  train(whole)
  cmd, env = _cli(config, root / "killed")
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
  log = root / "killed" / "log.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    steps = [json.loads(x).get("step", 0) for x in log.read_text().splitlines()] \
        if log.exists() else []
    if max(steps, default=0) >= 5:  # past the checkpoint at step 4
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.02)
  assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()[-2000:]
  killed_at = max(read_log(str(root / "killed"))[0])
  assert killed_at < whole.steps and not (root / "killed" / "final").exists()
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  ref, ref_evals = read_log(str(root / "whole"))
  got, got_evals = read_log(str(root / "killed"))
  assert [got[s]["loss"] for s in sorted(got)] == [ref[s]["loss"] for s in sorted(ref)]
  assert got_evals[-1] == ref_evals[-1]
  assert ref[whole.steps]["loss"] < ref[1]["loss"]  # it learns
  from checkpoints_convert import restore
  _, a = restore(str(root / "whole" / "final"))
  _, b = restore(str(root / "killed" / "final"))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_resuming_with_other_settings_is_refused(tiny_job):
  root, config = tiny_job
  out = str(root / "short")
  train(load_config(config, {"out_dir": out, "steps": 4}), stop_after=1)
  with pytest.raises(TrainConfigError, match=r"holds a run with other settings \(lr\)"):
    train(load_config(config, {"out_dir": out, "steps": 4, "lr": 0.5}))


def test_fsdp_over_eight_devices_gives_the_single_device_losses(tiny_job):
  root, config = tiny_job
  common = {"steps": 3, "global_batch": 8, "micro_batch": 8, "save_every": 3, "eval_every": 3}
  train(load_config(config, {**common, "out_dir": str(root / "one")}))
  cmd, env = _cli(config, root / "eight", "--set", "fsdp=4",
                  *[x for k, v in common.items() for x in ("--set", f"{k}={v}")])
  env["XLA_FLAGS"] = xla_flags("--xla_force_host_platform_device_count=8")
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  one, _ = read_log(str(root / "one"))
  eight, _ = read_log(str(root / "eight"))
  np.testing.assert_allclose([eight[s]["loss"] for s in (1, 2, 3)],
                             [one[s]["loss"] for s in (1, 2, 3)], rtol=2e-5)
