"""Continued pretraining at scale: rematerialization, the chunked cross-entropy and the blocked
prefix attention compute today's loss and gradients, with less memory; the paper's 8B config
builds (abstractly: nothing of 8B is allocated on CPU)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax_longctx.core.config import PRESETS, preset
from jax_longctx.model import forward, random_params
from jax_longctx.ops.cache import Cache
from tests.conftest import tiny_config, xla_flags
from train_cpt import TrainConfigError, load_config, read_log, train
from train_cpt import state as state_lib
from train_cpt.loop import jit_step, make_train_step
from train_cpt.optimizer import optimizer
from train_cpt.loss import sequence_loss
from train_cpt.pattern import CptAttention, blocked_causal_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "train_cpt", "configs", "llama3.1-8b_refreshkv_paper.toml")
RTOL = 1e-5  # fp32; the differences seen are ~3e-7 (summation order)


def _todays_loss(params, tokens, cfg, method):
  """The loss as train_cpt computed it before remat and chunking: whole logits, log-softmax."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  cache = Cache(jnp.zeros((b,), jnp.int32), (None,) * cfg.num_layers, t)
  logits, _ = forward(params, tokens, positions, cache, method, cfg)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _assert_close_trees(got, ref):
  """Each leaf within RTOL of the reference in relative norm."""
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
    err = float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r))
    assert err <= RTOL, (jax.tree_util.keystr(path), err)


@pytest.fixture(scope="module")
def problem():
  cfg = tiny_config()
  method = CptAttention(24, 5)
  params = random_params(cfg, seed=1)
  tokens = jax.random.randint(jax.random.key(0), (2, 30), 0, cfg.vocab_size)
  ref = jax.value_and_grad(_todays_loss)(params, tokens, cfg, method)
  return cfg, method, params, tokens, ref


@pytest.mark.parametrize("remat", [None, "layer", "dots"])
@pytest.mark.parametrize("loss_chunk", [0, 7])  # 7: 29 targets in 5 chunks, the last padded
def test_loss_and_gradients_are_todays_under_remat_and_chunking(problem, remat, loss_chunk):
  cfg, method, params, tokens, (ref_loss, ref_grads) = problem

  def loss(p):
    return sequence_loss(p, tokens, model_cfg=cfg, method=method, compute_dtype=jnp.float32,
                         remat=remat, loss_chunk=loss_chunk)

  got_loss, got_grads = jax.value_and_grad(loss)(params)
  np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=RTOL)
  _assert_close_trees(got_grads, ref_grads)
  # The layers (3) and the cross-entropy chunk really are checkpointed.
  expected = (cfg.num_layers if remat else 0) + (1 if loss_chunk else 0)
  assert str(jax.make_jaxpr(loss)(params)).count("remat2[") == expected


def test_blocked_prefix_attention_is_one_call_in_blocks():
  ks = jax.random.split(jax.random.key(2), 3)
  q = jax.random.normal(ks[0], (2, 37, 6, 8))
  k, v = (jax.random.normal(x, (2, 37, 2, 8)) for x in ks[1:])

  def loss(fn, q, k, v):
    return jnp.sum(jnp.sin(fn(q, k, v)))

  one = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
  ref = jax.value_and_grad(loss, (1, 2, 3))(one, q, k, v)
  for block in (5, 37, 64):
    blocked = lambda q, k, v: blocked_causal_attention(q, k, v, block)  # noqa: E731,B023
    got = jax.value_and_grad(loss, (1, 2, 3))(blocked, q, k, v)
    np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=RTOL)
    _assert_close_trees(got[1], ref[1])


# Small enough to compile in seconds on CPU, large enough that activations and logits dominate.
MEMORY_MODEL = dict(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                    head_dim=64, intermediate_size=1024, max_position_embeddings=1024)
MEMORY_CASES = [("none", 0), ("layer", 0), ("dots", 0), ("none", 128), ("layer", 128)]


def temp_bytes() -> dict:
  """Temp bytes of the compiled train step (4 rows of 528 tokens) for each of MEMORY_CASES."""
  from train_cpt.config import TrainConfig
  model_cfg = tiny_config(**MEMORY_MODEL)
  out = {}
  for remat, chunk in MEMORY_CASES:
    cfg = TrainConfig(prefix_len=512, suffix_len=16, top_k=64, global_batch=4, micro_batch=4,
                      remat=remat, loss_chunk=chunk, compute_dtype="float32")
    mesh, opt = state_lib.training_mesh(cfg), optimizer(cfg)
    state = state_lib.abstract_state(model_cfg, opt, mesh)
    compiled = jit_step(cfg, model_cfg, opt, state).lower(
        state["params"], state["opt_state"], state_lib.abstract_batch(cfg, mesh)).compile()
    out[f"{remat}/{chunk}"] = compiled.memory_analysis().temp_size_in_bytes
  return out


def test_compiled_step_needs_less_memory_with_remat_and_chunked_loss():
  # XLA:CPU drops jax.checkpoint's optimization barriers, and CSE then merges the recomputation
  # into the forward (no saving at all); keeping them, as XLA:GPU does, needs this flag, read
  # when the backend starts: hence a process of its own.
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags("--xla_disable_hlo_passes=cse_barrier_expander"))
  done = subprocess.run([sys.executable, "-m", "tests.test_cpt_memory"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  temp = json.loads(done.stdout.strip().splitlines()[-1])
  logits = 4 * 527 * 8192 * 4  # one [rows, T, V] fp32 array
  assert temp["layer/0"] < 0.5 * temp["none/0"]
  assert temp["dots/0"] < 0.75 * temp["none/0"]
  assert temp["none/0"] - temp["none/128"] > logits
  assert temp["layer/128"] == min(temp.values())


def test_paper_config_parses_and_its_step_builds_abstractly():
  cfg = load_config(PAPER)
  assert (cfg.prefix_len, cfg.suffix_len, cfg.top_k) == (8092, 50, 2048)
  assert (cfg.lr, cfg.warmup_steps, cfg.weight_decay, cfg.global_batch) == (5e-6, 20, 0.0, 64)
  assert (cfg.remat, cfg.loss_chunk > 0, cfg.fsdp, cfg.eval_rows) == ("layer", True, 0, 0)
  source = state_lib.Source(cfg)
  assert source.config == preset("llama-3.1-8b", dtype="float32")
  mesh, opt = state_lib.training_mesh(cfg), optimizer(cfg)
  assert mesh.shape["fsdp"] == len(jax.devices())
  state = state_lib.abstract_state(source.config, opt, mesh)
  n = sum(x.size for x in jax.tree.leaves(state["params"]))
  assert n == source.config.num_params() and 8.0e9 < n < 8.1e9
  batch = state_lib.abstract_batch(cfg, mesh)
  assert batch.shape == (64, 1, 8142)
  params, opt_state, loss, gnorm = jax.eval_shape(
      make_train_step(cfg, source.config, opt), state["params"], state["opt_state"], batch)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == \
      jax.tree.map(lambda x: (x.shape, x.dtype), state["params"])
  assert loss.shape == () and gnorm.shape == ()


def _adam_steps(transform, grads_seq, params):
  state, out = transform.init(params), []
  for g in grads_seq:
    u, state = transform.update(g, state, params)
    out.append(u)
  return out, state


def test_adam_with_stored_moments_is_optax_adam_and_bf16_halves_the_state():
  """fp32 storage: optax.scale_by_adam's updates (1e-6); bf16 storage: both moments bf16 (half
  the bytes), updates within 2% of fp32's over 6 steps (the stored moments' rounding)."""
  from train_cpt.optimizer import scale_by_adam_stored
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10.0 ** -k, jnp.float32),
                        params) for k in range(6)]
  ref, ref_state = _adam_steps(optax.scale_by_adam(0.9, 0.999, 1e-8), grads, params)
  got, _ = _adam_steps(scale_by_adam_stored(0.9, 0.999, 1e-8, jnp.float32), grads, params)
  for r, g in zip(ref, got):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7), r, g)
  low, low_state = _adam_steps(scale_by_adam_stored(0.9, 0.999, 1e-8, jnp.bfloat16), grads, params)
  assert {x.dtype for x in jax.tree.leaves((low_state.mu, low_state.nu))} == {jnp.dtype("bfloat16")}
  bytes_of = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))  # noqa: E731
  assert 2 * bytes_of((low_state.mu, low_state.nu)) == bytes_of((ref_state.mu, ref_state.nu))
  for r, g in zip(ref, low):
    for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(g)):
      assert float(jnp.linalg.norm(b - a) / jnp.linalg.norm(a)) < 0.02


def test_bf16_moments_train_and_resume_on_the_same_curve(tmp_path, monkeypatch):
  monkeypatch.setitem(PRESETS, "tiny-test", tiny_config())
  settings = dict(model="random:tiny-test", prefix_len=24, suffix_len=6, top_k=5, steps=4,
                  warmup_steps=1, global_batch=2, micro_batch=2, eval_rows=0, save_every=2,
                  compute_dtype="float32", moments_dtype="bfloat16", lr=1e-3)
  whole = load_config(None, dict(settings, out_dir=str(tmp_path / "whole")))
  train(whole)
  cut = load_config(None, dict(settings, out_dir=str(tmp_path / "cut")))
  train(cut, stop_after=2)
  train(cut)
  a, b = read_log(str(tmp_path / "whole"))[0], read_log(str(tmp_path / "cut"))[0]
  assert sorted(a) == sorted(b) == [1, 2, 3, 4]
  assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in a]  # bit for bit


@pytest.mark.parametrize("overrides, match", [
    ({"moments_dtype": "int8"}, r"moments_dtype='int8' must be one of \('float32', 'bfloat16'\)"),
    ({"remat": "all"}, r"remat='all' must be one of \('none', 'layer', 'dots'\)"),
    ({"loss_chunk": -1}, "loss_chunk=-1 must be >= 0"),
    ({"model": "random:llama-9"}, "model='random:llama-9': no such preset"),
    ({"model": "random:llama-3.1-8b", "text_files": ["*.txt"]}, "leave text_files empty"),
])
def test_bad_scale_settings_are_named(overrides, match):
  with pytest.raises(TrainConfigError, match=match):
    load_config(None, overrides)


def test_random_weights_train_on_random_tokens(tmp_path, monkeypatch):
  monkeypatch.setitem(PRESETS, "tiny-test", tiny_config())
  cfg = load_config(None, dict(model="random:tiny-test", out_dir=str(tmp_path), prefix_len=24,
                               suffix_len=6, top_k=5, steps=2, warmup_steps=0, global_batch=2,
                               micro_batch=2, eval_rows=0, compute_dtype="float32",
                               remat="layer", loss_chunk=8))
  assert train(cfg) == {}  # no evaluation asked for
  steps, evals = read_log(str(tmp_path))
  assert sorted(steps) == [1, 2] and evals == []
  assert all(np.isfinite(steps[s]["loss"]) for s in steps)
  assert os.path.isdir(tmp_path / "final" / "params")


if __name__ == "__main__":  # the subprocess of the memory test
  print(json.dumps(temp_bytes()))
