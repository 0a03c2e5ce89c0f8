"""Mesh ReAttention against one-device ReAttention, run in a subprocess with 8 fake CPU devices
(tests/test_reattention_mesh.py):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.helpers.reattention_mesh_checks NAME...
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jax_longctx.ops.cache import KVCache
from jax_longctx.core.mesh import make_mesh
from jax_longctx.methods.token_layout import TokenLayout
from jax_longctx.methods import AttnContext, TokenShards, get
from jax_longctx.methods.reattention_scope import Scope
from jax_longctx.core.options import RunOptions
from jax_longctx.core.rope import inv_freq
from pallas_kernels import Route, quant4
from tests.conftest import TINY_LLAMA3, mesh_config
from tests.helpers import check_main

N = 8
MESH = Mesh(np.array(jax.devices()[:N]), ("ctx",))
# Scope 4 + 3 * 4 + 16 = 32 (the tiny model's window is 64): selection starts past 20 tokens.
HP = dict(n_global=4, n_local=16, span=4, top_k=2, clip=3, chunk=8)


def _steps(ends, chunk, n_decode):
  """(q_pos, valid) [B, S] of every step: prefill chunks up to the longest prompt, then decode
  steps at each sequence's own next position."""
  ends = np.asarray(ends)
  for s in range(0, int(ends.max()), chunk):
    pos = np.broadcast_to(np.arange(s, s + chunk), (len(ends), chunk))
    yield pos.astype(np.int32), pos < ends[:, None]
  for i in range(n_decode):
    yield (ends + i)[:, None].astype(np.int32), np.ones((len(ends), 1), bool)


def _specs(state: KVCache):
  """shard_map specs of a cache split along the tokens over ctx (a 4-bit one's residual key
  group and its index whole on every device)."""
  kv = P(None, None, "ctx")
  if not isinstance(state.k, quant4.GroupedKeys):
    return KVCache(kv, kv)
  return KVCache(quant4.GroupedKeys(quant4.Int4(kv, kv, kv, 2, state.k.main.group), P(), P()),
                 quant4.Int4(kv, kv, kv, state.v.axis, state.v.group))


def layer(tied: bool, backend: str = "reference", block: int = 0, kv_dtype=jnp.float32,
          t: int = 128):
  """One layer's steps on random pre-RoPE q/k/v, batch 2 of lengths 117 and 45 over a 128-token
  cache (16 tokens a device: devices 3-7 hold none of the second sequence, and most devices none
  of a step's scope): the same scope exactly (indices, length, query rank) and the same (out,
  lse) as one device, for 8-token prefill chunks and 4 decode steps. `tied`: every key is one of
  three vectors, so most scores tie (the top-k must break ties to the lowest index across
  devices exactly as one device's top-k does). `block` 8: the block-cyclic layout (each device
  holds tokens 8p..8p+7 and 64+8p..64+8p+7), whose parts of a scope are not contiguous.
  kv_dtype "int4" (t 512, block 0 or 32: whole key groups a shard): the 4-bit cache, its newest
  key group on every device, each full group in its shard: the same as one device's 4-bit
  cache, group for group."""
  cfg = mesh_config(**TINY_LLAMA3)
  one = get("reattention", **HP)
  mesh_method = get("reattention_mesh", shard_block=block, **HP)
  options = RunOptions(route=Route(backend=backend))
  b, h, kvh, d = 2, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  rng = np.random.default_rng(5)
  keys = rng.normal(size=(3 if tied else b * t, kvh, d)).astype(np.float32)
  k_all = keys[rng.integers(0, 3, (b, t))] if tied else keys.reshape(b, t, kvh, d)
  v_all = rng.normal(size=(b, t, kvh, d)).astype(np.float32)
  freqs = inv_freq(cfg)
  kv = P(None, None, "ctx")

  def mesh_step(state, q, k, v, q_pos, valid):
    ctx = AttnContext(layer=0, q_pos=q_pos, valid=valid, freqs=freqs, cfg=cfg, options=options,
                      tokens=TokenShards("ctx", N))
    return mesh_method.step(state, q, k, v, ctx)

  one_state = KVCache.zeros(cfg, b, t, kv_dtype)
  specs = _specs(one_state)
  run_mesh = jax.jit(jax.shard_map(
      mesh_step, mesh=MESH, in_specs=(specs,) + (P(),) * 5,
      out_specs=(P(), P(), specs, Scope(P(), P(), P())), check_vma=False))
  run_one = jax.jit(lambda state, q, k, v, q_pos, valid: one.step(
      state, q, k, v, AttnContext(layer=0, q_pos=q_pos, valid=valid, freqs=freqs, cfg=cfg,
                                  options=options)))
  mesh_state = one_state
  selected = 0
  for q_pos, valid in _steps((117, 45), HP["chunk"], 4):
    q = jnp.asarray(rng.normal(size=q_pos.shape + (h, d)), jnp.float32)
    k = jnp.asarray(np.take_along_axis(k_all, q_pos[:, :, None, None], axis=1))
    v = jnp.asarray(np.take_along_axis(v_all, q_pos[:, :, None, None], axis=1))
    args = (q, k, v, jnp.asarray(q_pos), jnp.asarray(valid))
    out, lse, one_state, sc = run_one(one_state, *args)
    m_out, m_lse, mesh_state, m_sc = run_mesh(mesh_state, *args)
    for name in ("idx", "length", "q_offset"):
      np.testing.assert_array_equal(np.asarray(getattr(m_sc, name)), np.asarray(getattr(sc, name)),
                                    err_msg=f"scope {name} at positions {q_pos[:, 0]}")
    ok = valid[:, :, None]
    np.testing.assert_allclose(np.where(ok[..., None], m_out, 0), np.where(ok[..., None], out, 0),
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.where(ok, m_lse, 0), np.where(ok, lse, 0), atol=2e-5, rtol=1e-5)
    selected += int(np.sum(np.asarray(sc.length) > HP["n_global"] + HP["n_local"]))
  t_local = t // N  # device p's slot s holds token position(s, p): each token in its owner's slot
  layout = TokenLayout(N, t_local, block)
  where = np.concatenate([np.asarray(layout.position(np.arange(t_local), p)) for p in range(N)])
  if isinstance(one_state.k, quant4.GroupedKeys):
    g = one_state.k.main.group
    groups = where[::g] // g  # the whole cache's group held in each shard's groups, in order
    for name in ("residual", "residual_group"):
      np.testing.assert_array_equal(np.asarray(getattr(mesh_state.k, name)),
                                    np.asarray(getattr(one_state.k, name)), err_msg=name)
    for x_mesh, x_one in ((mesh_state.k.main, one_state.k.main), (mesh_state.v, one_state.v)):
      for name in ("codes", "scale", "zero"):
        at = groups if (x_one is one_state.k.main and name != "codes") else where
        np.testing.assert_array_equal(np.asarray(getattr(x_mesh, name)),
                                      np.asarray(getattr(x_one, name))[:, :, at], err_msg=name)
  else:
    np.testing.assert_array_equal(np.asarray(mesh_state.k), np.asarray(one_state.k)[:, :, where])
    np.testing.assert_array_equal(np.asarray(mesh_state.v), np.asarray(one_state.v)[:, :, where])
  assert selected > 10, "contexts too short: no step selected spans"


def model(one_name="reattention", mesh_name="reattention_mesh", kv_dtype=None, cache_len=128,
          **kw):
  """The tiny model (GQA 6/2) end to end, prompts of 93 and 52 tokens over a 128-token cache:
  the last-token logits after the chunked prefill, the per-token NLL of 6 teacher-forced decode
  steps, and greedy tokens through the driver (the mesh entry routes to the sharded cache)
  equal the one-device method's: ReAttention (`kw`: settings beyond HP), or RESA over it (`kw`:
  its settings; its prior then sums and attends over every shard). kv_dtype "int4" (cache_len
  256: whole key groups a shard): the 4-bit cache on both."""
  from jax_longctx.run import driver, sharding
  from jax_longctx.run.chunked_prefill import prefill_step
  from jax_longctx.run.generation import prefill, teacher_forced_nll
  from jax_longctx.model import random_params
  cfg = mesh_config(**TINY_LLAMA3)
  params = random_params(cfg, seed=1)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (93, 52)]
  targets = rng.integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
  block = kw.pop("shard_block", 0)
  if one_name == "resa":
    one = get("resa", base="reattention", base_args=tuple(HP.items()), **kw)
    mesh_entry = get("resa_mesh", base_args=tuple(HP.items()), shard_block=block, **kw)
  else:
    one, mesh_entry = get(one_name, **HP, **kw), get(mesh_name, shard_block=block, **HP, **kw)
  one_options = RunOptions(kv_dtype=kv_dtype)
  cache, last = prefill(params, cfg, prompts, one, cache_len=cache_len, options=one_options)
  nll, _ = teacher_forced_nll(params, cache, last, targets, cfg=cfg, method=one,
                              options=one_options)
  compiled = prefill_step._cache_size()
  options = RunOptions(mesh=make_mesh(MESH), kv_dtype=kv_dtype)
  placed = sharding.placed(params, cfg, options.mesh)
  m_cache, m_last = prefill(placed, cfg, prompts, mesh_entry, cache_len=cache_len,
                            options=options)
  np.testing.assert_allclose(np.asarray(m_last), np.asarray(last), atol=1e-4, rtol=0)
  # Every chunk ran one compiled step (a single-device `last` at chunk 1 once compiled a second)
  assert prefill_step._cache_size() == compiled + 1, (compiled, prefill_step._cache_size())
  nll_on_mesh, _ = teacher_forced_nll(placed, m_cache, m_last, targets, cfg=cfg,
                                      method=mesh_entry, options=options)
  np.testing.assert_allclose(np.asarray(nll_on_mesh), np.asarray(nll), atol=1e-4, rtol=0)
  if one_name == "resa":  # the prior did change the decode steps
    plain = get("reattention", **HP)
    c, l = prefill(params, cfg, prompts, plain, cache_len=cache_len)
    assert np.max(np.abs(np.asarray(teacher_forced_nll(params, c, l, targets, cfg=cfg,
                                                       method=plain)[0]) - nll)) > 1e-3
  want = driver.generate(params, cfg, prompts, one, max_new_tokens=5, cache_len=cache_len,
                         options=one_options)
  # Without a mesh the mesh entry spreads over every device on ctx.
  got = driver.generate(params, cfg, prompts, mesh_entry, max_new_tokens=5, cache_len=cache_len,
                        options=one_options)
  assert got.tokens == want.tokens and got.report == {"devices": N}


def errors():
  """A cache that does not split into equal shards or whole blocks (in 4 bits: of whole key
  groups), and blocks that would split a prefill chunk or a key group, are refused in one line."""
  from jax_longctx.core.errors import LongctxError
  from jax_longctx.run.generation import prefill
  cfg = mesh_config(**TINY_LLAMA3)
  for block, cache_len, kv_dtype, message in [
      (0, 100, None, "cache_len=100 is not a multiple of 8, the unit 'reattention_mesh' splits"),
      (8, 96, None, "cache_len=96 is not a multiple of 64, the unit 'reattention_mesh' splits"),
      (12, 192, None,
       "shard_block=12 must be 0 (contiguous shards) or a multiple of the chunk (8)"),
      # 4 bits: shards of whole key groups (32 tokens)
      (0, 128, "int4", "cache_len=128 is not a multiple of 256, the unit 'reattention_mesh'"),
      (8, 256, "int4", "shard_block=8 must be a multiple of the 4-bit cache's key group (32)")]:
    entry = get("reattention_mesh", shard_block=block, **HP)
    options = RunOptions(mesh=make_mesh(MESH), kv_dtype=kv_dtype)
    try:
      prefill({}, cfg, [[1, 2, 3]], entry, cache_len=cache_len, options=options)
    except LongctxError as e:
      assert message in str(e) and "\n" not in str(e), e
    else:
      raise AssertionError(f"no error for {block}, {cache_len}")


CHECKS = {"layer": lambda: layer(False), "layer_tied": lambda: layer(True),
          # The GPU kernels interpreted: decode's gathered kernel and the flash kernel, given
          # parts whose query ranks are negative or that are empty.
          "layer_gpu_kernels": lambda: layer(False, "gpu"), "model": model, "errors": errors,
          # Every 2nd query of a prefill chunk votes (vote_stride): the devices agree on which.
          "stride_model": lambda: model(vote_stride=2),
          "resa_model": lambda: model("resa", "resa_mesh", lam=0.7),
          # Block-cyclic: the tied case (ties across devices no longer in index order), the GPU
          # kernels (ranked parts through the flash kernel), the model and RESA end to end.
          "cyclic_layer_tied": lambda: layer(True, block=8),
          "cyclic_layer_gpu_kernels": lambda: layer(False, "gpu", block=8),
          "cyclic_model": lambda: model(shard_block=8),
          "cyclic_resa_model": lambda: model("resa", "resa_mesh", lam=0.7, shard_block=8),
          # The 4-bit cache: contiguous and block-cyclic shards, the GPU kernels interpreted.
          "int4_layer": lambda: layer(False, kv_dtype="int4", t=512),
          "int4_model": lambda: model(kv_dtype="int4", cache_len=256),
          "int4_resa_model": lambda: model("resa", "resa_mesh", lam=0.7, kv_dtype="int4",
                                           cache_len=256),
          "int4_cyclic_layer_gpu_kernels": lambda: layer(False, "gpu", block=32, kv_dtype="int4",
                                                         t=512)}

if __name__ == "__main__":
  assert len(jax.devices()) >= N, f"needs {N} devices, got {len(jax.devices())}"
  check_main.main(CHECKS, sys.argv[1:])
