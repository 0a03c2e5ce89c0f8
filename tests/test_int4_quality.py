"""experiments/int4_quality.py's stand-in quantizer: the 4-bit levels it claims to store."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.int4_quality import GROUP, WriteHook, int4_quantize, round_write
from pallas_kernels import quant


def _keys():
  """[2, 3, 5, 128] with channel magnitudes from 0.01 to 30 (outlier channels, as Qwen's)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5, 128))
  return x * jnp.geomspace(0.01, 30.0, 128)


def test_row_levels_are_4_bit_with_one_scale_a_row():
  x = _keys()
  q = int4_quantize("row")(x, "int8")
  assert q.values.dtype == jnp.int8 and q.scale.shape == (*x.shape[:-1], 1)
  assert int(jnp.max(jnp.abs(q.values))) == 7
  step = np.asarray(jnp.max(jnp.abs(x), -1) / 7)[..., None]
  err = np.abs(np.asarray(quant.dequantize(q)) - np.asarray(x))
  assert (err <= step / 2 * (1 + 1e-5)).all()
  assert err.max() > step.max() / 4  # rounding to 15 levels, not to int8's 255


def test_grouped_levels_bound_the_error_by_each_groups_step_plus_int8s():
  x = _keys()
  q = int4_quantize("g32")(x, "int8")
  groups = np.asarray(x).reshape(*x.shape[:-1], -1, GROUP)
  group_step = (np.abs(groups).max(-1, keepdims=True) / 7)
  row_step = np.abs(np.asarray(x)).max(-1)[..., None, None] / 127
  err = np.abs(np.asarray(quant.dequantize(q)) - np.asarray(x)).reshape(groups.shape)
  assert (err <= (group_step + row_step) / 2 * (1 + 1e-5)).all()
  row = np.abs(np.asarray(quant.dequantize(int4_quantize("row")(x, "int8"))) - np.asarray(x))
  rms = lambda e: float(np.sqrt(np.mean(np.square(e))))  # noqa: E731
  assert rms(err) < 0.9 * rms(row)  # a group's scale fits it better than the row's


def test_other_dtypes_are_left_to_the_8_bit_quantizer():
  x = _keys()
  q = int4_quantize("row")(x, "float8_e4m3fn")
  ref = quant.quantize(x, "float8_e4m3fn")
  np.testing.assert_array_equal(np.asarray(q.values, np.float32),
                                np.asarray(ref.values, np.float32))


# ---- kivi32 / static: the KVCache.write hook (experiments/int4_quality.py's module doc) -------

def _kv(shape=(2, 70, 3, 64)):
  """Keys and values [B, S, KV, d], never zero: channel scales 0.01..30 (outliers) and a per
  channel offset, so an asymmetric range differs from a symmetric one."""
  kk, kv = jax.random.split(jax.random.PRNGKey(1))
  scale = jnp.geomspace(0.01, 30.0, shape[-1])
  k = (jax.random.normal(kk, shape) + 3.0) * scale
  v = jax.random.normal(kv, shape) * scale[::-1] + 0.5
  return k, v


def _within_half_a_step(y, x, lo, hi):
  """|y - x| <= (hi - lo) / 30: half of one of 15 steps (16 levels) of [lo, hi], and y on them."""
  step = (hi - lo) / 15
  assert (np.abs(y - x) <= step / 2 * (1 + 1e-4) + 1e-6).all()
  on_grid = (y - lo) / step
  assert np.allclose(on_grid, np.round(on_grid), atol=2e-3)


def test_kivi32_keys_per_channel_over_32_tokens_values_per_token_over_32_channels():
  k, v = _kv()
  b, s, h, d = k.shape
  valid = jnp.ones((b, s), bool).at[1, 40].set(False)  # row 1's second group holds padding
  pos = jnp.broadcast_to(jnp.arange(s), (b, s))
  kq, vq = (np.asarray(a) for a in round_write("kivi32", k, v, valid, pos))
  kn, vn = np.asarray(k), np.asarray(v)
  groups = kn[:, :64].reshape(b, 2, GROUP, h, d)  # each channel's range over a group's tokens
  lo, hi = groups.min(2, keepdims=True), groups.max(2, keepdims=True)
  got = kq[:, :64].reshape(groups.shape)
  _within_half_a_step(got[0], groups[0], lo[0], hi[0])
  _within_half_a_step(got[1, 0], groups[1, 0], lo[1, 0], hi[1, 0])
  np.testing.assert_array_equal(got[1, 1], groups[1, 1])  # not full of real tokens: whole
  np.testing.assert_array_equal(kq[:, 64:], kn[:, 64:])  # the trailing 6: KIVI's residual
  assert (np.abs(got[0] - groups[0]) > 0).mean() > 0.9
  rows = vn.reshape(b, s, h, d // GROUP, GROUP)  # each token's range over 32 channels
  _within_half_a_step(vq.reshape(rows.shape), rows, rows.min(-1, keepdims=True),
                      rows.max(-1, keepdims=True))
  assert (np.abs(vq[:, 64:] - vn[:, 64:]) > 0).mean() > 0.9  # values: every token rounded
  # a one-token (decode) write: its keys whole, its values rounded
  k1, v1 = round_write("kivi32", k[:, :1], v[:, :1], valid[:, :1], pos[:, :1])
  np.testing.assert_array_equal(np.asarray(k1), kn[:, :1])
  assert not np.allclose(np.asarray(v1), vn[:, :1])
  # stored in int8 as the cache then does: int8's half step (row max / 254) on top
  back = np.asarray(quant.dequantize(quant.quantize(jnp.asarray(kq), "int8")))
  bound = (hi - lo)[0] / 30 + np.abs(kq[0, :64]).max(-1).reshape(2, GROUP, h, 1) / 254
  assert (np.abs(back[0, :64].reshape(2, GROUP, h, d) - groups[0]) <= bound * (1 + 1e-4)).all()


def test_static_keys_in_calibrated_channel_ranges_values_per_row():
  k, v = _kv()
  kn, vn = np.asarray(k), np.asarray(v)
  lo, hi = kn.min((0, 1)), kn.max((0, 1))  # [KV, d], as the calibration records
  valid = jnp.ones(k.shape[:2], bool)
  pos = jnp.broadcast_to(jnp.arange(k.shape[1]), k.shape[:2])
  kq, vq = (np.asarray(a) for a in round_write("static", k, v, valid, pos, (lo, hi)))
  _within_half_a_step(kq, kn, lo, hi)
  _within_half_a_step(vq, vn, vn.min(-1, keepdims=True), vn.max(-1, keepdims=True))
  for i in range(kq.shape[-1]):  # one channel: its levels are 16 of one range for every token
    assert len(np.unique(kq[..., 0, i])) <= 16
  # a key past its range is clipped to it; --keep-first: position 0's keys and values whole
  wide, _ = round_write("static", 2 * k, v, valid, pos, (lo, hi))
  np.testing.assert_allclose(np.asarray(wide).max((0, 1)), hi, rtol=1e-5)
  kf, vf = (np.asarray(a) for a in round_write("static", k, v, valid, pos, (lo, hi), True))
  np.testing.assert_array_equal(kf[:, 0], kn[:, 0])
  np.testing.assert_array_equal(vf[:, 0], vn[:, 0])
  np.testing.assert_array_equal(kf[:, 1:], kq[:, 1:])


def _prefill_and_decode(cfg, params, method, hook, kv_dtype):
  """One padded 64-token chunk (40 real tokens) and one decode step under `hook`: the cache."""
  from jax_longctx.model import forward, new_cache
  ids = jax.random.randint(jax.random.PRNGKey(2), (1, 64), 0, cfg.vocab_size)
  pos = jnp.arange(64)[None]
  cache = new_cache(cfg, method, 1, 96, kv_dtype, chunk=64)
  with hook.installed():  # jitted: traced once a step (hooks run at tracing), then compiled
    _, cache = jax.jit(lambda c: forward(params, ids, pos, c, method, cfg, valid=pos < 40))(cache)
    _, cache = jax.jit(lambda c: forward(params, ids[:, 40:41], pos[:, 40:41], c, method, cfg,
                                         decode=True))(cache)
  return cache


def test_the_hook_knows_layers_keys_values_and_padding_on_full_and_reattention():
  from jax_longctx.methods import get
  from jax_longctx.model import random_params
  from tests.conftest import tiny_config
  cfg = tiny_config(head_dim=64, max_position_embeddings=256)
  params = random_params(cfg, seed=3)
  methods = (get("full"), get("reattention", n_global=4, n_local=64, span=5, top_k=3, clip=6))
  stored = {}
  calibration = WriteHook("static", record=True)
  for m in methods:  # a float32 cache holds exactly what each write gave it
    stored[m.name] = _prefill_and_decode(cfg, params, m, calibration, "float32").state
  assert set(calibration.ranges) == {(m.name, i) for m in methods for i in range(cfg.num_layers)}
  for (name, layer), (lo, hi) in calibration.ranges.items():
    keys = np.asarray(stored[name][layer].k[0])  # [KV, T, d]: 41 real tokens, then nothing
    np.testing.assert_array_equal(lo, keys[:, :41].min(1))  # the prompt's 23 padding tokens,
    np.testing.assert_array_equal(hi, keys[:, :41].max(1))  # which the hook saw, left out
    assert not keys[:, 41:].any()  # and never written (KVCache.write drops padding)
  assert not np.allclose(calibration.ranges[("full", 1)][1],
                         calibration.ranges[("reattention", 1)][1])  # after / before RoPE
  # layer 0's writes (the embeddings' keys and values) as round_write stores them
  for levels, m in zip(("kivi32", "static"), methods):
    hook = WriteHook(levels, ranges=calibration.ranges)
    got = _prefill_and_decode(cfg, params, m, hook, "float32").state[0]
    k, v = (jnp.swapaxes(x[:, :, :41], 1, 2) for x in (stored[m.name][0].k,
                                                       stored[m.name][0].v))
    assert not np.allclose(np.asarray(got.k[:, :, :32]), np.asarray(stored[m.name][0].k[:, :, :32]))
    key_range = calibration.ranges[(m.name, 0)]
    kq, vq = round_write(levels, k[:, :40], v[:, :40], jnp.ones((1, 40), bool),
                         jnp.arange(40)[None], key_range)
    k1, v1 = round_write(levels, k[:, 40:], v[:, 40:], jnp.ones((1, 1), bool),
                         jnp.full((1, 1), 40), key_range)  # the decoded token's own write
    np.testing.assert_allclose(np.asarray(got.k[:, :, :41]),
                               np.swapaxes(np.concatenate([kq, k1], 1), 1, 2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got.v[:, :, :41]),
                               np.swapaxes(np.concatenate([vq, v1], 1), 1, 2), rtol=1e-6)


def test_a_cache_stored_outside_a_kvcache_write_is_refused():
  from jax_longctx.ops import cache
  x = jnp.ones((1, 2, 3, 64))
  with WriteHook("kivi32").installed(), pytest.raises(SystemExit, match="outside KVCache.write"):
    cache.stored(x, cache.zeros((1, 3, 8, 64), "int8"), heads_axis=2)


def test_a_kivi32_sweep_writes_int4_kivi32_records(tmp_path):
  from experiments.int4_quality import main
  from tests.conftest import write_tiny_checkpoint
  model = str(write_tiny_checkpoint(tmp_path, head_dim=64))
  out = str(tmp_path / "kivi32")
  assert main(["--levels", "kivi32", "--out", out, "--", "--model", model, "--methods",
               "full", "--task", "ppl", "--samples", "1", "--lengths", "300", "--task-arg",
               "n_scored=8"]) == 0
  records = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
  assert [(r["method"], r["kv_dtype"]) for r in records] == [("full int4_kivi32", "int4_kivi32")]
  assert np.isfinite(records[0]["score"])
